"""Device functions shared by the Triton kernels: rounding, bfloat16 stores, and one tile of a
packed block decoded in registers (math dictionary §15.1).

Every helper is exact float32 arithmetic in the order of :mod:`kv_cache.kernels.reference`, so
the kernels match it bit for bit where the reference is exact (quantize, dequantize). Two
helpers exist because Triton's interpreter (``TRITON_INTERPRET=1``, used by the tests) differs
from the GPU where the reference is exact: float32 -> bfloat16 casts truncate there, so
:func:`bf16_bits` rounds to nearest even by hand; and :func:`rint` rounds half to even with
``floor`` only (``torch.round``'s rule), as no portable ``rint`` exists in ``triton.language``.
"""

from __future__ import annotations

import triton
import triton.language as tl


@triton.jit
def rint(x):
    """Round half to even (``torch.round``) of float32 ``x``: ``x - floor(x)`` is exact in float32."""
    f = tl.floor(x)
    frac = x - f
    odd = (f - 2.0 * tl.floor(f * 0.5)) != 0.0
    up = (frac > 0.5) | ((frac == 0.5) & odd)
    return tl.where(up, f + 1.0, f)


@triton.jit
def bf16_bits(x):
    """float32 ``x`` rounded to nearest even bfloat16, as its 16 bits (uint32 holding them).

    Finite inputs only (the callers check): ``bits + 0x7fff + lsb`` carries into the exponent
    exactly like the hardware conversion (overflow gives infinity)."""
    bits = x.to(tl.uint32, bitcast=True)
    return (bits + 0x7FFF + ((bits >> 16) & 1)) >> 16


@triton.jit
def bf16_value(b16):
    """The float32 value of bfloat16 bits ``b16`` (uint32 holding 16 bits): exact."""
    return (b16 << 16).to(tl.float32, bitcast=True)


@triton.jit
def cast_store(ptr, x, mask, OUT: tl.constexpr):
    """Store float32 ``x`` as ``OUT`` (0 float32, 1 float16, 2 bfloat16), rounding to nearest even."""
    if OUT == 2:
        tl.store(ptr, bf16_bits(x).to(tl.uint16).to(tl.bfloat16, bitcast=True), mask=mask)
    elif OUT == 1:
        tl.store(ptr, x.to(tl.float16), mask=mask)
    else:
        tl.store(ptr, x, mask=mask)


@triton.jit
def levels(codes_ptr, row_off, t, c, mask, stride_t, P, lut_ptr, BITS: tl.constexpr):
    """``lut[code]`` of tokens ``t`` ``[BN, 1]`` and channels ``c`` ``[1, DP]`` of one row.

    Code ``c`` of a token starts at bit ``c * BITS`` of its ``P`` bytes (pack_bits' little-endian
    layout: 2 and 4 bits never straddle a byte, a 3-bit code may span two)."""
    bitpos = c * BITS
    byte = bitpos // 8
    ptr = codes_ptr + row_off + t * stride_t + byte
    word = tl.load(ptr, mask=mask, other=0).to(tl.int32)
    if BITS == 3:
        word = word | (tl.load(ptr + 1, mask=mask & (byte + 1 < P), other=0).to(tl.int32) << 8)
    code = (word >> (bitpos % 8)) & ((1 << BITS) - 1)
    return tl.load(lut_ptr + code, mask=mask, other=0.0)


@triton.jit
def meta(ptr, row_off, t, grp, c, mask, stride_t, GS, TOKEN: tl.constexpr, CODED: tl.constexpr, table_ptr):
    """Scale (or zero point) of each element as float32: ``[t, c // GS]`` (token grouping) or
    ``[grp, c]`` (channel grouping, ``grp`` the token's group); uint8 codes read through ``table``."""
    if TOKEN:
        off = t * stride_t + c // GS
    else:
        off = grp * stride_t + c
    v = tl.load(ptr + row_off + off, mask=mask, other=0)
    if CODED:
        return tl.load(table_ptr + v.to(tl.int32), mask=mask, other=0.0)
    return v.to(tl.float32)


@triton.jit
def dequant_tile(t, c, mask, r64, P,
                 codes_ptr, c_s0, c_s1, lut_ptr, scale_ptr, s_s0, s_s1, zero_ptr, z_s0, z_s1,
                 gid_ptr, g_s0, g_s1, table_ptr, GS,
                 BITS: tl.constexpr, TOKEN: tl.constexpr, HAS_ZERO: tl.constexpr, HAS_GID: tl.constexpr,
                 CODED: tl.constexpr):
    """``x_hat = scale * (lut[code] - zero)`` of tokens ``t`` ``[BN, 1]``, channels ``c`` ``[1, DP]``
    of row ``r64`` (int64), float32 ``[BN, DP]`` in registers (0 where ``mask`` is False).

    ``*_s0`` / ``*_s1`` are each tensor's row and token (or group) strides, channels contiguous:
    a block may be the leading part of a longer buffer."""
    lv = levels(codes_ptr, r64 * c_s0, t, c, mask, c_s1, P, lut_ptr, BITS)
    grp = t // GS
    if HAS_GID:
        grp = tl.load(gid_ptr + r64 * g_s0 + t * g_s1, mask=mask, other=0)
    if HAS_ZERO:
        lv = lv - meta(zero_ptr, r64 * z_s0, t, grp, c, mask, z_s1, GS, TOKEN, False, table_ptr)
    return lv * meta(scale_ptr, r64 * s_s0, t, grp, c, mask, s_s1, GS, TOKEN, CODED, table_ptr)
