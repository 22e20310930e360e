"""Triton kernels: the CUDA backend of :mod:`kv_cache.kernels`.

Same signatures and results as the compiled CPU kernels they stand in for (each is tested
against :mod:`kv_cache.kernels.reference`), one file per kernel:

* :mod:`.quantize_pack` - fused quantize + pack (:func:`kv_cache.kernels.quantize_block`);
* :mod:`.dequantize` - fused unpack + dequantize (:func:`kv_cache.kernels.dequantize_block`);
* :mod:`.attend` - attention read straight from the packed codes: a decoding step's whole
  attention over a layer's blocks (:func:`kv_cache.kernels.attend_mixed`, split over the tokens,
  merged by log-sum-exp) and one packed block (:func:`kv_cache.kernels.attend_block`);
* :mod:`.paged` - attention read from a paged cache in place through a block table
  (:func:`kv_cache.kernels.paged.attend_paged`, vLLM's blocks).

The functions here take arguments already validated by :mod:`kv_cache.kernels._checks`; use
the public ops, which pick this backend for CUDA tensors (:func:`kv_cache.kernels.backend`).
Importing this package imports ``triton`` (an ``ImportError`` without it); nothing compiles
before the first call. Under ``TRITON_INTERPRET=1`` (set before ``triton`` is imported) the
kernels run on CPU tensors in Triton's interpreter: that is how the tests run them without a GPU.
"""

from .attend import attend_block, attend_mixed
from .dequantize import dequantize_block
from .paged import attend_paged
from .quantize_pack import quantize_block

__all__ = ["attend_block", "attend_mixed", "attend_paged", "dequantize_block", "quantize_block"]
