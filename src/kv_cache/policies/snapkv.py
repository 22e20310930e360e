"""SnapKV (Li et al., 2024): one-shot selection at prefill from an observation window.

Formula: ``math_dictionary/kv-compression-math.md`` section 9.2. The window's attention comes
from :mod:`kv_cache.attention` (summed over the window by the attention itself) or, on the
reference path (sdpa/eager), is recomputed from its queries (``w x T`` probabilities only).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import ClassVar

import torch

from ..compression.selection import pool_scores, reduce_gqa, snapkv_scores, window_attention
from .base import EvictionPolicy, ScoreInputs


@dataclass(repr=False)
class SnapKV(EvictionPolicy):
    """Keep ``TopK(pool(mean window attention)) U recent window`` once, after prefill.

    ``recent_window`` doubles as the observation window ``w`` (always kept).
    """

    kernel_size: int = 5
    pooling: str = "avg"
    gqa_reduce: str = "mean"

    needs_attention: ClassVar[bool] = True
    prefill_only: ClassVar[bool] = True

    def __post_init__(self) -> None:
        if isinstance(self.recent_window, float):
            raise ValueError(
                f"SnapKV.recent_window is the observation window, a token count (int >= 1); got {self.recent_window!r}"
            )
        super().__post_init__()

    def query_window(self, q_len: int, budget_tokens: int) -> int:
        """The observation window: the last ``recent_window`` queries of the prompt."""
        return min(q_len, max(1, self.window_tokens(budget_tokens)))

    def score(self, inputs: ScoreInputs) -> torch.Tensor:
        if inputs.attention is not None:  # window attention summed by the attention function
            mean = inputs.attention / inputs.attention_queries
            return reduce_gqa(pool_scores(mean, self.kernel_size, self.pooling), inputs.shape[1], self.gqa_reduce)
        q = inputs.query
        w = max(1, min(self.recent_window, q.shape[2]))
        attn = window_attention(q[:, :, -w:], inputs.keys, scaling=inputs.scaling, key_valid=inputs.key_valid)
        return snapkv_scores(
            attn, inputs.keys.shape[1], kernel_size=self.kernel_size, pooling=self.pooling,
            gqa_reduce=self.gqa_reduce,
        )
