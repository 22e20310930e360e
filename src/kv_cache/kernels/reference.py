"""Pure-torch reference of the compiled kernels: the fallback and the test oracle.

Same signatures and results as :mod:`kv_cache.kernels.ops` (vectorized torch, any device).
Formulas: ``math_dictionary/kv-compression-math.md`` §15.
"""

from __future__ import annotations

import dataclasses

import torch

from ..compression._arrays import raise_non_finite
from ..compression.packing import pack_bits, unpack_bits
from ..compression.quantizer import quantize
from ..compression.rope import rotate
from ..compression.rotation import fwht
from ._checks import (
    AttendArgs,
    QuantizeArgs,
    bad_group_error,
    check_attend_args,
    check_block,
    check_out,
    check_out_dtype,
    check_quantize_args,
    midpoints,
    value_inverse_matrices,
)
from .qblock import KeyRope, QBlock, uniform_lut


def unpack_codes(block: QBlock) -> torch.Tensor:
    """The codes of ``block`` unpacked: uint8 ``[R, N, d]``."""
    R, N, _ = block.codes.shape
    d = block.head_dim
    return unpack_bits(block.codes.reshape(-1), block.bits, R * N * d).view(R, N, d)


def expand_meta(block: QBlock, meta: torch.Tensor | None) -> torch.Tensor | None:
    """``scale`` or ``zero`` of ``block`` broadcast to every element: float32 ``[R, N, d]``.

    Raises
    ------
    ValueError
        A group index (``gid``, or ``t // group_size``) is outside the scale table.
    """
    if meta is None:
        return None
    R, N, _ = block.codes.shape
    d = block.head_dim
    meta = meta.float()
    if block.grouping == "token":
        return meta.repeat_interleave(block.group_size, dim=-1)
    ng = meta.shape[1]
    if block.gid is None:
        if N and (N - 1) // block.group_size >= ng:  # the last token's group (no device read)
            raise bad_group_error()
        return meta.index_select(1, torch.arange(N, device=meta.device) // block.group_size)
    gid = block.gid.long()
    if gid.numel():
        lo, hi = torch.stack(torch.aminmax(gid)).tolist()  # one host read
        if lo < 0 or hi >= ng:
            raise bad_group_error()
    return torch.gather(meta, 1, gid.unsqueeze(-1).expand(R, N, d))


def _dequantize(block: QBlock, out_dtype: torch.dtype) -> torch.Tensor:
    v = block.lut[unpack_codes(block).long()]  # [R, N, d] float32
    zero = expand_meta(block, block.zero)
    if zero is not None:
        v = v.sub_(zero)
    v = v.mul_(expand_meta(block, block.scale_values()))
    if block.rope is not None:  # keys before RoPE (§29.8): as attention reads them
        v = _rope_keys(v, block.rope)
    return v.to(out_dtype)


def dequantize_block(block: QBlock, out_dtype: torch.dtype = torch.float32, *,
                     out: torch.Tensor | None = None) -> torch.Tensor:
    """Torch reference of :func:`kv_cache.kernels.dequantize_block` (same contract)."""
    block = check_block(block, "block")
    out_dtype = check_out_dtype(out_dtype)
    out = check_out(out, block, out_dtype)
    result = _dequantize(block, out_dtype)
    return result if out is None else out.copy_(result)


def _quantize(a: QuantizeArgs) -> QBlock:
    x, bits, gs = a.x, a.bits, a.group_size
    R, N, d = x.shape
    if a.lut is None:
        qt = quantize(x, bits, axis=-2 if a.grouping == "channel" else -1, group_size=gs,
                      symmetric=a.symmetric, scale_dtype=a.scale_dtype)
        zero = None if a.symmetric else qt.zero_point
        return QBlock(qt.data.view(R, N, d * bits // 8), bits, uniform_lut(bits, a.symmetric, x.device),
                      a.grouping, qt.scale, zero, gs)
    # codebook: scale = RMS of the group (sum of squares in float64), code = nearest level
    if a.grouping == "channel":
        xr = x.float().view(R, N // gs, gs, d)
        red = 2
    else:
        xr = x.float().view(R, N, d // gs, gs)
        red = 3
    rms = (xr.double().square().sum(red) / gs).sqrt()
    if not bool(torch.isfinite(rms).all()):
        raise_non_finite(x, "x")
    stored = rms.float().to(a.scale_dtype)
    if not bool(torch.isfinite(stored).all()):
        raise ValueError(
            f"scale_dtype={a.scale_dtype} cannot represent the scales of x "
            f"(max RMS = {float(rms.max()):.3g}); use a wider scale_dtype")
    s = stored.float().unsqueeze(red)
    v = torch.where(s != 0, xr / s, torch.zeros((), device=x.device))
    codes = torch.bucketize(v, midpoints(a.lut)).to(torch.uint8).reshape(R, N, d)
    packed = pack_bits(codes, bits).view(R, N, d * bits // 8)
    return QBlock(packed, bits, a.lut.contiguous(), a.grouping, stored, None, gs)


def quantize_block(
    x: torch.Tensor,
    bits: int,
    grouping: str,
    group_size: int,
    symmetric: bool = False,
    scale_dtype: torch.dtype = torch.float32,
    lut: torch.Tensor | None = None,
) -> QBlock:
    """Torch reference of :func:`kv_cache.kernels.quantize_block` (same contract).

    Uniform levels call :func:`kv_cache.compression.quantizer.quantize` itself.
    """
    return _quantize(check_quantize_args(x, bits, grouping, group_size, symmetric, scale_dtype, lut))


def rectangular(block: QBlock) -> QBlock:
    """A flat ragged block (``block.offsets``) as an ordinary ``[R, max(lengths), ...]`` block:
    row ``r`` holds its own tokens first, then repeats of the buffer's tokens (masked by the
    lengths). The reference path's view of the layout; the kernels read the buffer in place."""
    if not block.flat:
        return block
    R = block.codes.shape[0]
    n = int(block.lengths.max()) if R else 0
    total = block.codes.shape[1]
    idx = (block.offsets.unsqueeze(1) + torch.arange(n, device=block.codes.device)).clamp_(max=max(total - 1, 0))

    def rows(t: torch.Tensor | None) -> torch.Tensor | None:
        return None if t is None else t[0][idx]

    token = block.grouping == "token"
    rope = block.rope
    if rope is not None:  # each row's positions, gathered like its codes
        rope = dataclasses.replace(rope, positions=rows(rope.positions))
    return QBlock(rows(block.codes), block.bits, block.lut, block.grouping,
                  rows(block.scale) if token else block.scale.contiguous(),
                  (rows(block.zero) if token else block.zero.contiguous()) if block.zero is not None else None,
                  block.group_size, rows(block.gid), block.scale_table, rope=rope)


def rectangular_dense(t: torch.Tensor, offsets: torch.Tensor, lengths: torch.Tensor) -> torch.Tensor:
    """A flat ragged full-precision block ``[B, H, N, d]`` (row axes of stride 0) as
    ``[B, H, max(lengths), d]`` (repeats past each row's length, masked by the lengths)."""
    B, H, total, d = t.shape
    n = int(lengths.max()) if lengths.numel() else 0
    idx = (offsets.unsqueeze(1) + torch.arange(n, device=t.device)).clamp_(max=max(total - 1, 0))
    return t[0, 0][idx].reshape(B, H, n, d)


def _rope_keys(kx: torch.Tensor, rope: KeyRope) -> torch.Tensor:
    """Dequantized keys before RoPE ``[R, N, d]`` float32 -> the keys attention reads (§29.8)."""
    if rope.signs is not None:  # out of the randomized Hadamard space: (y H) * s
        R = kx.shape[0]
        kx = fwht(kx) * rope.signs.repeat(R // rope.signs.shape[0], 1).unsqueeze(1)
    if rope.scale is not None:
        kx = kx * rope.scale.unsqueeze(1)
    if rope.mean is not None:
        kx = kx + rope.mean.unsqueeze(1)
    return rotate(kx, rope.positions.long(), rope.inv_freq, float(rope.scaling), rope.layout)


def _attend(a: AttendArgs, return_logits: bool):
    if a.k.flat:
        a = AttendArgs(a.q, rectangular(a.k), rectangular(a.v), a.scaling, a.start, a.length)
    q, k, v = a.q, a.k, a.v
    R, G, _ = q.shape
    N = k.codes.shape[1]
    kx = _dequantize(k, torch.float32)  # [R, N, dk]; keys before RoPE turned to their positions (§29.8)
    vx = _dequantize(v, torch.float32)  # [R, N, dv]
    s = torch.bmm(q, kx.transpose(1, 2)).mul_(a.scaling)  # [R, G, N]
    if a.start is not None or a.length is not None:
        t = torch.arange(N, device=q.device)
        masked = torch.zeros(R, N, dtype=torch.bool, device=q.device)
        if a.start is not None:
            masked |= t < a.start.to(q.device).long().unsqueeze(1)
        if a.length is not None:
            masked |= t >= a.length.to(q.device).long().unsqueeze(1)
        s.masked_fill_(masked.unsqueeze(1), float("-inf"))
    lse = torch.logsumexp(s, dim=-1)  # [R, G]; -inf where every token is masked
    p = torch.exp(s - torch.where(torch.isfinite(lse), lse, torch.zeros_like(lse)).unsqueeze(-1))
    out = torch.bmm(p, vx)
    return out, lse, (s if return_logits else None)


def attend_block(
    q: torch.Tensor,
    kblock: QBlock,
    vblock: QBlock,
    scaling: float,
    start: torch.Tensor | None = None,
    length: torch.Tensor | None = None,
    return_logits: bool = False,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor | None]:
    """Torch reference of :func:`kv_cache.kernels.attend_block` (dequantize, matmul, softmax)."""
    return _attend(check_attend_args(q, kblock, vblock, scaling, start, length), bool(return_logits))


__all__ = ["attend_block", "attend_mixed", "dequantize_block", "expand_meta", "quantize_block", "unpack_codes"]


def merge_parts(parts: list[tuple[torch.Tensor, torch.Tensor]]) -> tuple[torch.Tensor, torch.Tensor]:
    """One softmax over blocks from per-block ``(out [..., dv], lse [...])`` (math dictionary §16):
    ``lse = logsumexp_B lse_B``, ``out = sum_B exp(lse_B - lse) out_B``; a block without valid
    tokens (``lse_B = -inf``) weighs 0."""
    if len(parts) == 1:
        return parts[0]
    lse = torch.logsumexp(torch.stack([p[1] for p in parts]), dim=0)
    out = None
    for o, l in parts:
        w = torch.exp(l - lse).nan_to_num_(0.0).unsqueeze(-1)
        out = o * w if out is None else out.addcmul_(o, w)
    return out, lse


def rows_times(x: torch.Tensor, mats: torch.Tensor) -> torch.Tensor:
    """``x[r] @ mats[r % H]`` for ``x`` ``[R, G, d]`` and ``mats`` ``[H, d, d]``."""
    R, G, d = x.shape
    H = mats.shape[0]
    return (x.reshape(R // H, H, G, d) @ mats.unsqueeze(0)).reshape(R, G, -1)


def _attend_mixed(a) -> tuple[torch.Tensor, torch.Tensor]:
    parts = []
    for p, inverse in zip(a.packed, a.inverses):
        out, lse, _ = _attend(p, False)
        if inverse is not None:
            out = rows_times(out, value_inverse_matrices(inverse))
        parts.append((out, lse))
    R, G, d = a.q.shape
    for k, v, st, off, ln in a.dense:
        if off is not None:
            k, v = rectangular_dense(k, off, ln), rectangular_dense(v, off, ln)
        n = k.shape[2]
        kx, vx = k.float().reshape(R, n, d), v.float().reshape(R, n, -1)
        s = torch.bmm(a.q, kx.transpose(1, 2)).mul_(a.scaling)
        pos = torch.arange(n, device=s.device)
        if st is not None:
            s.masked_fill_((pos < st.long().unsqueeze(1)).unsqueeze(1), float("-inf"))
        if ln is not None:
            s.masked_fill_((pos >= ln.long().unsqueeze(1)).unsqueeze(1), float("-inf"))
        lse = torch.logsumexp(s, dim=-1)
        p = torch.exp(s - lse.unsqueeze(-1)).nan_to_num_(0.0)
        parts.append((torch.bmm(p, vx), lse))
    return merge_parts(parts)


def attend_mixed(q, scaling, *, packed=None, dense=(), q_packed=None, value_inverse=None):
    """Torch reference of :func:`kv_cache.kernels.attend_mixed`."""
    from ._checks import check_mixed_args

    return _attend_mixed(check_mixed_args(q, scaling, packed, dense, q_packed, value_inverse))
