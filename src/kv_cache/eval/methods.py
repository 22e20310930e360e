"""Moved to :mod:`kv_cache.spec.grammar` (the method grammar is every entry point's, not the evaluation's); this path is kept for one release and warns."""

import importlib as _importlib
import warnings as _warnings

globals().update({k: v for k, v in vars(_importlib.import_module("kv_cache.spec.grammar")).items() if not k.startswith("__")})
_warnings.warn("kv_cache.eval.methods moved to kv_cache.spec.grammar; the old path goes in the next release", DeprecationWarning, stacklevel=2)
