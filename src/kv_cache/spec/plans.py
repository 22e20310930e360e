"""Method specs that name a cache plan: presets ``<r>x`` and plan files ``plan[<path>]``
(rows of :data:`kv_cache.spec.grammar.METHOD_GRAMMAR`; math dictionary §23)."""

from __future__ import annotations

import re
from typing import Any, Callable

from ..cache import CompressedCache, compress
from .method import Method


def _planned(spec: str, get_plan: Callable[[Any], Any], resolved: str) -> Method:
    """A method whose cache is ``CompressedCache(config, plan=get_plan(model))``."""
    def make(model):
        cache = CompressedCache(model.config, plan=get_plan(model))
        return cache, lambda: compress(model, cache)
    return Method(spec, "ours", None, None, make, resolved=resolved, needs_tokenizer=True)


def plan_file(spec: str, m: re.Match[str]) -> Method:
    """``plan[<path>]``: a plan file, read now (the path keeps the case it was given in)."""
    from ..plan import CachePlan

    plan = CachePlan.load(spec.strip()[len("plan["):-1])
    return _planned(spec, lambda model: plan, f"kv_cache plan {plan.fingerprint}")


def preset(spec: str, m: re.Match[str]) -> Method:
    """``<r>x``: ``kv_cache.plan.model_preset_plan`` for that ratio (evicting with the scorer
    measured for the model), sized once per model (not per sample)."""
    from ..plan import model_preset_plan, parse_target

    ratio, made = parse_target(m.string), {}

    def get(model):
        key = (id(model), next(model.parameters()).dtype)
        if key not in made:
            made.clear()
            made[key] = model_preset_plan(model, m.string)
        return made[key]
    return _planned(spec, get, f"kv_cache preset {ratio:g}x")
