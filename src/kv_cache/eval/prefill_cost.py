"""Prefill cost: a method's prefill time over a plain prefill's, both timed in the same sample.

The plain prefill is the model with transformers' ``DynamicCache`` (no hooks, no compression) on
the same token ids, run just before the method's own prefill, so the two times share the
machine's state of the moment. The full cache's own prefill *is* that plain prefill, so its cost
is 1 by construction and it pays no second one. KVzip keeps its in-run measurement
(:attr:`kv_cache.context.PrefillStats.cost_ratio`: its context prefill plus reconstruction pass
over that context prefill), so it is not timed twice either. A preset or plan that evicts with
KVzap runs no such pass: its prefill is compared with a plain prefill timed right after it (the
perplexity task too), never reported as 1 by construction.
"""

from __future__ import annotations

import time

import torch

from ..generation import forward_at


def plain_prefill_seconds(model, ids: torch.Tensor, *, last_only: bool = False) -> float:
    """Seconds of a plain prefill of ``ids`` ``[1, T]``: ``model`` over a fresh ``DynamicCache``."""
    from transformers import DynamicCache

    if not isinstance(ids, torch.Tensor) or ids.dim() != 2 or ids.shape[1] == 0:
        raise ValueError("ids must be a token id tensor [batch, tokens] with tokens >= 1; got "
                         f"{tuple(getattr(ids, 'shape', ())) or type(ids).__name__}")
    cache = DynamicCache()
    with torch.no_grad():
        t0 = time.perf_counter()
        logits = forward_at(model, cache, ids, 0, last_only=last_only)
        seconds = time.perf_counter() - t0
    del logits, cache
    return seconds


def prefill_cost(method_s: float | None, plain_s: float | None) -> dict:
    """``{"prefill_cost", "prefill_s", "plain_prefill_s"}`` of a timed prefill (``{}`` when either
    time is missing or not positive)."""
    if method_s is None or plain_s is None or plain_s <= 0 or method_s <= 0:
        return {}
    return {"prefill_cost": method_s / plain_s, "prefill_s": method_s, "plain_prefill_s": plain_s}


__all__ = ["plain_prefill_seconds", "prefill_cost"]
