"""Moved to :mod:`kv_cache.spec.plans` (with the method grammar); this path is kept for one release and warns."""

import importlib as _importlib
import warnings as _warnings

globals().update({k: v for k, v in vars(_importlib.import_module("kv_cache.spec.plans")).items() if not k.startswith("__")})
_warnings.warn("kv_cache.eval.plan_methods moved to kv_cache.spec.plans; the old path goes in the next release", DeprecationWarning, stacklevel=2)
