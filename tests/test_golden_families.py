"""Golden tests on real models of two families: SmolLM2-135M (Llama) and Qwen2.5-Coder-0.5B (Qwen2).

Held-out text (Moby Dick, pg2701: never used for any calibration): 768 tokens prefilled and
compressed, the next 256 scored, against the full cache of the same window. Bounds sit at about
twice the measured figure (wave 5):

* ``q4d`` (``QuantConfig(bits=4)``) over four windows (chapters 1, 10, 20 and 40): the mean
  next-token KL from the full cache, which is stable across windows where the perplexity of 256
  tokens is not (KIVI-4 scores *below* the full cache on two of the four windows). Wave 6's
  default (keys before RoPE, per token, half-whitened, 4.17 bits per element) measured 0.0043
  (SmolLM2) and 0.0066 (Qwen2.5), bounds 1.5x: 0.0065 and 0.0099. For scale: the per-channel
  layout before it (4.77 bits) measured 0.0021 / 0.0038 and KIVI-4 (5.0 bits) 0.0058 / 0.0064;
  the bound fails per-token codes after RoPE on Qwen2.5 (KL 0.40 on the layout table's windows)
  and, narrowly, wave 5's unscaled codes before RoPE there (0.011).
* the ``8x`` preset and ``kvzip@0.25`` on the chapter-1 window: perplexity within about twice
  what they measure there (8x +1.86% / +0.37%, kvzip@0.25 +3.38% / +3.12%).
* KVzap (``q4`` + ``kvzap@0.25``, the shipped scorer) on Qwen2.5's chapter-1 window: the mean
  next-token KL from the full cache, measured 0.074 (+0.23% perplexity), bound 0.15; inverted
  scores measure 0.23.

The fidelity check stays quiet on all of them. The tiny random grid (``test_architectures.py``)
cannot catch a layout that breaks one family's keys (Qwen2's key bias broke the previous
per-token default by +60%): these can.
"""

from __future__ import annotations

import functools
import math
import warnings

import pytest
import torch

import kv_cache
from kv_cache import CompressedCache, FidelityWarning, KVzip, QuantConfig
from kv_cache.context import forward_at
from kv_cache.models import load_model, shared_data_dir
from kv_cache.plan import preset_plan

PREFIX, SCORED = 768, 256
LIMITS = {  # Δppl on the chapter-1 window, about twice the measured figure
    ("smollm2", "8x"): 0.037, ("smollm2", "kvzip@0.25"): 0.068,
    ("qwen2.5-0.5b", "8x"): 0.0075, ("qwen2.5-0.5b", "kvzip@0.25"): 0.063,
}
Q4D_KL = {"smollm2": 0.0065, "qwen2.5-0.5b": 0.0099}  # mean KL over CHAPTERS (see the module docstring)
CHAPTERS = ("CHAPTER 1. Loomings.", "CHAPTER 10. A Bosom Friend.", "CHAPTER 20. All Astir.",
            "CHAPTER 40. Midnight, Forecastle.")


def _window(tok, chapter: str = CHAPTERS[0]) -> torch.Tensor:
    text = (shared_data_dir() / "gutenberg" / "pg2701.txt").read_text(encoding="utf-8").replace("\r\n", "\n")
    start = text.index(chapter)
    return torch.tensor([tok(text[start:start + 8000]).input_ids[:PREFIX + SCORED]])


def _log_probs(model, tok, ids: torch.Tensor, cache) -> torch.Tensor:
    """Next-token log-probabilities ``[SCORED, vocab]`` of the scored tokens, read through ``cache``."""
    with torch.no_grad(), kv_cache.compress(model, cache):  # the native attention reads ragged heads
        last, _ = kv_cache.prefill(model, cache, ids[:, :PREFIX], tokenizer=tok, last_only=True)
        cont = forward_at(model, cache, ids[:, PREFIX:-1], PREFIX)
    return torch.cat([last[:, -1:].float(), cont], 1)[0].log_softmax(-1)  # predicts tokens PREFIX..end


def _ppl(model, tok, ids: torch.Tensor, cache=None, lp: torch.Tensor | None = None) -> float:
    lp = _log_probs(model, tok, ids, cache) if lp is None else lp
    return math.exp(float(-lp.gather(1, ids[0, PREFIX:, None]).mean()))


def _kl(full: torch.Tensor, got: torch.Tensor) -> float:
    """Mean next-token KL(full || got) over the scored tokens."""
    return float((full.exp() * (full - got)).sum(-1).mean())


def _cache(model, name: str):
    if name == "q4d":
        return CompressedCache(model.config, quant=QuantConfig(bits=4))
    if name == "8x":
        return CompressedCache(model.config, plan=preset_plan(model.config, "8x", context_tokens=PREFIX))
    return CompressedCache(model.config, eviction=KVzip(budget=0.25))


@functools.lru_cache(maxsize=2)
def _model_and_full(alias: str):
    """The model, its tokenizer, the chapter-1 window and the full cache's log-probabilities there."""
    model, tok = load_model(alias)
    ids = _window(tok)
    return model, tok, ids, _log_probs(model, tok, ids, CompressedCache(model.config))


# Measured on this window (wave 4): KVzip keeping 25% costs +3.4% (SmolLM2) and +3.1% (Qwen2.5)
# with half its budget kept recent (math dictionary §19.5; +9.6% and +15.8% without). The 8x preset
# (4-bit codes + KVzip sized to 8.0x by its measured bytes, §19.6, scoring a token also by what the
# prompt's last 96 queries read, §19.7) costs +1.9% and +0.4% here (+4.5% and +5.4% with the
# reconstruction score alone).
CASES = sorted(LIMITS)


@pytest.mark.slow
@pytest.mark.parametrize("alias", sorted(Q4D_KL))
def test_default_layout_holds_on_real_families(alias):
    """``q4d``: the mean next-token KL from the full cache over four held-out windows within
    Q4D_KL (1.5x the measured figure), the fidelity check quiet."""
    model, tok = load_model(alias)
    kls = []
    for chapter in CHAPTERS:
        ids = _window(tok, chapter)
        full = _log_probs(model, tok, ids, CompressedCache(model.config))
        cache = _cache(model, "q4d")
        with warnings.catch_warnings():
            warnings.simplefilter("error", FidelityWarning)  # the check (§26) must stay quiet
            got = _log_probs(model, tok, ids, cache)
        assert cache.memory_report().attention_errors, f"{alias} {chapter}: the fidelity check did not run"
        kls.append(_kl(full, got))
    mean = sum(kls) / len(kls)
    assert mean <= Q4D_KL[alias], f"{alias} q4d: mean KL {mean:.5f} over {len(kls)} windows > {Q4D_KL[alias]} ({kls})"


@pytest.mark.slow
@pytest.mark.parametrize("alias, name", CASES)
def test_defaults_hold_on_real_families(alias, name):
    model, tok, ids, full_lp = _model_and_full(alias)
    full = _ppl(model, tok, ids, lp=full_lp)
    cache = _cache(model, name)
    with warnings.catch_warnings():
        warnings.simplefilter("error", FidelityWarning)  # the checks (§26, §26.1) must stay quiet
        ppl = _ppl(model, tok, ids, cache)
    report = cache.memory_report()
    assert report.attention_errors, f"{alias} {name}: the fidelity check did not run"
    # the eviction check after KVzip (measured here: kvzip@0.25 drops 0.12 / 0.20 of the last
    # queries' attention, 8x 0.07 / 0.16, against the limit 0.25)
    assert report.mean_evicted_attention is not None, f"{alias} {name}: eviction check"
    delta, limit = ppl / full - 1, LIMITS[(alias, name)]
    assert delta <= limit, f"{alias} {name}: {ppl:.3f} against full {full:.3f} ({delta:+.2%} > {limit:+.2%})"


# KVzap (q4 + kvzap@0.25, the shipped Qwen2.5 scorer) on the chapter-1 window: mean next-token KL
# from the full cache measured 0.074 (+0.23% perplexity); with its scores inverted (it keeps the
# tokens it predicts matter least) 0.23, so the bound at about twice the measured figure fails it.
KVZAP_KL = 0.15


@pytest.mark.slow
def test_every_path_on_qwen25():
    """Q/K/V biases, head_dim 64 at 7:1 GQA: the kernels' decode step, KVzip with precision tiers,
    KVzap with the shipped Qwen2.5 scorer, and a plan, through ``generate`` over a 600-token window;
    KVzap's quality as the mean next-token KL from the full cache on the 768 + 256 token window
    (within KVZAP_KL), since its greedy tokens continue differently."""
    from kv_cache import KVzap

    model, tok, window, full_lp = _model_and_full("qwen2.5-0.5b")
    assert (model.config.num_attention_heads, model.config.num_key_value_heads) == (14, 2)
    ids = window[:, :600]
    configs = {
        "tiers": dict(quant=QuantConfig(bits=4, evicted_bits=2), eviction=KVzip(budget=0.25)),
        "kvzap": dict(quant=QuantConfig(bits=4), eviction=KVzap(budget=0.25)),
        "plan": dict(plan=preset_plan(model.config, "4x", context_tokens=ids.shape[1])),
    }
    with torch.no_grad():
        want = model.generate(ids, max_new_tokens=8, do_sample=False)[0, ids.shape[1]:]
    for name, kw in configs.items():
        cache = CompressedCache(model.config, **kw)
        with warnings.catch_warnings():
            # KVzap evicts inside the prefill's own pass, so its figure includes dropping 75% of the
            # tokens (0.65 in layer 23 here): the layouts alone must stay quiet
            warnings.simplefilter("ignore" if name == "kvzap" else "error", FidelityWarning)
            kv_cache.prefill(model, cache, ids, tokenizer=tok, last_only=True)
        with kv_cache.compress(model, cache), torch.no_grad():
            nxt = torch.tensor([[int(want[0])]])
            out = model.generate(torch.cat([ids, nxt], 1), past_key_values=cache, max_new_tokens=6,
                                 do_sample=False)[0, ids.shape[1] + 1:]
        report = cache.memory_report()
        assert report.ratio > 3 and report.attention_errors, name
        assert len(out) == 6
        if name != "kvzap":  # KVzap at 25% continues differently here: its quality is measured below
            assert int((out == want[1:7]).sum()) >= 3, (name, out.tolist(), want.tolist())
    cache = CompressedCache(model.config, quant=QuantConfig(bits=4), eviction=KVzap(budget=0.25))
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", FidelityWarning)  # as above
        got = _log_probs(model, tok, window, cache)
    kl = _kl(full_lp, got)
    assert cache.memory_report().ratio > 3
    assert kl <= KVZAP_KL, f"kvzap@0.25: mean KL {kl:.4f} from the full cache > {KVZAP_KL}"
