"""The planner: a :class:`CachePlan` from a byte target, its bytes predicted before running.

* :func:`predict_bytes` runs the plan's storage on random states of the model's K/V shape (no
  model call): every layer is given ``T`` tokens (a sliding layer slides to ``min(T, W - 1)``, its
  residual the one a prefill leaves), then keeps the budget's count per head (uneven by one
  token across heads under a shared budget, so the ragged layout and its per-row overhead are
  what is measured) with the evicted tier demoted.
  The bytes are ``memory_report``'s, so the prediction carries the layout's exact metadata,
  sinks and residual (math dictionary §23). With per-channel key groups (the 2-4-bit default,
  §25.3) a group's scale and zero point stay while any of its tokens is kept: the dry run keeps
  tokens spread over every group, an upper bound (a real KVzip keeps clusters and frees whole
  groups). The plans' KVzip therefore carries ``target_ratio``: once its scores are known it keeps
  the most tokens whose measured bytes still reach the ratio (math dictionary §19.6), so the
  predicted budget is a floor and the ratio is what the cache holds (without it, ``16x`` held
  27.7x on Qwen2.5 at 4K tokens).
* :func:`preset_plan` is the documented default of ``"4x"`` / ``"8x"`` / ``"16x"`` (or any
  ``"<r>x"``): ``QuantConfig(bits=4)`` and, where 4-bit codes alone do not reach the ratio,
  ``KVzip`` keeping the largest fraction of tokens that does; where that fraction would be below
  :data:`HEAVY_EVICTION`, fewer bits, which keep more tokens: K4V3 (:data:`HEAVY_LAYOUT`) or the
  layout measured for the model (:data:`HEAVY_LAYOUTS`, recorded by ``kvcache preset-scorers``).
  Every layout is ``QuantConfig(bits=b)``'s default as the model holds it (:func:`layouts_for`:
  keys before RoPE, coded per token, §29.7). The plans' KVzip scores a token by
  the larger of its reconstruction score and the attention the prompt's last
  :data:`CONTINUATION_QUERIES` queries give it (math dictionary §19.7).
* On a model with sliding-window layers (hybrid, or windowed throughout), :func:`preset_plan`
  first walks :data:`HYBRID_LADDER` and takes the widest layout that reaches the ratio dropping
  nothing; past the ladder it evicts from the ladder's narrowest layout, which drops the fewest
  tokens. Eviction there reaches only the few full-attention layers, the model's only memory past
  the window, and costs far more than a bit less per code (math dictionary §23.3).
* :func:`plan_for` measures: every candidate layout (4, 3 and 2 bits, K4V3 and K3V2) at the
  largest eviction budget that meets the target, with KVzip (and, if asked, with KVzap too), is
  scored on calibration text (compressed prefix, teacher-forced continuation) by the mean
  next-token KL divergence from the full cache and by the perplexity over the full cache's; the
  least costly by the chosen metric among those the checks stay quiet on is the plan.
"""

from __future__ import annotations

import copy
import dataclasses
import math
import re
from typing import Any, Sequence

import torch

from ..cache.architecture import layer_windows
from ..cache.config import QuantConfig
from ..cache.budgets import resolved_budget
from ..cache.layer import CompressedLayer
from ..cache.report import fp16_kv_bytes, kv_geometry
from ..cache.rope_frame import rope_frames
from ..policies import KVzap, KVzip
from .plan import CachePlan

PRESETS = ("4x", "8x", "16x")
"""Named presets; any ``"<ratio>x"`` with a ratio above 1 works the same way."""

DEFAULT_CONTEXT = 4096
"""Context length the presets are sized for when none is given (the bytes per token of a
layout with full-precision sinks fall slightly with the length)."""

CONTINUATION_QUERIES = 96
"""The plans' KVzip also keeps what the prompt's last 96 queries attend (``KVzip.continuation_queries``,
math dictionary §19.7): on held-out text it brings the ``8x`` preset from +5.4% to +0.4% (Qwen2.5)
and from +4.5% to +1.9% (SmolLM2) over the full cache (``benchmarks/probe_continuation.py``)."""

BUDGET_STEP = 0.01
"""Resolution of the KVzip fraction the planner searches."""

CANDIDATE_LAYOUTS: dict[str, QuantConfig] = {
    "q4d": QuantConfig(bits=4),
    "k4v3d": QuantConfig(bits=3, key_bits=4),
    "q3d": QuantConfig(bits=3),
    "k3v2d": QuantConfig(bits=2, key_bits=3),
    "q2d": QuantConfig(bits=2),
}
"""The layouts :func:`plan_for` measures and the presets are sized from: ``QuantConfig(bits=b)``'s
default at each width (keys before RoPE, half-whitened and coded per token on arrival, §29.7), as
a cache holds it for the model (:func:`layouts_for`: per-channel codes after RoPE where its heads
are narrower than 64 channels or its RoPE cannot be removed). Until wave 6 (issue 62) the presets
used the per-channel layout after RoPE (``q<b>da``) at every width."""

PLAN_SCORERS = ("kvzip", "kvzap")
"""The evictions :func:`plan_for` can size and measure with every layout (KVzip with the
continuation score, §19.7; KVzap, §24, acting once after the prefill)."""

PLAN_METRICS = ("kl", "delta_ppl")
"""What :func:`plan_for`'s choice minimizes on the calibration windows (:func:`.measure.continuation_cost`)."""

HEAVY_LAYOUT = "k4v3d"
"""The layout a preset evicts from where 4-bit codes would keep fewer than :data:`HEAVY_EVICTION`
of the tokens, on a model the record of measured presets does not name a layout for: K4V3 codes
(about 3.7 bits per element against 4.2), which keep 1.15x the tokens at the same bytes. Measured
at ``16x`` on 2 held-out *Moby Dick* windows of 4,096 tokens (SmolLM2, KVzap): +1.90% (KL 0.0120)
against +2.23% (0.0124) for 4-bit codes, +2.78% for 3-bit and +3.35% for K3V2 codes."""

HEAVY_LAYOUTS = ("k4v3d", "k3v2d")
"""The layouts ``kvcache preset-scorers`` measures for a preset that evicts heavily
(:func:`~kv_cache.plan.preset_scorers.measure`), recording the one of lower perplexity on the
calibration windows: fewer bits keep more tokens, which wins where eviction costs more than
quantization. Qwen2.5 at ``16x`` on held-out *Moby Dick*: K3V2 keeping 36% +2.15% (KL 0.093),
K4V3 keeping 26% +5.82% (0.090)."""

HEAVY_EVICTION = 0.25
"""The kept fraction of 4-bit codes below which a preset evicts from :data:`HEAVY_LAYOUT` (or the
layout the record names) instead (``16x`` at 4K keeps about 23%, ``8x`` about 47%)."""


def layouts_for(config: Any) -> dict[str, QuantConfig]:
    """:data:`CANDIDATE_LAYOUTS` as a cache holds them for the model of ``config``
    (:meth:`QuantConfig.for_model`, decided once: at most one warning when its RoPE cannot be removed)."""
    kept = CANDIDATE_LAYOUTS["q4d"].for_model(config).pre_rope
    return {n: q if kept else q.after_rope() for n, q in CANDIDATE_LAYOUTS.items()}


HYBRID_LADDER = ("q4d", "k4v3d", "q3d", "k3v2d")
"""The layouts a preset tries, widest first, on a model with sliding-window layers before it evicts
anything: on Gemma 3 270M (Moby Dick, 1,792 tokens) KVzip dropping half the full-attention layers'
tokens costs +18.8% while the same half kept at 2 bits costs +1.8%, and at 3,840 tokens ``16x``
as 3-bit codes costs +1.3% where 4-bit codes + KVzip cost +10.8% (math dictionary §22.8, §23.3).
``q2d`` is left out: 2-bit codes everywhere cost +2.9% to +19.5% on the all-global models."""


def parse_target(target: Any) -> float:
    """``"8x"`` / ``8`` / ``8.0`` -> ``8.0``; raise for anything else or a ratio <= 1."""
    if isinstance(target, str):
        m = re.fullmatch(r"\s*(\d+(?:\.\d+)?)\s*x\s*", target.lower())
        if not m:
            raise ValueError(f"target must be a ratio like {list(PRESETS)} or a number > 1; got {target!r}")
        ratio = float(m.group(1))
    elif isinstance(target, (int, float)) and not isinstance(target, bool):
        ratio = float(target)
    else:
        raise ValueError(f"target must be a ratio like {list(PRESETS)} or a number > 1; got {target!r}")
    if not math.isfinite(ratio) or ratio <= 1.0:
        raise ValueError(f"target ratio must be > 1 (vs an fp16 cache); got {target!r}")
    return ratio


def _keep_masks(T: int, lead: int, trail: int, counts: list[int]) -> torch.Tensor:
    """``[1, H, T]`` bool: the protected ``lead`` / ``trail`` slots and evenly spread others."""
    rows = []
    for n in counts:
        m = torch.zeros(T, dtype=torch.bool)
        m[:lead] = True
        if trail:
            m[T - trail:] = True
        free = torch.nonzero(~m).squeeze(1)
        extra = max(0, min(n - int(m.sum()), free.numel()))
        if extra:
            m[free[torch.linspace(0, free.numel() - 1, extra).round().long()]] = True
        rows.append(m)
    return torch.stack(rows)[None]


class _DryRun:
    """The plan's layers after holding ``T`` random tokens each (quantized once), from which any
    budget's bytes follow by a copy and an eviction (:meth:`bytes`)."""

    def __init__(self, config: Any, plan: CachePlan, T: int, dtype: torch.dtype, seed: int = 0):
        plan.check_model(config)
        g = kv_geometry(config)
        quant = plan.quant_config()
        gen = torch.Generator().manual_seed(seed)
        self.heads, self.T, self.layers = g.kv_heads, T, []
        # keys before RoPE: each layer's frame as the cache sets it (its frequencies and, after an
        # eviction, its arrivals' bitmap are held and counted, §29.6)
        frames = rope_frames(config, g.head_dim) if quant is not None and quant.pre_rope else None
        for i, window in enumerate(layer_windows(config)):
            q = quant if window is None or quant is None else quant.sliding_config()
            layer = CompressedLayer(i, q, None, window)
            if frames is not None:
                layer.rope_frame = frames[i]
            n = T  # a sliding layer is given every token and slides, as in a prefill (its residual follows T)
            k = torch.randn(1, g.kv_heads, n, g.head_dim, generator=gen).to(dtype)
            v = torch.randn(1, g.kv_heads, n, g.head_dim, generator=gen).to(dtype)
            layer.update(k, v)
            self.layers.append(layer)

    def bytes(self, policy: Any) -> int:
        """Bytes held once ``policy`` (None: keep all) kept its budget in every full layer."""
        total = 0
        for layer in self.layers:
            if layer.window is None and policy is not None:
                n = self.T
                # as the cache resolves it: a fractional budget is raised to the slots kept anyway (§12)
                budget = min(resolved_budget(policy, layer.quant, layer.layer_idx, n)[1], n)
                if budget < n:
                    layer = copy.deepcopy(layer)
                    lead, trail = layer.storage.protected()
                    H = self.heads
                    uneven = policy.scope != "head" and H > 1
                    counts = [budget + (((-1) ** h) if uneven and h < H - (H % 2) else 0) for h in range(H)]
                    layer.apply_keep_masks(_keep_masks(n, lead, trail, counts))
            total += sum(layer.nbytes_by_category().values())
        return total


def predict_bytes(config: Any, plan: CachePlan, context_tokens: int, *, dtype: torch.dtype = torch.float32,
                  seed: int = 0) -> int:
    """Bytes a cache of ``plan`` holds after prefilling ``context_tokens`` tokens (batch 1).

    Parameters
    ----------
    config : the model's config; plan : the plan; context_tokens : ``T >= 1``
    dtype : the model's dtype (what full-precision parts are held in)

    Returns
    -------
    ``int``: the sum of ``nbytes`` over every tensor the layers would hold.
    """
    if isinstance(context_tokens, bool) or not isinstance(context_tokens, int) or context_tokens < 1:
        raise ValueError(f"context_tokens must be an int >= 1; got {context_tokens!r}")
    return _DryRun(config, plan, context_tokens, dtype, seed).bytes(plan.eviction())


def _with_prediction(config: Any, plan: CachePlan, context_tokens: int, dtype: torch.dtype, **extra) -> CachePlan:
    held = predict_bytes(config, plan, context_tokens, dtype=dtype)
    fp16 = fp16_kv_bytes(config, context_tokens)
    predicted = {"bytes": held, "bytes_per_token": held / context_tokens, "context_tokens": context_tokens,
                 "ratio": fp16 / held, "dtype": str(dtype).removeprefix("torch."), **extra}
    return dataclasses.replace(plan, predicted=predicted)


def _evicting(scorer: str, budget: float, ratio: float, scorer_path: str | None = None):
    """The plans' eviction at ``budget``, grown to ``ratio`` once its scores are known (§19.6):
    ``"kvzip"`` or ``"kvzap"`` (acting once, after the prefill), each with the continuation score (§19.7)."""
    if scorer == "kvzap":
        return KVzap(budget=budget, target_ratio=ratio, decoding=False, scorer=scorer_path,
                     continuation_queries=CONTINUATION_QUERIES)
    return KVzip(budget=budget, target_ratio=ratio, continuation_queries=CONTINUATION_QUERIES)


def _largest_budget(config: Any, layout: QuantConfig, ratio: float, context_tokens: int, dtype: torch.dtype,
                    name: str, scorer: str = "kvzip", scorer_path: str | None = None) -> CachePlan | None:
    """The plan of ``layout`` (+ ``scorer``'s eviction keeping the largest fraction) whose
    predicted ratio reaches ``ratio``, or None if even the smallest fraction does not."""
    fp16 = fp16_kv_bytes(config, context_tokens)

    def plan_at(rho: float | None) -> CachePlan:  # the eviction then keeps more if its real bytes allow (§19.6)
        return CachePlan.uniform(config, layout, None if rho is None else _evicting(scorer, rho, ratio, scorer_path),
                                 name=name)

    run = _DryRun(config, plan_at(None), context_tokens, dtype)  # quantized once; budgets evict copies

    def reaches(k: int | None) -> bool:
        return fp16 / run.bytes(None if k is None else KVzip(budget=round(k * BUDGET_STEP, 4))) >= ratio

    if reaches(None):
        return _with_prediction(config, plan_at(None), context_tokens, dtype)
    lo, hi = 1, int(round(1 / BUDGET_STEP)) - 1  # the largest k with ratio(k * step) >= target
    if not reaches(lo):
        return None
    while lo < hi:
        mid = (lo + hi + 1) // 2
        lo, hi = (mid, hi) if reaches(mid) else (lo, mid - 1)
    return _with_prediction(config, plan_at(round(lo * BUDGET_STEP, 4)), context_tokens, dtype)


def preset_plan(config: Any, target: Any = "8x", *, context_tokens: int | None = None,
                dtype: torch.dtype = torch.float32, scorer: str = "kvzip",
                scorer_path: str | None = None, heavy_layout: str | None = None) -> CachePlan:
    """The documented default plan for ``target`` (see the module docstring), sized for
    ``context_tokens`` (default :data:`DEFAULT_CONTEXT`, capped at the model's positions).

    On a model whose every layer attends globally: 4-bit codes (``QuantConfig(bits=4)``, as the
    model holds it: :func:`layouts_for`), plus KVzip keeping the largest fraction of tokens that
    reaches the ratio; below :data:`HEAVY_EVICTION` kept, ``heavy_layout`` instead (a
    :data:`CANDIDATE_LAYOUTS` name; None: :data:`HEAVY_LAYOUT`, K4V3), which keeps more;
    2-bit codes if even 1% misses. On a model with sliding-window layers: the widest layout of
    :data:`HYBRID_LADDER` that reaches the ratio with no eviction; past the ladder, its narrowest
    layout (K3V2) plus KVzip keeping the largest fraction that reaches it (it drops the fewest
    tokens), then 2-bit codes as above.

    ``scorer`` (one of :data:`PLAN_SCORERS`) is the eviction's: ``"kvzap"`` sizes the same layouts
    with KVzap's learned scores (``scorer_path``, or None: the scorer shipped for the model, bound
    when the cache is used), with the same continuation score as KVzip's (§19.7).
    :func:`~kv_cache.plan.preset_scorers.model_preset_plan` picks the scorer and the heavy layout
    measured for a model."""
    if scorer not in PLAN_SCORERS:
        raise ValueError(f"scorer must be one of {list(PLAN_SCORERS)}; got {scorer!r}")
    if heavy_layout is not None and heavy_layout not in CANDIDATE_LAYOUTS:
        raise ValueError(f"heavy_layout must be one of {list(CANDIDATE_LAYOUTS)} or None; got {heavy_layout!r}")
    ratio = parse_target(target)
    T = context_tokens or default_context(config)
    name = target if isinstance(target, str) else f"{ratio:g}x"
    layouts = layouts_for(config)
    evicting = "q4d"
    if any(w is not None for w in layer_windows(config)):
        for n in HYBRID_LADDER:  # fewer bits before any eviction (module docstring)
            plan = _with_prediction(config, CachePlan.uniform(config, layouts[n], None, name=name), T, dtype)
            if plan.predicted["ratio"] >= ratio:
                return plan
        evicting = HYBRID_LADDER[-1]  # past the ladder, the layout that drops the fewest tokens
    plan = _largest_budget(config, layouts[evicting], ratio, T, dtype, name, scorer, scorer_path)
    heavy = plan is None or (plan.policy is not None and plan.policy.budget < HEAVY_EVICTION)
    if heavy and evicting == "q4d":
        plan = _largest_budget(config, layouts[heavy_layout or HEAVY_LAYOUT], ratio, T, dtype, name, scorer,
                               scorer_path) or plan
    if plan is None:
        plan = _largest_budget(config, layouts["q2d"], ratio, T, dtype, name, scorer, scorer_path)
    if plan is None:
        raise ValueError(f"no plan reaches {ratio:g}x at {T} tokens: even 2-bit codes keeping 1% of the tokens hold "
                         "more; lower the target")
    return plan


def heavy_evicting(config: Any, target: Any, *, context_tokens: int | None = None,
                   dtype: torch.dtype = torch.float32) -> bool:
    """Whether :func:`preset_plan` evicts ``target`` from its heavy layout on this model (an
    all-global model on which 4-bit codes would keep fewer than :data:`HEAVY_EVICTION` of the
    tokens): the presets whose layout ``kvcache preset-scorers`` measures."""
    if any(w is not None for w in layer_windows(config)):
        return False
    T = context_tokens or default_context(config)
    plan = _largest_budget(config, layouts_for(config)["q4d"], parse_target(target), T, dtype, "probe")
    return plan is None or (plan.policy is not None and plan.policy.budget < HEAVY_EVICTION)


def default_context(config: Any) -> int:
    """The context a plan is sized for when none is given: :data:`DEFAULT_CONTEXT`, capped at half
    the model's positions."""
    text = config.get_text_config() if hasattr(config, "get_text_config") else config
    limit = int(getattr(text, "max_position_embeddings", 0) or 0)
    return min(DEFAULT_CONTEXT, limit // 2) if limit else DEFAULT_CONTEXT


def plan_for(model: torch.nn.Module, tokenizer: Any, *, target: Any = None, bytes_per_token: float | None = None,
             max_bytes: int | None = None, calibration_text: str, context_tokens: int | None = None,
             continuation: int = 64, windows: int = 2,
             layouts: Sequence[str] = tuple(CANDIDATE_LAYOUTS), scorers: Sequence[str] | None = None,
             kvzap_scorer: str | None = None, metric: str = "kl") -> CachePlan:
    """Measure the candidates that meet one byte target and return the least costly plan.

    Parameters
    ----------
    model, tokenizer : a transformers causal LM and its tokenizer
    target / bytes_per_token / max_bytes : exactly one: a ratio vs fp16 (``"8x"``), bytes per
        context token, or bytes for ``context_tokens`` tokens
    calibration_text : text the costs are measured on (never the evaluation text)
    context_tokens : the context length planned for (default :data:`DEFAULT_CONTEXT`, capped at
        half the model's positions); the calibration windows are this long plus ``continuation``
    windows : how many calibration windows the KL is averaged over
    layouts : the candidate layouts (:data:`CANDIDATE_LAYOUTS` names)
    scorers : the evictions tried with every layout that must evict, among :data:`PLAN_SCORERS`
        (default: KVzip alone; ``("kvzip", "kvzap")`` doubles the candidates: KVzap's learned
        scores need no second prefill and rank tokens differently, math dictionary §23.4)
    kvzap_scorer : a KVzap scorer file (``kvcache calibrate-scorer``); None: the one shipped for
        the model
    metric : what the choice minimizes, one of :data:`PLAN_METRICS`: ``"kl"``, the mean next-token
        KL divergence from the full cache, or ``"delta_ppl"``, the continuation's perplexity over
        the full cache's

    Returns
    -------
    :class:`CachePlan` with ``predicted`` holding the bytes, the ratio and every candidate's
    measured KL and perplexity, with the fidelity and eviction checks' figures on the calibration
    windows and whether they warned (:func:`.measure.continuation_cost`). The choice is the least
    ``metric`` among the candidates on which neither check warned on any window (among all of
    them when every one warned; the chosen plan's cache then warns as it is used).
    """
    from .measure import calibration_windows, continuation_cost, reference_log_probs

    given = [x is not None for x in (target, bytes_per_token, max_bytes)]
    if sum(given) != 1:
        raise ValueError("give exactly one of target=, bytes_per_token= or max_bytes=; got "
                         f"target={target!r}, bytes_per_token={bytes_per_token!r}, max_bytes={max_bytes!r}")
    T = context_tokens or default_context(model.config)
    fp16 = fp16_kv_bytes(model.config, T)
    if target is not None:
        ratio = parse_target(target)
    else:
        held = bytes_per_token * T if bytes_per_token is not None else max_bytes
        if not isinstance(held, (int, float)) or isinstance(held, bool) or held <= 0:
            raise ValueError(f"bytes_per_token / max_bytes must be > 0; got {bytes_per_token!r} / {max_bytes!r}")
        ratio = fp16 / held
    unknown = [n for n in layouts if n not in CANDIDATE_LAYOUTS]
    if unknown:
        raise ValueError(f"layouts must be among {list(CANDIDATE_LAYOUTS)}; got {unknown}")
    dtype = next(model.parameters()).dtype
    name = target if isinstance(target, str) else f"{ratio:.3g}x"
    if metric not in PLAN_METRICS:
        raise ValueError(f"metric must be one of {list(PLAN_METRICS)}; got {metric!r}")
    scorers = _plan_scorers(model, scorers, kvzap_scorer)
    held = layouts_for(model.config)
    candidates, seen = [], set()
    for scorer in scorers:
        for n in layouts:
            plan = _largest_budget(model.config, held[n], ratio, T, dtype, name, scorer, kvzap_scorer)
            if plan is None or plan.fingerprint in seen:  # cannot reach the ratio, or reaches it evicting nothing
                continue
            seen.add(plan.fingerprint)
            candidates.append((n if scorer == "kvzip" or plan.policy is None else f"{n}+{scorer}", plan))
    if not candidates:
        raise ValueError(f"no candidate layout reaches {ratio:.3g}x at {T} tokens; lower the target")
    wins = calibration_windows(tokenizer, calibration_text, T, continuation, windows)
    reference = reference_log_probs(model, tokenizer, wins, T)
    measured = []
    for n, plan in candidates:
        measured.append({"layout": n, "fingerprint": plan.fingerprint,
                         **continuation_cost(model, tokenizer, plan, wins, T, reference),
                         "budget": None if plan.policy is None else plan.policy.budget,
                         "ratio": plan.predicted["ratio"]})
    # a candidate the checks warned on (§26, §26.1) is chosen only when every candidate warned
    best = min(range(len(candidates)), key=lambda j: (measured[j]["warned"], measured[j][metric]))
    plan = candidates[best][1]
    return dataclasses.replace(plan, predicted={**plan.predicted, "candidates": measured, "target_ratio": ratio,
                                                "calibration_windows": len(wins), "metric": metric})


def _plan_scorers(model: torch.nn.Module, scorers: Sequence[str] | None, kvzap_scorer: str | None) -> tuple[str, ...]:
    """``plan_for``'s evictions: the ones asked for (checked; KVzap without a scorer for the model
    raises, naming how to fit one), KVzip alone by default."""
    scorers = ("kvzip",) if scorers is None else tuple(scorers)
    bad = [x for x in scorers if x not in PLAN_SCORERS]
    if not scorers or bad:
        raise ValueError(f"scorers must be a non-empty sequence of {list(PLAN_SCORERS)}; got {list(scorers)}")
    if "kvzap" in scorers:
        KVzap(scorer=kvzap_scorer).bind(model)  # raises now, naming the fix, if no scorer fits the model
    return scorers
