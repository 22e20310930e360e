"""H2O with ``evict_every = k``: heads grow to ``budget + k - 1`` tokens, then the ``k`` lowest
accumulated sums outside the recent window go at once (math dictionary §9.1)."""

from __future__ import annotations

import pytest
import torch

from kv_cache import H2O, CompressedCache, compress
from kv_cache.context import forward_at
from kv_cache.eval.accounting import walked_nbytes
from kv_cache.spec.grammar import parse_method


def _decode_lengths(model, ids, policy, steps):
    cache = CompressedCache(model.config, eviction=policy)
    lengths = []
    with torch.no_grad(), compress(model, cache):
        logits = model(ids, past_key_values=cache).logits[:, -1:]
        pos = ids.shape[1]
        for _ in range(steps):
            nxt = logits.argmax(-1)
            logits = forward_at(model, cache, nxt, pos)[:, -1:]
            pos += 1
            lengths.append(cache.layers[0].storage.length)
    return cache, lengths


@pytest.mark.parametrize("k", [1, 4])
def test_heads_hold_at_most_budget_plus_k_minus_one(stories, k):
    model, tok = stories
    ids = tok("Once upon a time there was a little dog. The dog liked to run in the park every day.",
              return_tensors="pt").input_ids
    budget = 12
    cache, lengths = _decode_lengths(model, ids, H2O(budget=budget, recent_window=4, evict_every=k), 10)
    assert max(lengths) == budget + k - 1 and min(lengths) == budget
    if k == 1:
        assert set(lengths) == {budget}
    else:  # grows one token per step, then drops back by k at once
        i = lengths.index(budget)
        assert lengths[i:i + k] == list(range(budget, budget + k))
    assert cache.memory_report().total_bytes == walked_nbytes(cache)


def test_batched_eviction_drops_the_lowest_sums_outside_the_window(stories):
    model, tok = stories
    ids = tok("Once upon a time there was a little dog. The dog liked to run in the park every day.",
              return_tensors="pt").input_ids
    budget, k, window = 10, 3, 3
    cache = CompressedCache(model.config, eviction=H2O(budget=budget, recent_window=window, evict_every=k))
    with torch.no_grad(), compress(model, cache):
        logits = model(ids, past_key_values=cache).logits[:, -1:]
        pos = ids.shape[1]
        layer = cache.layers[1]
        for _ in range(2 * k):
            keys_before = layer.storage.keys.clone()
            nxt = logits.argmax(-1)
            logits = forward_at(model, cache, nxt, pos)[:, -1:]
            pos += 1
            if layer.storage.length == budget and keys_before.shape[2] == budget + k - 1:
                break
        else:
            pytest.fail("no batched eviction happened")
    # The kept keys are the old ones minus k evicted outside the window, plus the new token.
    kept = layer.storage.keys[:, :, :-1]
    old = keys_before
    for h in range(old.shape[1]):
        rows = [any(torch.equal(old[0, h, t], kept[0, h, j]) for j in range(kept.shape[2]))
                for t in range(old.shape[2])]
        assert sum(not r for r in rows) == k and all(rows[-(window - 1):])  # the window survives


def test_evict_every_validation_and_spec():
    for bad in (0, -1, True, 2.5):
        with pytest.raises(ValueError, match="evict_every must be an int >= 1"):
            H2O(budget=0.5, evict_every=bad)
    with pytest.raises(ValueError, match="scope='head'"):
        H2O(budget=0.5, evict_every=4, scope="layer")
    assert repr(H2O(budget=0.5)) == "H2O(budget=0.5, recent_window=0.5, sink_tokens=0, gqa_reduce='mean')"
    assert parse_method("h2o@0.5e16").resolved.endswith("evict_every=16)")
    with pytest.raises(ValueError, match="applies to h2o and kvzap only"):
        parse_method("snapkv@0.5e16")
