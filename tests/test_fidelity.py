"""The fidelity check (math dictionary §26): model-free, then on stories260K.

It must fire on a layout that wrecks attention and stay quiet on one that does not; the
golden tests (``test_golden_families.py``) check the same on SmolLM2 and Qwen2.5.
"""

from __future__ import annotations

import math
import warnings

import pytest
import torch

import kv_cache
from kv_cache import CompressedCache, FidelityError, FidelityWarning, QuantConfig
from kv_cache.attention.fidelity import (FIDELITY_THRESHOLD, attention_output_error, broken_layers, checked_rows,
                                     fidelity_message, masked_attention)


def test_error_is_zero_for_the_exact_output_and_relative_otherwise():
    g = torch.Generator().manual_seed(0)
    q, k, v = (torch.randn(2, 3, 4, 8, generator=g) for _ in range(3))
    k, v = torch.randn(2, 3, 10, 8, generator=g), torch.randn(2, 3, 10, 8, generator=g)
    exact = masked_attention(q, k, v, 0.3)
    assert attention_output_error(q, k, v, exact, 0.3).abs().max() < 1e-6
    err = attention_output_error(q, k, v, 2 * exact, 0.3)  # twice the output: error 1 everywhere
    assert err.shape == (2, 3) and err.dtype == torch.float32
    torch.testing.assert_close(err, torch.ones(2, 3))


def test_softcap_and_padding_are_read():
    g = torch.Generator().manual_seed(1)
    q, k, v = torch.randn(1, 1, 2, 4, generator=g) * 10, torch.randn(1, 1, 6, 4, generator=g) * 10, \
        torch.randn(1, 1, 6, 4, generator=g)
    capped = masked_attention(q, k, v, 1.0, softcap=5.0)
    logits = 5.0 * torch.tanh(q @ k.transpose(-1, -2) / 5.0)
    torch.testing.assert_close(capped, torch.softmax(logits, -1) @ v)
    valid = torch.tensor([[[False, False, True, True, True, True]]])
    torch.testing.assert_close(masked_attention(q, k, v, 1.0, key_valid=valid),
                               masked_attention(q, k[:, :, 2:], v[:, :, 2:], 1.0))


@pytest.mark.parametrize("shapes", [((1, 2, 3), (1, 2, 5, 4), (1, 2, 5, 4), (1, 2, 3, 4)),
                                    ((1, 2, 3, 4), (1, 3, 5, 4), (1, 3, 5, 4), (1, 2, 3, 4)),
                                    ((1, 2, 3, 4), (1, 2, 5, 4), (1, 2, 5, 4), (1, 2, 2, 4))])
def test_bad_shapes_raise(shapes):
    with pytest.raises(ValueError, match="4-D|do not match"):
        attention_output_error(*(torch.zeros(s) for s in shapes), scaling=1.0)


def test_rows_threshold_and_message():
    assert checked_rows(2, 5, 2, "cpu").tolist() == [3, 4, 8, 9]
    bad = broken_layers({0: 0.1, 3: 0.9, 5: float("nan")}, 0.5)
    assert list(bad) == [3, 5]  # NaN counts as broken: never quiet about a figure it could not take
    msg = fidelity_message(bad, 0.5, strict=True)
    assert "layer 3: 0.90" in msg and "layer 5" in msg and "QuantConfig" in msg and "strict=False" in msg
    assert "strict=False" not in fidelity_message(bad, 0.5)


def test_cache_arguments_are_checked(stories):
    model, _ = stories
    with pytest.raises(TypeError, match="strict must be True or False; got 'yes'"):
        CompressedCache(model.config, quant=QuantConfig(bits=4), strict="yes")
    for bad in (0, -1.0, True, "0.5"):
        with pytest.raises(ValueError, match="fidelity_threshold must be a number > 0"):
            CompressedCache(model.config, quant=QuantConfig(bits=4), fidelity_threshold=bad)


def _ids(tok):
    return tok("Once upon a time there was a little girl named Lily. She liked to play outside with her ball "
               "and her dog. One day the sun was hot and the sky was blue. " * 2, return_tensors="pt").input_ids


def test_quiet_on_a_faithful_cache_and_reported(stories):
    model, tok = stories
    cache = CompressedCache(model.config, quant=QuantConfig(bits=8))
    with warnings.catch_warnings():
        warnings.simplefilter("error", FidelityWarning)
        kv_cache.prefill(model, cache, _ids(tok))
    report = cache.memory_report()
    assert sorted(report.attention_errors) == list(range(len(cache.layers)))
    assert report.max_attention_error < 0.05 and report.fidelity_threshold == FIDELITY_THRESHOLD
    assert "fidelity check" in str(report)
    n = len(cache.layers)
    with torch.no_grad():  # decoding adds nothing: the check runs once, at prefill
        kv_cache.context.forward_at(model, cache, torch.tensor([[7]]), _ids(tok).shape[1])
    assert len(cache.memory_report().attention_errors) == n


def test_fires_on_a_wrecking_cache_and_strict_raises(stories):
    model, tok = stories
    wrecking = QuantConfig(bits=2, key_grouping="token", center_keys=False)  # stories260K's head_dim 8 at 2 bits
    cache = CompressedCache(model.config, quant=wrecking)
    with pytest.warns(FidelityWarning, match="wrecks the attention of .* layer"):
        kv_cache.prefill(model, cache, _ids(tok))
    errors = cache.memory_report().attention_errors
    assert max(errors.values()) > FIDELITY_THRESHOLD
    strict = CompressedCache(model.config, quant=wrecking, strict=True)
    with pytest.raises(FidelityError, match=r"layer \d+: \d\.\d\d"):
        kv_cache.prefill(model, strict, _ids(tok))
    lenient = CompressedCache(model.config, quant=wrecking, fidelity_threshold=100.0)
    with warnings.catch_warnings():
        warnings.simplefilter("error", FidelityWarning)
        kv_cache.prefill(model, lenient, _ids(tok))


def test_full_precision_cache_is_not_checked(stories):
    model, tok = stories
    cache = CompressedCache(model.config)
    kv_cache.prefill(model, cache, _ids(tok))
    assert cache.memory_report().attention_errors == {}


def test_eviction_in_the_prefill_is_measured(stories):
    model, tok = stories
    cache = CompressedCache(model.config, eviction=kv_cache.SnapKV(budget=0.25))
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", FidelityWarning)
        kv_cache.prefill(model, cache, _ids(tok))
    errors = cache.memory_report().attention_errors
    assert errors and all(not math.isnan(e) for e in errors.values()) and max(errors.values()) > 0


def test_padded_batch_is_checked_per_row(stories):
    model, tok = stories
    texts = ["Once upon a time there was a cat.", "Once upon a time there was a big red dog who ran and ran all day."]
    enc = tok(texts, return_tensors="pt", padding=True)
    cache = CompressedCache(model.config, quant=QuantConfig(bits=8))
    with warnings.catch_warnings():
        warnings.simplefilter("error", FidelityWarning)
        kv_cache.prefill(model, cache, enc.input_ids, attention_mask=enc.attention_mask)
    assert cache.memory_report().max_attention_error < 0.05


def test_serve_strict_refuses_a_wrecking_method(stories, tmp_path):
    """``kvcache serve --strict``: a method that fails the fidelity check is a 400 and stores nothing;
    without it the context is stored (and the server logs the warning)."""
    import contextlib

    import httpx
    from serve_support import AUTH, create, error, serving

    model, tok = stories
    with contextlib.ExitStack() as stack:
        strict = stack.enter_context(serving(model, tok, tmp_path / "s", strict=True))
        lenient = stack.enter_context(serving(model, tok, tmp_path / "l"))
        with httpx.Client(base_url=strict.base_url, headers=AUTH, timeout=120) as http:
            err = error(http.post("/v1/contexts", json={"document": "Once upon a time there was a cat. " * 12,
                                                        "method": "q2dtn"}), 400, "invalid_method")
            assert "wrecks the attention" in err["message"] and "strict=False" in err["message"]
            assert http.get("/v1/contexts").json()["data"] == []
            assert create(http, document="Once upon a time there was a cat. " * 12, method="q8")["id"]
        with httpx.Client(base_url=lenient.base_url, headers=AUTH, timeout=120) as http, \
                warnings.catch_warnings():
            warnings.simplefilter("ignore", FidelityWarning)
            assert create(http, document="Once upon a time there was a cat. " * 12, method="q2dtn")["id"]


def test_advice_never_recommends_the_setting_in_use():
    """The message is built from the broken layers' own settings (issue 45: the demo's q4d warned
    and recommended q4d): per-token keys are told to go per channel, a width is told the next one
    up, 8-bit codes are told nothing about bits, an evicting layer is told to keep more tokens."""
    from kv_cache.attention.fidelity import fidelity_advice

    default4 = fidelity_advice({1: (4, 4, "channel", False), 2: (4, 4, "channel", False)})
    assert "key_grouping='channel'" not in default4 and "bits=4;" not in default4
    assert "bits=8; 4 are in use" in default4 and "layer_bits={1: 8, 2: 8}" in default4
    token4 = fidelity_advice({0: (4, 4, "token", False)})
    assert "keys per channel" in token4 and "key_grouping='token' is in use" in token4
    two = fidelity_advice({0: (2, 2, "channel", False)})
    assert "bits=4; 2 are in use" in two and "bits=8;" not in two
    eight = fidelity_advice({0: (8, 8, "channel", False)})
    assert "bits=" not in eight and "layer_bits" not in eight and "report it" in eight
    evicting = fidelity_advice({0: (8, 8, "channel", True), 3: (16, 16, "", True)})
    assert "larger eviction budget" in evicting and "bits=" not in evicting
    many = fidelity_advice({i: (3, 2, "channel", False) for i in range(6)})
    assert "layer_bits={0: 8, 1: 8, 2: 8, 3: 8, ...}" in many


def test_the_cache_warns_with_its_own_settings(stories):
    """A real warning names what the cache holds: a 2-bit default cache is told 4 bits, never its own layout."""
    model, tok = stories
    ids = tok("Lily had a red ball. She played with it in the park every day. " * 6, return_tensors="pt").input_ids
    cache = CompressedCache(model.config, quant=QuantConfig(bits=2), fidelity_threshold=1e-6)
    with pytest.warns(FidelityWarning) as record:
        kv_cache.prefill(model, cache, ids)
    message = next(str(w.message) for w in record if issubclass(w.category, FidelityWarning))
    assert "bits=4; 2 are in use" in message and "QuantConfig(bits=4) with its default" not in message
