"""Kernels over packed KV codes: compiled for the CPU, Triton for CUDA, a pure-torch fallback.

* :func:`quantize_block` - fused quantize + pack of ``[R, N, d]`` into a :class:`QBlock`;
* :func:`code_tokens` - per-token codes, rotated first, with 8-bit log norms (a token-grouped store);
* :func:`turn_stored_keys` - a few keys between the frame a cache stores them in and the model's;
* :func:`dequantize_block` - fused unpack + dequantize of a :class:`QBlock`;
* :func:`attend_block` - attention of ``G`` queries per row read straight from the codes,
  returning the output and its log-sum-exp so it merges with full-precision tokens.

The C++ extension (``csrc/kv_kernels.cpp``, C++17 + OpenMP) is compiled on first use into
``$KV_CACHE_HOME/ext/<hash>/`` (default ``~/.cache/kv_cache``) and reused by later
processes; ``python -m kv_cache.kernels`` builds it ahead of time. Importing this package
compiles nothing. ``KV_CACHE_KERNELS=torch`` forces :mod:`kv_cache.kernels.reference`; a
failed build logs one warning and falls back to it too. CUDA tensors run the Triton kernels
(:mod:`kv_cache.kernels.triton`, same contracts) when ``triton`` imports, any other device the
torch reference; :func:`backend` says which serves a device (:mod:`._select`). Formulas:
``math_dictionary/kv-compression-math.md`` §15-§16.
"""

from ._build import available, build_dir, isa, load
from ._select import backend
from .arrival import code_tokens, turn_stored_keys
from .ops import attend_block, attend_mixed, compact_rows_, dequantize_block, quantize_block
from .qblock import GROUPINGS, KeyRope, QBlock, uniform_lut

__all__ = [
    "GROUPINGS",
    "KeyRope",
    "QBlock",
    "attend_block",
    "attend_mixed",
    "compact_rows_",
    "available",
    "backend",
    "build_dir",
    "code_tokens",
    "dequantize_block",
    "isa",
    "load",
    "quantize_block",
    "turn_stored_keys",
    "uniform_lut",
]
