"""The slots every head of a layer keeps whatever its eviction budget (math dictionary §12)."""

from __future__ import annotations

import torch

from ..compression.global_budget import select_global
from ..compression.selection import forced_mask
from ..policies.base import EvictionPolicy
from .config import QuantConfig


def fixed_parts(quant: QuantConfig | None, policy: EvictionPolicy, window: int) -> dict[str, int]:
    """Slots every head of a layer keeps whatever its budget, by part (math dictionary §12):
    ``quantization sinks`` (``QuantConfig.sink_tokens``), ``residual`` (the longest
    full-precision residual, ``max(residual_length, group_size) - 1``), ``recent_window``
    (``window`` tokens) and ``sink_tokens`` (the policy's). A budget must be at least their sum."""
    sinks = 0 if quant is None else quant.sink_tokens
    residual = 0 if quant is None else max(quant.residual_length, quant.group_size) - 1
    return {"quantization sinks": sinks, "residual": residual, "recent_window": window,
            "sink_tokens": policy.sink_tokens}


def resolved_budget(policy: EvictionPolicy, quant: QuantConfig | None, layer_idx: int, prompt_len: int
                    ) -> tuple[int, int, int]:
    """``(requested, budget, window)`` in tokens for a layer's prompt of ``prompt_len`` tokens.

    ``requested`` is the policy's budget resolved against the prompt length; ``window`` the
    recent window, resolved against ``requested``. A fractional budget below the slots every
    head keeps whatever the budget (:func:`fixed_parts`: quantization sinks, the longest
    full-precision residual, the recent window, the policy's sinks) is raised to them, as a
    budget above the prompt keeps the whole prompt; :meth:`CompressedCache.memory_report`
    says so. A token (int) budget is never raised: the cache's constructor refuses one that is
    too small.
    """
    requested = policy.budget_tokens(layer_idx, prompt_len)
    window = policy.window_tokens(requested)
    budget = requested
    if isinstance(policy.budget, float):
        budget = max(requested, sum(fixed_parts(quant, policy, window).values()))
    return requested, budget, window


def forced_slots(policy: EvictionPolicy, protected: tuple[int, int], scores: torch.Tensor,
                 valid: torch.Tensor | None, window: int) -> tuple[torch.Tensor, torch.Tensor]:
    """``(valid, forced)`` bool ``[batch, kv_heads, T]`` for ``scores`` of that shape: the slots that
    hold tokens (``valid`` broadcast; None: all) and those kept whatever their score: the policy's
    sinks and recent ``window``, and the storage's ``protected`` ``(leading, trailing)`` slots
    (quantization sinks, the full-precision residual)."""
    B, H, T = scores.shape
    valid = torch.ones(B, H, T, dtype=torch.bool, device=scores.device) if valid is None else valid.expand(B, H, T)
    forced = forced_mask(valid, sink_tokens=policy.sink_tokens, recent_window=window)
    lead, trail = protected
    forced[..., :lead] |= valid[..., :lead]
    if trail:
        forced[..., T - trail:] |= valid[..., T - trail:]
    return valid, forced


def check_budget_fits(layer_idx: int, budget: int, lead: int, trail: int, window: int, sink_tokens: int) -> None:
    """Raise unless ``budget`` tokens hold a layer's fixed slots: the storage's protected ``lead``
    (quantization sinks) and ``trail`` (full-precision residual), the recent ``window`` and the
    policy's ``sink_tokens`` (a token budget the cache's constructor let by)."""
    if lead + trail + window + sink_tokens > budget:
        raise ValueError(
            f"budget of layer {layer_idx} ({budget} tokens) must be >= quantization sinks "
            f"({lead}) + full-precision residual ({trail}) + recent_window ({window}) "
            f"+ sink_tokens ({sink_tokens}); raise the budget or lower QuantConfig.residual_length"
        )


def layer_masks(scores: torch.Tensor, total: int, floor: int, valid: torch.Tensor, forced: torch.Tensor
                ) -> torch.Tensor:
    """One top-``total`` over the heads of one layer per batch row (``scope="layer"``, math
    dictionary §19.1): bool ``[batch, kv_heads, T]`` keep masks of ``scores`` of that shape, every
    head keeping at least ``floor`` and its ``forced`` slots."""
    return torch.stack([select_global([scores[b]], total, floor=floor, valid=[valid[b]], forced=[forced[b]])[0]
                        for b in range(scores.shape[0])])
