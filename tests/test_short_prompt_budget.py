"""A fractional budget on a prompt shorter than the parts every head keeps (issue 18).

``budget=0.5`` of a 6-token prompt is 3 tokens, fewer than the quantization sinks, the longest
full-precision residual, the recent window and the policy's sinks together. The budget is then
raised to those parts (as a budget above the prompt keeps the whole prompt), the cache runs, and
``memory_report()`` says so. A token (int) budget that small is still refused at construction.
"""

from __future__ import annotations

import re
from pathlib import Path

import pytest
import torch

import kv_cache
from kv_cache import H2O, CompressedCache, CompressedContext, KVzip, QuantConfig, SnapKV
from kv_cache.cache.budgets import fixed_parts

PROMPT = "The cat sat"  # 6 tokens with stories260K's tokenizer (BOS included)
README = Path(__file__).resolve().parents[1] / "README.md"


def _prompt(tok):
    inputs = tok(PROMPT, return_tensors="pt")
    assert inputs.input_ids.shape == (1, 6)
    return inputs


def _generate(model, inputs, cache, n=8):
    with kv_cache.compress(model, cache), torch.no_grad():
        return model.generate(**inputs, past_key_values=cache, max_new_tokens=n, do_sample=False)


def _need(quant, policy, prompt_len=6):
    requested = policy.budget_tokens(0, prompt_len)
    return requested, sum(fixed_parts(quant, policy, policy.window_tokens(requested)).values())


@pytest.mark.parametrize("policy, same_as", [
    (H2O(budget=0.5), H2O(budget=8, recent_window=1)),       # 4 sinks + 3 residual + window 1 (half of 3)
    (SnapKV(budget=0.5), SnapKV(budget=39)),                 # 4 sinks + 3 residual + window 32
    (SnapKV(budget=0.5, scope="model"), SnapKV(budget=39, scope="model")),
])
def test_fraction_below_fixed_parts_is_raised_and_reported(stories, policy, same_as):
    model, tok = stories
    inputs = _prompt(tok)
    quant = QuantConfig(bits=4, key_grouping="token", pre_rope=False)
    requested, need = _need(quant, policy)
    assert requested == 3 and need == same_as.budget
    cache = CompressedCache(model.config, quant=quant, eviction=policy)
    out = _generate(model, inputs, cache)
    rep = cache.memory_report()
    assert rep.budget_raised == {i: (3, need) for i in range(model.config.num_hidden_layers)}
    assert len(rep.notes) == 1 and "budget raised to the fixed parts' minimum in every layer" in rep.notes[0]
    assert "is 3 tokens" in rep.notes[0] and f"= {need}" in rep.notes[0]
    assert f"\nnote: {rep.notes[0]}" in str(rep)
    assert all(layer.kept_length() <= need for layer in cache.layers)
    # Exactly the token budget of the fixed parts' minimum, with the window resolved from the fraction.
    ref = CompressedCache(model.config, quant=quant, eviction=same_as)
    assert torch.equal(out, _generate(model, inputs, ref))
    assert [la.kept_length() for la in cache.layers] == [la.kept_length() for la in ref.layers]
    assert ref.memory_report().budget_raised == {} and ref.memory_report().notes == []


def test_raised_h2o_budget_still_evicts_while_decoding(stories):
    model, tok = stories
    cache = CompressedCache(model.config, quant=QuantConfig(bits=4, key_grouping="token", pre_rope=False), eviction=H2O(budget=0.5))
    _generate(model, _prompt(tok), cache, n=12)  # 6 + 11 stored tokens seen, 8 kept
    assert cache.get_seq_length() == 17
    assert [layer.kept_length() for layer in cache.layers] == [8] * model.config.num_hidden_layers
    assert cache.memory_report().tokens_kept == 8


@pytest.mark.parametrize("quant, kept", [(QuantConfig(bits=4, key_grouping="token", pre_rope=False), 6), (None, 5)])
def test_kvzip_on_a_short_context(stories, quant, kept):
    """KVzip (0.3 of 6 tokens = 2) keeps its 4 sinks and its recent window (1 token: half the
    budget), plus the quantization sinks and residual."""
    model, tok = stories
    policy = KVzip(budget=0.3)
    requested, need = _need(quant, policy)
    assert (requested, need) == ((2, 12) if quant is not None else (2, 5))
    ctx = CompressedContext.build(model, tok, PROMPT, quant=quant, eviction=policy)
    rep = ctx.cache.memory_report()
    assert rep.budget_raised == {i: (2, need) for i in range(model.config.num_hidden_layers)}
    assert rep.tokens_seen == 6 and rep.tokens_kept == kept  # without quantization: evicted down to 5
    assert "budget raised" in str(rep)
    assert isinstance(ctx.ask(" on the", max_new_tokens=4), str)
    # prefill + generate: the same cache kind through kv_cache.prefill
    cache = CompressedCache(model.config, quant=quant, eviction=KVzip(budget=0.3))
    ids = _prompt(tok).input_ids
    kv_cache.prefill(model, cache, ids, tokenizer=tok)
    with kv_cache.compress(model, cache), torch.no_grad():
        out = model(torch.tensor([[tok.eos_token_id]]), past_key_values=cache, use_cache=True)
    assert out.logits.isfinite().all() and cache.memory_report().budget_raised == rep.budget_raised


def test_a_fraction_above_the_fixed_parts_is_not_raised(stories):
    model, tok = stories
    ids = tok("Once upon a time, there was a little girl named Lily. " * 4, return_tensors="pt")
    cache = CompressedCache(model.config, quant=QuantConfig(bits=4, key_grouping="token", pre_rope=False), eviction=H2O(budget=0.5))
    _generate(model, ids, cache, n=2)
    rep = cache.memory_report()
    assert rep.budget_raised == {} and rep.notes == [] and "note:" not in str(rep)


def test_a_token_budget_below_the_fixed_parts_still_raises(stories):
    model = stories[0]
    with pytest.raises(ValueError, match=r"budget \(3\) must be >= 8: quantization sinks \(4\) \+ residual .* \(3\) "
                                         r"\+ recent_window \(1\) \+ sink_tokens \(0\)"):
        CompressedCache(model.config, quant=QuantConfig(bits=4, key_grouping="token", pre_rope=False), eviction=H2O(budget=3))


def test_readme_first_example_runs_on_stories260K(stories, monkeypatch, capsys):
    """The README's drop-in example, as written, with stories260K in place of SmolLM2."""
    text = README.read_text()
    section = text[text.index("## Drop-in cache for `model.generate`"):]
    code = re.search(r"```python\n(.*?)```", section, re.S).group(1)
    assert 'load_model("smollm2")' in code and "H2O(budget=0.5)" in code
    import kv_cache.models

    monkeypatch.setattr(kv_cache.models, "load_model", lambda name: stories)
    exec(compile(code, str(README), "exec"), {})
    printed = capsys.readouterr().out
    assert "B held" in printed and "vs fp16" in printed
    assert "note: budget raised to the fixed parts' minimum" in printed  # 16 tokens: 0.5 is 8 < 4 + 3 + 4
