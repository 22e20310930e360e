"""The slots every head of a layer keeps whatever its eviction budget (math dictionary §12)."""

from __future__ import annotations

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
