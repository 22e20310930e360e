"""Method specs that name a cache plan: presets ``<r>x`` and plan files ``plan[<path>]``
(rows of :data:`kv_cache.spec.grammar.METHOD_GRAMMAR`; math dictionary §23)."""

from __future__ import annotations

import re
from typing import Any, Callable

from ..cache import CompressedCache, compress
from .method import Method


def _planned(spec: str, get_plan: Callable[..., Any], resolved: str, for_prompt: bool = False) -> Method:
    """A method whose cache is ``CompressedCache(config, plan=get_plan(model))``; with
    ``for_prompt``, ``get_plan(model, prompt_tokens)`` where the prompt's length is known."""
    def make(model, *prompt_tokens):
        cache = CompressedCache(model.config, plan=get_plan(model, *prompt_tokens))
        return cache, lambda: compress(model, cache)
    return Method(spec, "ours", None, None, make, resolved=resolved, needs_tokenizer=True,
                  make_for_prompt=make if for_prompt else None)


def plan_file(spec: str, m: re.Match[str]) -> Method:
    """``plan[<path>]``: a plan file, read now (the path keeps the case it was given in)."""
    from ..plan import CachePlan

    plan = CachePlan.load(spec.strip()[len("plan["):-1])
    return _planned(spec, lambda model: plan, f"kv_cache plan {plan.fingerprint}")


def preset(spec: str, m: re.Match[str]) -> Method:
    """``<r>x``: ``kv_cache.plan.model_preset_plan`` for that ratio, sized for the default
    context once per model and scorer (not per sample), evicting with the scorer measured for the
    model at the prompt's length where it is known (:meth:`Method.build`)."""
    from ..plan import model_preset_plan, parse_target, preset_scorer

    ratio, made = parse_target(m.string), {}

    def get(model, prompt_tokens=None):
        key = (id(model), next(model.parameters()).dtype, preset_scorer(model, m.string, prompt_tokens=prompt_tokens))
        if key not in made:
            made.clear()
            made[key] = model_preset_plan(model, m.string, prompt_tokens=prompt_tokens)
        return made[key]
    return _planned(spec, get, f"kv_cache preset {ratio:g}x", for_prompt=True)
