"""What a plan costs on calibration text: the mean next-token KL divergence from the full cache
and the perplexity over the full cache's, over a teacher-forced continuation after a compressed
prefix (math dictionary §13, §23)."""

from __future__ import annotations

import math
from typing import Any

import torch
from transformers import DynamicCache

from ..cache import CompressedCache, compress
from ..attention.fidelity import broken_layers, eviction_past
from ..context import forward_at, prefill
from .plan import CachePlan


def calibration_windows(tokenizer: Any, text: str, context: int, continuation: int, windows: int
                        ) -> list[torch.Tensor]:
    """Up to ``windows`` non-overlapping ``[1, context + continuation]`` id windows of ``text``."""
    if not isinstance(text, str) or not text.strip():
        raise ValueError("calibration_text must be a non-empty str")
    if windows < 1 or continuation < 1:
        raise ValueError(f"windows and continuation must be >= 1; got {windows} and {continuation}")
    ids = tokenizer(text, return_tensors="pt", add_special_tokens=False).input_ids[0]
    n = context + continuation
    out = [ids[s:s + n][None] for s in range(0, ids.numel() - n + 1, n)][:windows]
    if not out:
        raise ValueError(f"calibration_text holds {ids.numel()} tokens; one window needs {n} "
                         f"({context} context + {continuation} continuation)")
    return out


def _continuation_log_probs(model, cache, window: torch.Tensor, context: int, tokenizer, ours: bool) -> torch.Tensor:
    prefix, cont = window[:, :context], window[:, context:]
    if ours:
        logits, _ = prefill(model, cache, prefix, tokenizer=tokenizer, last_only=True)
        with compress(model, cache):
            rest = forward_at(model, cache, cont[:, :-1], context)
    else:
        logits = forward_at(model, cache, prefix, 0, last_only=True)
        rest = forward_at(model, cache, cont[:, :-1], context)
    return torch.log_softmax(torch.cat([logits[:, -1:], rest], 1)[0].float(), -1)


def reference_log_probs(model, tokenizer, windows: list[torch.Tensor], context: int) -> list[torch.Tensor]:
    """The full cache's continuation log-probabilities per window (``[continuation, vocab]``
    float32): computed once and handed to :func:`continuation_cost` for every candidate."""
    with torch.no_grad():
        return [_continuation_log_probs(model, DynamicCache(), w, context, tokenizer, ours=False) for w in windows]


def continuation_cost(model, tokenizer, plan: CachePlan, windows: list[torch.Tensor], context: int | None = None,
                      reference: list[torch.Tensor] | None = None) -> dict[str, Any]:
    """What ``plan`` costs on calibration windows.

    ``reference``: :func:`reference_log_probs` of the same windows and context (None: computed here).

    Returns
    -------
    ``{"kl", "delta_ppl", "attention_error", "evicted_attention", "warned"}``: ``kl`` the mean over
    windows and continuation positions of ``KL(P_full || P_plan)``; ``delta_ppl`` the continuation's
    perplexity over the full cache's, minus 1 (``exp`` of the mean NLL difference over every scored
    token of every window); ``attention_error`` the fidelity check's largest per-layer error (§26)
    and ``evicted_attention`` the eviction check's share (§26.1), the largest over windows (None:
    not measured); ``warned`` True when either was past its limit on some window (the cache warned
    there, and would with ``strict=True`` have raised).
    """
    kls, dnll, errors, shares, warned = [], [], [], [], False
    with torch.no_grad():
        for j, w in enumerate(windows):
            T = context if context is not None else int(plan.predicted.get("context_tokens", w.shape[1] // 2))
            ref = (reference[j] if reference is not None
                   else _continuation_log_probs(model, DynamicCache(), w, T, tokenizer, ours=False))
            cache = CompressedCache(model.config, plan=plan)
            got = _continuation_log_probs(model, cache, w, T, tokenizer, ours=True)
            kls.append(float((ref.exp() * (ref - got)).sum(-1).mean()))
            target = w[0, T:, None].to(got.device)
            dnll.append(float((ref.gather(-1, target) - got.gather(-1, target)).mean()))
            report = cache.memory_report()  # both checks' figures are fixed at the prefill
            if report.max_attention_error is not None:
                errors.append(report.max_attention_error)
                warned |= bool(broken_layers(report.attention_errors, report.fidelity_threshold))
            if report.mean_evicted_attention is not None:
                shares.append(report.mean_evicted_attention)
                warned |= eviction_past(report.evicted_attention, report.eviction_threshold)
    return {"kl": sum(kls) / len(kls), "delta_ppl": math.exp(sum(dnll) / len(dnll)) - 1,
            "attention_error": max(errors) if errors else None,
            "evicted_attention": max(shares) if shares else None, "warned": warned}
