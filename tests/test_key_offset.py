"""The per-channel key offset (math dictionary §25): the pure helpers, and exactness in every family.

Keys are held as ``k - mu``. Softmax attention is invariant to it; soft-capping (Gemma 2) and
learned sinks (gpt-oss) get the shift added back. With every token held in float32 (a residual
that never flushes), a centered cache must give the logits of the uncompressed one.
"""

from __future__ import annotations

import math

import pytest
import torch
from transformers import DynamicCache

import kv_cache
from kv_cache import CompressedCache, QuantConfig
from kv_cache.attention.key_offset import key_offset, lse_shift, shift_keys, unshift_keys

import test_architectures as arch
from test_architectures import _run


def test_key_offset_is_the_mean_after_the_sinks():
    k = torch.randn(2, 3, 20, 8)
    k[:, :, :4] += 100.0  # sink tokens unlike the rest
    mu = key_offset(k, 4)
    assert mu.shape == (2, 3, 1, 8) and mu.dtype == torch.float32
    torch.testing.assert_close(mu, k[:, :, 4:].mean(2, keepdim=True))
    torch.testing.assert_close(key_offset(k[:, :, :3], 4), k[:, :, :3].mean(2, keepdim=True))  # short: all tokens
    torch.testing.assert_close(unshift_keys(shift_keys(k, mu), mu), k)
    assert shift_keys(k, None) is k and unshift_keys(k, None) is k


def test_key_offset_dtypes_and_constant_channels():
    k = torch.full((1, 1, 5, 4), 3.0, dtype=torch.bfloat16)  # a constant channel: offset = the constant
    mu = key_offset(k)
    assert mu.dtype == torch.float32 and bool((mu == 3.0).all())
    assert bool((shift_keys(k, mu) == 0).all()) and shift_keys(k, mu).dtype == torch.bfloat16


@pytest.mark.parametrize("bad, match", [
    (torch.zeros(1, 2, 0, 4), "at least one token"),
    (torch.zeros(2, 0, 4), r"\[batch, kv_heads, tokens, head_dim\]"),
    (torch.tensor([[[[1.0, float("nan")]]]]), "NaN or Inf"),
    (torch.tensor([[[[1.0, float("inf")]]]]), "NaN or Inf"),
])
def test_key_offset_refuses_bad_keys(bad, match):
    with pytest.raises(ValueError, match=match):
        key_offset(bad)


def test_lse_shift_is_what_the_logits_lack():
    q, k, mu = torch.randn(1, 2, 3, 8), torch.randn(1, 2, 5, 8), torch.randn(1, 2, 1, 8)
    s = 0.35
    lse_true = torch.logsumexp(q @ k.transpose(-1, -2) * s, -1)
    lse_shifted = torch.logsumexp(q @ (k - mu).transpose(-1, -2) * s, -1)
    torch.testing.assert_close(lse_shifted + lse_shift(q, mu, s), lse_true)


def test_center_keys_field():
    assert QuantConfig(bits=4, key_grouping="token").center_keys is True
    assert QuantConfig(bits=4, pre_rope=False).center_keys is False and QuantConfig.kivi(bits=4).center_keys is False
    assert QuantConfig(bits=4).center_keys is True  # the default since wave 6: keys before RoPE, per token
    with pytest.raises(ValueError, match="center_keys must be True, False or 'auto'; got 1"):
        QuantConfig(bits=4, center_keys=1)


CENTERED_FP32 = dict(bits=4, key_grouping="token", residual_length=150, residual_dtype=torch.float32,
                     center_keys=True)
"""Nothing flushes within the 103 tokens of :func:`test_architectures._run`: every key is held shifted, in float32."""


def _make_wide(name: str, monkeypatch):
    """The tiny model of ``name`` with its sliding window widened to 200 (the residual must fit in it)."""
    fam = dict(arch.FAMILIES[name])
    if "sliding_window" in fam:
        fam["sliding_window"] = 200
    monkeypatch.setitem(arch.FAMILIES, name, fam)
    return arch._make(name)


@pytest.mark.parametrize("name", ["llama", "qwen2", "gemma2", "gemma3_text", "gpt_oss"])
@pytest.mark.parametrize("padded", [False, True])
def test_centered_keys_are_exact(name, padded, monkeypatch):
    """gemma2 soft-caps its logits and gpt_oss adds learned sinks: both need the shift back."""
    model = _make_wide(name, monkeypatch)
    with torch.no_grad():
        want = _run(model, DynamicCache(config=model.config), padded)
        cache = CompressedCache(model.config, quant=QuantConfig(**CENTERED_FP32))
        with kv_cache.compress(model, cache):
            got = _run(model, cache, padded)
    full = [layer for layer in cache.layers if layer.window is None]
    assert all(layer.key_offset is not None for layer in full)
    assert any(float(layer.key_offset.abs().max()) > 0.01 for layer in full)  # the shift is real
    for w, g in zip(want, got):
        torch.testing.assert_close(g[:, -1:], w[:, -1:], atol=5e-4, rtol=5e-4)
    report = cache.memory_report()
    assert report.tables_bytes >= sum(layer.key_offset.nbytes for layer in cache.layers if layer.key_offset is not None)


def test_centered_cache_saves_and_loads_its_offset(stories, tmp_path):
    from kv_cache.cache.serialize import load_cache, save_cache

    model, tok = stories
    ids = tok("Once upon a time there was a little dog who loved to run in the sun. " * 3, return_tensors="pt").input_ids
    cache = CompressedCache(model.config, quant=QuantConfig(bits=4, key_grouping="token"))
    kv_cache.prefill(model, cache, ids)
    path = tmp_path / "c.kvc"
    save_cache(cache, path, model_config=model.config)
    loaded, _ = load_cache(path, model_config=model.config)
    for a, b in zip(cache.layers, loaded.layers):
        torch.testing.assert_close(a.key_offset, b.key_offset)
    nxt = torch.tensor([[5]])
    with torch.no_grad():
        la = kv_cache.context.forward_at(model, cache, nxt, ids.shape[1])
        lb = kv_cache.context.forward_at(model, loaded, nxt, ids.shape[1])
    torch.testing.assert_close(la, lb)
    assert not math.isnan(float(la.sum()))


def test_key_scale_is_the_rms_or_its_square_root():
    """Row 1 of a scaled offset: each centered channel's RMS over the tokens after the sinks
    (``scale=True``) or its square root (``"sqrt"``, the default's half-whitening, §29.7)."""
    k = torch.randn(1, 2, 40, 8) * torch.linspace(0.1, 10.0, 8)
    full, half = key_offset(k, 4, True), key_offset(k, 4, "sqrt")
    rms = (k[:, :, 4:] - k[:, :, 4:].mean(2, keepdim=True)).square().mean(2, keepdim=True).sqrt()
    torch.testing.assert_close(full[:, :, 1:], rms)
    torch.testing.assert_close(half[:, :, 1:], rms.sqrt())
    torch.testing.assert_close(unshift_keys(shift_keys(k, half), half), k, rtol=1e-5, atol=1e-5)
    with pytest.raises(ValueError, match="scale must be False, True or 'sqrt'; got 'half'"):
        key_offset(k, 4, "half")
