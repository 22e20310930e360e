"""Asked contexts stacked into one batch cache (:mod:`kv_cache.cache.stack`): rows on the same
context and on different ones, with questions of different lengths, decode greedily exactly as
each context's own session does alone; contexts whose heads hold different numbers of tokens
(KVzip's model-wide budget) included, and mixed with rectangular ones of the same quantization."""

from __future__ import annotations

import pytest
import torch

from kv_cache import CompressedContext
from kv_cache.cache import compress
from kv_cache.cache.stack import layout_key, session_states, stack_reason, stack_sessions
from kv_cache.cli.context import method_settings
from kv_cache.context import forward_at

DOC = ("Once upon a time, there was a little girl named Lily. She loved to play outside in the park. "
       "One day, she saw a big red ball near the tree. She ran to the ball and picked it up. ") * 2
DOC2 = "Tom had a big dog named Max. Max liked to run and jump in the garden. One day Max found a bone. " * 3
QUESTIONS = ["Lily went to the", "The ball was", "She", "Tom and Max went to the big park and"]
N = 16


_BUILT: dict = {}


def _build(stories, doc: str, spec: str) -> CompressedContext:
    """The context of ``doc`` compressed with ``spec``, built once per module (asking never changes it)."""
    if (doc, spec) not in _BUILT:
        model, tok = stories
        quant, eviction, _ = method_settings(spec, None, model)
        _BUILT[doc, spec] = CompressedContext.build(model, tok, doc, quant=quant, eviction=eviction)
    return _BUILT[doc, spec]


def _stacked_answers(model, tok, asks: list[tuple[CompressedContext, str]]) -> list[str]:
    """Greedy answers of ``asks`` decoded as rows of one stacked cache (no end of sequence)."""
    logits, states, pos = [], [], []
    for ctx, question in asks:
        ids = ctx.question_ids(question, 1)
        with compress(model, ctx.cache), ctx.cache.session(), torch.no_grad():
            logits.append(forward_at(model, ctx.cache, torch.tensor([ids]), ctx.context_tokens)[0, -1])
            states.append(session_states(ctx.cache))
        pos.append(ctx.context_tokens + len(ids))
    batch = stack_sessions([c.cache for c, _ in asks], states, model.config)
    out = [[] for _ in asks]
    nxt, p = torch.stack(logits).argmax(-1), torch.tensor(pos).unsqueeze(1)
    with compress(model, batch), batch.session(), torch.no_grad():
        for step in range(N):
            for b, t in enumerate(nxt.tolist()):
                out[b].append(t)
            if step + 1 < N:
                o = model(input_ids=nxt.unsqueeze(1), position_ids=p, past_key_values=batch, use_cache=True)
                nxt, p = o.logits[:, -1].argmax(-1), p + 1
    return [tok.decode(o, skip_special_tokens=True) for o in out]


@pytest.mark.filterwarnings("ignore::kv_cache.FidelityWarning")
@pytest.mark.parametrize("spec", ["q4d", "q2d", "full", "q4+snapkv@0.5", "q4+kvzip@0.5", "kvzip@0.5"])
def test_stacked_rows_answer_as_each_session_alone(stories, spec):
    model, tok = stories
    a, b = _build(stories, DOC, spec), _build(stories, DOC2, spec)
    assert stack_reason(a.cache) is None and layout_key(a.cache) == layout_key(b.cache)
    asks = [(a, QUESTIONS[0]), (a, QUESTIONS[1]), (b, QUESTIONS[2]), (b, QUESTIONS[3]), (a, QUESTIONS[3])]
    alone = [c.ask(q, max_new_tokens=N, eos_token_ids=[]) for c, q in asks]
    assert _stacked_answers(model, tok, asks) == alone
    assert len(set(alone)) == len(asks)
    assert a.ask(QUESTIONS[0], max_new_tokens=N, eos_token_ids=[]) == alone[0]  # the contexts never changed


@pytest.mark.filterwarnings("ignore::kv_cache.FidelityWarning")
def test_ragged_and_rectangular_contexts_share_a_batch(stories):
    model, tok = stories
    a, b = _build(stories, DOC, "q4"), _build(stories, DOC2, "q4+kvzip@0.5")
    assert type(b.cache.layers[0].storage).__name__ == "PackedRaggedStorage"
    assert layout_key(a.cache) == layout_key(b.cache)
    asks = [(a, QUESTIONS[0]), (b, QUESTIONS[3]), (b, QUESTIONS[2])]
    alone = [c.ask(q, max_new_tokens=N, eos_token_ids=[]) for c, q in asks]
    assert _stacked_answers(model, tok, asks) == alone


def test_stack_reason_and_refusals(stories):
    from kv_cache import CompressedCache, KVzip, QuantConfig

    model, tok = stories
    tiered = CompressedContext.build(model, tok, DOC, quant=QuantConfig(bits=4, evicted_bits=2),
                                     eviction=KVzip(budget=0.25))
    assert "demoted tokens" in stack_reason(tiered.cache)
    assert stack_reason(CompressedCache(model.config)) == "layer 0 holds nothing (the context is not prefilled)"
    a, full = _build(stories, DOC, "q4d"), _build(stories, DOC, "full")
    assert layout_key(a.cache) != layout_key(full.cache)
    with pytest.raises(RuntimeError, match="not in a session"):
        session_states(a.cache)
    with pytest.raises(ValueError, match="at least one cache"):
        stack_sessions([], [], model.config)
    with pytest.raises(ValueError, match="one question per cache"):
        stack_sessions([a.cache], [], model.config)
    with pytest.raises(ValueError, match="cannot be a batch row: layer 0 holds a precision tier's demoted tokens"):
        stack_sessions([tiered.cache], [[]], model.config)
    states = []
    for ctx in (a, full):
        with compress(model, ctx.cache), ctx.cache.session(), torch.no_grad():
            forward_at(model, ctx.cache, torch.tensor([ctx.question_ids("She", 1)]), ctx.context_tokens)
            states.append(session_states(ctx.cache))
    with pytest.raises(ValueError, match="2 different layouts"):
        stack_sessions([a.cache, full.cache], states, model.config)
