"""KVzap: the learned scorer (model-free), its file, the policy on stories260K, and the shipped
SmolLM2 scorer (slow)."""

from __future__ import annotations

import json
import math
from pathlib import Path

import pytest
import torch
from transformers import DynamicCache, LlamaConfig, LlamaForCausalLM

import kv_cache
from kv_cache import CompressedCache, CompressedContext, KVzap, QuantConfig
from kv_cache.compression.scorer import (LayerScorer, check_layer_scorer, fit_linear, fit_mlp, fit_static,
                                         log_targets, r_squared, score_hidden, standardise)
from kv_cache.compression.scorer_file import (Scorer, ScorerFileError, load_scorer, model_identity, read_header,
                                              save_scorer)
from kv_cache.spec.grammar import parse_method
from kv_cache.plan.scorer_training import fit_scorer

STORY = "Once upon a time there was a little girl named Lily. She liked to play with her toys in the park. " * 6


# ----------------------------------------------------------------------------------- model-free
def _linear_data(n=400, d=16, h=3, noise=0.0, seed=0):
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(n, d, generator=g) * torch.linspace(0.5, 3, d) + 2.0
    w = torch.randn(d, h, generator=g)
    y = x @ w + 0.5 + noise * torch.randn(n, h, generator=g)
    return x, y


def test_fit_linear_recovers_an_exact_linear_map():
    x, y = _linear_data()
    s = fit_linear(x, y, ridge=0.0)
    pred = score_hidden(s, x[None])[0].T
    assert pred.shape == y.shape
    assert r_squared(pred, y) > 0.999999
    torch.testing.assert_close(pred, y, atol=1e-3, rtol=1e-4)


def test_fit_static_scores_every_token_of_a_head_alike():
    """The per-head static score: W = 0 and b the per-head mean, so every token of a head gets the
    head's mean log score (R^2 0 within heads) and the file is a linear one."""
    x, y = _linear_data()
    y = y + torch.tensor([[-3.0, 1.0, 0.5]])[:, : y.shape[1]]
    s = fit_static(x, y)
    pred = score_hidden(s, x[None])[0].T
    torch.testing.assert_close(pred, y.mean(0, keepdim=True).expand_as(y))
    assert s.kind == "linear" and not bool(s.w1.any())
    assert abs(r_squared(pred, y)) < 1e-6  # nothing within a head is explained
    with pytest.raises(ValueError, match="NaN or Inf"):
        fit_static(x, torch.full_like(y, float("nan")))
    with pytest.raises(ValueError, match="at least 2 samples"):
        fit_static(x[:1], y[:1])


def test_fit_mlp_learns_a_nonlinear_target_better_than_linear():
    g = torch.Generator().manual_seed(1)
    x = torch.randn(2000, 8, generator=g)
    y = torch.stack([x[:, 0].abs(), (x[:, 1] * x[:, 2]).tanh()], 1)
    lin, mlp = fit_linear(x, y), fit_mlp(x, y, width=32, steps=600, seed=0)
    r_lin = r_squared(score_hidden(lin, x[None])[0].T, y)
    r_mlp = r_squared(score_hidden(mlp, x[None])[0].T, y)
    assert mlp.kind == "mlp" and lin.kind == "linear"
    assert r_mlp > r_lin + 0.3


def test_scorer_shapes_and_dtype():
    x, y = _linear_data(d=12, h=2)
    s = fit_linear(x, y)
    out = score_hidden(s, torch.randn(3, 7, 12, dtype=torch.bfloat16))
    assert out.shape == (3, 2, 7) and out.dtype == torch.float32


def test_constant_channels_and_targets():
    x, y = _linear_data(d=6)
    x[:, 2] = 4.0  # a constant channel: sigma 1, no division by zero
    mu, sigma = standardise(x)
    assert sigma[2] == 1.0 and torch.isfinite(mu).all()
    s = fit_linear(x, y)
    assert torch.isfinite(score_hidden(s, x[None])).all()
    assert r_squared(torch.zeros(5, 1), torch.ones(5, 1)) == 0.0  # constant target
    assert log_targets(torch.tensor([0.0, 1.0]))[0] == pytest.approx(math.log(1e-7))


@pytest.mark.parametrize("bad, match", [
    (lambda x, y: (x[None], y), "x must be"),
    (lambda x, y: (x, y[:-1]), "same N"),
    (lambda x, y: (x[:1], y[:1]), "at least 2"),
    (lambda x, y: (x.index_fill(0, torch.tensor([3]), float("nan")), y), "NaN or Inf"),
    (lambda x, y: (x, y.index_fill(0, torch.tensor([0]), float("inf"))), "NaN or Inf"),
])
def test_fit_rejects_bad_input(bad, match):
    x, y = _linear_data()
    with pytest.raises(ValueError, match=match):
        fit_linear(*bad(x, y))


def test_score_rejects_bad_input():
    s = fit_linear(*_linear_data(d=5))
    with pytest.raises(ValueError, match="batch, tokens"):
        score_hidden(s, torch.randn(4, 5))
    with pytest.raises(ValueError, match="hidden_size 6"):
        score_hidden(s, torch.randn(1, 4, 6))
    with pytest.raises(ValueError, match="ridge"):
        fit_linear(*_linear_data(), ridge=float("nan"))
    with pytest.raises(ValueError, match="width"):
        fit_mlp(*_linear_data(), width=0)
    bad = LayerScorer(s.mu, -s.sigma, s.w1, s.b1)
    with pytest.raises(ValueError, match="sigma"):
        check_layer_scorer(bad)
    with pytest.raises(ValueError, match="shape"):
        check_layer_scorer(LayerScorer(s.mu[:2], s.sigma, s.w1, s.b1))


# ----------------------------------------------------------------------------------- the file
def _identity(**kw):
    base = {"model_type": "llama", "architecture": "LlamaForCausalLM", "num_layers": 2, "kv_heads": 3, "q_heads": 6,
            "head_dim": 4, "hidden_size": 16, "weights_sha256": "0" * 64}
    base.update(kw)
    return base


def _scorer():
    x, y = _linear_data(d=16, h=3)
    return Scorer({0: fit_linear(x, y), 1: fit_mlp(x, y, steps=5)}, _identity(), {"note": "test"})


def test_scorer_file_round_trip(tmp_path):
    path = save_scorer(tmp_path / "s.safetensors", _scorer())
    back = load_scorer(path)
    assert sorted(back.layers) == [0, 1] and back.layers[1].kind == "mlp" and back.info == {"note": "test"}
    h = torch.randn(1, 5, 16)
    torch.testing.assert_close(back.score(0, h), _scorer().score(0, h))
    assert read_header(path)["format_version"] == 1
    back.check_identity(_identity())
    with pytest.raises(ScorerFileError, match="kv_heads expected 3"):
        back.check_identity(_identity(kv_heads=4))
    with pytest.raises(ScorerFileError, match="weights_sha256"):
        back.check_identity(_identity(weights_sha256="1" * 64))
    with pytest.raises(ValueError, match="no model for layer 5"):
        back.score(5, h)


def _rewrite_header(path: Path, fn):
    """Rewrite the JSON header of a safetensors file in place (its tensors untouched)."""
    raw = path.read_bytes()
    n = int.from_bytes(raw[:8], "little")
    head = json.loads(raw[8:8 + n])
    fn(head)
    text = json.dumps(head).encode()
    text += b" " * ((8 - len(text) % 8) % 8)
    path.write_bytes(len(text).to_bytes(8, "little") + text + raw[8 + n:])


def test_scorer_file_refuses_tampering_and_garbage(tmp_path):
    path = save_scorer(tmp_path / "s.safetensors", _scorer())

    def edit_meta(head):
        meta = json.loads(head["__metadata__"]["kv_cache.scorer"])
        meta["model"]["num_layers"] = 3
        head["__metadata__"]["kv_cache.scorer"] = json.dumps(meta, sort_keys=True)

    _rewrite_header(path, edit_meta)
    with pytest.raises(ScorerFileError, match="corrupted: header sha256"):
        load_scorer(path)
    path = save_scorer(tmp_path / "t.safetensors", _scorer())
    raw = bytearray(path.read_bytes())
    raw[-3] ^= 0xFF  # one byte of the last tensor
    path.write_bytes(bytes(raw))
    with pytest.raises(ScorerFileError, match="tensor .* sha256"):
        load_scorer(path)
    junk = tmp_path / "junk.safetensors"
    junk.write_bytes(b"not a safetensors file")
    with pytest.raises(ScorerFileError, match="not a readable"):
        load_scorer(junk)
    with pytest.raises(FileNotFoundError):
        load_scorer(tmp_path / "missing.safetensors")


def test_policy_validation():
    for kw, match in [({"evict_every": 0}, "evict_every"), ({"threshold": float("nan")}, "threshold"),
                      ({"decoding": 1}, "decoding"), ({"scorer": 3}, "scorer"), ({"scope": "row"}, "scope"),
                      ({"budget": 1.5}, "budget")]:
        with pytest.raises(ValueError, match=match):
            KVzap(**kw)
    assert KVzap().prefill_only is False and KVzap(decoding=False).prefill_only is True
    # target_ratio (§19.6) sizes the one eviction after the prefill: model scope, decoding=False
    for kw, match in [({"target_ratio": 1.0}, "finite ratio > 1"), ({"target_ratio": float("inf")}, "finite ratio"),
                      ({"target_ratio": 8, "scope": "head"}, "needs scope='model'"),
                      ({"target_ratio": 8, "decoding": True}, "decoding=False")]:
        with pytest.raises(ValueError, match=match):
            KVzap(**{"decoding": False, **kw})
    assert "target_ratio" not in repr(KVzap()) and "target_ratio=8" in repr(KVzap(decoding=False, target_ratio=8))


def test_specs():
    m = parse_method("kvzap@0.25")
    assert "KVzap(budget=0.25" in m.resolved and m.budget == 0.25
    t = parse_method("kvzap@t-6")
    assert "threshold=-6.0" in t.resolved and t.budget is None
    p = parse_method("kvzap@0.3[Some/Scorer.safetensors]")
    assert "scorer='Some/Scorer.safetensors'" in p.resolved
    tiers = parse_method("q4o2+kvzap@0.25")
    assert "decoding=False" in tiers.resolved and "evicted_bits=2" in tiers.resolved
    assert "evict_every=4" in parse_method("kvzap@0.25e4").resolved
    assert "scope='model'" in m.resolved  # KVzap's default; a per-head budget prints as every per-head policy
    assert "scope=" not in parse_method("kvzap@0.25:head").resolved
    for bad, match in [("h2o@t-3", "kvzap only"), ("h2o@0.5[x.safetensors]", "kvzap only")]:
        with pytest.raises(ValueError, match=match):
            parse_method(bad)


# ----------------------------------------------------------------------------------- stories260K
@pytest.fixture(scope="module")
def scorer_path(stories, tmp_path_factory):
    model, tok = stories
    text = Path(__file__).read_text()  # any text the tiny model tokenizes; not an evaluation text
    sc = fit_scorer(model, tok, text, tokens=1200, window=200, max_tokens_per_window=150)
    return str(save_scorer(tmp_path_factory.mktemp("kvzap") / "stories.safetensors", sc))


def test_fitted_file_records_the_model_and_the_fit(stories, scorer_path):
    model, _ = stories
    header = read_header(scorer_path)
    assert header["model"] == model_identity(model)
    info = header["info"]
    assert info["windows"] >= 2 and set(info["held_out_r2"]) == {str(i) for i in range(model.config.num_hidden_layers)}
    assert -1.0 < info["mean_held_out_r2"] <= 1.0 and 0.0 <= info["mean_held_out_top25_overlap"] <= 1.0



def test_kinds_fitted_on_one_collection(stories, scorer_path, tmp_path):
    """collect_windows runs KVzip's passes once; fit_collected fits any kind on them: the linear
    fit is fit_scorer's to the bit, an mlp records its width and steps and loads back as a
    scorer KVzap evicts with."""
    from kv_cache.plan.scorer_training import collect_windows, fit_collected

    model, tok = stories
    text = Path(__file__).read_text()
    pairs = collect_windows(model, tok, text, tokens=1200, window=200, max_tokens_per_window=150)
    assert pairs["windows"] >= 2 and set(pairs["train_x"]) == set(pairs["held_x"])
    lin = fit_collected(model, text, pairs, kind="linear")
    ref = load_scorer(scorer_path)
    for i, layer in lin.layers.items():
        assert torch.equal(layer.w1, ref.layers[i].w1) and torch.equal(layer.b1, ref.layers[i].b1)
    static = fit_collected(model, text, pairs, kind="static")
    assert static.info["fitted_as"] == "static" and lin.info["fitted_as"] == "linear"
    assert all(not bool(layer.w1.any()) for layer in static.layers.values())
    mlp = fit_collected(model, text, pairs, kind="mlp", mlp_width=8, mlp_steps=20)
    assert mlp.info["mlp_width"] == 8 and mlp.info["mlp_steps"] == 20
    assert all(layer.w1.shape[1] == 8 and layer.w2 is not None for layer in mlp.layers.values())
    path = save_scorer(tmp_path / "mlp.safetensors", mlp)
    cache = CompressedCache(model.config, eviction=KVzap(scorer=str(path), budget=0.5, scope="head"))
    ids = tok(STORY, return_tensors="pt").input_ids
    _generate(model, cache, ids, n=2)
    lengths = torch.stack([layer.head_lengths() for layer in cache.layers])  # [layers, batch, heads]
    assert int(lengths.max()) < ids.shape[1]  # the mlp's scores evicted
    with pytest.raises(ValueError, match="kind must be one of"):
        fit_collected(model, text, pairs, kind="tree")
    with pytest.raises(ValueError, match="width must be an int >= 1"):
        fit_collected(model, text, pairs, kind="mlp", mlp_width=0)
    # the ridge penalty: recorded, and a very large one shrinks W towards the static score
    assert lin.info["ridge"] == 1e-3
    stiff = fit_collected(model, text, pairs, kind="linear", ridge=1e6)
    assert stiff.info["ridge"] == 1e6
    for i, layer in stiff.layers.items():
        assert float(layer.w1.abs().max()) < 1e-3 * float(lin.layers[i].w1.abs().max())
        assert torch.allclose(layer.b1, static.layers[i].b1)
    for bad in (-1.0, float("nan"), float("inf"), True):
        with pytest.raises(ValueError, match="ridge must be a finite number >= 0"):
            fit_collected(model, text, pairs, kind="linear", ridge=bad)


def test_fit_scorer_refuses_a_bad_ridge_before_the_kvzip_passes(stories, monkeypatch):
    """A bad ridge is refused before any KVzip pass runs (they take minutes on a real model)."""
    from kv_cache.plan import scorer_training

    model, tok = stories
    monkeypatch.setattr(scorer_training, "collect_windows", lambda *a, **k: pytest.fail("the passes ran"))
    with pytest.raises(ValueError, match="ridge must be a finite number >= 0; got -1"):
        scorer_training.fit_scorer(model, tok, "unused", ridge=-1)


def _generate(model, cache, ids, n=24, **kw):
    with kv_cache.compress(model, cache, **kw):
        return model.generate(ids, past_key_values=cache, max_new_tokens=n, do_sample=False,
                              min_new_tokens=n)


@pytest.mark.parametrize("quant", [None, QuantConfig(bits=4, key_grouping="token"),
                                   QuantConfig(bits=4, sink_tokens=0, key_grouping="channel"),
                                   QuantConfig.kivi(bits=2, group_size=16, residual_length=16)],
                         ids=["fp", "q4", "q4-channel", "kivi2"])
@pytest.mark.parametrize("policy", [
    dict(budget=0.25), dict(budget=0.25, scope="layer"), dict(budget=0.25, scope="head"), dict(budget=64, scope="head"),
    dict(threshold=-2.0), dict(budget=0.25, evict_every=1)], ids=["model", "layer", "head", "tokens", "threshold", "every1"])
@pytest.mark.parametrize("batch", [1, 2])
def test_kvzap_matrix_bounded_memory(stories, scorer_path, quant, policy, batch):
    model, tok = stories
    texts = [STORY, STORY[: len(STORY) // 2]][:batch]
    enc = tok(texts, return_tensors="pt", padding=True)
    pol = KVzap(scorer=scorer_path, **policy)
    if quant is not None and quant.key_grouping == "channel" and quant.bits == 4 and policy.get("budget") == 64:
        # per-channel key groups hold up to 31 tokens in full precision: 64 tokens cannot hold them and the window
        with pytest.raises(ValueError, match=r"budget \(64\) must be >= 67"):
            CompressedCache(model.config, quant=quant, eviction=pol)
        return
    cache = CompressedCache(model.config, quant=quant, eviction=pol)
    with kv_cache.compress(model, cache):
        out = model.generate(**enc, past_key_values=cache, max_new_tokens=40, min_new_tokens=40, do_sample=False)
    assert out.shape == (batch, enc.input_ids.shape[1] + 40)
    T = enc.input_ids.shape[1]
    rep = cache.memory_report()
    assert rep.tokens_seen == T + 39
    lengths = torch.stack([layer.head_lengths() for layer in cache.layers]).float()  # [layers, batch, heads]
    if pol.threshold is None:
        budget = pol.budget if isinstance(pol.budget, int) else max(int(pol.budget * T), 1)
        raised = max(budget, pol.sink_tokens + pol.window_tokens(budget)
                     + (0 if quant is None else max(cache.quant.residual_length, cache.quant.group_size) - 1
                        + cache.quant.sink_tokens))
        slack = pol.evict_every - 1
        bound = lengths.max() if pol.scope == "head" else lengths.mean(dim=(0, 2)).max()
        assert bound <= raised + slack + 1
    else:  # the threshold keeps fewer than everything, more than the forced slots (the window: half of
        # `budget`'s share of the prompt, math dictionary §19.5)
        forced = pol.sink_tokens + pol.window_tokens(max(int(pol.budget * T), 1))
        assert forced <= lengths.min() and lengths.max() < T + 39
    assert 0 < rep.scores_bytes  # the kept scores are held, and counted


@pytest.mark.parametrize("policy", [dict(budget=0.25), dict(budget=0.25, scope="head"), dict(budget=48, evict_every=1)],
                         ids=["model", "head", "decoding"])
def test_keys_before_rope_keep_their_positions(stories, scorer_path, policy):
    """KVzap scores hidden states, so a cache storing keys before RoPE keeps the same tokens as
    one storing them after, each rotated back by its own arrival index at read (at prefill and
    through the evictions while decoding): at 8 bits both give the same tokens and logits."""
    model, tok = stories
    ids = tok(STORY, return_tensors="pt").input_ids
    runs = []
    for pre in (False, True):
        q = QuantConfig(bits=8, pre_rope=pre, key_grouping="token", rotation="hadamard", center_keys=True,
                        group_size=1, residual_length=0, channel_group=None)
        cache = CompressedCache(model.config, quant=q, eviction=KVzap(scorer=scorer_path, **policy),
                                fidelity_threshold=1e9)
        with torch.no_grad(), kv_cache.compress(model, cache):
            out = model.generate(ids, past_key_values=cache, max_new_tokens=24, min_new_tokens=24, do_sample=False,
                                 output_logits=True, return_dict_in_generate=True)
        runs.append((out.sequences, torch.stack(out.logits, 1), cache))
    (seq0, log0, c0), (seq1, log1, c1) = runs
    assert torch.equal(seq0, seq1)
    assert (log0 - log1).abs().max() < 0.05 * log0.abs().max()
    assert c1.memory_report().tokens_kept < ids.shape[1]  # KVzap acted
    for a, b in zip(c0.layers, c1.layers):  # the same number of tokens kept by every head
        assert torch.equal(a.head_lengths(), b.head_lengths())
    assert any(layer.kept_arrivals is not None for layer in c1.layers)


def test_memory_is_flat_while_decoding(stories, scorer_path):
    model, tok = stories
    ids = tok(STORY, return_tensors="pt").input_ids
    cache = CompressedCache(model.config, quant=QuantConfig(bits=4, key_grouping="token"),
                            eviction=KVzap(budget=48, scorer=scorer_path))
    held = []
    with torch.no_grad(), kv_cache.compress(model, cache):
        logits = kv_cache.context.forward_at(model, cache, ids, 0, last_only=True)
        for i in range(160):
            nxt = logits[:, -1].argmax(-1, keepdim=True)
            logits = kv_cache.context.forward_at(model, cache, nxt, ids.shape[1] + i)
            if i % 16 == 15:
                held.append(sum(t.nbytes for t in cache.held_tensors().values()))
    assert cache.memory_report().tokens_seen == ids.shape[1] + 160
    # after the budget is reached, the bytes held repeat every evict_every steps
    assert max(held[2:]) <= held[2] * 1.02 and min(held[2:]) >= held[2] * 0.98


def test_no_second_pass_and_large_budget_keeps_everything(stories, scorer_path):
    model, tok = stories
    ids = tok(STORY, return_tensors="pt").input_ids
    calls = []
    h = model.register_forward_hook(lambda *a: calls.append(1))
    try:
        cache = CompressedCache(model.config, eviction=KVzap(budget=0.25, scorer=scorer_path))
        kv_cache.prefill(model, cache, ids)
    finally:
        h.remove()
    assert len(calls) == 1  # scored in the prefill's own forward pass
    assert cache.memory_report().tokens_kept < ids.shape[1] * 0.5
    big = CompressedCache(model.config, eviction=KVzap(budget=100000, scorer=scorer_path))
    out = _generate(model, big, ids)
    ref = model.generate(ids, past_key_values=DynamicCache(), max_new_tokens=24, min_new_tokens=24, do_sample=False)
    assert torch.equal(out, ref)


def test_tiers_and_save_load(stories, scorer_path, tmp_path):
    model, tok = stories
    ids = tok(STORY, return_tensors="pt").input_ids
    cache = CompressedCache(model.config, quant=QuantConfig(bits=4, evicted_bits=2),
                            eviction=KVzap(budget=0.25, decoding=False, scorer=scorer_path))
    _generate(model, cache, ids, n=8)
    assert all(layer.demoted is not None for layer in cache.layers)
    with pytest.raises(ValueError, match="one-shot"):
        CompressedCache(model.config, quant=QuantConfig(bits=4, evicted_bits=2),
                        eviction=KVzap(budget=0.25, scorer=scorer_path))
    ctx = CompressedContext.build(model, tok, STORY, quant=QuantConfig(bits=4),
                                  eviction=KVzap(budget=0.3, scorer=scorer_path), chat=False)
    answer = ctx.ask(" Lily", max_new_tokens=8)
    ctx.save(tmp_path / "c.kvc")
    back = CompressedContext.load(tmp_path / "c.kvc", model, tok)
    assert back.ask(" Lily", max_new_tokens=8) == answer


def test_errors(stories, scorer_path):
    model, tok = stories
    ids = tok(STORY, return_tensors="pt").input_ids
    cache = CompressedCache(model.config, eviction=KVzap(budget=0.25, scorer=scorer_path))
    with pytest.raises(RuntimeError, match="compress"):
        model(ids, past_key_values=cache)
    none = CompressedCache(model.config, eviction=KVzap(budget=0.25))  # no shipped scorer for stories260K
    with pytest.raises(ScorerFileError, match="calibrate-scorer"):
        _generate(model, none, ids)
    other = LlamaForCausalLM(LlamaConfig(**{**model.config.to_dict(), "architectures": None}))
    cache = CompressedCache(other.config, eviction=KVzap(budget=0.25, scorer=scorer_path))
    with pytest.raises(ScorerFileError, match="weights_sha256"):
        _generate(other, cache, ids)
    with pytest.raises(FileNotFoundError):
        _generate(model, CompressedCache(model.config, eviction=KVzap(scorer="/nonexistent.safetensors")), ids)


@pytest.mark.parametrize("target", [4.0, 6.0])  # q4d alone holds 3.2x here
def test_target_ratio_keeps_the_most_tokens_that_reach_it(stories, scorer_path, target):
    """As KVzip's (§19.6): once the predicted scores are known the model-wide budget grows to the
    most tokens whose measured bytes still reach the ratio."""
    model, tok = stories
    ids = tok(STORY * 2, return_tensors="pt").input_ids[:, :240]
    reports = {}
    for ratio in (None, target):
        cache = CompressedCache(model.config, quant=QuantConfig(bits=4),
                                eviction=KVzap(budget=0.1, decoding=False, target_ratio=ratio, scorer=scorer_path))
        with torch.no_grad():
            kv_cache.prefill(model, cache, ids, last_only=True)
        reports[ratio] = cache.memory_report()
    plain, sized = reports[None], reports[target]
    assert plain.ratio > target and target <= sized.ratio <= target * 1.06
    assert sized.tokens_kept > plain.tokens_kept


def test_plan_for_measures_kvzap_next_to_kvzip(stories, scorer_path):
    """Asked to, the measured planner sizes both evictions with every layout and picks
    by the metric asked for; each candidate carries its KL and its perplexity over the full cache."""
    from kv_cache.plan import plan_for

    model, tok = stories
    text = Path(__file__).read_text()  # calibration text, never an evaluation text
    kw = dict(target="5x", calibration_text=text, context_tokens=200, continuation=16, windows=1, layouts=("q4d",))
    plan = plan_for(model, tok, scorers=("kvzip", "kvzap"), kvzap_scorer=scorer_path, metric="delta_ppl", **kw)
    cands = plan.predicted["candidates"]
    assert [c["layout"] for c in cands] == ["q4d", "q4d+kvzap"] and plan.predicted["metric"] == "delta_ppl"
    assert all(c["ratio"] >= 5 and c["kl"] >= 0 and c["delta_ppl"] > -1 for c in cands)
    assert plan.fingerprint == min(cands, key=lambda c: (c["warned"], c["delta_ppl"]))["fingerprint"]
    chosen = "q4d+kvzap" in [c["layout"] for c in cands if c["fingerprint"] == plan.fingerprint]
    assert isinstance(plan.policy, KVzap) == chosen
    only = plan_for(model, tok, scorers=("kvzap",), kvzap_scorer=scorer_path, **kw).predicted["candidates"]
    assert [c["layout"] for c in only] == ["q4d+kvzap"] and only[0]["fingerprint"] == cands[1]["fingerprint"]
    assert [c["layout"] for c in plan_for(model, tok, kvzap_scorer=scorer_path, **kw).predicted["candidates"]] == [
        "q4d"]  # KVzip alone unless asked
    with pytest.raises(ScorerFileError, match="calibrate-scorer"):
        plan_for(model, tok, scorers=("kvzap",), **kw)
    with pytest.raises(ValueError, match="scorers must be a non-empty sequence"):
        plan_for(model, tok, scorers=("h2o",), **kw)
    with pytest.raises(ValueError, match="metric must be one of"):
        plan_for(model, tok, metric="ppl", **kw)


def test_reference_attention_path_matches_native(stories, scorer_path):
    model, tok = stories
    ids = tok(STORY, return_tensors="pt").input_ids
    outs = []
    for attention in ("native", "reference"):
        cache = CompressedCache(model.config, eviction=KVzap(budget=0.3, scope="head", scorer=scorer_path))
        outs.append((_generate(model, cache, ids, n=16, attention=attention), cache.memory_report().tokens_kept))
    assert torch.equal(outs[0][0], outs[1][0]) and outs[0][1] == outs[1][1]


# ----------------------------------------------------------------------------------- SmolLM2 (golden)
@pytest.mark.slow
def test_shipped_smollm2_scorer_predicts_kvzip():
    from kv_cache.models import load_model, shared_data_dir
    from kv_cache.plan.scorer_training import collect_pairs, top_overlap
    from kv_cache.policies.kvzap import shipped_scorer

    model, tok = load_model("smollm2")
    path = shipped_scorer(model_identity(model))
    assert path is not None and path.parent.name == "kvzap_scorers"
    header = read_header(path)
    assert "wiki" not in header["info"]["source"]  # never fitted on the evaluation text
    sc = load_scorer(path)
    text = (shared_data_dir() / "wikitext-2-raw" / "wiki.test.raw").read_text().replace("\r\n", "\n")[20000:40000]
    ids = tok(text, return_tensors="pt").input_ids[:, :1024]
    xs, ys = collect_pairs(model, tok, ids, max_tokens_per_window=1000)
    overlaps = [top_overlap(sc.score(i, xs[i][None])[0].T, ys[i]) for i in xs]
    assert sum(overlaps) / len(overlaps) > 0.5  # chance is 0.25
