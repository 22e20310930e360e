"""StreamingLLM (Xiao et al., 2024): attention sinks + a recent window (section 9.3)."""

from __future__ import annotations

from dataclasses import dataclass

import torch

from .base import EvictionPolicy, ScoreInputs


@dataclass(repr=False)
class StreamingLLM(EvictionPolicy):
    """Keep the first ``sink_tokens`` and the most recent tokens, ``budget`` in total.

    Scores rise with position, so after the forced sinks the most recent tokens win.
    """

    sink_tokens: int = 4

    def __post_init__(self) -> None:
        super().__post_init__()
        if self.scope != "head":
            raise ValueError(
                f"StreamingLLM scores tokens by position, the same in every head, so a shared budget "
                f"(scope={self.scope!r}) has nothing to allocate: use scope='head'"
            )

    def score(self, inputs: ScoreInputs) -> torch.Tensor:
        b, h, T = inputs.shape
        return torch.arange(T, dtype=torch.float32, device=inputs.device).expand(b, h, T)
