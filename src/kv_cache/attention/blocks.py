"""Attention over one block of stored tokens, returning what a log-sum-exp merge needs.

A layer's stored tokens are a few blocks in token order (full-precision sinks, packed codes, a
full-precision residual); this call's new tokens are one more block. Each block is attended
separately and gives, per query row, its normalized output and its log-sum-exp

    lse_B = log sum_{t in B} exp(s_t),    out_B = sum_{t in B} softmax_B(s)_t v_t,

which :func:`merge` combines into the one softmax over all blocks (math dictionary §16):
``lse = logsumexp_B lse_B``, ``out = sum_B exp(lse_B - lse) out_B``.

Shapes: queries are grouped by KV head without repeating K/V, ``q`` ``[B, Hkv, G * L, d]``
with row ``g * L + i`` = query head ``j * G + g`` of KV head ``j`` at query position ``i``
(transformers' ``repeat_kv`` order). Outputs ``[B, Hkv, G * L, d_v]`` float32, ``lse``
``[B, Hkv, G * L]`` float32 (``-inf`` for a row that sees no valid token; its output is 0).
"""

from __future__ import annotations

import weakref
from dataclasses import dataclass
from typing import Any

import torch

from ..kernels import QBlock, attend_block, attend_mixed
from ..kernels.reference import merge_parts

ROW_CHUNK_BYTES = 64 * 2**20
"""Logits held at once by the full-precision paths (bounded memory for long prefills)."""

JOIN_NEW_TOKEN_BELOW = 256
"""On the per-block path, a decoded token is attended together with a full-precision block
shorter than this (one block fewer to attend and merge)."""

STAT_CHUNK_BYTES = 16 * 2**20
"""Probabilities held at once by a first prefill's statistics pass (:func:`_causal_column_sums`)
and by KVzip's reconstruction scores (:func:`reconstruction_scores`):
smaller than :data:`ROW_CHUNK_BYTES` because it runs on top of the prefill's own activations, so
an evicting cache's prefill does not peak above the full cache's (``bench_generate``)."""


def _row_chunks(rows: int, cols: int, heads: int) -> int:  # rows per chunk of ROW_CHUNK_BYTES logits
    return max(1, ROW_CHUNK_BYTES // max(1, 4 * cols * heads))


def _softmax_parts(logits: torch.Tensor, v: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """``(out, lse, p)`` of masked logits ``[..., rows, T]`` against ``v`` ``[..., T, d_v]``."""
    lse = torch.logsumexp(logits, dim=-1)
    p = torch.exp(logits - lse.unsqueeze(-1)).nan_to_num_(0.0)  # all-masked rows: lse = -inf, p = 0
    return p @ v, lse, p


@dataclass
class FullBlock:
    """Full-precision tokens: ``keys``/``values`` ``[B, Hkv, n, d]`` (all before the queries)."""

    keys: torch.Tensor
    values: torch.Tensor

    @property
    def length(self) -> int:
        return self.keys.shape[2]

    def attend(self, q: torch.Tensor, scaling: float, start: torch.Tensor | None, stat_rows: torch.Tensor | None):
        """Attend ``q`` ``[B, Hkv, M, d]`` to every token at or after ``start`` ``[B, Hkv]``.

        Returns ``(out, lse, p_stat)``; ``p_stat`` ``[B, Hkv, S, n]`` are the in-block
        probabilities of the rows ``stat_rows`` (or None).
        """
        q, k, v = q.float(), self.keys.float(), self.values.float()  # float32 statistics (bf16/fp16 models)
        valid = None
        if start is not None:
            valid = torch.arange(self.length, device=k.device) >= start.unsqueeze(-1)  # [B, Hkv, n]

        def part(rows: torch.Tensor | slice) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
            logits = (q[:, :, rows] @ k.transpose(-1, -2)) * scaling
            if valid is not None:
                logits = logits.masked_fill(~valid.unsqueeze(2), float("-inf"))
            return _softmax_parts(logits, v)

        M = q.shape[2]
        step = _row_chunks(M, self.length, q.shape[0] * q.shape[1])
        if step >= M:  # one chunk (decoding): the statistics reuse its probabilities
            out, lse, p = part(slice(None))
            return out, lse, (None if stat_rows is None else p[:, :, stat_rows])
        outs, lses = [], []
        for s in range(0, M, step):
            out, lse, _ = part(slice(s, s + step))
            outs.append(out)
            lses.append(lse)
        p_stat = None if stat_rows is None else part(stat_rows)[2]
        return torch.cat(outs, dim=2), torch.cat(lses, dim=2), p_stat


@dataclass
class QuantBlock:
    """Packed tokens: ``keys``/``values`` are :class:`~kv_cache.kernels.QBlock` s over rows
    ``R = B * Hkv``; attention reads the codes directly (no dequantized key matrix)."""

    keys: QBlock
    values: QBlock
    batch: int
    kv_heads: int
    rotation: Any = None  # stored in a rotated space: ``forward``/``inverse`` of [B, Hkv, n, d]

    @property
    def length(self) -> int:
        return self.keys.codes.shape[1]

    def attend(self, q: torch.Tensor, scaling: float, start: torch.Tensor | None, stat_rows: torch.Tensor | None):
        B, H, M, d = q.shape
        R = B * H
        if self.rotation is not None:  # q.k = (qR).(kR): rotate the query once, not every key
            q = self.rotation.forward_keys(q.float())
        qf = q.reshape(R, M, d).float()
        st = None if start is None else start.reshape(R).to(torch.int32)
        want_all = stat_rows is not None and stat_rows.numel() == M
        out, lse, logits = attend_block(qf, self.keys, self.values, scaling, start=st, return_logits=want_all)
        p_stat = None
        if stat_rows is not None:
            if not want_all:
                _, lse_s, logits = attend_block(qf[:, stat_rows].contiguous(), self.keys, self.values, scaling,
                                                start=st, return_logits=True)
            else:
                lse_s = lse
            p_stat = torch.exp(logits - lse_s.unsqueeze(-1)).nan_to_num_(0.0).reshape(B, H, -1, self.length)
        out = out.reshape(B, H, M, -1)
        if self.rotation is not None:  # sum_t p_t v_t = (sum_t p_t v_t R) R^T: once per call
            out = self.rotation.inverse(out)
        return out, lse.reshape(B, H, M), p_stat


@dataclass
class RaggedBlock:
    """Rows that hold different numbers of tokens (per-head budgets): each ``(b, h)`` row has its
    own blocks (``batch = kv_heads = 1``) and ``lengths[r]`` tokens.

    Seen from outside, the block is ``length = max(lengths)`` slots long and row ``r`` is
    right-aligned: its first ``length - lengths[r]`` slots are virtual padding (never held,
    always masked), so starts and statistics keep the rectangular ``[B, Hkv, ...]`` contract.
    """

    rows: list
    batch: int
    kv_heads: int
    lengths: list

    @property
    def length(self) -> int:
        return max(self.lengths, default=0)

    def attend(self, q: torch.Tensor, scaling: float, start: torch.Tensor | None, stat_rows: torch.Tensor | None):
        B, H, M, _ = q.shape
        L = self.length
        outs, lses, stats = [], [], []
        for r, blocks in enumerate(self.rows):
            b, h = divmod(r, H)
            qr = q[b:b + 1, h:h + 1]
            parts, ps, off = [], [], 0
            for blk in blocks:
                # leading padding of this sub-block: the row's start past its virtual padding and the blocks before
                st = _row_start(start, r, off + L - self.lengths[r], blk.length, q.device)
                o, l, p = blk.attend(qr, scaling, None if st is None else st.reshape(1, 1), stat_rows)
                parts.append((o, l))
                ps.append(p)
                off += blk.length
            if not parts:
                dv = q.shape[-1]
                parts = [(q.new_zeros(1, 1, M, dv, dtype=torch.float32),
                          torch.full((1, 1, M), float("-inf"), device=q.device))]
            o, l = merge(parts)
            outs.append(o)
            lses.append(l)
            if stat_rows is not None:
                row = [p * torch.exp(lb[:, :, stat_rows] - l[:, :, stat_rows]).nan_to_num_(0.0).unsqueeze(-1)
                       for p, (_, lb) in zip(ps, parts) if p is not None]
                pad = L - self.lengths[r]
                cols = torch.cat(row, dim=-1) if row else q.new_zeros(1, 1, stat_rows.numel(), 0)
                stats.append(torch.nn.functional.pad(cols, (pad, 0)))
        out = torch.cat(outs, dim=0).reshape(B, H, M, -1)
        lse = torch.cat(lses, dim=0).reshape(B, H, M)
        p_stat = None if stat_rows is None else torch.cat(stats, dim=0).reshape(B, H, -1, L)
        return out, lse, p_stat


def join_new_token(view: list) -> list:
    """``view`` with each one-token full-precision block (a decoded token) joined to the short
    full-precision block right before it (:data:`JOIN_NEW_TOKEN_BELOW`): the same tokens in the
    same order, one block fewer for the per-block path (the one-call step needs no join)."""
    out = []
    for blk in view:
        prev = out[-1] if out else None
        if (isinstance(blk, FullBlock) and blk.length == 1 and isinstance(prev, FullBlock)
                and prev.length <= JOIN_NEW_TOKEN_BELOW):
            # torch.cat promotes: a float16 residual joins a float32 token as float32, the token exact
            out[-1] = FullBlock(torch.cat([prev.keys, blk.keys], 2), torch.cat([prev.values, blk.values], 2))
        else:
            out.append(blk)
    return out


_SAME_SPACE: dict = {}
"""``(id(a), id(b)) -> (weakref a, weakref b, equal)``: :func:`_same_rotation`'s answers. A rotation's
tensors are never written in place (the cache holds them as made), so the comparison, a host read
of GPU tensors, runs once per pair of rotations instead of at every decoding step."""


def _same_rotation(a: Any, b: Any) -> bool:
    """Whether two packed blocks are stored in the same space (one query, one inverse for both)."""
    if a is b or a is None or b is None:
        return a is b
    hit = _SAME_SPACE.get((id(a), id(b)))
    if hit is not None and hit[0]() is a and hit[1]() is b:
        return hit[2]
    if a.keys != b.keys:
        same = False
    elif a.matrices is not None or b.matrices is not None:
        same = a.matrices is not None and b.matrices is not None and torch.equal(a.matrices, b.matrices)
    else:
        same = torch.equal(a.signs, b.signs)
    if len(_SAME_SPACE) >= 256:
        _SAME_SPACE.clear()
    _SAME_SPACE[(id(a), id(b))] = (weakref.ref(a), weakref.ref(b), same)
    return same


def _one_call(blocks: list, q: torch.Tensor, scaling: float, starts: list) -> tuple[torch.Tensor, torch.Tensor]:
    """``blocks`` (full-precision and packed, ``batch * kv_heads = R`` rows) with per-block starts
    (int32 ``[R]`` or None) in one :func:`~kv_cache.kernels.attend_mixed` call; ``q``
    ``[B, H, G, d]``. Each packed block is scored in its own space (``q R`` for a rotated block,
    its share rotated back in the kernel); blocks stored in the same space share one rotated
    query. Returns ``(out [B, H, G, d_v], lse [B, H, G])`` float32."""
    B, H, G, d = q.shape
    R = B * H
    spaces: list = []  # (rotation, q R, R^T) per distinct space
    packed, dense = [], []
    for blk, start in zip(blocks, starts):
        if isinstance(blk, FullBlock):
            dense.append((blk.keys, blk.values, start))
            continue
        if hasattr(blk, "dense_entry"):  # a flat ragged full-precision buffer (kv_cache.attention.flat)
            dense.append(blk.dense_entry(start))
            continue
        space = next((sp for sp in spaces if _same_rotation(sp[0], blk.rotation)), None)
        if space is None:
            rot = blk.rotation
            space = (rot, None, None) if rot is None else (rot, rot.forward_keys(q).reshape(R, G, d),
                                                           rot.value_inverse())
            spaces.append(space)
        packed.append((blk.keys, blk.values, start, q.reshape(R, G, d) if space[1] is None else space[1], space[2]))
    out, lse = attend_mixed(q.reshape(R, G, d), scaling, packed=packed or None, dense=dense)
    return out.reshape(B, H, G, -1), lse.reshape(B, H, G)


def fused_decode(view: list, q: torch.Tensor, scaling: float, starts: torch.Tensor | None
                 ) -> tuple[torch.Tensor, torch.Tensor] | None:
    """A decoding step's attention over a layer's whole view in one kernel call, or None.

    ``view``: the stored blocks in token order (the new token included); ``q`` ``[B, Hkv, G, d]``
    (one query position); ``starts`` ``[B, Hkv]`` leading padding slots or None. Full-precision
    and packed blocks (any number, e.g. a precision tier's demoted tokens next to the kept ones)
    go to one :func:`kv_cache.kernels.attend_mixed` call: one
    parallel call, merged inside it, each packed block's rotation undone on its share of the
    output. A view with ragged blocks (heads of different lengths) and otherwise only
    full-precision blocks takes one such call per ``(b, h)`` row. Anything else returns None and
    takes the per-block path. Returns ``(out [B, Hkv, G, d_v], lse [B, Hkv, G])`` float32.
    """
    if not view:
        return None
    qf = q.float()
    if any(hasattr(b, "segments") for b in view):  # the packed ragged layout: its buffers in the one call
        return _fused_flat(view, qf, scaling, starts)
    if any(isinstance(b, RaggedBlock) for b in view):
        return _fused_rows(view, qf, scaling, starts)
    if any(not isinstance(b, (FullBlock, QuantBlock)) for b in view):
        return None
    B, H = q.shape[:2]
    rows, offset = [], 0
    for blk in view:
        rows.append(None if starts is None else (starts - offset).clamp(0, blk.length).reshape(B * H).to(torch.int32))
        offset += blk.length
    return _one_call(view, qf, scaling, rows)


def _fused_flat(view: list, q: torch.Tensor, scaling: float, starts: torch.Tensor | None
                ) -> tuple[torch.Tensor, torch.Tensor] | None:
    """:func:`fused_decode` of a view with :class:`~kv_cache.attention.flat.FlatRaggedBlock` s (every
    row's tokens in one buffer, read at per-row offsets) and rectangular blocks: one call."""
    B, H = q.shape[:2]
    blocks, row_starts, offset = [], [], 0
    for blk in view:
        st = None if starts is None else (starts - offset).clamp(0, blk.length)
        if hasattr(blk, "segments"):
            for sub, sub_start in blk.segments(st):
                blocks.append(sub)
                row_starts.append(sub_start)
        elif isinstance(blk, (FullBlock, QuantBlock)):
            blocks.append(blk)
            row_starts.append(None if st is None else st.reshape(B * H).to(torch.int32))
        else:
            return None
        offset += blk.length
    return _one_call(blocks, q, scaling, row_starts) if blocks else None


def _fused_rows(view: list, q: torch.Tensor, scaling: float, starts: torch.Tensor | None
                ) -> tuple[torch.Tensor, torch.Tensor] | None:
    """:func:`fused_decode` of a view with ragged blocks: one call per ``(b, h)`` row over that
    row's own blocks (right-aligned in the ragged block's slots, as :class:`RaggedBlock` reads
    them) and its slice of the full-precision blocks."""
    if any(not isinstance(b, (FullBlock, RaggedBlock)) for b in view):
        return None
    B, H = q.shape[:2]
    outs, lses = [], []
    for r in range(B * H):
        b, h = divmod(r, H)
        blocks, row_starts, offset = [], [], 0
        for blk in view:
            if isinstance(blk, FullBlock):
                blocks.append(FullBlock(blk.keys[b:b + 1, h:h + 1], blk.values[b:b + 1, h:h + 1]))
                row_starts.append(_row_start(starts, r, offset, blk.length, q.device))
                offset += blk.length
                continue
            inner = offset + blk.length - blk.lengths[r]  # virtual padding first
            offset += blk.length
            for sub in blk.rows[r]:
                if not isinstance(sub, (FullBlock, QuantBlock)):
                    return None
                blocks.append(sub)
                row_starts.append(_row_start(starts, r, inner, sub.length, q.device))
                inner += sub.length
        if not blocks:
            return None
        o, lse = _one_call(blocks, q[b:b + 1, h:h + 1], scaling, row_starts)
        outs.append(o)
        lses.append(lse)
    return torch.cat(outs, dim=0).reshape(B, H, *outs[0].shape[2:]), torch.cat(lses, dim=0).reshape(B, H, -1)


def _row_start(starts: torch.Tensor | None, r: int, offset: int, length: int, device: torch.device
               ) -> torch.Tensor | None:
    """Leading padding slots of row ``r`` in a block of ``length`` slots that begins ``offset``
    slots into the view: ``clamp(starts[r] - offset, 0, length)`` as int32 ``[1]`` (None: no padding).

    Starts held on the host are read there (free) and the tensor is filled on ``device``; starts
    held on a GPU stay there (no host read: a decoding step never waits for the device)."""
    if starts is None:
        return None
    flat = starts.reshape(-1)
    if flat.device.type == "cpu":
        value = min(int(flat[r]) - offset, length)
        return torch.full((1,), value, dtype=torch.int32, device=device) if value > 0 else None
    return (flat[r:r + 1] - offset).clamp(0, length).to(device=device, dtype=torch.int32)


def attend_new(
    q: torch.Tensor,
    keys: torch.Tensor,
    values: torch.Tensor,
    scaling: float,
    group: int,
    valid: torch.Tensor | None,
    n_stat: int,
    sum_stats: bool,
):
    """Causal attention of this call's ``L`` queries to its own ``L`` tokens.

    ``q`` ``[B, Hkv, G * L, d]``; ``keys``/``values`` ``[B, Hkv, L, d]``; ``valid`` ``[B, L]``
    (False = padding) or None. A padding query always sees itself, so every row has a valid
    token. ``n_stat``: the last ``n_stat`` positions are the policy's queries. Returns
    ``(out, lse, stat)``: ``stat`` is None (``n_stat == 0``), the in-block probabilities of
    those queries ``[B, Hkv, G * n_stat, L]``, or, with ``sum_stats`` (this block is the only
    one: a first prefill, so in-block probabilities are final), their sum over the queries of
    each query head, ``[B, Hkv, G, L]``, accumulated chunk by chunk without holding an
    ``L x L`` matrix; the output then comes from sdpa and ``lse`` is None (nothing to merge).

    Queries are processed in chunks of positions; a chunk ``[s, e)`` reads keys ``[0, e)``
    only (causal), so a prefill costs about half of a full ``L x L`` pass.
    """
    B, H, M, d = q.shape
    L = keys.shape[2]
    G = group
    if sum_stats:
        # The first prefill: nothing stored. sdpa's fused kernel (GQA native) for the output, and
        # the policy's statistics, if any, from a pass that forms probabilities only.
        mask = None
        if valid is not None:
            pos = torch.arange(L, device=q.device)
            mask = ((pos[None, :] <= pos[:, None]) & valid[:, None, None, :]) | (pos[None, :] == pos[:, None])
        out = torch.nn.functional.scaled_dot_product_attention(
            q.reshape(B, H * G, L, d), keys, values, attn_mask=mask, is_causal=mask is None, scale=scaling,
            enable_gqa=True)
        stat = None if not n_stat else _causal_column_sums(q, keys, scaling, G, valid, n_stat)
        return out.reshape(B, H, M, -1), None, stat
    q5 = q.reshape(B, H, G, L, d).float()
    k, v = keys.float(), values.float()
    pos = torch.arange(L, device=q.device)
    out = torch.empty(B, H, G, L, v.shape[-1], device=q.device)
    lse = torch.empty(B, H, G, L, device=q.device)
    first_stat = L - n_stat
    p_stat = None if not n_stat else torch.zeros(B, H, G, n_stat, L, device=q.device)
    step = max(1, ROW_CHUNK_BYTES // max(1, 4 * L * B * H * G))
    for s in range(0, L, step):
        e = min(L, s + step)
        allowed = pos[None, :e] <= pos[s:e, None]  # [c, e]
        if valid is not None:
            allowed = (allowed & valid[:, None, None, None, :e]) | (pos[None, :e] == pos[s:e, None])
        logits = (q5[:, :, :, s:e] @ k[:, :, None, :e].transpose(-1, -2)) * scaling  # [B, H, G, c, e]
        logits = logits.masked_fill(~allowed, float("-inf"))
        o, l, p = _softmax_parts(logits, v[:, :, None, :e])
        out[:, :, :, s:e] = o
        lse[:, :, :, s:e] = l
        if e > first_stat and n_stat:
            a = max(s, first_stat)
            p_stat[:, :, :, a - first_stat:e - first_stat, :e] = p[:, :, :, a - s:]
    stat = None if p_stat is None else p_stat.reshape(B, H, G * n_stat, L)
    return out.reshape(B, H, M, -1), lse.reshape(B, H, M), stat


def _causal_column_sums(q, keys, scaling, G, valid, n_stat) -> torch.Tensor:
    """``[B, Hkv, G, L]``: causal softmax probabilities of the last ``n_stat`` positions, summed
    over those positions per query head, in chunks of positions that read keys ``[0, e)`` only."""
    B, H, M, d = q.shape
    L = keys.shape[2]
    q5 = q.reshape(B, H, G, L, d)[:, :, :, L - n_stat:].float()
    k = keys.float()
    pos = torch.arange(L, device=q.device)
    colsum = torch.zeros(B, H, G, L, device=q.device)
    step = max(1, STAT_CHUNK_BYTES // max(1, 4 * L * B * H * G))
    for s in range(0, n_stat, step):
        e = min(n_stat, s + step)
        end = L - n_stat + e  # causal: these queries see keys [0, end)
        qpos = pos[L - n_stat + s:end]
        allowed = pos[None, :end] <= qpos[:, None]
        if valid is not None:
            allowed = (allowed & valid[:, None, None, None, :end]) | (pos[None, :end] == qpos[:, None])
        # one [B, H, G, c, end] buffer per chunk, softmax in place (a prefill's peak memory)
        logits = (q5[:, :, :, s:e] @ k[:, :, None, :end].transpose(-1, -2)).mul_(scaling)
        logits.masked_fill_(~allowed, float("-inf"))
        logits.sub_(logits.amax(-1, keepdim=True)).exp_()
        logits.div_(logits.sum(-1, keepdim=True))
        colsum[..., :end] += logits.sum(3)
    return colsum


def merge(parts: list[tuple[torch.Tensor, torch.Tensor]]) -> tuple[torch.Tensor, torch.Tensor]:
    """One softmax over all blocks from per-block ``(out, lse)``: ``(out, lse)`` of the union
    (:func:`kv_cache.kernels.reference.merge_parts`, the torch form of the kernel's merge)."""
    return merge_parts(parts)


def reconstruction_scores(
    q: torch.Tensor,
    stored_keys: torch.Tensor,
    new_keys: torch.Tensor,
    scaling: float,
    group: int,
    sinks: int,
    start: int,
    end: int,
    softcap: float | None = None,
) -> torch.Tensor:
    """KVzip's scores of stored slots ``[start, end)`` from one repeat chunk (math dictionary §19.3;
    soft-capped logits ``c tanh(s / c)`` with ``softcap`` ``c``, as the model's softmax has them, §22.4).

    ``q`` ``[B, Hkv, G * L, d]`` are the repeat chunk's queries (grouped as everywhere here),
    ``stored_keys`` ``[B, Hkv, T, d]`` the stored context in full precision, ``new_keys``
    ``[B, Hkv, L, d]`` the chunk's own keys. Each query's softmax runs over the first ``sinks``
    stored slots, the repeated slots ``[start, end)`` and the chunk's tokens up to itself
    (causal); the score of a repeated slot is its largest probability over the chunk's queries
    and the ``G`` query heads of its KV head. Returns float32 ``[B, Hkv, end - start]``.
    Queries are taken in row blocks of at most :data:`STAT_CHUNK_BYTES` of logits.
    """
    B, H, M, d = q.shape
    G = group
    L = M // G
    k_ctx = torch.cat([stored_keys[:, :, :sinks], stored_keys[:, :, start:end]], dim=2).float()
    kn = new_keys.float()
    q5 = q.reshape(B, H, G, L, d).float()
    n_ctx = k_ctx.shape[2]
    best = torch.full((B, H, end - start), float("-inf"), device=q.device)
    pos = torch.arange(L, device=q.device)
    step = max(1, STAT_CHUNK_BYTES // max(1, 4 * (n_ctx + L) * B * H * G))
    for s in range(0, L, step):
        e = min(L, s + step)
        qc = q5[:, :, :, s:e]
        lc = (qc @ k_ctx[:, :, None].transpose(-1, -2)).mul_(scaling)  # [B, H, G, c, n_ctx]
        ln = (qc @ kn[:, :, None, :e].transpose(-1, -2)).mul_(scaling)  # [B, H, G, c, e]
        if softcap is not None:  # before the mask: tanh(-inf) would unmask
            lc.div_(softcap).tanh_().mul_(softcap)
            ln.div_(softcap).tanh_().mul_(softcap)
        ln.masked_fill_(pos[None, :e] > pos[s:e, None], float("-inf"))
        lse = torch.logaddexp(torch.logsumexp(lc, dim=-1), torch.logsumexp(ln, dim=-1)).unsqueeze(-1)
        # max_i p_i = exp(max_i (s_i - lse_i)): one exp per slot, not per probability
        best = torch.maximum(best, (lc[..., sinks:] - lse).amax(dim=(2, 3)))
    return best.exp_()
