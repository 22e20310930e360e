"""The RULER-style task registry (:data:`TASKS`) and :func:`build_task`.

Needle tasks (``niah_*``, ``vt``, ``passkey``) share one builder: draw a :class:`Spec` per
sample, then fit the haystack around its needles so that the rendered prompt has between
``context - CONTEXT_SLACK`` and ``context`` tokens.  ``cwe`` has its own builder
(:mod:`.cwe`).
"""

from __future__ import annotations

import logging
import random
from collections.abc import Callable
from dataclasses import replace
from typing import Any

from .cwe import build_cwe
from .haystack import Source, cut, noise_source, splice, text_source
from .prompts import CONTEXT_SLACK, RetrievalSample, fit_length, prompt_tokens
from .request import TaskRequest
from .specs import MAX_NEW_TOKENS, Spec, niah_spec, passkey_spec, vt_spec
from .text import chars_per_token

logger = logging.getLogger(__name__)

__all__ = ["TASKS", "build_task"]


def _short_error(task: str, source: Source, context: int, n: int) -> ValueError:
    return ValueError(
        f"text too short for task {task!r}: its {len(source.ends)} tokens (from character "
        f"{source.start}) fill the prompt to only {n} of the requested {context} tokens; "
        f"use a longer text, a smaller context, or haystack='noise'"
    )


def _build_needle_task(
    task: str,
    make_spec: Callable[[random.Random, float | None], Spec],
    request: TaskRequest,
    *,
    max_new_tokens: int,
    random_depth: bool = True,
) -> list[RetrievalSample]:
    tokenizer, text, context, depths = (
        request.tokenizer, request.text, request.context, request.depths
    )
    query_aware, use_chat = request.query_aware, request.use_chat
    noise = noise_source(tokenizer, context) if request.haystack == "noise" else None
    cpt = chars_per_token(tokenizer, text) if request.haystack == "text" else 1.0
    samples = []
    for i, rng in enumerate(request.rngs(task)):
        if depths is not None:
            depth: float | None = depths[i % len(depths)]
        else:
            depth = rng.random() if random_depth else None
        spec = make_spec(rng, depth)
        src_seed = rng.getrandbits(64)

        def render(k: int, source: Source) -> tuple[RetrievalSample, int]:
            hay = cut(source, k)
            ctx, positions, points = splice(hay, spec.needles, spec.sep)
            meta = dict(spec.metadata)
            meta.update(
                needles=[nd for _, nd in spec.needles],
                needle_positions=positions,
                needle_depths=[p / max(1, len(hay)) for p in points],
                haystack=request.haystack,
                haystack_tokens=k,
                source_start=source.start,
                seed=request.seed,
                index=i,
                max_new_tokens=max_new_tokens,
                fit={"query_aware": query_aware, "chat": use_chat},
            )
            sample = RetrievalSample(
                task=task,
                context=ctx,
                question=spec.question,
                answer_prefix=spec.answer_prefix,
                expected=list(spec.expected),
                depth=spec.depth,
                metadata=meta,
                instruction=spec.instruction,
            )
            return sample, prompt_tokens(sample, tokenizer, query_aware, use_chat)

        for grow in range(4):
            source = noise if noise is not None else text_source(
                tokenizer, text, context, random.Random(src_seed), cpt, grow
            )
            hi = len(source.ends)
            _, n0 = render(0, source)
            k, sample, n = fit_length(lambda k: render(k, source), context, 0, hi, context - n0)
            if k < hi or n >= context - CONTEXT_SLACK:
                break
            if source.complete:
                raise _short_error(task, source, context, n)
        else:  # pragma: no cover - the window grows to the whole text within 4 tries
            raise _short_error(task, source, context, n)
        samples.append(replace(sample, metadata={**sample.metadata, "num_tokens": n}))
        logger.debug("%s sample %d: %d prompt tokens (target %d)", task, i, n, context)
    return samples


def _needle_builder(
    task: str, make_spec: Callable[..., Spec], max_new_tokens: int, random_depth: bool = True
) -> Callable[..., list[RetrievalSample]]:
    def builder(request: TaskRequest, **options: Any) -> list[RetrievalSample]:
        return _build_needle_task(
            task,
            lambda rng, depth: make_spec(rng, depth, **options),
            request,
            max_new_tokens=max_new_tokens,
            random_depth=random_depth,
        )

    builder.__name__ = f"build_{task}"
    builder.__doc__ = f"Build ``{task}`` samples; see :func:`build_task`."
    return builder


def _niah(num_keys: int, num_values: int, num_queries: int) -> Callable[..., Spec]:
    def make(rng: random.Random, depth: float, **options: Any) -> Spec:
        if options:
            raise TypeError(f"unexpected options for niah tasks: {sorted(options)}")
        return niah_spec(
            rng, depth, num_keys=num_keys, num_values=num_values, num_queries=num_queries
        )

    return make


def _passkey(rng: random.Random, depth: float, **options: Any) -> Spec:
    if options:
        raise TypeError(f"unexpected options for passkey: {sorted(options)}")
    return passkey_spec(rng, depth)


#: Task name -> builder ``f(request, **options)`` taking a :class:`TaskRequest`.
#: Upstream RULER settings: multikey = 4 keys / 1 queried, multivalue = 4
#: values, multiquery = 4 keys all queried, vt = 1 chain of 4 hops.
TASKS: dict[str, Callable[..., list[RetrievalSample]]] = {
    "niah_single": _needle_builder("niah_single", _niah(1, 1, 1), MAX_NEW_TOKENS["niah"]),
    "niah_multikey": _needle_builder("niah_multikey", _niah(4, 1, 1), MAX_NEW_TOKENS["niah"]),
    "niah_multivalue": _needle_builder("niah_multivalue", _niah(1, 4, 1), MAX_NEW_TOKENS["niah"]),
    "niah_multiquery": _needle_builder("niah_multiquery", _niah(4, 1, 4), MAX_NEW_TOKENS["niah"]),
    "vt": _needle_builder("vt", vt_spec, MAX_NEW_TOKENS["vt"], random_depth=False),
    "cwe": build_cwe,
    "passkey": _needle_builder("passkey", _passkey, MAX_NEW_TOKENS["passkey"]),
}


def build_task(name: str, request: TaskRequest, **options: Any) -> list[RetrievalSample]:
    """Build samples of a RULER-style retrieval task.

    Each sample's prompt, rendered by :func:`~kv_cache.eval.tasks.build_prompt` with the
    request's ``query_aware`` and ``chat`` settings, has between ``context - CONTEXT_SLACK``
    and ``context`` tokens (counted by :func:`~kv_cache.eval.tasks.count_prompt_tokens`, i.e.
    ``len(tokenizer(prompt).input_ids)``).  Both modes render the same prompt (only the
    compression boundary differs), so the length holds for either.

    Parameters
    ----------
    name : str
        A key of :data:`TASKS`: ``niah_single``, ``niah_multikey``,
        ``niah_multivalue``, ``niah_multiquery``, ``vt``, ``cwe`` or ``passkey``.
    request : TaskRequest
        Tokenizer, haystack text, target context, number of samples, depths, seed, haystack
        kind and rendering, already validated.
    **options
        Task-specific knobs: ``vt``: ``num_chains`` (1), ``num_hops`` (4);
        ``cwe``: ``top_k`` (10), ``freq_common`` (30, scaled down to fit),
        ``freq_uncommon`` (3).

    Returns
    -------
    list of RetrievalSample

    Raises
    ------
    ValueError
        Unknown task name, invalid option, context too small for the task,
        or text too short to fill the context.
    TypeError
        If ``request`` is not a :class:`TaskRequest` or an option is unknown to the task.

    Examples
    --------
    >>> request = TaskRequest(tok, text, context=4096, num_samples=4)  # doctest: +SKIP
    >>> build_task("niah_single", request)[0].metadata["num_tokens"]  # doctest: +SKIP
    4096
    """
    if not isinstance(name, str) or name not in TASKS:
        raise ValueError(f"unknown task {name!r}; known tasks: {', '.join(sorted(TASKS))}")
    if not isinstance(request, TaskRequest):
        raise TypeError(f"request must be a TaskRequest, got {type(request).__name__}")
    return TASKS[name](request, **options)
