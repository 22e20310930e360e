"""Moved to :mod:`kv_cache.attention.key_offset` (the key offset sits below the cache that stores it); this path is kept for one release and warns."""

import importlib as _importlib
import warnings as _warnings

globals().update({k: v for k, v in vars(_importlib.import_module("kv_cache.attention.key_offset")).items() if not k.startswith("__")})
_warnings.warn("kv_cache.cache.key_offset moved to kv_cache.attention.key_offset; the old path goes in the next release", DeprecationWarning, stacklevel=2)
