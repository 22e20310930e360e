"""The eviction check (math dictionary §26.1): model-free, then against a float64 eager oracle on
tiny hybrid (Gemma 3) and soft-capped (Gemma 2) configs, then through the cache's options.

After KVzip's eviction, each evicting layer's figure is the share of the attention of the prompt's
last 8 queries (the fidelity check's queries) that falls on the slots it dropped; the cache warns
past ``eviction_threshold`` times the share of full-attention layers, and raises with ``strict``.
The golden tests (``test_golden_families.py``) check that it stays quiet on SmolLM2 and Qwen2.5.
"""

from __future__ import annotations

import warnings

import pytest
import torch
from transformers import DynamicCache

import kv_cache
from kv_cache import CompressedCache, FidelityError, FidelityWarning, KVzip, QuantConfig
from kv_cache.cache.serialize import load_cache, save_cache
from kv_cache.attention.fidelity import (EVICTION_THRESHOLD, FIDELITY_QUERIES, eviction_limit, eviction_message,
                                     eviction_past, evicted_share, query_attention)
from test_kvzip_hybrid import CONFIGS, _capture, _context, _kept_slots, _model, _Tok


# ---------------------------------------------------------------------------------------------- model-free
def test_query_attention_is_the_mean_softmax_of_the_checked_rows():
    g = torch.Generator().manual_seed(0)
    q, k = torch.randn(2, 3, 5, 8, generator=g) * 3, torch.randn(2, 3, 11, 8, generator=g) * 3
    got = query_attention(q, k, 0.4)
    want = torch.softmax(0.4 * q.double() @ k.double().transpose(-1, -2), -1).mean(2)
    assert got.shape == (2, 3, 11) and got.dtype == torch.float32
    torch.testing.assert_close(got.double(), want, atol=1e-6, rtol=1e-5)
    capped = query_attention(q, k, 0.4, softcap=2.0)
    s = 2.0 * torch.tanh(0.4 * q.double() @ k.double().transpose(-1, -2) / 2.0)
    torch.testing.assert_close(capped.double(), torch.softmax(s, -1).mean(2), atol=1e-6, rtol=1e-5)
    valid = torch.ones(2, 3, 11, dtype=torch.bool)
    valid[:, :, :4] = False  # left padding
    padded = query_attention(q, k, 0.4, key_valid=valid)
    assert float(padded[..., :4].abs().max()) == 0.0
    torch.testing.assert_close(padded.sum(-1), torch.ones(2, 3))


def test_evicted_share_is_the_dropped_mass_mean_over_heads_worst_row():
    att = torch.tensor([[[0.5, 0.25, 0.25], [0.1, 0.1, 0.8]],
                        [[0.0, 0.0, 1.0], [1.0, 0.0, 0.0]]])  # [B=2, Hkv=2, T=3]
    keep_all = torch.ones(2, 2, 3, dtype=torch.bool)
    assert evicted_share(att, keep_all) == 0.0
    assert evicted_share(att, ~keep_all) == 1.0
    keep = torch.tensor([True, False, True]).expand(2, 2, 3)
    # row 0: heads drop 0.25 and 0.1 -> 0.175; row 1: 0 and 0 -> 0; the worst row
    assert evicted_share(att, keep) == pytest.approx(0.175)


def test_check_functions_validate():
    att = torch.full((1, 2, 4), 0.25)
    with pytest.raises(ValueError, match="same .B, Hkv, T. shape and keep must be bool"):
        evicted_share(att, torch.ones(1, 2, 3, dtype=torch.bool))
    with pytest.raises(ValueError, match="keep must be bool"):
        evicted_share(att, torch.ones(1, 2, 4))
    with pytest.raises(ValueError, match=r"must be 4-D"):
        query_attention(torch.randn(2, 4, 8), torch.randn(1, 2, 4, 8), 1.0)
    with pytest.raises(ValueError, match=r"full_layers must be in \[1, layers\]; got 0 of 6"):
        eviction_limit(0.25, 0, 6)
    assert eviction_limit(0.25, 3, 18) == pytest.approx(0.25 / 6)
    assert eviction_limit(0.25, 24, 24) == 0.25
    text = eviction_message({3: 0.5, 1: 0.3}, 0.125, strict=True)
    assert "40% of the attention" in text and "layer 3: 0.50, layer 1: 0.30" in text and "evicted_bits=2" in text
    assert "strict=False" in text and "hybrid" not in text
    assert "fewer bits and no eviction" in eviction_message({3: 0.5}, 0.04, hybrid=True)
    assert eviction_past({1: 0.3, 3: 0.1}, 0.15) and not eviction_past({1: 0.3, 3: 0.1}, 0.2)
    assert eviction_past({1: float("nan"), 3: 0.0}, 0.2)  # a figure that is not a number counts as past
    assert not eviction_past({}, 0.2)


@pytest.mark.parametrize("bad", [0, 0.0, -0.1, 1.5, float("nan"), True, "0.2", None])
def test_eviction_threshold_is_validated(bad):
    model = _model("gemma3_text")
    with pytest.raises(ValueError, match=r"eviction_threshold must be a share of attention in \(0, 1\]; got"):
        CompressedCache(model.config, eviction=KVzip(budget=0.5), eviction_threshold=bad)


# ---------------------------------------------------------------------------------------------- reference
def _prefill(model, cache, ids, *, strict_ok: bool = True):
    with torch.no_grad(), kv_cache.compress(model, cache), warnings.catch_warnings(record=True) as seen:
        warnings.simplefilter("always", FidelityWarning)
        kv_cache.prefill(model, cache, torch.tensor([ids]), tokenizer=_Tok())
    return [w for w in seen if issubclass(w.category, FidelityWarning)]


@pytest.mark.parametrize("name", list(CONFIGS))
def test_figure_matches_a_float64_eager_oracle(name):
    """Each evicting layer's figure is the share of the last 8 queries' attention (float64 eager,
    soft-capped where the model caps) on the slots KVzip dropped, mean over KV heads."""
    model = _model(name)
    T = 70
    ids = _context(T)
    reference = DynamicCache(config=model.config)
    cache = CompressedCache(model.config, eviction=KVzip(budget=0.5, chunk_size=32))
    with torch.no_grad():
        model(input_ids=torch.tensor([ids]), past_key_values=reference, use_cache=True)
    _prefill(model, cache, ids)
    with torch.no_grad(), kv_cache.compress(model, cache):
        kept = _kept_slots(cache, reference, T)
    seen = _capture(model, torch.tensor([ids]))
    figures = cache.memory_report().evicted_attention
    assert sorted(figures) == sorted(kept) == [1, 3]  # the full-attention layers only
    for i, keep in kept.items():
        q, k, scaling, softcap, _ = seen[i]
        Hkv, G = k.shape[1], q.shape[1] // k.shape[1]
        s = scaling * q[0, :, T - FIDELITY_QUERIES:] @ k[0].repeat_interleave(G, 0).transpose(-1, -2)  # [Hq, 8, T]
        if softcap is not None:
            s = softcap * torch.tanh(s / softcap)
        p = torch.softmax(s, -1).view(Hkv, G * FIDELITY_QUERIES, T).mean(1)  # [Hkv, T]
        want = float((p * ~keep).sum(-1).mean())
        assert 0.05 < want < 0.95  # something was dropped, something kept: the figure can be wrong
        assert figures[i] == pytest.approx(want, abs=1e-4), (name, i)


# ---------------------------------------------------------------------------------------------- the cache
def test_hybrid_limit_warns_raises_and_tiers_are_exempt():
    """On the tiny hybrid config (2 of 4 layers global: limit 0.25 x 1/2) KVzip at half drops about
    half of the diffuse attention of random weights: the cache warns, names the layers, and with
    ``strict=True`` raises; kept at 2 bits instead of dropped (tiers), nothing is measured or said."""
    model = _model("gemma3_text")
    ids = _context(70)
    cache = CompressedCache(model.config, eviction=KVzip(budget=0.5))
    assert cache.eviction_limit == pytest.approx(EVICTION_THRESHOLD / 2)
    said = _prefill(model, cache, ids)
    report = cache.memory_report()
    assert report.eviction_threshold == pytest.approx(EVICTION_THRESHOLD / 2)
    assert report.mean_evicted_attention > report.eviction_threshold
    assert len(said) == 1 and "layer 1:" in str(said[0].message) and "layer 3:" in str(said[0].message)
    assert "on this hybrid model" in str(said[0].message) and "QuantConfig(bits=3)" in str(said[0].message)
    assert "eviction check" in str(report) and report.as_dict()["mean_evicted_attention"] == report.mean_evicted_attention
    assert "recent_attention" not in cache.layers[1].state  # transient: dropped once KVzip evicted

    strict = CompressedCache(model.config, eviction=KVzip(budget=0.5), strict=True)
    with pytest.raises(FidelityError, match=r"the eviction drops \d+% of the attention .* evicted_bits=2"):
        _prefill(model, strict, ids)

    lenient = CompressedCache(model.config, eviction=KVzip(budget=0.5), eviction_threshold=1.0)
    said = _prefill(model, lenient, ids)
    assert lenient.eviction_limit == 0.5  # the threshold, scaled by the 2 global layers of 4
    assert bool(said) == (lenient.memory_report().mean_evicted_attention > 0.5)

    tiers = CompressedCache(model.config, quant=QuantConfig(bits=4, group_size=8, residual_length=8, evicted_bits=2),
                            eviction=KVzip(budget=0.5))
    assert not [w for w in _prefill(model, tiers, ids) if "eviction drops" in str(w.message)]
    assert tiers.memory_report().evicted_attention == {}


def test_a_budget_that_keeps_everything_drops_nothing():
    model = _model("gemma3_text")
    cache = CompressedCache(model.config, eviction=KVzip(budget=200))  # more than the 40 tokens
    assert _prefill(model, cache, _context(40)) == []
    assert cache.memory_report().evicted_attention == {1: 0.0, 3: 0.0}


def test_the_figure_travels_in_context_files(tmp_path):
    model = _model("gemma3_text")
    cache = CompressedCache(model.config, eviction=KVzip(budget=0.5), eviction_threshold=1.0)
    _prefill(model, cache, _context(70))
    path = tmp_path / "ctx.kvc"
    save_cache(cache, path, model_config=model.config)
    loaded, _ = load_cache(path, model_config=model.config)
    assert loaded.memory_report().evicted_attention == pytest.approx(cache.memory_report().evicted_attention)


# ---------------------------------------------------------------------------------------------- stories260K
DOC = "Once upon a time there was a cat. She liked to play in the sun with her friend the dog. " * 6


def test_on_a_real_model_strict_refuses_what_drops_too_much(stories, tmp_path):
    """stories260K (a real Llama, every layer global: limit 0.25), 158 tokens: KVzip keeping half
    drops about 0.01 of the last queries' attention, keeping 5% about 0.57. ``strict=True``
    refuses the latter in the library, in ``CompressedContext.build`` and in ``kvcache serve
    --strict`` (400, nothing stored), and lets the former through."""
    import httpx
    from serve_support import AUTH, create, error, serving

    from kv_cache.context import CompressedContext

    model, tok = stories
    ids = tok(DOC, return_tensors="pt").input_ids
    fine = CompressedCache(model.config, eviction=KVzip(budget=0.5), strict=True)
    assert _prefill_ids(model, tok, fine, ids) == []
    assert fine.memory_report().mean_evicted_attention < 0.05
    for strict in (True, False):
        cache = CompressedCache(model.config, eviction=KVzip(budget=0.05), strict=strict)
        if strict:
            with pytest.raises(FidelityError, match=r"the eviction drops \d+% .* limit 0.25 .*strict=False"):
                _prefill_ids(model, tok, cache, ids)
        else:
            assert len(_prefill_ids(model, tok, cache, ids)) == 1
            assert cache.memory_report().mean_evicted_attention > 0.4
    with pytest.raises(FidelityError, match="the eviction drops"):
        CompressedContext.build(model, tok, DOC, eviction=KVzip(budget=0.05), strict=True)
    with serving(model, tok, tmp_path / "s", strict=True) as server, \
            httpx.Client(base_url=server.base_url, headers=AUTH, timeout=120) as http:
        err = error(http.post("/v1/contexts", json={"document": DOC, "method": "kvzip@0.05"}), 400, "invalid_method")
        assert "the eviction drops" in err["message"] and "evicted_bits=2" in err["message"]
        assert http.get("/v1/contexts").json()["data"] == []
        assert create(http, document=DOC, method="kvzip@0.5")["id"]


def _prefill_ids(model, tok, cache, ids):
    with torch.no_grad(), kv_cache.compress(model, cache), warnings.catch_warnings(record=True) as seen:
        warnings.simplefilter("always", FidelityWarning)
        kv_cache.prefill(model, cache, ids, tokenizer=tok)
    return [w for w in seen if issubclass(w.category, FidelityWarning)]
