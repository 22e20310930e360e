"""Attention over materialized full-precision states with a sliding window and soft-capping,
and learned attention sinks (math dictionary §22).

The block path (:mod:`.blocks`) reads packed codes in place and merges blocks by log-sum-exp; it
has no notion of positions, so it serves every call whose queries all see every stored token.
This module serves the rest:

* a **sliding-window** layer's call whose queries do not all see every held token (a prefill
  longer than the window, a chunk or a session's question after a full window): query ``i`` at
  position ``p_i`` sees key ``j`` at position ``p_j`` iff ``p_i - W < p_j <= p_i``;
* **logit soft-capping** (Gemma 2): ``s = c * tanh(s / c)`` on every logit before the softmax,
  which no log-sum-exp merge of blocks can apply afterwards.

The stored blocks are dequantized once for the call (a sliding layer holds at most ``W - 1``
tokens; a layer whose heads hold different numbers of tokens is laid out right-aligned with its
virtual slots masked) and the queries are processed in chunks, each against the keys its window
reaches. :func:`attend_positions_observed` also sums the probabilities of a policy's queries
(H2O, SnapKV) in the same pass, so soft-capped layers evict like the others (§22.7).

**Learned sinks** (gpt-oss ``s_aux``): one more logit ``s_h`` per query head in the softmax
denominator, with no value. Given any path's ``(out, lse)`` the correction is exact:
``lse' = logaddexp(lse, s_h)``, ``out' = out * exp(lse - lse')`` (:func:`apply_learned_sinks`).

Shapes follow :mod:`.blocks`: ``q`` ``[B, Hkv, G * L, d]`` (row ``g * L + i``), keys and values
``[B, Hkv, S, d]``; outputs float32 ``[B, Hkv, G * L, d_v]``, ``lse`` ``[B, Hkv, G * L]``.
"""

from __future__ import annotations

import torch

from ..kernels import dequantize_block

CHUNK_BYTES = 32 * 2**20
"""Logits held at once by :func:`attend_positions` (bounded memory for long prefills)."""


def materialize(view: list) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor | None] | None:
    """The stored blocks of ``view`` (:class:`~.blocks.FullBlock` / :class:`~.blocks.QuantBlock` /
    ragged blocks, in token order) as float32 ``(keys, values, held)``, ``keys``/``values``
    ``[B, Hkv, S, d]``: packed codes dequantized, a rotated block rotated back. A ragged block
    (heads holding different numbers of tokens, §19.2) is laid out as it is seen from outside:
    ``max_r n_r`` slots, row ``r`` right-aligned after zero-filled virtual padding; ``held``
    ``[B, Hkv, S]`` bool is False on those slots (None when no block is ragged). None for an
    empty view."""
    from .blocks import FullBlock, QuantBlock, RaggedBlock

    ks, vs, helds, ragged = [], [], [], False
    for blk in view:
        if hasattr(blk, "as_rows"):  # the packed ragged layout (kv_cache.attention.flat)
            blk = blk.as_rows()
        if isinstance(blk, FullBlock):
            k, v = blk.keys.float(), blk.values.float()
            held = None
        elif isinstance(blk, QuantBlock):
            B, H, n = blk.batch, blk.kv_heads, blk.length
            k = dequantize_block(blk.keys).reshape(B, H, n, -1)
            v = dequantize_block(blk.values).reshape(B, H, n, -1)
            if blk.rotation is not None:
                k, v = blk.rotation.inverse_keys(k), blk.rotation.inverse(v)
            held = None
        elif isinstance(blk, RaggedBlock):
            k, v, held = _materialize_rows(blk)
            ragged = True
        else:
            raise ValueError(f"{type(blk).__name__}: not a block the positional path can read; expected FullBlock, "
                             "QuantBlock or a ragged block")
        ks.append(k)
        vs.append(v)
        helds.append(held if held is not None else torch.ones(k.shape[:3], dtype=torch.bool, device=k.device))
    if not ks:
        return None
    held = (helds[0] if len(helds) == 1 else torch.cat(helds, 2)) if ragged else None
    return ((ks[0], vs[0], held) if len(ks) == 1 else (torch.cat(ks, 2), torch.cat(vs, 2), held))


def _materialize_rows(blk) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """A :class:`~.blocks.RaggedBlock` as float32 ``[B, Hkv, N, d]`` keys and values, row ``r``'s
    ``n_r`` tokens in its last slots, and ``held`` ``[B, Hkv, N]`` (False on virtual padding)."""
    B, H, N = blk.batch, blk.kv_heads, blk.length
    rows = [materialize(blocks) for blocks in blk.rows]
    first = next((r for r in rows if r is not None), None)
    if first is None:
        raise ValueError("a ragged block whose rows hold no token cannot be read by positions")
    dk, dv, dev = first[0].shape[-1], first[1].shape[-1], first[0].device
    keys = torch.zeros(B * H, N, dk, device=dev)
    values = torch.zeros(B * H, N, dv, device=dev)
    held = torch.zeros(B * H, N, dtype=torch.bool, device=dev)
    for r, (row, n) in enumerate(zip(rows, blk.lengths)):
        if row is None or not n:
            continue
        keys[r, N - n:] = row[0].reshape(n, dk)
        values[r, N - n:] = row[1].reshape(n, dv)
        held[r, N - n:] = True if row[2] is None else row[2].reshape(n)
    return keys.reshape(B, H, N, dk), values.reshape(B, H, N, dv), held.reshape(B, H, N)


def attend_positions(
    q: torch.Tensor,
    keys: torch.Tensor,
    values: torch.Tensor,
    scaling: float,
    group: int,
    q_pos: torch.Tensor,
    k_pos: torch.Tensor,
    *,
    window: int | None = None,
    softcap: float | None = None,
    key_valid: torch.Tensor | None = None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Causal attention by positions, with an optional sliding window and soft-capping.

    Parameters
    ----------
    q : ``[B, Hkv, G * L, d]`` queries (any float dtype; computed in float32)
    keys, values : ``[B, Hkv, S, d]`` / ``[B, Hkv, S, d_v]``, ascending positions ``k_pos``
    scaling : softmax scale
    group : ``G``, query heads per KV head
    q_pos : ``[L]`` int64 positions of the queries; ``k_pos`` ``[S]`` those of the keys (ascending)
    window : ``W``: key ``j`` is seen by query ``i`` iff ``q_pos[i] - W < k_pos[j] <= q_pos[i]``;
        None: ``k_pos[j] <= q_pos[i]``
    softcap : ``c``: logits become ``c * tanh(s / c)`` before masking (None: off)
    key_valid : ``[B, Hkv, S]`` bool (False: padding) or None. A key at a query's own position
        is always seen, so no row is empty.

    Returns
    -------
    ``(out [B, Hkv, G * L, d_v] float32, lse [B, Hkv, G * L] float32)``
    """
    out, lse, _ = _attend(q, keys, values, scaling, group, q_pos, k_pos, window, softcap, key_valid, 0)
    return out, lse


def attend_positions_observed(
    q: torch.Tensor,
    keys: torch.Tensor,
    values: torch.Tensor,
    scaling: float,
    group: int,
    q_pos: torch.Tensor,
    k_pos: torch.Tensor,
    stat_queries: int,
    *,
    window: int | None = None,
    softcap: float | None = None,
    key_valid: torch.Tensor | None = None,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """:func:`attend_positions`, and the attention statistics a policy reads (H2O, SnapKV §9).

    ``stat_queries`` ``n`` (``1 <= n <= L``): the softmax probabilities of the last ``n`` query
    positions (the soft-capped, windowed, masked softmax the output is made of) are summed over
    those positions, per query head, in the same pass over the keys.

    Returns
    -------
    ``(out, lse, attention)``: ``out``/``lse`` as :func:`attend_positions`; ``attention``
    ``[B, Hkv * G, S]`` float32, query head ``j * G + g`` (transformers' ``repeat_kv`` order).
    """
    L = q_pos.numel()
    if isinstance(stat_queries, bool) or not isinstance(stat_queries, int) or not 1 <= stat_queries <= L:
        raise ValueError(f"stat_queries must be an int in [1, {L}] (the call's query positions); got {stat_queries!r}")
    out, lse, sums = _attend(q, keys, values, scaling, group, q_pos, k_pos, window, softcap, key_valid,
                             stat_queries)
    B, H = sums.shape[:2]
    return out, lse, sums.reshape(B, H * group, -1)


def _attend(q, keys, values, scaling, group, q_pos, k_pos, window, softcap, key_valid, n_stat):
    """The chunked pass of :func:`attend_positions`; ``sums`` ``[B, Hkv, G, S]`` of the last
    ``n_stat`` query positions' probabilities (None when ``n_stat`` is 0)."""
    B, H, M, d = q.shape
    L = q_pos.numel()
    G = group
    if M != G * L:
        raise ValueError(f"q has {M} rows; expected group ({G}) x positions ({L})")
    q5 = q.reshape(B, H, G, L, d).float()
    k, v = keys.float(), values.float()
    out = q5.new_empty(B, H, G, L, v.shape[-1])
    lse = q5.new_empty(B, H, G, L)
    S = k.shape[2]
    sums = q5.new_zeros(B, H, G, S) if n_stat else None
    step = max(1, CHUNK_BYTES // max(1, 4 * B * H * G * max(S, 1)))
    for s in range(0, L, step):
        e = min(L, s + step)
        lo = 0 if window is None else int(torch.searchsorted(k_pos, q_pos[s] - window + 1))
        hi = int(torch.searchsorted(k_pos, q_pos[e - 1], right=True))
        kp = k_pos[lo:hi]
        logits = torch.einsum("bhgld,bhtd->bhglt", q5[:, :, :, s:e], k[:, :, lo:hi]) * scaling
        if softcap is not None:
            logits = torch.tanh(logits / softcap) * softcap
        qp = q_pos[s:e, None]
        seen = kp[None, :] <= qp
        if window is not None:
            seen &= kp[None, :] > qp - window
        mask = seen[None, None, None]  # [1, 1, 1, l, t]
        if key_valid is not None:
            mask = mask & (key_valid[:, :, lo:hi][:, :, None, None, :] | (kp[None, :] == qp)[None, None, None])
        logits = logits.masked_fill(~mask, float("-inf"))
        chunk_lse = torch.logsumexp(logits, dim=-1)
        p = torch.exp(logits - chunk_lse.unsqueeze(-1)).nan_to_num_(0.0)
        out[:, :, :, s:e] = torch.einsum("bhglt,bhtd->bhgld", p, v[:, :, lo:hi])
        lse[:, :, :, s:e] = chunk_lse
        if n_stat and e > L - n_stat:
            sums[..., lo:hi] += p[:, :, :, max(s, L - n_stat) - s:].sum(3)
    return out.reshape(B, H, M, -1), lse.reshape(B, H, M), sums


def apply_learned_sinks(out: torch.Tensor, lse: torch.Tensor, sinks: torch.Tensor, kv_heads: int
                        ) -> tuple[torch.Tensor, torch.Tensor]:
    """Add one learned logit per query head to the softmax denominator (gpt-oss ``s_aux``).

    ``out`` ``[B, Hkv, G * L, d_v]`` and ``lse`` ``[B, Hkv, G * L]`` (float32) of any path;
    ``sinks`` ``[Hq]`` (``Hq = Hkv * G``). Returns the corrected ``(out, lse)``:
    ``lse' = logaddexp(lse, s)``, ``out' = out * exp(lse - lse')``.
    """
    B, H, M = lse.shape
    Hq = sinks.numel()
    if Hq % kv_heads:
        raise ValueError(f"learned sinks: {Hq} values for {kv_heads} KV heads; expected a multiple")
    G = Hq // kv_heads
    s = sinks.float().reshape(1, H, G, 1).expand(B, H, G, M // G).reshape(B, H, M)
    new = torch.logaddexp(lse, s)
    return out * torch.exp(lse - new).nan_to_num_(0.0).unsqueeze(-1), new
