"""Moved to :mod:`kv_cache.attention.fidelity` (the fidelity and eviction checks sit below the cache that runs them); this path is kept for one release and warns."""

import importlib as _importlib
import warnings as _warnings

globals().update({k: v for k, v in vars(_importlib.import_module("kv_cache.attention.fidelity")).items() if not k.startswith("__")})
_warnings.warn("kv_cache.cache.fidelity moved to kv_cache.attention.fidelity; the old path goes in the next release", DeprecationWarning, stacklevel=2)
