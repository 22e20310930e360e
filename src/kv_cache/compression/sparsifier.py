"""The seed's token-selection API for one head: H2O, SnapKV, compression ratios.

numpy in, numpy out (torch tensors are accepted too and give torch results). These are thin
wrappers over the batched :func:`kv_cache.compression.selection.select_tokens`, so the seed
functions and the cache's eviction policies share one implementation.
Formulas: ``math_dictionary/kv-compression-math.md`` sections 6-10.
"""

from __future__ import annotations

from typing import Any

import numpy as np
import torch

from ._arrays import check_float, check_int, check_rank, to_numpy, to_torch
from .selection import select_tokens


def cumulative_attention_scores(attention_history: Any) -> Any:
    """H2O score ``Score(i) = sum_t a_t(i)`` (section 9.1).

    Parameters
    ----------
    attention_history : array, shape ``[num_steps, num_tokens]``
        Attention weight that observation step ``t`` gave token ``i``.

    Returns
    -------
    array, shape ``[num_tokens]``, float32 (float64 for float64 input)

    Raises
    ------
    ValueError
        Rank other than 2, empty input, NaN/Inf.
    TypeError
        Non-float dtype.
    """
    t, was_numpy = to_torch(attention_history, "attention_history")
    check_rank(t, (2,), "attention_history", "[num_steps, num_tokens]")
    check_float(t, "attention_history")
    acc = torch.float64 if t.dtype == torch.float64 else torch.float32
    out = t.to(acc).sum(dim=0)
    return to_numpy(out) if was_numpy else out


def _select_one_head(scores: torch.Tensor, budget: int, recent_window: int, was_numpy: bool) -> Any:
    budget = check_int(budget, "budget", minimum=1)
    recent_window = check_int(recent_window, "recent_window", minimum=0)
    idx = select_tokens(scores, budget, recent_window=recent_window).to(torch.int32)
    return to_numpy(idx) if was_numpy else idx


def keep_recent_and_heavy_hitters(attention_history: Any, budget: int, recent_window: int) -> Any:
    """H2O keep set ``TopK(Score, B - W) U R_W`` (section 9.1).

    Parameters
    ----------
    attention_history : array, shape ``[num_steps, num_tokens]``
    budget : int
        ``B >= recent_window``; ``min(B, num_tokens)`` tokens are kept.
    recent_window : int
        ``W >= 0``; the last ``W`` tokens are always kept.

    Returns
    -------
    array of int32, shape ``[min(B, num_tokens)]``, sorted and unique.

    Raises
    ------
    ValueError
        ``budget < recent_window``, ``budget < 1``, negative window, bad history.
    """
    scores = cumulative_attention_scores(attention_history)
    t, was_numpy = to_torch(scores, "scores")
    return _select_one_head(t, budget, recent_window, was_numpy)


def snapkv_select(observation_scores: Any, budget: int, recent_window: int) -> Any:
    """SnapKV keep set ``TopK(s, B - W) U R_W`` from one-shot observation scores (section 9.2).

    Parameters
    ----------
    observation_scores : array, shape ``[num_tokens]``
    budget, recent_window : int
        As in :func:`keep_recent_and_heavy_hitters`.

    Returns
    -------
    array of int32, shape ``[min(B, num_tokens)]``, sorted and unique.
    """
    t, was_numpy = to_torch(observation_scores, "observation_scores")
    check_rank(t, (1,), "observation_scores", "[num_tokens]")
    check_float(t, "observation_scores")
    return _select_one_head(t, budget, recent_window, was_numpy)


def compression_ratio(total_tokens: int, kept_tokens: int) -> float:
    """Token compression ``T / K`` (section 10); requires ``0 < K <= T``."""
    total_tokens = check_int(total_tokens, "total_tokens")
    kept_tokens = check_int(kept_tokens, "kept_tokens")
    if total_tokens <= 0 or kept_tokens <= 0 or kept_tokens > total_tokens:
        raise ValueError(
            "require 0 < kept_tokens <= total_tokens; "
            f"got total_tokens={total_tokens}, kept_tokens={kept_tokens}"
        )
    return total_tokens / kept_tokens


def total_gain(
    bytes_per_token_before: float,
    bytes_per_token_after: float,
    total_tokens: int,
    kept_tokens: int,
) -> float:
    """The seed's total gain ``(s_old / s_new) * (T / K)`` (section 10).

    Parameters
    ----------
    bytes_per_token_before, bytes_per_token_after : float
        Storage per cached token (include metadata in ``after``), both ``> 0``.
    total_tokens, kept_tokens : int
        ``0 < kept_tokens <= total_tokens``.
    """
    for name, v in (("bytes_per_token_before", bytes_per_token_before),
                    ("bytes_per_token_after", bytes_per_token_after)):
        if isinstance(v, bool) or not isinstance(v, (int, float, np.integer, np.floating)):
            raise TypeError(f"{name} must be a number; got {v!r}")
        if not np.isfinite(v) or v <= 0:
            raise ValueError(f"{name} must be finite and > 0; got {v}")
    return float(bytes_per_token_before) / float(bytes_per_token_after) * compression_ratio(
        total_tokens, kept_tokens
    )


__all__ = [
    "compression_ratio",
    "cumulative_attention_scores",
    "keep_recent_and_heavy_hitters",
    "snapkv_select",
    "total_gain",
]
