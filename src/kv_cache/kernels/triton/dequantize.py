"""Fused unpack + dequantize on the GPU: :func:`kv_cache.kernels.dequantize_block` in one Triton kernel.

``x_hat = scale * (lut[code] - zero)`` in float32, rounded to nearest even into the output
dtype (math dictionary §15.1): bit for bit :func:`kv_cache.kernels.reference.dequantize_block`.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from ..qblock import QBlock
from ._blocks import block_args, check_groups, pow2
from ._tiles import cast_store, dequant_tile

_OUT_KIND = {torch.float32: 0, torch.float16: 1, torch.bfloat16: 2}
TILE_ELEMENTS = 4096


@triton.jit
def _dequantize(out_ptr, N, d, P,
                codes_ptr, c_s0, c_s1, lut_ptr, scale_ptr, s_s0, s_s1, zero_ptr, z_s0, z_s1,
                gid_ptr, g_s0, g_s1, table_ptr, GS,
                BITS: tl.constexpr, TOKEN: tl.constexpr, ZERO: tl.constexpr, GID: tl.constexpr,
                CODED: tl.constexpr, OUT: tl.constexpr, BN: tl.constexpr, DP: tl.constexpr):
    """Program = (row, ``BN`` tokens): one ``[BN, DP]`` tile decoded and stored."""
    r = tl.program_id(0).to(tl.int64)
    t = tl.program_id(1) * BN + tl.arange(0, BN)[:, None]
    c = tl.arange(0, DP)[None, :]
    mask = (t < N) & (c < d)
    x = dequant_tile(t, c, mask, r, P, codes_ptr, c_s0, c_s1, lut_ptr, scale_ptr, s_s0, s_s1, zero_ptr, z_s0, z_s1,
                     gid_ptr, g_s0, g_s1, table_ptr, GS, BITS, TOKEN, ZERO, GID, CODED)
    cast_store(out_ptr + r * N * d + t * d + c, x, mask, OUT)


def dequantize_block(block: QBlock, out_dtype: torch.dtype, out: torch.Tensor | None) -> torch.Tensor:
    """:func:`kv_cache.kernels.dequantize_block` of a validated ``block`` ``[R, N, d]`` on its device:
    ``[R, N, d]`` of ``out_dtype`` (written into ``out``, contiguous, when given).

    Raises
    ------
    ValueError
        A group index outside the scale table (:func:`._blocks.check_groups`).
    """
    check_groups(block)
    R, N, P = block.codes.shape
    d = block.head_dim
    if out is None:
        out = torch.empty((R, N, d), dtype=out_dtype, device=block.codes.device)
    if R == 0 or N == 0 or d == 0:
        return out
    DP = pow2(d)
    BN = max(1, min(pow2(N), TILE_ELEMENTS // DP))
    tensors, flags = block_args(block)
    _dequantize[(R, triton.cdiv(N, BN))](out, N, d, P, *tensors, **flags, OUT=_OUT_KIND[out_dtype], BN=BN, DP=DP)
    return out


__all__ = ["dequantize_block"]
