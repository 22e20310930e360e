"""Token-importance precision tiers (``QuantConfig.evicted_bits``, math dictionary §21).

The tokens a one-shot policy does not keep move to a second, lower-precision storage instead
of being dropped. Layers: model-free (the tier's layout, validation), reference comparison
(attention over both tiers equals sdpa over their dequantized tokens), a method matrix on the
tiny model (policies x scopes x layouts: bytes walked, every token represented, save/load).
"""

from __future__ import annotations

import pytest
import torch
from transformers import DynamicCache

from kv_cache import CompressedCache, KVzip, QuantConfig, SnapKV, H2O, compress, prefill
from kv_cache.eval.accounting import walked_nbytes
from kv_cache.spec.grammar import parse_method, parse_quant


# --------------------------------------------------------------------------- model-free
def test_evicted_config_is_the_layout_at_the_lower_width():
    q = QuantConfig(bits=3, key_bits=4, layer_bits={0: (4, 4)}, evicted_bits=2, pre_rope=False)
    low = q.evicted_config()
    assert (low.bits, low.key_bits, low.value_bits, low.layer_bits) == (2, None, None, ())
    # every token packed at once; per-channel keys keep their 32-token groups
    assert (low.sink_tokens, low.residual_length, low.group_size) == (0, 0, 32)
    per_token = QuantConfig(bits=3, key_grouping="token", evicted_bits=2).evicted_config()
    assert (per_token.sink_tokens, per_token.residual_length, per_token.group_size) == (0, 0, 1)
    default = QuantConfig(bits=3, evicted_bits=2).evicted_config()  # the default: keys before RoPE, per token
    assert (default.pre_rope, default.scale_keys, default.group_size, default.residual_length) == (True, "sqrt", 1, 0)
    for name in ("rotation", "key_grouping", "levels", "channel_group", "scale_dtype", "rotation_seed"):
        assert getattr(low, name) == getattr(q, name)
    assert low.evicted_bits is None
    kivi = QuantConfig.kivi(bits=4, evicted_bits=2).evicted_config()  # per-channel keys keep their token groups
    assert (kivi.bits, kivi.group_size, kivi.key_grouping, kivi.residual_length) == (2, 32, "channel", 0)
    assert "evicted_bits=2" in repr(q) and "evicted_bits" not in repr(QuantConfig(bits=3))


def test_evicted_bits_validation():
    with pytest.raises(ValueError, match=r"evicted_bits must be one of \[2, 3, 4, 8\]; got 5"):
        QuantConfig(bits=4, evicted_bits=5)
    with pytest.raises(ValueError, match="evicted_bits must be one of"):
        QuantConfig(bits=4, evicted_bits=True)
    with pytest.raises(ValueError, match=r"evicted_bits=8: the evicted tier keeps this layout.*lloyd_max"):
        QuantConfig(bits=4, evicted_bits=8)  # Lloyd-Max levels exist at 2-4 bits only
    with pytest.raises(ValueError, match="no evicted tier"):
        QuantConfig(bits=4).evicted_config()
    with pytest.raises(ValueError, match="evicted_layer_bits .* needs evicted_bits"):
        QuantConfig(bits=4, evicted_layer_bits={1: (3, 2)})
    with pytest.raises(ValueError, match=r"QuantConfig.evicted_layer_bits maps layer indices"):
        QuantConfig(bits=4, evicted_bits=2, evicted_layer_bits={1: (5, 2)})
    with pytest.raises(ValueError, match=r"names layers \[40\] but the model has 5 layers"):
        QuantConfig(bits=4, evicted_bits=2, evicted_layer_bits={40: (3, 2)}).check_layers(5)
    low = QuantConfig(bits=3, evicted_bits=2, evicted_layer_bits={1: (3, 2)}).evicted_config()
    assert low.bits_for(1) == (3, 2) and low.bits_for(0) == (2, 2)


def test_evicted_bits_needs_a_one_shot_policy(stories):
    model, _ = stories
    q = QuantConfig(bits=4, evicted_bits=2)
    with pytest.raises(ValueError, match="needs eviction=KVzip.*got no eviction policy"):
        CompressedCache(model.config, quant=q)  # nothing would ever be demoted: never a silent no-op
    with pytest.raises(ValueError, match="got H2O, which evicts while decoding"):
        CompressedCache(model.config, quant=q, eviction=H2O(budget=0.5))


def test_spec_letter():
    q = parse_quant("q4do2")
    assert q.evicted_bits == 2 and q.bits == 4 and q.levels == "lloyd_max"
    m = parse_method("q3do2+kvzip@0.25")
    assert "evicted_bits=2" in m.resolved and m.needs_tokenizer
    with pytest.raises(ValueError, match="evicted_bits must be one of"):
        parse_quant("q4do5")


# --------------------------------------------------------------------------- the tiny model
def _ids(tok, n=160):
    text = ("Once upon a time there was a little girl named Lily. She loved to play outside in the park. "
            "One day she found a red ball under a big tree. ") * 8
    return tok(text, return_tensors="pt").input_ids[:, :n]


def _question(tok):
    return tok(" Lily found a", return_tensors="pt", add_special_tokens=False).input_ids


def _session_logits(model, cache, n, question):
    with compress(model, cache), cache.session(), torch.no_grad():
        out = model(input_ids=question, past_key_values=cache, use_cache=True,
                    position_ids=torch.arange(n, n + question.shape[1])[None])
    return out.logits[0, -1]


LAYOUT = dict(bits=4, group_size=16, residual_length=16)  # KIVI: stories260K's 8-channel heads are too
# short for one norm per vector at 2 bits


@pytest.mark.parametrize("policy", ["snapkv", "kvzip-head"])
def test_attention_over_both_tiers_equals_sdpa_over_their_tokens(stories, policy):
    """Reference comparison: the native attention over the kept tier and the evicted tier is
    transformers' sdpa over the two tiers' dequantized tokens (order is irrelevant to a softmax)."""
    model, tok = stories
    ids = _ids(tok)
    pol = SnapKV(budget=0.3, recent_window=8) if policy == "snapkv" else KVzip(budget=0.3, scope="head")
    cache = CompressedCache(model.config, quant=QuantConfig.kivi(**LAYOUT, evicted_bits=2), eviction=pol)
    prefill(model, cache, ids, tokenizer=tok)
    ref = DynamicCache()
    for i, layer in enumerate(cache.layers):
        assert layer.demoted is not None and not layer.demoted.ragged
        k, v = layer.storage.read()
        dk, dv = layer.demoted.read()
        assert k.shape[2] + dk.shape[2] == ids.shape[1]  # every token is represented, once
        ref.update(torch.cat([k, dk], 2), torch.cat([v, dv], 2), i)
    q = _question(tok)
    with torch.no_grad():
        want = model(input_ids=q, past_key_values=ref, use_cache=True,
                     position_ids=torch.arange(ids.shape[1], ids.shape[1] + q.shape[1])[None]).logits[0, -1]
    torch.testing.assert_close(_session_logits(model, cache, ids.shape[1], q), want, rtol=1e-4, atol=1e-4)


def test_evicted_tokens_are_the_dropped_ones_requantized(stories):
    """The evicted tier holds exactly the tokens plain eviction drops, at the lower width."""
    model, tok = stories
    ids = _ids(tok)
    plain = CompressedCache(model.config, quant=QuantConfig.kivi(**LAYOUT), eviction=SnapKV(budget=0.3, recent_window=8))
    tiers = CompressedCache(model.config, quant=QuantConfig.kivi(**LAYOUT, evicted_bits=2),
                            eviction=SnapKV(budget=0.3, recent_window=8))
    full = CompressedCache(model.config, quant=QuantConfig.kivi(**LAYOUT))
    for c in (plain, tiers, full):
        prefill(model, c, ids)
    layer, lp, lf = tiers.layers[1], plain.layers[1], full.layers[1]
    k_kept, _ = layer.storage.read()
    torch.testing.assert_close(k_kept, lp.storage.read()[0])  # the kept tier is plain eviction's cache
    k_all, v_all = lf.storage.read()
    # the kept tier's keys are the context's stored keys at the kept positions, exactly
    d = torch.cdist(k_kept[0], k_all[0], compute_mode="donot_use_mm_for_euclid_dist")
    assert float(d.min(-1).values.max()) == 0.0
    kept = d.argmin(-1)  # [H, K]
    drop = torch.ones(k_all.shape[1], k_all.shape[2], dtype=torch.bool).scatter_(1, kept, False)
    idx = drop.nonzero()[:, 1].reshape(k_all.shape[1], -1)[None]
    from kv_cache.cache.packed import gather_tokens
    from kv_cache.cache.storage import make_storage

    want = make_storage(tiers.quant.evicted_config(), k_all[:, :, :0], v_all[:, :, :0], track_groups=False, layer=1)
    want.append(gather_tokens(k_all, idx), gather_tokens(v_all, idx))
    got_k, got_v = layer.demoted.read()
    want_k, want_v = want.read()
    torch.testing.assert_close(got_k, want_k)
    torch.testing.assert_close(got_v, want_v)
    assert layer.demoted.quant.bits == 2 and layer.demoted.packed.length == got_k.shape[2] == idx.shape[2]

def test_tiers_are_closer_to_the_uncompressed_selection_than_eviction(stories):
    """Against the same layout without eviction, demoting the tokens a tight budget would drop
    loses much less than dropping them, and demoting at the kept width loses almost nothing."""
    model, tok = stories
    ids = _ids(tok)
    q = _question(tok)

    def logits(bits, budget):
        pol = None if budget is None else SnapKV(budget=budget, recent_window=8)
        cache = CompressedCache(model.config, quant=QuantConfig.kivi(**LAYOUT, evicted_bits=bits), eviction=pol)
        prefill(model, cache, ids)
        assert cache.memory_report().total_bytes == walked_nbytes(cache)
        return _session_logits(model, cache, ids.shape[1], q), cache.memory_report().total_bytes

    def kl(a, b):
        return float(torch.nn.functional.kl_div(a.log_softmax(-1), b.log_softmax(-1), log_target=True, reduction="sum"))

    ref, _ = logits(None, None)
    evict, bytes_evict = logits(None, 0.1)
    tiers, bytes_tiers = logits(2, 0.1)
    same, _ = logits(4, 0.1)
    assert kl(tiers, ref) < kl(evict, ref) / 2
    assert kl(same, ref) < kl(tiers, ref) / 4
    assert bytes_tiers > bytes_evict  # the evicted tier is held, and counted


QUANTS = {"kivi": QuantConfig.kivi(**LAYOUT, evicted_bits=2),
          "defaults": QuantConfig(bits=3, evicted_bits=2),
          "per-layer": QuantConfig.kivi(**LAYOUT, evicted_bits=2, evicted_layer_bits={1: (3, 2), 3: (4, 4)})}
POLICIES = {
    "snapkv-head": lambda: SnapKV(budget=0.4, recent_window=8),
    "snapkv-layer": lambda: SnapKV(budget=0.4, recent_window=8, scope="layer"),
    "kvzip-model": lambda: KVzip(budget=0.3, chunk_size=64),
}


@pytest.mark.parametrize("quant", list(QUANTS))
@pytest.mark.parametrize("policy", list(POLICIES))
def test_tier_matrix(stories, quant, policy, tmp_path):
    """Every layout x policy x scope: all tokens represented, bytes walked, generate runs, and a
    saved cache answers exactly as before."""
    from kv_cache.cache.serialize import load_cache, save_cache

    model, tok = stories
    ids = _ids(tok)
    cache = CompressedCache(model.config, quant=QUANTS[quant], eviction=POLICIES[policy]())
    prefill(model, cache, ids, tokenizer=tok)
    report = cache.memory_report()
    assert report.tokens_kept == ids.shape[1]  # demoted, not dropped
    assert report.elements_kept == 2 * cache.head_dim * ids.shape[1] * cache.geometry.kv_heads * len(cache.layers)
    assert report.total_bytes == walked_nbytes(cache)
    names = cache.held_tensors()
    assert any(".demoted." in n for n in names)
    if policy != "snapkv-head":
        assert any(layer.demoted.ragged for layer in cache.layers)
    q = _question(tok)
    first = _session_logits(model, cache, ids.shape[1], q)
    path = tmp_path / "tiers.kvc"
    save_cache(cache, path)
    loaded, _ = load_cache(path, model_config=model.config)
    torch.testing.assert_close(_session_logits(model, loaded, ids.shape[1], q), first)
    assert loaded.quant == cache.quant
    with compress(model, cache), torch.no_grad():  # decoding appends to the kept tier only
        out = model.generate(torch.cat([ids, q], 1), past_key_values=cache, max_new_tokens=6, do_sample=False)
    assert out.shape[1] == ids.shape[1] + q.shape[1] + 6
    assert cache.get_seq_length() == ids.shape[1] + q.shape[1] + 5


def test_tiers_need_the_native_attention(stories):
    model, tok = stories
    ids = _ids(tok, 80)
    cache = CompressedCache(model.config, quant=QuantConfig.kivi(**LAYOUT, evicted_bits=2),
                            eviction=SnapKV(budget=0.4, recent_window=8))
    with compress(model, cache, attention="reference"), torch.no_grad():
        with pytest.raises(RuntimeError, match="evicted_bits .* only the native attention reads"):
            model(input_ids=ids, past_key_values=cache, use_cache=True)


def test_budget_above_the_prompt_demotes_nothing(stories):
    """A budget larger than the sequence keeps every token in the kept tier (nothing to demote)."""
    model, tok = stories
    ids = _ids(tok, 60)
    cache = CompressedCache(model.config, quant=QuantConfig.kivi(**LAYOUT, evicted_bits=2),
                            eviction=SnapKV(budget=100, recent_window=8))
    prefill(model, cache, ids)
    assert all(layer.demoted is None for layer in cache.layers)
    assert cache.memory_report().tokens_kept == ids.shape[1]


def test_left_padded_batch_demotes_each_rows_own_tokens(stories):
    """A left-padded batch: the unpadded row equals the row alone, and every row represents
    exactly its own valid tokens (padding is dropped, never demoted)."""
    model, tok = stories
    texts = ["Once upon a time there was a little girl named Lily. She loved to play outside in the park. " * 3,
             "Tom had a big red ball. He liked to kick it far away. " * 2]
    q = tok(" She", return_tensors="pt", add_special_tokens=False).input_ids
    quant = QuantConfig.kivi(**LAYOUT, evicted_bits=2)
    ids0 = tok(texts[0], return_tensors="pt").input_ids
    alone = CompressedCache(model.config, quant=quant, eviction=SnapKV(budget=40, recent_window=8))
    prefill(model, alone, ids0)
    want = _session_logits(model, alone, ids0.shape[1], q)
    batch = tok(texts, return_tensors="pt", padding=True)
    cache = CompressedCache(model.config, quant=quant, eviction=SnapKV(budget=40, recent_window=8))
    prefill(model, cache, batch.input_ids, attention_mask=batch.attention_mask)
    T = batch.input_ids.shape[1]
    valid = batch.attention_mask.sum(-1)
    assert int(valid[1]) < T  # row 1 was padded
    for layer in cache.layers:
        torch.testing.assert_close(layer.head_lengths(), valid[:, None].expand(2, layer.storage.heads))
    mask = torch.cat([batch.attention_mask, torch.ones(2, q.shape[1], dtype=torch.long)], 1)
    with compress(model, cache), cache.session(), torch.no_grad():
        out = model(input_ids=q.repeat(2, 1), attention_mask=mask, past_key_values=cache, use_cache=True)
    torch.testing.assert_close(out.logits[0, -1], want, rtol=2e-3, atol=2e-3)
    assert torch.isfinite(out.logits).all()
