"""Attention read straight from the packed codes, on the GPU: :func:`kv_cache.kernels.attend_mixed`
and :func:`kv_cache.kernels.attend_block` in Triton (math dictionary §15.3-§15.5, §16).

A call splits every block (packed, or full-precision ``[B, H, n, d]``) into chunks of tokens;
one program takes one (row, chunk, group of queries) and runs an online softmax over its tokens
in tiles: a packed tile is decoded in registers (``scale * (lut[code] - zero)``, never written
to memory), scored against the ``G`` queries that share the row (GQA: the KV is never repeated),
and accumulated into ``(m, l, acc)``. A rotated packed block is scored with its own ``q R`` and
its accumulator is mapped back by ``R^T`` before it leaves the program (linear, so it commutes
with the merge). A second kernel merges every chunk of every block by log-sum-exp:
``M = max m_i``, ``L = sum l_i e^{m_i - M}``, ``out = sum acc_i e^{m_i - M} / L``,
``lse = M + log L`` (``out = 0``, ``lse = -inf`` for a row with no valid token).

Scores and values are float32 dot products (``input_precision="ieee"``: no TF32), so results
equal the reference up to float32 summation order.
"""

from __future__ import annotations

import functools

import torch
import triton
import triton.language as tl

from ...compression.rotation import fwht
from .._checks import AttendArgs, MixedArgs, value_inverse_matrices
from ._blocks import block_args, check_groups, pow2
from ._tiles import dequant_tile

BLOCK_N = 32
"""Tokens per tile."""
WAVES = 4
"""Programs per streaming multiprocessor a call aims for when it splits the tokens."""


@triton.jit
def _online(s, vt, m, l, acc):
    """One tile of the online softmax: scores ``s`` ``[BG, BN]`` (masked ``-inf``), values ``vt`` ``[BN, DVP]``."""
    m_new = tl.maximum(m, tl.max(s, axis=1))
    m_safe = tl.where(m_new == -float("inf"), 0.0, m_new)
    alpha = tl.exp(m - m_safe)
    p = tl.exp(s - m_safe[:, None])
    l = l * alpha + tl.sum(p, axis=1)
    acc = acc * alpha[:, None] + tl.dot(p, vt, input_precision="ieee")
    return m_new, l, acc


@triton.jit
def _program(q_ptr, q_s0, q_s1, G, d, BG: tl.constexpr, DP: tl.constexpr, DVP: tl.constexpr):
    """What a program of :func:`_attend_packed` / :func:`_attend_dense` is: ``(r, ci, gs, gmask, c,
    cv, q)``: its row, its chunk, its ``BG`` query indices (``gmask``: those below ``G``), the key
    and value channels (``[DP]``, ``[DVP]``) and its queries ``q`` ``[BG, DP]`` (0 past ``d``)."""
    r = tl.program_id(0).to(tl.int64)
    ci = tl.program_id(1)
    gs = tl.program_id(2) * BG + tl.arange(0, BG)
    gmask = gs < G
    c = tl.arange(0, DP)
    cv = tl.arange(0, DVP)
    q = tl.load(q_ptr + r * q_s0 + gs[:, None] * q_s1 + c[None, :], mask=gmask[:, None] & (c[None, :] < d), other=0.0)
    return r, ci, gs, gmask, c, cv, q


@triton.jit
def _empty_state(BG: tl.constexpr, DVP: tl.constexpr):
    """The online softmax's ``(m, l, acc)`` before any token: ``-inf``, 0, 0."""
    return tl.full((BG,), -float("inf"), tl.float32), tl.zeros((BG,), tl.float32), tl.zeros((BG, DVP), tl.float32)


@triton.jit
def _store_partial(pm_ptr, pl_ptr, pa_ptr, r, item, NI, gs, gmask, G, dv, m, l, acc, inv_ptr, inv_H,
                   HAS_INV: tl.constexpr, DVP: tl.constexpr, BJ: tl.constexpr):
    """Write one item's ``(m, l, acc)``; a rotated block's ``acc`` times ``inverse[r % H]`` first."""
    base = (r * NI + item) * G
    tl.store(pm_ptr + base + gs, m, mask=gmask)
    tl.store(pl_ptr + base + gs, l, mask=gmask)
    a_ptr = pa_ptr + (base + gs[:, None]) * dv
    if HAS_INV:
        i = tl.arange(0, DVP)
        inv_base = inv_ptr + (r % inv_H) * dv * dv
        for j0 in tl.static_range(0, DVP, BJ):
            j = j0 + tl.arange(0, BJ)
            mat = tl.load(inv_base + i[:, None] * dv + j[None, :], mask=(i[:, None] < dv) & (j[None, :] < dv),
                          other=0.0)
            tl.store(a_ptr + j[None, :], tl.dot(acc, mat, input_precision="ieee"),
                     mask=gmask[:, None] & (j[None, :] < dv))
    else:
        j = tl.arange(0, DVP)
        tl.store(a_ptr + j[None, :], acc, mask=gmask[:, None] & (j[None, :] < dv))


@triton.jit
def _pair_channels(half, INTERLEAVED: tl.constexpr, HP: tl.constexpr, RP: tl.constexpr):
    """``(ca, cb, cr, pmask)``: the first and second channel of each rotary pair (``[HP]``, lanes
    past ``half`` masked by ``pmask``) and the channels after the pairs (``[RP]``)."""
    i = tl.arange(0, HP)
    if INTERLEAVED:
        ca = 2 * i
        cb = 2 * i + 1
    else:
        ca = i
        cb = half + i
    return ca, cb, 2 * half + tl.arange(0, RP), i < half


@triton.jit
def _key_part(t, cols, cmask, tin, r, c, kP, d, rinv, rinv_H, rmean, rscale, factor,
              kc, kc0, kc1, klut, ks, ks0, ks1, kz, kz0, kz1, kg, kg0, kg1, ktab, kGS,
              K_BITS: tl.constexpr, K_TOKEN: tl.constexpr, K_ZERO: tl.constexpr, K_GID: tl.constexpr,
              K_CODED: tl.constexpr, R_INV: tl.constexpr, R_MEAN: tl.constexpr, R_SCALE: tl.constexpr,
              kfull):
    """Channels ``cols`` ``[W]`` of the tile's keys before RoPE, offset and scale back:
    ``factor * (sigma * u + mu)`` ``[BN, W]``, ``u`` dequantized, or mapped out of a rotated
    space by ``kfull @ inverse[r % H][:, cols]`` (``R_INV``)."""
    if R_INV:
        mat = tl.load(rinv + (r % rinv_H) * d * d + c[:, None] * d + cols[None, :],
                      mask=(c[:, None] < d) & cmask[None, :], other=0.0)
        u = tl.dot(kfull, mat, input_precision="ieee")
    else:
        u = dequant_tile(t[:, None], cols[None, :], tin[:, None] & cmask[None, :], r, kP,
                         kc, kc0, kc1, klut, ks, ks0, ks1, kz, kz0, kz1, kg, kg0, kg1, ktab, kGS,
                         K_BITS, K_TOKEN, K_ZERO, K_GID, K_CODED)
    if R_SCALE:
        u = u * tl.load(rscale + r * d + cols, mask=cmask, other=0.0)[None, :]
    if R_MEAN:
        u = u + tl.load(rmean + r * d + cols, mask=cmask, other=0.0)[None, :]
    return u * factor


@triton.jit
def _turned_keys(t, tin, r, c, kP, d, rpos_row, rw, half, rinv, rinv_H, rmean, rscale, factor,
                   kc, kc0, kc1, klut, ks, ks0, ks1, kz, kz0, kz1, kg, kg0, kg1, ktab, kGS,
                   K_BITS: tl.constexpr, K_TOKEN: tl.constexpr, K_ZERO: tl.constexpr, K_GID: tl.constexpr,
                   K_CODED: tl.constexpr, R_INV: tl.constexpr, R_MEAN: tl.constexpr, R_SCALE: tl.constexpr,
                   INTERLEAVED: tl.constexpr, HP: tl.constexpr, RP: tl.constexpr):
    """The tile's keys stored before RoPE, turned (math dictionary §29.8): ``(k'_a, k'_b, k_rest)``,
    ``[BN, HP]`` twice (the two channels of each pair) and ``[BN, RP]`` (the channels past the
    pairs), with ``k' = s R(p)(sigma * u + mu)``. The angles ``p w`` are float32 products (as
    transformers computes them), reduced modulo ``2 pi`` before the cosine."""
    ca, cb, cr, pmask = _pair_channels(half, INTERLEAVED, HP, RP)
    i = tl.arange(0, HP)
    rmask = cr < d
    kfull = tl.zeros((1, 1), tl.float32)
    if R_INV:
        kfull = dequant_tile(t[:, None], c[None, :], tin[:, None] & (c[None, :] < d), r, kP,
                             kc, kc0, kc1, klut, ks, ks0, ks1, kz, kz0, kz1, kg, kg0, kg1, ktab, kGS,
                             K_BITS, K_TOKEN, K_ZERO, K_GID, K_CODED)
    ka = _key_part(t, ca, pmask, tin, r, c, kP, d, rinv, rinv_H, rmean, rscale, factor,
                   kc, kc0, kc1, klut, ks, ks0, ks1, kz, kz0, kz1, kg, kg0, kg1, ktab, kGS,
                   K_BITS, K_TOKEN, K_ZERO, K_GID, K_CODED, R_INV, R_MEAN, R_SCALE, kfull)
    kb = _key_part(t, cb, pmask, tin, r, c, kP, d, rinv, rinv_H, rmean, rscale, factor,
                   kc, kc0, kc1, klut, ks, ks0, ks1, kz, kz0, kz1, kg, kg0, kg1, ktab, kGS,
                   K_BITS, K_TOKEN, K_ZERO, K_GID, K_CODED, R_INV, R_MEAN, R_SCALE, kfull)
    kr = _key_part(t, cr, rmask, tin, r, c, kP, d, rinv, rinv_H, rmean, rscale, 1.0,
                   kc, kc0, kc1, klut, ks, ks0, ks1, kz, kz0, kz1, kg, kg0, kg1, ktab, kGS,
                   K_BITS, K_TOKEN, K_ZERO, K_GID, K_CODED, R_INV, R_MEAN, R_SCALE, kfull)
    pos = tl.load(rpos_row + t, mask=tin, other=0).to(tl.float32)
    ang = pos[:, None] * tl.load(rw + i, mask=pmask, other=0.0)[None, :]
    n = tl.floor(ang * 0.15915494309189535 + 0.5)  # turns; 2 pi = 6.28125 (exact times n < 2**16) + the rest
    ang = (ang - n * 6.28125) - n * 0.0019353071795864769
    cs = tl.cos(ang)
    sn = tl.sin(ang)
    return ka * cs - kb * sn, ka * sn + kb * cs, kr


@triton.jit
def _attend_packed(q_ptr, q_s0, q_s1, start_ptr, length_ptr, logit_ptr, lg_s0, lg_s1,
                   pm_ptr, pl_ptr, pa_ptr, item0, NI, inv_ptr, inv_H,
                   N, G, d, dv, chunk, scaling, kP, vP,
                   kc, kc0, kc1, klut, ks, ks0, ks1, kz, kz0, kz1, kg, kg0, kg1, ktab, kGS,
                   vc, vc0, vc1, vlut, vs, vs0, vs1, vz, vz0, vz1, vg, vg0, vg1, vtab, vGS,
                   rpos, rpos_s0, rw, half, rinv, rinv_H, rmean, rscale, factor,
                   K_BITS: tl.constexpr, K_TOKEN: tl.constexpr, K_ZERO: tl.constexpr, K_GID: tl.constexpr,
                   K_CODED: tl.constexpr, V_BITS: tl.constexpr, V_TOKEN: tl.constexpr, V_ZERO: tl.constexpr,
                   V_GID: tl.constexpr, V_CODED: tl.constexpr, HAS_START: tl.constexpr, HAS_LENGTH: tl.constexpr,
                   HAS_INV: tl.constexpr, LOGITS: tl.constexpr,
                   ROPE: tl.constexpr, R_INV: tl.constexpr, R_MEAN: tl.constexpr, R_SCALE: tl.constexpr,
                   INTERLEAVED: tl.constexpr, HP: tl.constexpr, RP: tl.constexpr,
                   BN: tl.constexpr, BG: tl.constexpr, DP: tl.constexpr, DVP: tl.constexpr, BJ: tl.constexpr):
    """Program = (row, chunk of ``chunk`` tokens, ``BG`` queries) of a packed block; ``ROPE``: its
    keys are stored before RoPE and turned to their positions ``rpos[r, t]`` here (§29.8)."""
    r, ci, gs, gmask, c, cv, q = _program(q_ptr, q_s0, q_s1, G, d, BG, DP, DVP)
    qa = q
    qb = q
    qr = q
    if ROPE:  # the query's channels in the pairs' order: first of each pair, second, the rest
        ca, cb, cr, pm = _pair_channels(half, INTERLEAVED, HP, RP)
        pmask = gmask[:, None] & pm[None, :]
        q_row = q_ptr + r * q_s0 + gs[:, None] * q_s1
        qa = tl.load(q_row + ca[None, :], mask=pmask, other=0.0)
        qb = tl.load(q_row + cb[None, :], mask=pmask, other=0.0)
        qr = tl.load(q_row + cr[None, :], mask=gmask[:, None] & (cr < d)[None, :], other=0.0)
    lo = ci * chunk
    hi = tl.minimum(lo + chunk, N)
    first = 0
    last = N
    if HAS_START:
        first = tl.load(start_ptr + r)
    if HAS_LENGTH:
        last = tl.load(length_ptr + r)
    begin = lo
    end = hi
    if not LOGITS:  # only tiles with valid tokens (every score is written when LOGITS)
        begin = tl.maximum(lo, tl.minimum(first, hi))
        end = tl.maximum(begin, tl.minimum(hi, last))
    m, l, acc = _empty_state(BG, DVP)
    for t0 in range(begin, end, BN):
        t = t0 + tl.arange(0, BN)
        tin = t < end
        valid = tin & (t >= first) & (t < last)
        if ROPE:
            ta, tb, kr = _turned_keys(t, tin, r, c, kP, d, rpos + r * rpos_s0, rw, half, rinv, rinv_H, rmean, rscale,
                                      factor, kc, kc0, kc1, klut, ks, ks0, ks1, kz, kz0, kz1, kg, kg0, kg1, ktab, kGS,
                                      K_BITS, K_TOKEN, K_ZERO, K_GID, K_CODED, R_INV, R_MEAN, R_SCALE,
                                      INTERLEAVED, HP, RP)
            s = (tl.dot(qa, tl.trans(ta), input_precision="ieee") + tl.dot(qb, tl.trans(tb), input_precision="ieee")
                 + tl.dot(qr, tl.trans(kr), input_precision="ieee")) * scaling
        else:
            kt = dequant_tile(t[:, None], c[None, :], tin[:, None] & (c[None, :] < d), r, kP,
                              kc, kc0, kc1, klut, ks, ks0, ks1, kz, kz0, kz1, kg, kg0, kg1, ktab, kGS,
                              K_BITS, K_TOKEN, K_ZERO, K_GID, K_CODED)
            s = tl.dot(q, tl.trans(kt), input_precision="ieee") * scaling
        s = tl.where(valid[None, :], s, -float("inf"))
        if LOGITS:
            tl.store(logit_ptr + r * lg_s0 + gs[:, None] * lg_s1 + t[None, :], s, mask=gmask[:, None] & tin[None, :])
        vt = dequant_tile(t[:, None], cv[None, :], tin[:, None] & (cv[None, :] < dv), r, vP,
                          vc, vc0, vc1, vlut, vs, vs0, vs1, vz, vz0, vz1, vg, vg0, vg1, vtab, vGS,
                          V_BITS, V_TOKEN, V_ZERO, V_GID, V_CODED)
        m, l, acc = _online(s, vt, m, l, acc)
    _store_partial(pm_ptr, pl_ptr, pa_ptr, r, item0 + ci, NI, gs, gmask, G, dv, m, l, acc, inv_ptr, inv_H,
                   HAS_INV, DVP, BJ)


@triton.jit
def _attend_dense(q_ptr, q_s0, q_s1, start_ptr, pm_ptr, pl_ptr, pa_ptr, item0, NI,
                  k_ptr, k_sb, k_sh, k_st, v_ptr, v_sb, v_sh, v_st, H,
                  n, G, d, dv, chunk, scaling,
                  HAS_START: tl.constexpr, BN: tl.constexpr, BG: tl.constexpr, DP: tl.constexpr,
                  DVP: tl.constexpr):
    """Program = (row, chunk, ``BG`` queries) of a full-precision block ``[B, H, n, d]`` (any float dtype)."""
    r, ci, gs, gmask, c, cv, q = _program(q_ptr, q_s0, q_s1, G, d, BG, DP, DVP)
    k_row = k_ptr + (r // H) * k_sb + (r % H) * k_sh
    v_row = v_ptr + (r // H) * v_sb + (r % H) * v_sh
    lo = ci * chunk
    hi = tl.minimum(lo + chunk, n)
    begin = lo
    if HAS_START:
        begin = tl.maximum(lo, tl.minimum(tl.load(start_ptr + r), hi))
    m, l, acc = _empty_state(BG, DVP)
    for t0 in range(begin, hi, BN):
        t = t0 + tl.arange(0, BN)
        tin = t < hi
        kt = tl.load(k_row + t[:, None] * k_st + c[None, :], mask=tin[:, None] & (c[None, :] < d), other=0.0)
        s = tl.dot(q, tl.trans(kt.to(tl.float32)), input_precision="ieee") * scaling
        s = tl.where(tin[None, :], s, -float("inf"))
        vt = tl.load(v_row + t[:, None] * v_st + cv[None, :], mask=tin[:, None] & (cv[None, :] < dv), other=0.0)
        m, l, acc = _online(s, vt.to(tl.float32), m, l, acc)
    _store_partial(pm_ptr, pl_ptr, pa_ptr, r, item0 + ci, NI, gs, gmask, G, dv, m, l, acc, pm_ptr, 1,
                   False, DVP, DVP)


@triton.jit
def _merge(pm_ptr, pl_ptr, pa_ptr, out_ptr, lse_ptr, NI, G, dv, BG: tl.constexpr, DVP: tl.constexpr):
    """Program = (row, ``BG`` queries): the log-sum-exp merge of the row's ``NI`` items."""
    r = tl.program_id(0).to(tl.int64)
    gs = tl.program_id(1) * BG + tl.arange(0, BG)
    gmask = gs < G
    j = tl.arange(0, DVP)
    amask = gmask[:, None] & (j[None, :] < dv)
    big = tl.full((BG,), -float("inf"), tl.float32)
    for i in range(NI):
        big = tl.maximum(big, tl.load(pm_ptr + (r * NI + i) * G + gs, mask=gmask, other=-float("inf")))
    safe = tl.where(big == -float("inf"), 0.0, big)
    total = tl.zeros((BG,), tl.float32)
    acc = tl.zeros((BG, DVP), tl.float32)
    for i in range(NI):
        base = (r * NI + i) * G
        w = tl.exp(tl.load(pm_ptr + base + gs, mask=gmask, other=-float("inf")) - safe)
        total += w * tl.load(pl_ptr + base + gs, mask=gmask, other=0.0)
        acc += w[:, None] * tl.load(pa_ptr + (base + gs[:, None]) * dv + j[None, :], mask=amask, other=0.0)
    ok = total > 0
    out = acc / tl.where(ok, total, 1.0)[:, None]
    tl.store(out_ptr + (r * G + gs[:, None]) * dv + j[None, :], tl.where(ok[:, None], out, 0.0), mask=amask)
    tl.store(lse_ptr + r * G + gs, tl.where(ok, safe + tl.log(tl.where(ok, total, 1.0)), -float("inf")), mask=gmask)


@functools.lru_cache(maxsize=8)
def _multiprocessors(device: str) -> int:
    if torch.device(device).type == "cuda":
        return torch.cuda.get_device_properties(torch.device(device)).multi_processor_count
    return 1  # Triton's interpreter (CPU tensors) runs programs one by one: few chunks


def _chunking(n: int, R: int, G_blocks: int, device: torch.device, splits: int | None) -> tuple[int, int]:
    """``(chunk, chunks)``: tokens per program and programs per row for a block of ``n`` tokens."""
    if splits is None:
        splits = max(1, -(-WAVES * _multiprocessors(str(device)) // max(1, R * G_blocks)))
    chunk = max(BLOCK_N, -(-n // (splits * BLOCK_N)) * BLOCK_N)
    return chunk, -(-n // chunk)


def _bg(G: int) -> int:
    """Queries per program: a power of two >= 16 (``tl.dot``'s smallest tile), at most 64."""
    return max(16, min(64, pow2(G)))


def _rows3(t: torch.Tensor) -> torch.Tensor:
    return t if t.shape[-1] <= 1 or t.stride(-1) == 1 else t.contiguous()


def _run(q: torch.Tensor, packed: list, dense: list, scaling: float, *, length=None, logits=None,
         splits: int | None = None) -> tuple[torch.Tensor, torch.Tensor]:
    """Launch every block's programs, then the merge. ``packed``: ``(AttendArgs, inverse)``;
    ``dense``: ``(keys, values, start)``. Returns ``(out [R, G, dv], lse [R, G])`` float32."""
    R, G, d = q.shape
    dv = packed[0][0].v.head_dim if packed else dense[0][1].shape[-1]
    dev = q.device
    BG = _bg(G)
    gblocks = -(-G // BG)
    DP, DVP = max(16, pow2(d)), max(16, pow2(dv))
    plans, NI = [], 0
    for p, inv in packed:
        n = p.k.codes.shape[1]
        chunk, chunks = _chunking(n, R, gblocks, dev, splits) if n else (BLOCK_N, 0)
        plans.append(("packed", p, inv, n, chunk, chunks, NI))
        NI += chunks
    for k, v, st, *_ in dense:  # flat ragged blocks never reach here (ops takes the torch path)
        n = k.shape[2]
        chunk, chunks = _chunking(n, R, gblocks, dev, splits) if n else (BLOCK_N, 0)
        plans.append(("dense", (k, v, st), None, n, chunk, chunks, NI))
        NI += chunks
    out = torch.empty((R, G, dv), dtype=torch.float32, device=dev)
    lse = torch.empty((R, G), dtype=torch.float32, device=dev)
    if R == 0 or G == 0:
        return out, lse
    pm = torch.empty((R, max(NI, 1), G), dtype=torch.float32, device=dev)
    pl = torch.empty_like(pm)
    pa = torch.empty((R, max(NI, 1), G, dv), dtype=torch.float32, device=dev)
    for kind, blk, inv, n, chunk, chunks, item0 in plans:
        if not chunks:
            continue
        grid = (R, chunks, gblocks)
        if kind == "packed":
            p = blk
            check_groups(p.k)
            check_groups(p.v)
            qp = _rows3(p.q)
            kt, kf = block_args(p.k)
            vt, vf = block_args(p.v)
            flags = {f"K_{key}": val for key, val in kf.items()} | {f"V_{key}": val for key, val in vf.items()}
            rt, rf = rope_args(p.k, pm)
            lg = logits if logits is not None else pm
            _attend_packed[grid](qp, qp.stride(0), qp.stride(1), p.start if p.start is not None else pm,
                                 length if length is not None else pm, lg, lg.stride(0), lg.stride(1),
                                 pm, pl, pa, item0, NI, inv.contiguous() if inv is not None else pm,
                                 1 if inv is None else inv.shape[0],
                                 n, G, d, dv, chunk, scaling, p.k.codes.shape[2], p.v.codes.shape[2],
                                 *kt, *vt, *rt, **flags, **rf, HAS_START=p.start is not None,
                                 HAS_LENGTH=length is not None,
                                 HAS_INV=inv is not None, LOGITS=logits is not None,
                                 BN=BLOCK_N, BG=BG, DP=DP, DVP=DVP, BJ=min(DVP, 32))
        else:
            k, v, st = blk
            k, v = _rows3(k), _rows3(v)
            qd = _rows3(q)
            _attend_dense[grid](qd, qd.stride(0), qd.stride(1), st if st is not None else pm, pm, pl, pa, item0, NI,
                                k, k.stride(0), k.stride(1), k.stride(2), v, v.stride(0), v.stride(1), v.stride(2),
                                k.shape[1], n, G, d, dv, chunk, scaling,
                                HAS_START=st is not None, BN=BLOCK_N, BG=BG, DP=DP, DVP=DVP)
    _merge[(R, gblocks)](pm, pl, pa, out, lse, NI, G, dv, BG=BG, DVP=DVP)
    return out, lse


def rope_args(k, dummy: torch.Tensor) -> tuple[tuple, dict]:
    """``(tensors, constexpr flags)`` of a key block's :class:`~kv_cache.kernels.KeyRope` for
    :func:`_attend_packed` (none: flags off, ``dummy`` in every tensor slot, never read). Keys in
    a randomized Hadamard space are mapped back by the dense ``H diag(s) / sqrt(d)`` per head."""
    r = k.rope
    if r is None:
        return ((dummy, 0, dummy, 0, dummy, 1, dummy, dummy, 1.0),
                dict(ROPE=False, R_INV=False, R_MEAN=False, R_SCALE=False, INTERLEAVED=False, HP=16, RP=16))
    d = k.head_dim
    half = r.inv_freq.numel()
    inv = dummy
    if r.signs is not None:
        eye = torch.eye(d, dtype=torch.float32, device=r.signs.device)
        inv = (fwht(eye).unsqueeze(0) * r.signs.unsqueeze(1)).contiguous()  # [H, d, d]: (y H / sqrt(d)) * s
    pos = r.positions.contiguous()
    tensors = (pos, pos.stride(0), r.inv_freq.contiguous(), half, inv, 1 if r.signs is None else inv.shape[0],
               dummy if r.mean is None else r.mean.contiguous(), dummy if r.scale is None else r.scale.contiguous(),
               float(r.scaling))
    flags = dict(ROPE=True, R_INV=r.signs is not None, R_MEAN=r.mean is not None, R_SCALE=r.scale is not None,
                 INTERLEAVED=r.layout == "interleaved", HP=max(16, pow2(half)), RP=max(16, pow2(d - 2 * half)))
    return tensors, flags


def attend_block(a: AttendArgs, return_logits: bool, *, splits: int | None = None):
    """:func:`kv_cache.kernels.attend_block` of validated arguments: ``(out [R, G, d_v], lse [R, G],
    logits [R, G, N] or None)``, float32, on the device of ``a.q``.

    ``splits``: programs per row over the tokens (None: enough to fill the GPU; tests set it)."""
    R, G, _ = a.q.shape
    logits = None
    if return_logits:
        logits = torch.empty((R, G, a.k.codes.shape[1]), dtype=torch.float32, device=a.q.device)
    out, lse = _run(a.q, [(a, None)], [], a.scaling, length=a.length, logits=logits, splits=splits)
    return out, lse, logits


def attend_mixed(a: MixedArgs, *, splits: int | None = None) -> tuple[torch.Tensor, torch.Tensor]:
    """:func:`kv_cache.kernels.attend_mixed` of validated arguments: ``(out [R, G, d_v], lse [R, G])``
    float32 over every packed and full-precision block in one softmax (§16)."""
    inverses = [value_inverse_matrices(vi) for vi in a.inverses]  # Hadamard signs as matrices
    return _run(a.q, list(zip(a.packed, inverses)), list(a.dense), a.scaling, splits=splits)


__all__ = ["BLOCK_N", "attend_block", "attend_mixed"]
