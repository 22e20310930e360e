"""Honest accounting: the bytes a cache reports are the bytes it keeps resident."""

from __future__ import annotations

import pytest
import torch


@pytest.mark.parametrize("n", [192, 197])  # 192: a multiple of every flush block (an empty residual)
@pytest.mark.parametrize("quant", ["kivi4", "default4", "default2", "tiers"])
def test_held_tensors_own_exactly_their_bytes(stories, quant, n):
    """No held tensor is a view that keeps a larger storage alive (a prefill's sinks or empty
    residual sliced from the whole ``[b, h, T, d]`` states would pin all ``T`` tokens while its
    ``nbytes`` counts only its own): the bytes reported are the bytes resident."""
    from kv_cache import CompressedCache, QuantConfig, SnapKV, compress, prefill

    model, tok = stories
    quants = {"kivi4": QuantConfig.kivi(bits=4), "default4": QuantConfig(bits=4), "default2": QuantConfig(bits=2),
              "tiers": QuantConfig.kivi(bits=4, evicted_bits=2)}
    text = "Once upon a time there was a little girl named Lily. She loved to play outside. " * 12
    ids = tok(text, return_tensors="pt").input_ids[:, :n]
    cache = CompressedCache(model.config, quant=quants[quant],
                            eviction=SnapKV(budget=0.5) if quant == "tiers" else None)
    prefill(model, cache, ids)

    def pinned():
        return {name: (t.nbytes, t.untyped_storage().nbytes()) for name, t in cache.held_tensors().items()
                if t.untyped_storage().nbytes() != t.nbytes}

    assert pinned() == {}
    with compress(model, cache), torch.no_grad():
        for i in range(5):
            model(input_ids=ids[:, i:i + 1], past_key_values=cache, use_cache=True,
                  position_ids=torch.tensor([[n + i]]))
    assert pinned() == {}
