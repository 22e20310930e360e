"""Fused quantize + pack on the GPU: :func:`kv_cache.kernels.quantize_block` in one Triton kernel.

Same contract and results as the compiled kernel and :func:`kv_cache.kernels.reference.quantize_block`
(math dictionary §1-§2, §15.2): uniform levels reproduce :func:`kv_cache.compression.quantize`
bit for bit (statistics, floors, guard, constant-group rule, codes from the *stored* scale,
round half to even); a codebook takes the group's RMS (sum of squares in float64) as the scale
and the nearest level of ``x / scale`` (binary search over the midpoints, ties to the lower
level). Each program holds its tile ``[tokens, words, codes per word]`` in registers: the
statistics reduce over it, the codes are OR-ed into words, and the words are written as
bytes, so nothing but the packed codes, scales and zero points reaches memory.

Errors (NaN/Inf in ``x``, a scale the scale dtype cannot hold, a codebook that is not finite
and increasing) are flagged on the device and read once per call: one host synchronisation,
the price of raising them before the codes are used.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from ...compression._arrays import raise_non_finite
from .._checks import LEVELS_ERROR, QuantizeArgs, midpoints
from ..qblock import QBlock, uniform_lut
from ._blocks import pow2
from ._tiles import bf16_bits, bf16_value, rint

_NON_FINITE, _SCALE, _LEVELS = 2, 1, 3  # status, by priority: levels > non-finite > scale
_SCALE_KIND = {torch.float32: 0, torch.float16: 1, torch.bfloat16: 2}
_MODE = {"asym": 0, "sym": 1, "codebook": 2}
TILE_ELEMENTS = 4096
"""Elements of ``x`` one program holds (tokens x channels)."""


@triton.jit
def _stored(scale, SCALE_KIND: tl.constexpr):
    """``(value, bits)``: the float32 value of ``scale`` as stored in the scale dtype, and what to store."""
    if SCALE_KIND == 2:
        b = bf16_bits(scale)
        return bf16_value(b), b.to(tl.uint16).to(tl.bfloat16, bitcast=True)
    elif SCALE_KIND == 1:
        h = scale.to(tl.float16)
        return h.to(tl.float32), h
    else:
        return scale, scale


@triton.jit
def _reduce(v, TOKEN: tl.constexpr, MAX: tl.constexpr):
    """Sum (``MAX`` False) or max of ``v`` over each group: axes 2 and 1 of ``[T, W, K]`` (token
    grouping, one value per token) or axis 0 (channel grouping, one per channel ``[W, K]``)."""
    if TOKEN:
        if MAX:
            return tl.max(tl.max(v, axis=2), axis=1)
        return tl.sum(tl.sum(v, axis=2), axis=1)
    if MAX:
        return tl.max(v, axis=0)
    return tl.sum(v, axis=0)


@triton.jit
def _group_scale(x, m, GS, MODE: tl.constexpr, QMAX: tl.constexpr, QMIN: tl.constexpr, TOKEN: tl.constexpr,
                 SCALE_KIND: tl.constexpr):
    """``(scale, minimum)`` of the elements ``m`` of each group of ``x`` (formulas §1, §2, §15.2);
    a float16-stored uniform scale is at least 2**-24, float16's smallest (§15.2)."""
    if MODE == 2:  # codebook: the RMS, sum of squares in float64
        w = tl.where(m, x, 0.0).to(tl.float64)
        ss = _reduce(w * w, TOKEN, False)
        return tl.sqrt(ss / GS).to(tl.float32), ss.to(tl.float32)  # float64: sqrt.rn.f64 on the GPU
    else:
        mx = _reduce(tl.where(m, x, -float("inf")), TOKEN, True)
        mn = -_reduce(tl.where(m, -x, -float("inf")), TOKEN, True)
        amax = tl.maximum(tl.abs(mn), tl.abs(mx))
        if MODE == 1:
            scale = tl.math.div_rn(tl.maximum(amax, 1e-8), QMAX * 1.0)
        else:
            scale = tl.math.div_rn(tl.maximum(mx - mn, 1e-8), (QMAX - QMIN) * 1.0)
            scale = tl.maximum(scale, amax * 0.00006103515625)  # 2**-14: the zero-point guard
        scale = tl.where((mn == mx) & (amax > 0), amax, scale)
        scale = tl.where(amax == 0, 1.0, scale)
        if SCALE_KIND == 1:
            scale = tl.maximum(scale, 5.9604644775390625e-08)  # 2**-24: a tiny group's scale stays nonzero
        return scale, mn


@triton.jit
def _unrepresentable(val, MODE: tl.constexpr, SCALE_KIND: tl.constexpr):
    """A stored scale the reference refuses: not finite (codebook), or not finite or 0 in a narrower dtype."""
    if MODE == 2:
        return ~(tl.abs(val) < float("inf"))
    elif SCALE_KIND != 0:
        return ~(tl.abs(val) < float("inf")) | (val == 0.0)
    else:
        return val != val


@triton.jit
def _codes(x, s, mn_or_zero, mids_ptr, MODE: tl.constexpr, BITS: tl.constexpr, QMAX: tl.constexpr,
           QMIN: tl.constexpr):
    """Integer codes of ``x`` with the stored scale ``s`` (and zero point ``mn_or_zero``)."""
    if MODE == 2:
        v = tl.where(s != 0.0, tl.math.div_rn(x, tl.where(s != 0.0, s, 1.0)), 0.0)
        code = tl.zeros(x.shape, dtype=tl.int32)
        for i in tl.static_range(BITS):  # count the midpoints below v: binary search
            step = 1 << (BITS - 1 - i)
            mid = tl.load(mids_ptr + code + step - 1)
            code = tl.where(mid < v, code + step, code)
        return code
    elif MODE == 1:
        q = tl.minimum(tl.maximum(rint(tl.math.div_rn(x, s)), -QMAX * 1.0), QMAX * 1.0)
        return q.to(tl.int32) + (1 << (BITS - 1))
    else:
        q = tl.minimum(tl.maximum(rint(tl.math.div_rn(x, s)) + mn_or_zero, QMIN * 1.0), QMAX * 1.0)
        return q.to(tl.int32)


@triton.jit
def _store_words(codes_ptr, base, code, c_k, wmask, BITS: tl.constexpr, BPW: tl.constexpr):
    """OR the ``K`` codes of each word (last axis) together and store the word's ``BPW`` bytes.

    ``code`` ``[T, W, K]``; ``base`` ``[T, W]`` the byte offset of each word."""
    word = tl.sum(code << (c_k * BITS), axis=2)
    for b in tl.static_range(BPW):
        tl.store(codes_ptr + base + b, ((word >> (8 * b)) & 255).to(tl.uint8), mask=wmask)


@triton.jit
def _check_levels(lut_ptr, status_ptr, NLEV: tl.constexpr):
    i = tl.arange(0, NLEV)
    a = tl.load(lut_ptr + i)
    b = tl.load(lut_ptr + i + 1, mask=i + 1 < NLEV, other=float("inf"))
    bad = (a != a) | (tl.abs(a) == float("inf")) | ~(a < b)
    tl.atomic_max(status_ptr, tl.max(tl.where(bad, 3, 0)))


@triton.jit
def _quantize_token(x_ptr, x_s0, x_s1, codes_ptr, scale_ptr, zero_ptr, mids_ptr, lut_ptr, status_ptr,
                    N, d, NG, GS,
                    BITS: tl.constexpr, K: tl.constexpr, BPW: tl.constexpr, WP: tl.constexpr, BT: tl.constexpr,
                    MODE: tl.constexpr, SCALE_KIND: tl.constexpr, QMAX: tl.constexpr, QMIN: tl.constexpr,
                    NLEV: tl.constexpr):
    """Token grouping: one scale per token and group of ``GS`` channels; program = (row, BT tokens)."""
    r = tl.program_id(0).to(tl.int64)
    t = tl.program_id(1) * BT + tl.arange(0, BT)
    w = tl.arange(0, WP)
    k = tl.arange(0, K)
    t3 = t[:, None, None]
    c = w[None, :, None] * K + k[None, None, :]  # [1, WP, K] channel of each code
    m = (t3 < N) & (c < d)
    x = tl.load(x_ptr + r * x_s0 + t3 * x_s1 + c, mask=m, other=0.0).to(tl.float32)
    bad = m & ((x != x) | (tl.abs(x) == float("inf")))
    status = tl.max(tl.max(tl.max(tl.where(bad, 2, 0), axis=2), axis=1))
    grp = c // GS
    s_el = tl.zeros(x.shape, dtype=tl.float32)
    z_el = tl.zeros(x.shape, dtype=tl.float32)
    tm = t < N
    for g in range(NG):
        gm = m & (grp == g)
        scale, mn = _group_scale(x, gm, GS, MODE, QMAX, QMIN, True, SCALE_KIND)
        scale, mn = tl.where(tm, scale, 1.0), tl.where(tm, mn, 0.0)  # no inf/NaN in padding lanes
        val, out = _stored(scale, SCALE_KIND)
        unrep = _unrepresentable(val, MODE, SCALE_KIND)
        status = tl.maximum(status, tl.max(tl.where(tm & unrep, 1, 0)))
        tl.store(scale_ptr + r * N * NG + t * NG + g, out, mask=tm)
        s_el = tl.where(grp == g, val[:, None, None], s_el)
        if MODE == 0:
            zp = rint(0.0 - tl.math.div_rn(mn, val))
            tl.store(zero_ptr + r * N * NG + t * NG + g, zp.to(tl.int16), mask=tm)
            z_el = tl.where(grp == g, zp[:, None, None], z_el)
    code = tl.where(m, _codes(x, s_el, z_el, mids_ptr, MODE, BITS, QMAX, QMIN), 0)
    P = (d // K) * BPW
    _store_words(codes_ptr, r * N * P + t[:, None] * P + w[None, :] * BPW, code, k[None, None, :],
                 tm[:, None] & (w[None, :] < d // K), BITS, BPW)
    if MODE == 2:
        if (tl.program_id(0) == 0) & (tl.program_id(1) == 0):
            _check_levels(lut_ptr, status_ptr, NLEV)
    tl.atomic_max(status_ptr, status)


@triton.jit
def _quantize_channel(x_ptr, x_s0, x_s1, codes_ptr, scale_ptr, zero_ptr, mids_ptr, lut_ptr, status_ptr,
                      N, d, GS,
                      BITS: tl.constexpr, K: tl.constexpr, BPW: tl.constexpr, BW: tl.constexpr,
                      GSP: tl.constexpr, MODE: tl.constexpr, SCALE_KIND: tl.constexpr, QMAX: tl.constexpr,
                      QMIN: tl.constexpr, NLEV: tl.constexpr):
    """Channel grouping: one scale per group of ``GS`` tokens and channel; program = (row, group,
    ``BW`` words of channels)."""
    r = tl.program_id(0).to(tl.int64)
    grp = tl.program_id(1)
    i = tl.arange(0, GSP)
    w = tl.program_id(2) * BW + tl.arange(0, BW)
    k = tl.arange(0, K)
    t3 = grp * GS + i[:, None, None]
    c = w[None, :, None] * K + k[None, None, :]
    m = (i[:, None, None] < GS) & (c < d)
    x = tl.load(x_ptr + r * x_s0 + t3 * x_s1 + c, mask=m, other=0.0).to(tl.float32)
    bad = m & ((x != x) | (tl.abs(x) == float("inf")))
    status = tl.max(tl.max(tl.max(tl.where(bad, 2, 0), axis=2), axis=1))
    scale, mn = _group_scale(x, m, GS, MODE, QMAX, QMIN, False, SCALE_KIND)  # [BW, K]: one per channel
    c2 = w[:, None] * K + k[None, :]
    cm = c2 < d
    scale, mn = tl.where(cm, scale, 1.0), tl.where(cm, mn, 0.0)  # no inf/NaN in padding lanes
    val, out = _stored(scale, SCALE_KIND)
    unrep = _unrepresentable(val, MODE, SCALE_KIND)
    status = tl.maximum(status, tl.max(tl.max(tl.where(cm & unrep, 1, 0), axis=1)))
    meta_off = r * (N // GS) * d + grp * d + c2
    tl.store(scale_ptr + meta_off, out, mask=cm)
    zp = tl.zeros(val.shape, dtype=tl.float32)
    if MODE == 0:
        zp = rint(0.0 - tl.math.div_rn(mn, val))
        tl.store(zero_ptr + meta_off, zp.to(tl.int16), mask=cm)
    code = tl.where(m, _codes(x, val[None, :, :], zp[None, :, :], mids_ptr, MODE, BITS, QMAX, QMIN), 0)
    P = (d // K) * BPW
    _store_words(codes_ptr, r * N * P + (grp * GS + i[:, None]) * P + w[None, :] * BPW, code, k[None, None, :],
                 (i[:, None] < GS) & (w[None, :] < d // K), BITS, BPW)
    if MODE == 2:
        if (tl.program_id(0) == 0) & (tl.program_id(1) == 0) & (tl.program_id(2) == 0):
            _check_levels(lut_ptr, status_ptr, NLEV)
    tl.atomic_max(status_ptr, status)


def quantize_block(a: QuantizeArgs) -> QBlock:
    """:func:`kv_cache.kernels.quantize_block` of validated arguments ``a`` on ``a.x.device``.

    ``x`` ``[R, N, d]`` (float16 / bfloat16 / float32) -> :class:`QBlock` with codes
    ``[R, N, d * bits / 8]`` uint8, scales ``[R, N // gs, d]`` (channel) or ``[R, N, d // gs]``
    (token) of ``a.scale_dtype``, int16 zero points (asymmetric uniform) or None.

    Raises
    ------
    ValueError
        NaN/Inf in ``x``; a scale ``scale_dtype`` cannot represent; codebook levels that are not
        finite and strictly increasing (checked on the device, read back once).
    """
    x = a.x if a.x.stride(-1) == 1 else a.x.contiguous()
    R, N, d = x.shape
    bits, gs, dev = a.bits, a.group_size, x.device
    K = 8 // bits if bits != 3 else 8
    BPW = 1 if bits != 3 else 3
    mode = "codebook" if a.lut is not None else ("sym" if a.symmetric else "asym")
    qmin, qmax = (0, (1 << bits) - 1) if mode == "asym" else (-((1 << (bits - 1)) - 1), (1 << (bits - 1)) - 1)
    meta_shape = (R, N // gs, d) if a.grouping == "channel" else (R, N, d // gs)
    codes = torch.empty((R, N, d * bits // 8), dtype=torch.uint8, device=dev)
    scale = torch.empty(meta_shape, dtype=a.scale_dtype, device=dev)
    zero = torch.empty(meta_shape, dtype=torch.int16, device=dev) if mode == "asym" else None
    status = torch.zeros(1, dtype=torch.int32, device=dev)
    lut = a.lut.contiguous() if a.lut is not None else None
    mids = midpoints(lut) if lut is not None else status  # unused without a codebook
    common = dict(BITS=bits, K=K, BPW=BPW, MODE=_MODE[mode], SCALE_KIND=_SCALE_KIND[a.scale_dtype], QMAX=qmax,
                  QMIN=qmin, NLEV=1 << bits)
    args = (x, x.stride(0), x.stride(1), codes, scale, zero if zero is not None else scale, mids,
            lut if lut is not None else status, status)
    if a.grouping == "token":
        WP = pow2(d // K)
        BT = max(1, min(pow2(N), TILE_ELEMENTS // (WP * K)))
        _quantize_token[(R, triton.cdiv(N, BT))](*args, N, d, d // gs, gs, WP=WP, BT=BT, **common)
    else:
        GSP = pow2(gs)
        BW = max(1, min(pow2(d // K), TILE_ELEMENTS // (GSP * K)))
        _quantize_channel[(R, N // gs, triton.cdiv(d // K, BW))](*args, N, d, gs, BW=BW, GSP=GSP, **common)
    flag = int(status.item())  # the one host read: errors must be raised before the codes are used
    if flag == _LEVELS:
        raise ValueError(LEVELS_ERROR)
    if flag == _NON_FINITE:
        raise_non_finite(x, "x")
    if flag == _SCALE:
        raise ValueError(
            f"scale_dtype={a.scale_dtype} cannot represent the scales of x "
            f"(max |x| = {float(x.abs().max()):.3g}); use a wider scale_dtype")
    lut_out = uniform_lut(bits, a.symmetric, dev) if lut is None else lut
    return QBlock(codes, bits, lut_out, a.grouping, scale, zero, gs)


__all__ = ["quantize_block"]
