"""Batched token selection at KV-head granularity: budgets, windows, pooling, GQA reduction.

Everything here works on scores of shape ``[..., num_tokens]`` (typically
``[batch, kv_heads, seq_len]``) and returns *sorted* token indices per row. Formulas:
``math_dictionary/kv-compression-math.md`` sections 6-9.

Tie-breaking (deterministic, documented contract): among equal scores the **earlier** token
(lower index) wins. Forced tokens (sinks, the recent window) always win over scored ones, and
valid tokens always win over padding.
"""

from __future__ import annotations

import math
from typing import Any

import torch
import torch.nn.functional as F

from ._arrays import check_float, check_int, check_min_rank, check_rank

POOLINGS = ("avg", "max")
GQA_REDUCTIONS = ("mean", "max")


def check_budget(budget: int | float) -> int | float:
    """Validate a budget without resolving it: an ``int >= 1`` or a ``float`` in ``(0, 1]``.

    Raises
    ------
    ValueError
        Non-positive count or fraction outside ``(0, 1]``.
    TypeError
        Budget neither int nor float.
    """
    if isinstance(budget, bool) or not isinstance(budget, (int, float)):
        raise TypeError(
            f"budget must be an int token count or a float fraction in (0, 1]; got {budget!r}"
        )
    if isinstance(budget, float):
        if not (0.0 < budget <= 1.0) or math.isnan(budget):
            raise ValueError(f"a fractional budget must be in (0, 1]; got {budget}")
    elif budget < 1:
        raise ValueError(f"a token-count budget must be >= 1; got {budget}")
    return budget


def resolve_budget(budget: int | float, total_tokens: int) -> int:
    """Turn a budget into a token count ``K`` with ``1 <= K <= total_tokens`` (section 6).

    Parameters
    ----------
    budget : int or float
        An ``int >= 1`` is a token count (a count above ``total_tokens`` keeps everything);
        a ``float`` in ``(0, 1]`` is a fraction, ``K = max(1, round(budget * total_tokens))``.
    total_tokens : int
        ``T >= 1``.

    Raises
    ------
    ValueError
        Non-positive count, fraction outside ``(0, 1]``, ``total_tokens < 1``.
    TypeError
        Budget neither int nor float.
    """
    total_tokens = check_int(total_tokens, "total_tokens", minimum=1)
    check_budget(budget)
    if isinstance(budget, float):
        return max(1, min(total_tokens, int(round(budget * total_tokens))))
    return min(int(budget), total_tokens)


def forced_mask(
    valid: torch.Tensor, *, sink_tokens: int = 0, recent_window: int = 0
) -> torch.Tensor:
    """Tokens that are always kept: the first ``sink_tokens`` and last ``recent_window`` valid ones.

    Parameters
    ----------
    valid : bool tensor, shape ``[..., T]``
        False marks padding (left padding in batches).

    Returns
    -------
    bool tensor, shape ``[..., T]``
    """
    pos = valid.to(torch.int32).cumsum(-1) - 1  # rank among valid tokens
    n_valid = valid.sum(-1, keepdim=True)
    keep = valid & ((pos < sink_tokens) | (pos >= n_valid - recent_window))
    return keep


def select_tokens(
    scores: Any,
    budget: int,
    *,
    recent_window: int = 0,
    sink_tokens: int = 0,
    valid: torch.Tensor | None = None,
) -> torch.Tensor:
    """Per-row top-``budget`` tokens after forcing sinks and the recent window (section 7).

    Parameters
    ----------
    scores : torch.Tensor, shape ``[..., T]`` (e.g. ``[batch, kv_heads, seq_len]``)
        Importance per token; higher is kept first. Any float dtype; compared in float32.
    budget : int
        Tokens to keep per row, ``K = min(budget, T)``.
    recent_window, sink_tokens : int
        Forced tokens; ``recent_window + sink_tokens <= budget`` is required.
    valid : bool tensor broadcastable to ``scores``, optional
        False for padding. Padding is chosen only when a row has fewer than ``K`` valid
        tokens (its slots are then padding that stays masked).

    Returns
    -------
    torch.Tensor
        int64 indices, shape ``[..., K]``, sorted ascending, unique per row.

    Raises
    ------
    ValueError
        Empty or non-finite scores, rank 0, bad budget/window values.
    """
    if not isinstance(scores, torch.Tensor):
        raise TypeError(f"scores must be a torch.Tensor; got {type(scores).__name__}")
    check_min_rank(scores, 1, "scores", "[..., num_tokens]")
    check_float(scores, "scores")
    budget = check_int(budget, "budget", minimum=1)
    recent_window = check_int(recent_window, "recent_window", minimum=0)
    sink_tokens = check_int(sink_tokens, "sink_tokens", minimum=0)
    if recent_window + sink_tokens > budget:
        raise ValueError(
            f"budget must be >= recent_window + sink_tokens = {recent_window + sink_tokens} "
            f"(recent_window={recent_window}, sink_tokens={sink_tokens}); got budget={budget}"
        )
    T = scores.shape[-1]
    k = min(budget, T)
    if valid is not None and valid.dtype != torch.bool:
        raise TypeError(f"valid must be a bool tensor; got {valid.dtype}")
    if valid is None:  # no padding: the forced tokens are the first and last slots (H2O's decoding step)
        priority = scores.to(torch.float32, copy=True)
        priority[..., :sink_tokens] = float("inf")
        if recent_window:
            priority[..., max(0, T - recent_window):] = float("inf")
    else:
        valid = valid.expand_as(scores)
        forced = forced_mask(valid, sink_tokens=sink_tokens, recent_window=recent_window)
        inf = torch.tensor(float("inf"), dtype=torch.float32, device=scores.device)
        priority = torch.where(valid, scores.float(), -inf)
        priority = torch.where(forced, inf, priority)
    if 2 * (T - k) <= T:  # few to drop (H2O drops one per step): O(T), no sort
        return _drop_lowest(priority, T - k)
    order = torch.sort(priority, dim=-1, descending=True, stable=True).indices[..., :k]
    return torch.sort(order, dim=-1).values


def _drop_lowest(priority: torch.Tensor, m: int) -> torch.Tensor:
    """The ``T - m`` kept indices (sorted) when the ``m`` lowest priorities are dropped, ties
    dropping the later token: exactly what the stable descending sort keeps, in O(T)."""
    T = priority.shape[-1]
    if m == 1:  # one token per row (H2O's decoding step): the last of each row's lowest
        lowest = priority == priority.amin(-1, keepdim=True)
        drop = T - 1 - lowest.flip(-1).to(torch.uint8).argmax(-1, keepdim=True)
        pos = torch.arange(T - 1, device=priority.device).expand(*priority.shape[:-1], T - 1)
        return pos + (pos >= drop)
    pos = torch.arange(T, device=priority.device).expand_as(priority)
    if m == 0:
        return pos.contiguous()
    v = torch.kthvalue(priority, m, dim=-1, keepdim=True).values  # the m-th lowest priority
    below = priority < v
    tied = priority == v
    need = m - below.sum(-1, keepdim=True)  # how many tied tokens go, the latest first
    tied_from_end = tied.flip(-1).cumsum(-1).flip(-1)
    drop = below | (tied & (tied_from_end <= need))
    return pos.masked_select(~drop).reshape(*priority.shape[:-1], T - m)


def pool_scores(scores: torch.Tensor, kernel_size: int, pooling: str = "avg") -> torch.Tensor:
    """Smooth scores along tokens with a same-length 1-D pooling (SnapKV's clustering step).

    Parameters
    ----------
    scores : torch.Tensor, shape ``[..., T]``
    kernel_size : int
        Odd, ``>= 1``; 1 is the identity.
    pooling : {"avg", "max"}

    Returns
    -------
    torch.Tensor
        float32, shape ``[..., T]``. Average pooling divides by ``kernel_size`` at the edges
        (zero padding counted), as SnapKV's ``avg_pool1d`` does.
    """
    kernel_size = check_int(kernel_size, "kernel_size", minimum=1)
    if kernel_size % 2 == 0:
        raise ValueError(f"kernel_size must be odd so the output keeps T tokens; got {kernel_size}")
    if pooling not in POOLINGS:
        raise ValueError(f"pooling must be one of {list(POOLINGS)}; got {pooling!r}")
    s = scores.float()
    if kernel_size == 1:
        return s
    shape = s.shape
    flat = s.reshape(-1, 1, shape[-1])
    pad = kernel_size // 2
    if pooling == "avg":
        out = F.avg_pool1d(flat, kernel_size, stride=1, padding=pad)
    else:
        out = F.max_pool1d(flat, kernel_size, stride=1, padding=pad)
    return out.reshape(shape)


def reduce_gqa(scores: torch.Tensor, num_kv_heads: int, how: str = "mean") -> torch.Tensor:
    """Reduce query-head scores to KV-head scores (section 8).

    Parameters
    ----------
    scores : torch.Tensor, shape ``[batch, num_q_heads, ...]``
        Query heads ``h`` of group ``j`` are ``h = j * group + r`` (transformers' ``repeat_kv``).
    num_kv_heads : int
        Must divide ``num_q_heads``.
    how : {"mean", "max"}

    Returns
    -------
    torch.Tensor
        shape ``[batch, num_kv_heads, ...]``, float32.
    """
    if how not in GQA_REDUCTIONS:
        raise ValueError(f"how must be one of {list(GQA_REDUCTIONS)}; got {how!r}")
    num_kv_heads = check_int(num_kv_heads, "num_kv_heads", minimum=1)
    hq = scores.shape[1]
    if hq % num_kv_heads:
        raise ValueError(
            f"num_q_heads ({hq}) must be a multiple of num_kv_heads ({num_kv_heads})"
        )
    s = scores.float().reshape(scores.shape[0], num_kv_heads, hq // num_kv_heads, *scores.shape[2:])
    return s.mean(2) if how == "mean" else s.amax(2)


def window_attention(
    query: torch.Tensor,
    key: torch.Tensor,
    *,
    scaling: float | None = None,
    key_valid: torch.Tensor | None = None,
    query_start: int | None = None,
) -> torch.Tensor:
    """Softmax attention of the last ``w`` queries over all ``T`` keys, GQA without repeating KV.

    Used to score tokens when the attention kernel (sdpa, flash) does not return weights: only
    ``w x T`` probabilities are formed, never ``T x T``.

    Parameters
    ----------
    query : torch.Tensor, shape ``[batch, num_q_heads, w, head_dim]``
        The queries of the last ``w`` positions (positions ``T - w .. T - 1``), after RoPE.
    key : torch.Tensor, shape ``[batch, num_kv_heads, T, head_dim]``
    scaling : float, optional
        Default ``head_dim ** -0.5``.
    key_valid : bool tensor, shape ``[batch, T]``, optional
        False for padding keys.
    query_start : int, optional
        Position of the first query; default ``T - w`` (the last ``w`` positions).

    Returns
    -------
    torch.Tensor
        float32 probabilities, shape ``[batch, num_q_heads, w, T]``; causal inside the window.
        Rows of queries that see no valid key (padding queries) are all zero.
    """
    check_rank(query, (4,), "query", "[batch, num_q_heads, w, head_dim]")
    check_rank(key, (4,), "key", "[batch, num_kv_heads, T, head_dim]")
    b, hq, w, d = query.shape
    hk, T = key.shape[1], key.shape[2]
    if hq % hk:
        raise ValueError(f"num_q_heads ({hq}) must be a multiple of num_kv_heads ({hk})")
    start = T - w if query_start is None else query_start
    if w > T or start < 0 or start + w > T:
        raise ValueError(
            f"window ({w} queries from position {start}) must lie inside the {T} keys"
        )
    scaling = d**-0.5 if scaling is None else scaling
    q = query.float().reshape(b, hk, hq // hk, w, d)
    logits = torch.einsum("bhgwd,bhtd->bhgwt", q, key.float()) * scaling
    q_pos = torch.arange(start, start + w, device=key.device)[:, None]
    k_pos = torch.arange(T, device=key.device)[None, :]
    mask = k_pos <= q_pos  # [w, T]
    if key_valid is not None:
        mask = mask & key_valid[:, None, None, None, :]
    logits = logits.masked_fill(~mask, float("-inf"))
    probs = torch.softmax(logits, dim=-1)
    if key_valid is not None:
        # A padding query sees no valid key: its row is all -inf; define its attention as zero.
        probs = probs.nan_to_num_(0.0)
    return probs.reshape(b, hq, w, T)


def snapkv_scores(
    attn: torch.Tensor,
    num_kv_heads: int,
    *,
    kernel_size: int = 5,
    pooling: str = "avg",
    gqa_reduce: str = "mean",
) -> torch.Tensor:
    """SnapKV token scores from observation-window attention (section 9.2).

    ``s = reduce_gqa(pool(mean_over_window(attn)))``.

    Parameters
    ----------
    attn : torch.Tensor, shape ``[batch, num_q_heads, w, T]``
        Attention probabilities of the ``w`` observation queries.
    num_kv_heads : int
    kernel_size : int, odd
    pooling : {"avg", "max"}
    gqa_reduce : {"mean", "max"}

    Returns
    -------
    torch.Tensor
        float32, shape ``[batch, num_kv_heads, T]``.
    """
    check_rank(attn, (4,), "attn", "[batch, num_q_heads, window, num_tokens]")
    check_float(attn, "attn")
    s = attn.float().mean(dim=2)  # [B, Hq, T]
    s = pool_scores(s, kernel_size, pooling)
    return reduce_gqa(s, num_kv_heads, gqa_reduce)


def streaming_llm_indices(total_tokens: int, sink_tokens: int, recent_window: int) -> torch.Tensor:
    """StreamingLLM keep set: ``{0..S-1} U {T-W..T-1}`` (section 9.3), sorted int64."""
    T = check_int(total_tokens, "total_tokens", minimum=0)
    S = check_int(sink_tokens, "sink_tokens", minimum=0)
    W = check_int(recent_window, "recent_window", minimum=0)
    idx = torch.arange(T)
    return idx[(idx < S) | (idx >= T - W)]


__all__ = [
    "GQA_REDUCTIONS",
    "POOLINGS",
    "forced_mask",
    "left_padding_starts",
    "mask_key_valid",
    "pool_scores",
    "reduce_gqa",
    "check_budget",
    "resolve_budget",
    "select_tokens",
    "snapkv_scores",
    "starts_after",
    "streaming_llm_indices",
    "window_attention",
]


def mask_key_valid(mask: torch.Tensor | None, keys: torch.Tensor) -> torch.Tensor:
    """``[batch, T]`` bool: keys the last query may attend to (False = padding)."""
    b, T = keys.shape[0], keys.shape[2]
    if mask is None:
        return torch.ones(b, T, dtype=torch.bool, device=keys.device)
    row = mask[:, 0, -1, :T]
    if row.dtype == torch.bool:
        valid = row
    else:
        valid = row > torch.finfo(row.dtype).min / 2
    return valid.expand(b, T)


def left_padding_starts(before: torch.Tensor | None, new_valid: torch.Tensor, heads: int,
                        stored_before: int) -> torch.Tensor | None:
    """Leading padding slots ``[batch, heads]`` int32 of a layer after ``new_valid`` ``[batch, q_len]``
    (bool, False = padding) is appended to ``stored_before`` slots whose leading padding is
    ``before`` (None: none). None when no row has padding.

    Raises ValueError unless every row's padding precedes all of its valid tokens (left padding).
    """
    b, dev = new_valid.shape[0], new_valid.device
    lead = (~new_valid).to(torch.int32).cumprod(dim=1).sum(dim=1)  # leading invalid tokens per row
    zeros = torch.zeros(b, heads, dtype=torch.int32, device=dev)
    all_padding = (zeros if before is None else before) == stored_before
    if bool((lead != (~new_valid).sum(dim=1)).any()) or bool(((~all_padding) & (lead[:, None] > 0)).any()):
        raise ValueError(
            "kv_cache attention supports left padding only (each row's padding before all its tokens); "
            "got padding after valid tokens: use kv_cache.compress(model, cache, attention='reference')"
        )
    now = zeros if before is None else before.clone()
    now += torch.where(all_padding, lead[:, None].to(torch.int32), 0)
    return now if bool(now.any()) else None


def starts_after(starts: torch.Tensor | None, keep: torch.Tensor) -> torch.Tensor | None:
    """Leading padding slots ``[batch, heads]`` after each row keeps the sorted slots ``keep``
    ``[batch, heads, K]`` (padding is never kept past a valid token); None when none is left."""
    if starts is None:
        return None
    out = (keep < starts.unsqueeze(-1)).sum(-1).to(torch.int32)
    return out if bool(out.any()) else None
