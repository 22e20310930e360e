"""H2O (Zhang et al., 2023): heavy hitters by accumulated attention, evicted while decoding.

Formula: ``math_dictionary/kv-compression-math.md`` section 9.1. Every query's attention
(reduced over the query heads of each KV head) is added to a per-token running sum kept in
``state["h2o"]``; whenever the layer holds more than the budget, the lowest sums outside the
recent window are evicted at once, so the cache never grows past the budget.

The recent window defaults to half the budget (``recent_window=0.5``), the H2O paper's even
split between heavy hitters and recent tokens (e.g. its 20% budget = 10% + 10%). A small fixed
window starves new tokens: they have been seen by few queries, so their sums are small, and a
question fed after a compressed context would lose its own first tokens.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import ClassVar

import torch

from ..compression.selection import reduce_gqa, window_attention
from .base import EvictionPolicy, ScoreInputs

QUERY_CHUNK = 256


@dataclass(repr=False)
class H2O(EvictionPolicy):
    """Recent window + heavy hitters, with ``gqa_reduce`` in {"mean", "max"} over query heads.

    ``recent_window`` defaults to 0.5: half of the resolved budget (see the module docstring).
    ``evict_every`` (default 1: exact H2O, the cache never holds more than the budget): let a
    head grow to ``budget + evict_every - 1`` tokens while decoding and then evict the lowest
    ``evict_every`` sums at once. The sums still accumulate every step; what is saved is the
    per-step compaction, which moves every token after the evicted one (about the recent window,
    half the budget by default). The extra tokens are held, so they are counted in the bytes.
    """

    recent_window: int | float = 0.5
    gqa_reduce: str = "mean"
    evict_every: int = 1

    def __post_init__(self) -> None:
        super().__post_init__()
        k = self.evict_every
        if isinstance(k, bool) or not isinstance(k, int) or k < 1:
            raise ValueError(f"H2O.evict_every must be an int >= 1; got {k!r}")
        if k > 1 and self.scope != "head":
            raise ValueError(f"H2O.evict_every > 1 applies to per-head budgets (scope='head'); got scope={self.scope!r}")

    needs_attention: ClassVar[bool] = True
    prefill_only: ClassVar[bool] = False

    def eviction_slack(self) -> int:
        return self.evict_every - 1

    def query_window(self, q_len: int, budget_tokens: int) -> int:
        """Every query of the call: each one adds its attention to the running sums."""
        return q_len

    def score(self, inputs: ScoreInputs) -> torch.Tensor:
        b, n_kv, T = inputs.shape
        acc = inputs.state.get("h2o")
        total = torch.zeros(b, n_kv, T, dtype=torch.float32,
                            device=(inputs.keys if inputs.attention is None else inputs.attention).device)
        if acc is not None:
            total[..., : acc.shape[-1]] = acc
        if inputs.attention is not None:  # the attention function summed every query of the call
            total += reduce_gqa(inputs.attention, n_kv, self.gqa_reduce)
            inputs.state["h2o"] = total
            return total
        q, k = inputs.query, inputs.keys
        q_len = q.shape[2]
        # Column sums of softmax(q k^T) in chunks of queries: never a full T x T matrix.
        # Causal: queries [s, e) never see keys past position T - q_len + e, so they are skipped.
        for s in range(0, q_len, QUERY_CHUNK):
            e = min(q_len, s + QUERY_CHUNK)
            end = T - q_len + e
            valid = None if inputs.key_valid is None else inputs.key_valid[:, :end]
            attn = window_attention(q[:, :, s:e], k[:, :, :end], scaling=inputs.scaling, key_valid=valid,
                                    query_start=T - q_len + s)
            total[..., :end] += reduce_gqa(attn.sum(2), n_kv, self.gqa_reduce)
        inputs.state["h2o"] = total
        return total
