"""The storage codec of ``.kvc`` files: transform coding calibrated per model (math dictionary §27).

* :mod:`.transform`: PCA per layer, KV head and K / V (fit, forward, inverse);
* :mod:`.allocation`: a step per component for a byte target, least squared error;
* :mod:`.ans`: range-ANS entropy coding (``constriction``);
* :mod:`.basis_file`: the per-model basis file, referenced by fingerprint;
* fitting a basis on calibration text (``kvcache calibrate-codec``) runs the model: it is
  :mod:`kv_cache.plan.codec_calibration`, above the cache;
* :mod:`.payload`: encoding and checked decoding of a saved cache state.

The file format and its checks stay in :mod:`kv_cache.cache.serialize`.
"""

from .basis_file import CodecBasis, CodecBasisError, basis_for_model, find_basis, load_basis, save_basis
from .payload import CodecSettings, decode_state, encode_state, fp16_bytes

__all__ = ["CodecBasis", "CodecBasisError", "CodecSettings", "basis_for_model", "decode_state", "encode_state",
           "find_basis", "fp16_bytes", "load_basis", "save_basis"]
