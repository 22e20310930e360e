"""Compiled CPU kernels over packed KV codes, with a pure-torch fallback.

* :func:`quantize_block` - fused quantize + pack of ``[R, N, d]`` into a :class:`QBlock`;
* :func:`dequantize_block` - fused unpack + dequantize of a :class:`QBlock`;
* :func:`attend_block` - attention of ``G`` queries per row read straight from the codes,
  returning the output and its log-sum-exp so it merges with full-precision tokens.

The C++ extension (``csrc/kv_kernels.cpp``, C++17 + OpenMP) is compiled on first use into
``$KV_CACHE_HOME/ext/<hash>/`` (default ``~/.cache/kv_cache``) and reused by later
processes; ``python -m kv_cache.kernels`` builds it ahead of time. Importing this package
compiles nothing. ``KV_CACHE_KERNELS=torch`` forces :mod:`kv_cache.kernels.reference`; a
failed build logs one warning and falls back to it too. Formulas:
``math_dictionary/kv-compression-math.md`` §15.
"""

from ._build import available, build_dir, isa, load
from .ops import attend_block, attend_mixed, compact_rows_, dequantize_block, quantize_block
from .qblock import GROUPINGS, QBlock, uniform_lut

__all__ = [
    "GROUPINGS",
    "QBlock",
    "attend_block",
    "attend_mixed",
    "compact_rows_",
    "available",
    "build_dir",
    "dequantize_block",
    "isa",
    "load",
    "quantize_block",
    "uniform_lut",
]
