"""Paged attention on the GPU: :func:`kv_cache.kernels.paged.attend_paged` in Triton (math
dictionary §28.5).

One program takes one (request, kv head, chunk of tokens, group of queries). It walks the
request's block table tile by tile (32 tokens, always inside one block since block sizes are
multiples of 32), loads the tile's slots where they lie in the paged cache, decodes them in
registers (``m + s * code`` per-channel key groups, ``s * (byte - 128)`` int8, ``norm * level``
or ``m_j + s_j * code`` values) and runs the online softmax of :mod:`.attend`; the chunks are
then merged by log-sum-exp (``attend._merge``). Float32 dot products (``input_precision="ieee"``).

Keys stored before RoPE (``ROPE``, math dictionary §29.9): the tile's keys are decoded as the
two channels of each rotary pair and the channels past the pairs, turned to their positions
``t0 .. t0 + 31`` (float32 angles reduced modulo ``2 pi``, as :mod:`.attend` does), and scored
against the query's matching channels.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from ._blocks import pow2
from ._tiles import levels
from .attend import _bg, _chunking, _merge, _online, _pair_channels, _store_partial

BLOCK_N = 32
"""Tokens per tile: one key group."""


@triton.jit
def _f16_at(ptr, mask):
    """float32 of the little-endian float16 whose two bytes start at ``ptr`` (uint8 pointers)."""
    lo = tl.load(ptr, mask=mask, other=0).to(tl.uint16)
    hi = tl.load(ptr + 1, mask=mask, other=0).to(tl.uint16)
    return (lo | (hi << 8)).to(tl.float16, bitcast=True).to(tl.float32)


@triton.jit
def _key_cols(cache_ptr, base, tt, tin, cols, cmask, sw, d, KO, KMO, KMB, klut,
              K_KIND: tl.constexpr, K_BITS: tl.constexpr):
    """Channels ``cols`` ``[W]`` (masked by ``cmask``) of the tile's keys, dequantized: ``[BN, W]``."""
    mask2 = tin[:, None] & cmask[None, :]
    if K_KIND == 0:  # per-channel group: byte 2c of the group's float16 [2, D] is in slot 2c // KMB
        lv = levels(cache_ptr + KO, base, tt[:, None], cols[None, :], mask2, sw, d * K_BITS // 8, klut, K_BITS)
        sb = 2 * cols
        s_ptr = cache_ptr + base + (sb // KMB) * sw + KMO + sb % KMB
        mb = 2 * d + 2 * cols
        m_ptr = cache_ptr + base + (mb // KMB) * sw + KMO + mb % KMB
        kt = _f16_at(m_ptr, cmask)[None, :] + lv * _f16_at(s_ptr, cmask)[None, :]
    else:  # per-token int8
        lv = levels(cache_ptr + KO, base, tt[:, None], cols[None, :], mask2, sw, d, klut, 8)
        kt = lv * _f16_at(cache_ptr + base + tt * sw + KMO, tin)[:, None]
    return tl.where(mask2, kt, 0.0)


@triton.jit
def _attend_paged(q_ptr, cache_ptr, table_ptr, tab_s0, len_ptr, klut, vlut, ntab,
                  pm_ptr, pl_ptr, pa_ptr, NI, H, M, d, bs, sw, chunk, scaling,
                  KO, KMO, VO, VMO, KMB, rw, half, factor,
                  K_KIND: tl.constexpr, K_BITS: tl.constexpr, V_KIND: tl.constexpr, V_BITS: tl.constexpr,
                  ROPE: tl.constexpr, INTERLEAVED: tl.constexpr, HP: tl.constexpr, RP: tl.constexpr,
                  BN: tl.constexpr, BG: tl.constexpr, DP: tl.constexpr):
    """Program = (row ``r * H + h``, chunk of ``chunk`` tokens, ``BG`` queries); ``ROPE``: keys
    stored before RoPE, token ``t`` turned to position ``t`` (``rw`` the ``half`` frequencies)."""
    row = tl.program_id(0).to(tl.int64)
    ci = tl.program_id(1)
    gs = tl.program_id(2) * BG + tl.arange(0, BG)
    gmask = gs < M
    r = row // H
    h = row % H
    c = tl.arange(0, DP)
    cmask = c < d
    q = tl.load(q_ptr + (row * M + gs[:, None]) * d + c[None, :], mask=gmask[:, None] & cmask[None, :], other=0.0)
    ca, cb, cr, pmask = _pair_channels(half, INTERLEAVED, HP, RP)
    rmask = cr < d
    if ROPE:
        qrow = q_ptr + (row * M + gs[:, None]) * d
        qa = tl.load(qrow + ca[None, :], mask=gmask[:, None] & pmask[None, :], other=0.0)
        qb = tl.load(qrow + cb[None, :], mask=gmask[:, None] & pmask[None, :], other=0.0)
        qr = tl.load(qrow + cr[None, :], mask=gmask[:, None] & rmask[None, :], other=0.0)
        w = tl.load(rw + tl.arange(0, HP), mask=pmask, other=0.0)
    n = tl.load(len_ptr + r)
    lo = ci * chunk
    hi = tl.minimum(lo + chunk, n)
    m = tl.full((BG,), -float("inf"), tl.float32)
    l = tl.zeros((BG,), tl.float32)
    acc = tl.zeros((BG, DP), tl.float32)
    tt = tl.arange(0, BN)
    for t0 in range(lo, hi, BN):
        tin = (t0 + tt) < hi
        blk = tl.load(table_ptr + r * tab_s0 + t0 // bs).to(tl.int64)
        base = ((blk * H + h) * bs + t0 % bs) * sw  # the tile's first slot
        mask2 = tin[:, None] & cmask[None, :]
        # ---- keys
        if ROPE:  # k' = f R(p) k, p = t0 + tt; the channels past the pairs pass through
            ka = _key_cols(cache_ptr, base, tt, tin, ca, pmask, sw, d, KO, KMO, KMB, klut, K_KIND, K_BITS) * factor
            kb = _key_cols(cache_ptr, base, tt, tin, cb, pmask, sw, d, KO, KMO, KMB, klut, K_KIND, K_BITS) * factor
            kr = _key_cols(cache_ptr, base, tt, tin, cr, rmask, sw, d, KO, KMO, KMB, klut, K_KIND, K_BITS)
            ang = (t0 + tt).to(tl.float32)[:, None] * w[None, :]
            turns = tl.floor(ang * 0.15915494309189535 + 0.5)  # 2 pi = 6.28125 (exact times turns) + the rest
            ang = (ang - turns * 6.28125) - turns * 0.0019353071795864769
            cs = tl.cos(ang)
            sn = tl.sin(ang)
            s = (tl.dot(qa, tl.trans(ka * cs - kb * sn), input_precision="ieee")
                 + tl.dot(qb, tl.trans(ka * sn + kb * cs), input_precision="ieee")
                 + tl.dot(qr, tl.trans(kr), input_precision="ieee")) * scaling
        else:
            kt = _key_cols(cache_ptr, base, tt, tin, c, cmask, sw, d, KO, KMO, KMB, klut, K_KIND, K_BITS)
            s = tl.dot(q, tl.trans(kt), input_precision="ieee") * scaling
        s = tl.where(tin[None, :], s, -float("inf"))
        # ---- values
        if V_KIND == 0:  # codebook levels times the slot's log-coded norm
            lv = levels(cache_ptr + VO, base, tt[:, None], c[None, :], mask2, sw, d * V_BITS // 8, vlut, V_BITS)
            code = tl.load(cache_ptr + base + tt * sw + VMO, mask=tin, other=0).to(tl.int32)
            vt = lv * tl.load(ntab + code, mask=tin, other=0.0)[:, None]
        elif V_KIND == 1:
            lv = levels(cache_ptr + VO, base, tt[:, None], c[None, :], mask2, sw, d, vlut, 8)
            vt = lv * _f16_at(cache_ptr + base + tt * sw + VMO, tin)[:, None]
        else:  # per token and 32-channel group j: m_j + s_j * code
            lv = levels(cache_ptr + VO, base, tt[:, None], c[None, :], mask2, sw, d * V_BITS // 8, vlut, V_BITS)
            j = c // 32
            nj = d // 32
            meta = cache_ptr + base + tt[:, None] * sw + VMO
            vt = _f16_at(meta + 2 * (nj + j[None, :]), mask2) + lv * _f16_at(meta + 2 * j[None, :], mask2)
        vt = tl.where(mask2, vt, 0.0)
        m, l, acc = _online(s, vt, m, l, acc)
    _store_partial(pm_ptr, pl_ptr, pa_ptr, row, ci, NI, gs, gmask, M, d, m, l, acc, pm_ptr, 1, False, DP, DP)


def attend_paged(q: torch.Tensor, cache: torch.Tensor, block_table: torch.Tensor, lengths: torch.Tensor,
                 layout, scale: float, *, splits: int | None = None, key_rope=None) -> tuple[torch.Tensor, torch.Tensor]:
    """:func:`kv_cache.kernels.paged.attend_paged` of validated arguments, on the device of ``q``:
    ``(out [R, H, M, D], lse [R, H, M])`` float32. ``splits``: programs per row over the tokens;
    ``key_rope``: a :class:`~kv_cache.kernels.paged.PagedRope` (keys stored before RoPE)."""
    from ..paged import KEY_KINDS, VALUE_KINDS  # a cycle otherwise (paged imports _select)

    R, H, M, d = q.shape
    dev = q.device
    bs = cache.shape[2]
    out = torch.empty((R * H, M, d), dtype=torch.float32, device=dev)
    lse = torch.empty((R * H, M), dtype=torch.float32, device=dev)
    if R == 0 or M == 0:
        return out.view(R, H, M, d), lse.view(R, H, M)
    table = block_table.to(device=dev, dtype=torch.int32).contiguous()
    n = lengths.to(device=dev, dtype=torch.int64).clamp(0, table.shape[1] * bs).contiguous()
    longest = int(n.max())
    used = table[:, :-(-longest // bs)] if longest else table[:, :0]
    need = torch.arange(used.shape[1], device=dev)[None, :] * bs < n[:, None]
    if bool(((used < 0) | (used >= cache.shape[0]))[need].any()):
        raise ValueError(f"block_table names a block outside the cache's {cache.shape[0]} blocks")
    BG = _bg(M)
    gblocks = -(-M // BG)
    chunk, chunks = _chunking(max(longest, 1), R * H, gblocks, dev, splits)
    pm = torch.empty((R * H, chunks, M), dtype=torch.float32, device=dev)
    pl = torch.empty_like(pm)
    pa = torch.empty((R * H, chunks, M, d), dtype=torch.float32, device=dev)
    klut, vlut = layout.luts(dev)
    ntab = layout.norm_table.to(dev).contiguous() if layout.norm_table is not None else vlut
    o = layout.offsets
    qf = q.float().contiguous()
    if key_rope is None:
        rw, half, factor, rope = klut, 1, 1.0, dict(ROPE=False, INTERLEAVED=False, HP=16, RP=16)
    else:
        rw, half, factor = key_rope.inv_freq.to(dev).contiguous(), key_rope.inv_freq.numel(), float(key_rope.scaling)
        rope = dict(ROPE=True, INTERLEAVED=key_rope.layout == "interleaved", HP=max(16, pow2(half)),
                    RP=max(16, pow2(d - 2 * half)))
    _attend_paged[(R * H, chunks, gblocks)](
        qf, cache, table, table.stride(0), n, klut, vlut, ntab, pm, pl, pa, chunks, H, M, d, bs, cache.shape[3],
        chunk, scale, o[0], o[1], o[2], o[3], max(1, o[2] - o[1]), rw, half, factor,
        K_KIND=KEY_KINDS.index(layout.key_kind), K_BITS=layout.key_bits, V_KIND=VALUE_KINDS.index(layout.value_kind),
        V_BITS=layout.value_bits, BN=BLOCK_N, BG=BG, DP=max(16, pow2(d)), **rope)
    _merge[(R * H, gblocks)](pm, pl, pa, out, lse, chunks, M, d, BG=BG, DVP=max(16, pow2(d)))
    return out.view(R, H, M, d), lse.view(R, H, M)


__all__ = ["BLOCK_N", "attend_paged"]
