"""KVzip's repeat chunk in one pass (kv_cache.attention.reconstruction, math dictionary §19.3):
model-free against the two-pass reference (torch's sdpa + reconstruction_scores) and a
float64 softmax, the edges (empty ranges, bad slots, bf16), and on the tiny real model the
same scores and the same kept tokens as the two-pass path."""

from __future__ import annotations

import pytest
import torch

from kv_cache.attention.blocks import reconstruction_scores
from kv_cache.attention.reconstruction import one_pass_available, repeat_chunk_attention


def _two_pass(query, keys, values, new_k, new_v, scaling, sinks, start, end):
    """What the repeat chunk computed before: sdpa over everything, scores apart."""
    B, Hq, L, d = query.shape
    H, T = keys.shape[1], keys.shape[2]
    G = Hq // H
    all_k, all_v = torch.cat([keys, new_k], 2), torch.cat([values, new_v], 2)
    pos = torch.arange(L)
    mask = torch.cat([torch.ones(L, T, dtype=torch.bool), pos[None, :] <= pos[:, None]], 1)
    out = torch.nn.functional.scaled_dot_product_attention(query, all_k, all_v, attn_mask=mask, scale=scaling,
                                                           enable_gqa=True).transpose(1, 2)
    q = query.reshape(B, H, G * L, d)
    return out, reconstruction_scores(q, keys, new_k, scaling, G, sinks, start, end)


def _inputs(B=1, H=2, G=3, L=7, T=20, d=16, dv=16, seed=0, dtype=torch.float32):
    g = torch.Generator().manual_seed(seed)
    mk = lambda *s: torch.randn(*s, generator=g).to(dtype)  # noqa: E731
    return mk(B, H * G, L, d), mk(B, H, T, d), mk(B, H, T, dv), mk(B, H, L, d), mk(B, H, L, dv)


@pytest.mark.parametrize("sinks,start,end", [(2, 6, 12), (0, 0, 20), (4, 4, 20), (1, 1, 9), (3, 10, 10), (0, 0, 0)])
def test_one_pass_matches_the_two_pass_path(sinks, start, end):
    q, k, v, nk, nv = _inputs()
    out, scores = repeat_chunk_attention(q, k, v, nk, nv, 0.3, sinks, start, end)
    ref_out, ref_scores = _two_pass(q, k, v, nk, nv, 0.3, sinks, start, end)
    assert out.shape == ref_out.shape and out.dtype == torch.float32
    assert scores.shape == (1, 2, end - start) and scores.dtype == torch.float32
    torch.testing.assert_close(out, ref_out, rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(scores, ref_scores, rtol=1e-5, atol=1e-6)


def test_scores_are_the_restricted_softmax_in_float64():
    """Each repeated slot's largest probability under the softmax over sinks, the repeated range
    and the chunk's own earlier tokens, over the queries and the query heads of its KV head."""
    q, k, v, nk, nv = _inputs(B=2, H=2, G=2, L=5, T=14, d=8, dv=8, seed=3)
    sinks, start, end = 2, 5, 11
    _, scores = repeat_chunk_attention(q, k, v, nk, nv, 0.5, sinks, start, end)
    B, Hq, L, _ = q.shape
    for b in range(B):
        for h in range(2):
            keys = torch.cat([k[b, h, :sinks], k[b, h, start:end], nk[b, h]]).double()
            best = torch.zeros(end - start, dtype=torch.float64)
            for g in range(2):
                for i in range(L):
                    s = (keys @ q[b, h * 2 + g, i].double()) * 0.5
                    s[sinks + end - start + i + 1:] = float("-inf")
                    best = torch.maximum(best, torch.softmax(s, 0)[sinks:sinks + end - start])
            torch.testing.assert_close(scores[b, h].double(), best, rtol=1e-5, atol=1e-7)


def test_output_is_the_full_softmax_in_float64():
    q, k, v, nk, nv = _inputs(B=1, H=1, G=2, L=4, T=9, d=8, dv=8, seed=5)
    out, _ = repeat_chunk_attention(q, k, v, nk, nv, 0.7, 1, 3, 6)
    for hq in range(2):
        for i in range(4):
            keys = torch.cat([k[0, 0], nk[0, 0, :i + 1]]).double()
            vals = torch.cat([v[0, 0], nv[0, 0, :i + 1]]).double()
            p = torch.softmax((keys @ q[0, hq, i].double()) * 0.7, 0)
            torch.testing.assert_close(out[0, i, hq].double(), p @ vals, rtol=1e-5, atol=1e-6)


def test_large_logits_stay_finite():
    """The merge and the scores work in log space: logits far past float32's exp range."""
    q, k, v, nk, nv = _inputs(seed=7)
    out, scores = repeat_chunk_attention(q * 40, k * 40, v, nk * 40, nv, 1.0, 2, 6, 12)
    ref_out, ref_scores = _two_pass(q * 40, k * 40, v, nk * 40, nv, 1.0, 2, 6, 12)
    assert torch.isfinite(out).all() and torch.isfinite(scores).all()
    torch.testing.assert_close(out, ref_out, rtol=1e-4, atol=1e-4)
    # logits in the thousands: float32 rounds them by ~1e-4, which exp carries into the scores
    torch.testing.assert_close(scores, ref_scores, rtol=2e-3, atol=1e-6)


def test_bfloat16_follows_the_stored_dtype():
    q, k, v, nk, nv = _inputs(dtype=torch.bfloat16, seed=2)
    assert one_pass_available(q, v)
    out, scores = repeat_chunk_attention(q, k, v, nk, nv, 0.25, 2, 6, 12)
    assert out.dtype == torch.bfloat16 and scores.dtype == torch.float32
    ref_out, ref_scores = _two_pass(*(t.float() for t in (q, k, v, nk, nv)), 0.25, 2, 6, 12)
    torch.testing.assert_close(out.float(), ref_out, rtol=3e-2, atol=3e-2)
    torch.testing.assert_close(scores, ref_scores, rtol=5e-2, atol=1e-2)


def test_bad_slots_and_heads_raise():
    q, k, v, nk, nv = _inputs()
    for sinks, start, end in ((3, 2, 8), (0, 9, 8), (0, 0, 21), (-1, 0, 5)):
        with pytest.raises(ValueError, match="sinks <= start <= end <= T"):
            repeat_chunk_attention(q, k, v, nk, nv, 0.3, sinks, start, end)
    with pytest.raises(ValueError, match="multiple of the KV heads"):
        repeat_chunk_attention(q[:, :5], k, v, nk, nv, 0.3, 0, 0, 5)
    assert not one_pass_available(q.to(torch.float64), v)
    _, k8, v8, nk8, nv8 = _inputs(dv=8)
    assert not one_pass_available(q, v8)
    with pytest.raises(ValueError, match="head size"):
        repeat_chunk_attention(q, k8, v8, nk8, nv8, 0.3, 0, 0, 5)


# --------------------------------------------------------------------------- the tiny real model


def test_kvzip_keeps_the_same_tokens_in_one_pass(stories, monkeypatch):
    """The whole pass on the tiny Llama: scores equal to the two-pass path's, the same kept
    tokens and the same next-token logits afterwards."""
    import kv_cache.attention.function as fn
    from kv_cache import CompressedCache, KVzip, compress, prefill

    model, tok = stories
    text = ("Once upon a time there was a little girl named Lily. She loved to play outside in the park. "
            "One day she found a red ball under a big tree. ") * 6
    ids = tok(text, return_tensors="pt").input_ids[:, :150]
    results = []
    for one_pass in (True, False):
        if not one_pass:
            monkeypatch.setattr(fn, "one_pass_available", lambda query, values: False)
        scores = []
        cache = CompressedCache(model.config, eviction=KVzip(budget=0.4, chunk_size=48))
        for layer in cache.layers:  # the scores as each layer receives them
            orig = layer.observe_reconstruction
            layer.observe_reconstruction = (lambda o: lambda s: (scores.append(s.clone()), o(s)))(orig)
        with compress(model, cache):
            prefill(model, cache, ids, tokenizer=tok)
            nxt = model(input_ids=ids[:, -1:], past_key_values=cache, use_cache=True).logits
        kept = [layer.storage.length for layer in cache.layers]
        results.append((scores, kept, nxt))
    (s1, k1, n1), (s2, k2, n2) = results
    assert len(s1) == len(s2) > 0
    for a, b in zip(s1, s2):
        torch.testing.assert_close(a, b, rtol=1e-4, atol=1e-6)
    assert k1 == k2
    torch.testing.assert_close(n1, n2, rtol=1e-4, atol=1e-4)
