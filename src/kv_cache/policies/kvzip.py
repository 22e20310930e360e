"""KVzip (Kim et al., NeurIPS 2025): query-agnostic scores from reconstructing the context.

After the context is prefilled, the model reads a "repeat the previous context" prompt followed
by the context itself again, in chunks (:func:`kv_cache.prefill` runs this pass; it leaves no
trace in the cache or the positions). A stored context token's score is the largest attention
probability any repeat query gives it, over the repeat queries and the query heads of its KV
head (math dictionary §19.3)::

    score(t) = max_{chunk c, query i in c, head g of the KV head}  softmax_i(s)_t

where chunk ``c``'s queries see the sink tokens, the stored tokens of the chunk they repeat, and
their own repeat tokens (causally). Tokens needed to rebuild the context are exactly those a
future question may need. One budget is shared by every head of every layer by default
(``scope="model"``, as in the paper); the first ``sink_tokens`` are always kept, and so is a
recent window of half the budget (``recent_window=0.5``, math dictionary §19.5): the paper keeps
none, and on held-out 768-token windows that cost +9.6% (SmolLM2) and +15.8% (Qwen2.5) perplexity
at ``budget=0.25`` against +3.4% and +3.1% with the window.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import ClassVar

import torch

from ..compression.selection import reduce_gqa
from .base import EvictionPolicy, ScoreInputs, check_target_ratio

REPEAT_PROMPT = "\n\nRepeat the previous context exactly."
CONTINUE_PROMPT = "\n\nRepeat the part of the previous context exactly, starting with"


@dataclass(repr=False)
class KVzip(EvictionPolicy):
    """Reconstruction scores, ``budget`` tokens per head on average.

    Parameters (beyond :class:`EvictionPolicy`)
    ----------
    chunk_size : int, default 2048
        Context tokens repeated per forward pass: the pass's extra memory is bounded by the
        chunk (its scores are ``chunk x (sinks + chunk + prompt)`` probabilities, formed in
        row blocks), not by the context.
    overlap : int, default 8
        The last tokens of the previous chunk, repeated after :data:`CONTINUE_PROMPT` to say
        where the chunk starts.
    target_ratio : float, optional
        With ``scope="model"``: once the scores are known, keep the most tokens (never fewer
        than ``budget``) whose cache still holds at most ``fp16 bytes / target_ratio``, measured
        on the layout itself (math dictionary §19.6). The presets set it: a 4-bit layout with
        per-channel key groups frees a group's scales only when all its tokens go, so the bytes
        of a budget depend on which tokens KVzip keeps, and a budget sized before the scores
        (an upper bound) overshoots the ratio (27.7x for ``16x`` on Qwen2.5 at 4K tokens).
    continuation_queries : int, default 0
        ``n > 0``: a token's score is the larger of its reconstruction score and the attention
        the prompt's last ``n`` queries give it (summed over them, the largest over the query heads
        of its KV head; math dictionary §19.7), taken from the prefill's own attention call. The
        presets and plans use 96: the reconstruction score ranks tokens by what a copy needs,
        which predicts a continuation badly on Qwen2.5 (``kvzip@0.25`` +9.6% -> +5.5%, the ``8x``
        preset +7.9% -> +4.0% on calibration novels). 0 (default): the paper's score alone.
    """

    recent_window: int | float = 0.5
    sink_tokens: int = 4
    scope: str = "model"
    head_floor: float = 0.0
    chunk_size: int = 2048
    overlap: int = 8
    target_ratio: float | None = None
    continuation_queries: int = 0

    needs_attention: ClassVar[bool] = True
    prefill_only: ClassVar[bool] = True
    needs_reconstruction: ClassVar[bool] = True

    def __post_init__(self) -> None:
        super().__post_init__()
        for name, low in (("chunk_size", 1), ("overlap", 0), ("continuation_queries", 0)):
            v = getattr(self, name)
            if isinstance(v, bool) or not isinstance(v, int) or v < low:
                raise ValueError(f"KVzip.{name} must be an int >= {low}; got {v!r}")
        check_target_ratio(self)

    def query_window(self, q_len: int, budget_tokens: int) -> int:
        """The prompt's last ``continuation_queries`` queries (their attention is the continuation score)."""
        return min(q_len, self.continuation_queries)

    def continuation_scores(self, attention: torch.Tensor, kv_heads: int) -> torch.Tensor:
        """``attention`` ``[batch, q_heads, T]``, the probabilities of the prompt's last
        ``continuation_queries`` queries summed per query head -> ``[batch, kv_heads, T]`` float32:
        the largest of those sums over the query heads of each KV head (math dictionary §19.7)."""
        return reduce_gqa(attention, kv_heads, "max")

    def score(self, inputs: ScoreInputs) -> torch.Tensor:
        acc = inputs.state.get("kvzip")
        cont = inputs.state.get("kvzip_continuation")
        if acc is not None and cont is not None:  # kept if either the repeat or the continuation needs it
            return torch.maximum(acc.float(), cont.to(acc.device))
        if acc is None:
            raise RuntimeError(
                "KVzip scores come from its reconstruction pass, which did not run: prefill the context "
                "with kv_cache.prefill(model, cache, input_ids, tokenizer=...)"
            )
        return acc.float()
