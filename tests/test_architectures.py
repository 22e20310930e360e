"""Support by capability: a tiny random config of every decoder family in the test grid.

Hybrid sliding-window layers (``config.layer_types``), logit soft-capping (Gemma 2), learned
sinks (gpt-oss), ``query_pre_attn_scalar`` (Gemma), QK-norm (Qwen3, Gemma 3, OLMo 2), MQA and
head_dim 64-256. For each family (math dictionary §22):

* compression off gives the logits of transformers' own ``DynamicCache`` (eager attention),
  prefill longer than the window, batch 2 left-padded, and decoding steps;
* q8 stays close to it;
* every policy and q2 / q4 run through ``generate``, batch 2 left-padded included (Gemma 2's
  soft-capped layers too: the positional path hands H2O / SnapKV their statistics);
* sliding layers never hold more than ``W - 1`` tokens between calls.
"""

from __future__ import annotations

import pytest
import torch
from transformers import AutoConfig, AutoModelForCausalLM, DynamicCache

import kv_cache
from kv_cache import H2O, CompressedCache, CompressedContext, KVzip, QuantConfig, SnapKV, StreamingLLM
from kv_cache.cache.architecture import layer_windows

WINDOW = 40
HYBRID = ["sliding_attention", "full_attention", "sliding_attention", "full_attention"]
BASE = dict(vocab_size=512, hidden_size=64, intermediate_size=96, num_hidden_layers=4, num_attention_heads=4,
            num_key_value_heads=2, max_position_embeddings=512, pad_token_id=0, bos_token_id=1, eos_token_id=2)

FAMILIES = {
    "llama": dict(head_dim=32),
    "mistral": dict(head_dim=32, sliding_window=WINDOW),  # every layer slides
    "qwen2": dict(use_sliding_window=True, sliding_window=WINDOW, max_window_layers=2, layer_types=HYBRID),
    "qwen3": dict(head_dim=32),
    "gemma": dict(head_dim=32),
    "gemma2": dict(head_dim=32, sliding_window=WINDOW, layer_types=HYBRID, attn_logit_softcapping=20.0,
                   query_pre_attn_scalar=24),
    "gemma3_text": dict(head_dim=32, sliding_window=WINDOW, layer_types=HYBRID, query_pre_attn_scalar=24),
    "phi3": dict(),
    "olmo2": dict(),
    "gpt_oss": dict(head_dim=32, sliding_window=WINDOW, layer_types=HYBRID, num_local_experts=4,
                    num_experts_per_tok=2),
    "cohere2": dict(head_dim=32, sliding_window=WINDOW, layer_types=HYBRID),
    "granite": dict(),
    "smollm3": dict(),
    "ministral": dict(head_dim=32, sliding_window=WINDOW, layer_types=HYBRID),
    "exaone4": dict(head_dim=32, sliding_window=WINDOW, layer_types=HYBRID),
    "olmo3": dict(sliding_window=WINDOW, layer_types=HYBRID),
    "mqa_hd64": dict(num_key_value_heads=1, head_dim=64),  # llama, MQA
    "hd128": dict(num_attention_heads=2, num_key_value_heads=1, head_dim=128),
    "hd256_gemma3": dict(num_attention_heads=2, num_key_value_heads=1, head_dim=256, sliding_window=WINDOW,
                         layer_types=HYBRID),
}
MODEL_TYPE = {"mqa_hd64": "llama", "hd128": "qwen3", "hd256_gemma3": "gemma3_text"}


def _make(name: str, attn: str = "eager"):
    kw = {**BASE, **FAMILIES[name]}
    cfg = AutoConfig.for_model(MODEL_TYPE.get(name, name), **kw)
    torch.manual_seed(0)
    model = AutoModelForCausalLM.from_config(cfg, attn_implementation=attn).eval()
    with torch.no_grad():  # random init is small: widen the logits so attention is not uniform
        for p in model.parameters():
            if p.dim() == 2:
                p.mul_(2.5)
        for name_, buf in model.named_parameters():
            if name_.endswith("sinks"):
                buf.copy_(torch.randn_like(buf))
    return model


@pytest.fixture(scope="module", params=list(FAMILIES))
def family(request):
    return request.param, _make(request.param)


def _batch(n: int = 100, padded: bool = False):
    g = torch.Generator().manual_seed(1)
    ids = torch.randint(3, 512, (2 if padded else 1, n), generator=g)
    mask = torch.ones_like(ids)
    if padded:
        ids[1, :17] = 0
        mask[1, :17] = 0
    return ids, mask


def _step(model, cache, ids, mask):
    return model(input_ids=ids, attention_mask=mask, past_key_values=cache, use_cache=True).logits


def _run(model, cache, padded: bool, steps: int = 3):
    """Prefill 100 tokens (> the window), then ``steps`` decoded tokens; the logits of each call."""
    ids, mask = _batch(padded=padded)
    outs = [_step(model, cache, ids, mask)]
    g = torch.Generator().manual_seed(2)
    for _ in range(steps):
        nxt = torch.randint(3, 512, (ids.shape[0], 1), generator=g)
        mask = torch.cat([mask, torch.ones_like(nxt)], 1)
        outs.append(_step(model, cache, nxt, mask))
    return outs


def _check_windows(cache):
    for layer in cache.layers:
        if layer.window is not None and layer.storage is not None:
            assert layer.storage.length <= layer.window - 1, (layer.layer_idx, layer.storage.length)


@pytest.mark.parametrize("padded", [False, True])
def test_off_equals_dynamic_cache(family, padded):
    name, model = family
    with torch.no_grad():
        want = _run(model, DynamicCache(config=model.config), padded)
        cache = CompressedCache(model.config)
        with kv_cache.compress(model, cache):
            got = _run(model, cache, padded)
    _check_windows(cache)
    for w, g in zip(want, got):
        rows = slice(None) if not padded else slice(None)
        torch.testing.assert_close(g[rows, -1:], w[rows, -1:], atol=2e-4, rtol=2e-4)
    # the prefill's own positions (past the window) too: the valid ones
    ids, mask = _batch(padded=padded)
    torch.testing.assert_close(got[0][mask.bool()], want[0][mask.bool()], atol=2e-4, rtol=2e-4)


def test_q8_close_to_dynamic_cache(family):
    name, model = family
    with torch.no_grad():
        want = _run(model, DynamicCache(config=model.config), False)
        cache = CompressedCache(model.config, quant=QuantConfig(bits=8))
        with kv_cache.compress(model, cache):
            got = _run(model, cache, False)
    _check_windows(cache)
    for w, g in zip(want[1:], got[1:]):
        pw, pg = w[:, -1].log_softmax(-1), g[:, -1].log_softmax(-1)
        kl = float((pw.exp() * (pw - pg)).sum(-1).max())
        assert kl < 5e-3, (name, kl)


def _all_sliding(model) -> bool:
    return all(w is not None for w in layer_windows(model.config))


POLICIES = {
    "q4": dict(quant=QuantConfig(bits=4)),
    "q2": dict(quant=QuantConfig(bits=2)),
    "kivi4": dict(quant=QuantConfig.kivi(bits=4)),
    "h2o": dict(eviction=H2O(budget=0.5)),
    "snapkv": dict(eviction=SnapKV(budget=0.5)),
    "snapkv_layer": dict(eviction=SnapKV(budget=0.5, scope="layer")),
    "streaming": dict(eviction=StreamingLLM(budget=32, recent_window=16)),
    "q4+h2o": dict(quant=QuantConfig(bits=4), eviction=H2O(budget=0.6)),
}


@pytest.mark.parametrize("method", list(POLICIES))
@pytest.mark.parametrize("padded", [False, True])
def test_generate(family, method, padded):
    name, model = family
    kw = POLICIES[method]
    if method == "streaming" and padded:
        pytest.skip("StreamingLLM refuses batches of several rows (test_cache.py)")
    if kw.get("eviction") is not None and _all_sliding(model):
        with pytest.raises(ValueError, match="acts on full-attention layers"):
            CompressedCache(model.config, **kw)
        return
    ids, mask = _batch(padded=padded)
    cache = CompressedCache(model.config, **kw)
    with torch.no_grad(), kv_cache.compress(model, cache):
        out = model.generate(input_ids=ids, attention_mask=mask, past_key_values=cache, max_new_tokens=6,
                             do_sample=False, pad_token_id=0)
    assert out.shape == (ids.shape[0], ids.shape[1] + 6)
    _check_windows(cache)
    if kw.get("eviction") is not None:  # the policy acted on every full-attention layer
        full = [layer for layer in cache.layers if layer.window is None]
        assert all(int(layer.head_lengths().max()) < ids.shape[1] for layer in full), name
    rep = cache.memory_report()
    assert rep.total_bytes > 0


def test_kvzip_and_tiers_on_hybrid_layers(stories, tmp_path):
    """KVzip scores the full-attention layers; the sliding ones attend the repeat pass and keep their window."""
    _, tok = stories
    model = _make("gemma3_text")
    # long enough that 25% is above the slots every head keeps anyway (sinks, the per-channel residual)
    text = "Once upon a time there was a little girl named Lily who loved to play in the park. " * 8
    for kw in (dict(eviction=KVzip(budget=0.25)), dict(quant=QuantConfig(bits=4), eviction=KVzip(budget=0.25)),
               dict(quant=QuantConfig(bits=4, evicted_bits=2), eviction=KVzip(budget=0.25))):
        ctx = CompressedContext.build(model, tok, text, **kw)
        _check_windows(ctx.cache)
        full = [layer for layer in ctx.cache.layers if layer.window is None]
        seen = ctx.cache.get_seq_length()
        assert all(int(layer.head_lengths().max()) <= seen for layer in full)
        if kw.get("quant") is None or kw["quant"].evicted_bits is None:
            assert all(float(layer.head_lengths().float().mean()) < 0.5 * seen for layer in full)
        answer = ctx.ask("Who loved to play?", max_new_tokens=4)
        _check_windows(ctx.cache)
        ctx.save(tmp_path / "ctx.kvc")
        again = CompressedContext.load(tmp_path / "ctx.kvc", model, tok)
        assert again.ask("Who loved to play?", max_new_tokens=4) == answer
        assert again.cache.memory_report().total_bytes == ctx.cache.memory_report().total_bytes


@pytest.mark.parametrize("name", ["gemma3_text", "gpt_oss", "cohere2", "gemma2"])
def test_hybrid_generate_with_q4d_kvzip_and_tiers(stories, name):
    """A hybrid model through ``generate`` after a KVzip prefill: q4d, kvzip@0.25, tiers; the
    sliding layers stay within their window at every step."""
    _, tok = stories
    model = _make(name)
    ids = tok("Once upon a time there was a little girl named Lily who loved to play in the park. " * 3,
              return_tensors="pt").input_ids
    for kw in (dict(quant=QuantConfig(bits=4)), dict(eviction=KVzip(budget=0.25)),
               dict(quant=QuantConfig(bits=4, evicted_bits=2), eviction=KVzip(budget=0.25))):
        cache = CompressedCache(model.config, **kw)
        with torch.no_grad(), kv_cache.compress(model, cache):
            kv_cache.prefill(model, cache, ids[:, :-1], tokenizer=tok)  # generate feeds the last token
            _check_windows(cache)
            out = model.generate(ids, past_key_values=cache, max_new_tokens=8, do_sample=False, pad_token_id=0)
        assert out.shape[1] == ids.shape[1] + 8
        _check_windows(cache)
        rep = cache.memory_report()
        assert rep.window_saved_fp16_bytes > 0 and set(rep.bytes_by_layer_kind) == {"full_attention",
                                                                                     "sliding_attention"}


def test_layer_windows_reads_the_config():
    assert layer_windows(_make("llama").config) == [None] * 4
    assert layer_windows(_make("mistral").config) == [WINDOW] * 4
    assert layer_windows(_make("gemma3_text").config) == [WINDOW, None, WINDOW, None]
    cfg = _make("llama").config
    cfg.layer_types = ["chunked_attention"] * 4
    with pytest.raises(ValueError, match="layer 0 .* is 'chunked_attention'.*DynamicCache"):
        CompressedCache(cfg)
    cfg.layer_types = ["full_attention"] * 3
    with pytest.raises(ValueError, match="lists 3 layers but the model has 4"):
        CompressedCache(cfg)


def test_window_shorter_than_the_residual_is_refused():
    model = _make("gemma3_text")
    with pytest.raises(ValueError, match="sliding window of 40 tokens is shorter than"):
        CompressedCache(model.config, quant=QuantConfig.kivi(bits=4, residual_length=64))


def test_memory_report_shows_layer_kinds():
    model = _make("gemma3_text")
    cache = CompressedCache(model.config, quant=QuantConfig(bits=4))
    ids, mask = _batch()
    with torch.no_grad(), kv_cache.compress(model, cache):
        _step(model, cache, ids, mask)
    rep = cache.memory_report()
    assert set(rep.bytes_by_layer_kind) == {"full_attention", "sliding_attention"}
    assert sum(rep.bytes_by_layer_kind.values()) == rep.total_bytes
    assert rep.window_saved_fp16_bytes > 0
    assert "sliding" in str(rep)


@pytest.mark.parametrize("name", ["gemma3_text", "gpt_oss"])
def test_kvzap_on_hybrid_layers(stories, name, tmp_path):
    """KVzap on a hybrid model: a scorer fitted on this model scores the full-attention layers only
    (one per such layer), evicts them in the prefill and while decoding, and the sliding layers keep
    their window; a context saves and loads."""
    from kv_cache import KVzap
    from kv_cache.compression.scorer_file import save_scorer
    from kv_cache.plan.scorer_training import fit_scorer

    _, tok = stories
    model = _make(name)
    text = "Once upon a time there was a little girl named Lily who loved to play in the park. " * 30
    scorer = fit_scorer(model, tok, text, tokens=600, window=120, max_tokens_per_window=100)
    full_layers = [i for i, w in enumerate(layer_windows(model.config)) if w is None]
    assert sorted(scorer.layers) == full_layers
    path = str(save_scorer(tmp_path / "s.safetensors", scorer))
    ids = tok(text[:400], return_tensors="pt").input_ids
    for kw in (dict(eviction=KVzap(budget=0.25, scorer=path)),
               dict(quant=QuantConfig(bits=4), eviction=KVzap(budget=0.25, scope="head", evict_every=4, scorer=path)),
               dict(quant=QuantConfig(bits=4, evicted_bits=2), eviction=KVzap(budget=0.25, decoding=False, scorer=path))):
        cache = CompressedCache(model.config, **kw)
        with torch.no_grad(), kv_cache.compress(model, cache):
            out = model.generate(ids, past_key_values=cache, max_new_tokens=30, min_new_tokens=30, do_sample=False,
                                 pad_token_id=0)
        assert out.shape[1] == ids.shape[1] + 30
        _check_windows(cache)
        full = [cache.layers[i] for i in full_layers]
        if kw["eviction"].decoding:
            assert all(float(layer.head_lengths().float().mean()) < 0.6 * ids.shape[1] for layer in full)
    ctx = CompressedContext.build(model, tok, text[:400], eviction=KVzap(budget=0.3, scorer=path), chat=False)
    answer = ctx.ask(" Lily", max_new_tokens=4)
    ctx.save(tmp_path / "c.kvc")
    assert CompressedContext.load(tmp_path / "c.kvc", model, tok).ask(" Lily", max_new_tokens=4) == answer
