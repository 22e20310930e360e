"""Moved to :mod:`kv_cache.plan.codec_calibration` (fitting a basis runs the model, so it sits with the plans above the cache); this path is kept for one release and warns."""

import importlib as _importlib
import warnings as _warnings

globals().update({k: v for k, v in vars(_importlib.import_module("kv_cache.plan.codec_calibration")).items() if not k.startswith("__")})
_warnings.warn("kv_cache.codec.calibrate moved to kv_cache.plan.codec_calibration; the old path goes in the next release", DeprecationWarning, stacklevel=2)
