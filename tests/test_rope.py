"""RoPE applied and removed (kv_cache.compression.rope, math dictionary §29): against
transformers' own rotations, exact round trips with attention scaling and partial rotary, cos/sin
tables rebuilt from the frequencies, and the errors. Model-free."""

from __future__ import annotations

import pytest
import torch

from kv_cache.compression.rope import apply_rope, remove_rope, rope_tables


def _tables(T: int, r: int, layout: str, scaling: float = 1.0, base: float = 10000.0):
    inv = 1.0 / base ** (torch.arange(0, r, 2, dtype=torch.float64) / r)
    return rope_tables(inv, torch.arange(T), scaling, layout)


@pytest.mark.parametrize("layout, module", [("half", "llama"), ("interleaved", "cohere")])
def test_apply_matches_transformers(layout, module):
    import importlib

    m = importlib.import_module(f"transformers.models.{module}.modeling_{module}")
    torch.manual_seed(0)
    k = torch.randn(2, 3, 17, 64)
    cos, sin = _tables(17, 64, layout)
    cos_b, sin_b = cos.expand(2, 17, 64), sin.expand(2, 17, 64)
    _, ref = m.apply_rotary_pos_emb(k, k, cos_b, sin_b)
    torch.testing.assert_close(apply_rope(k, cos_b, sin_b, layout), ref, rtol=0, atol=1e-6)
    torch.testing.assert_close(apply_rope(k, cos, sin, layout), ref, rtol=0, atol=1e-6)


@pytest.mark.parametrize("layout", ["half", "interleaved"])
@pytest.mark.parametrize("scaling", [1.0, 1.2])  # YaRN / longrope scale cos and sin by an attention factor
def test_remove_inverts_apply(layout, scaling):
    torch.manual_seed(1)
    k = torch.randn(1, 2, 300, 128) * 3 + 5  # a constant offset, as a key bias gives
    cos, sin = _tables(300, 128, layout, scaling)
    back = remove_rope(apply_rope(k, cos, sin, layout), cos, sin, layout)
    torch.testing.assert_close(back, k, rtol=0, atol=1e-4)
    assert not torch.allclose(apply_rope(k, cos, sin, layout), k * scaling, atol=1e-2)  # it does rotate


def test_partial_rotary_passes_the_rest_through():
    torch.manual_seed(2)
    k = torch.randn(1, 1, 9, 80)
    cos, sin = _tables(9, 32, "half")
    out = apply_rope(k, cos, sin)
    assert torch.equal(out[..., 32:], k[..., 32:])
    torch.testing.assert_close(remove_rope(out, cos, sin), k, rtol=0, atol=1e-5)


def test_rotation_preserves_dot_products_relative_to_position():
    """q(p) . k(t) depends on p - t only: the property that lets keys be stored before RoPE."""
    torch.manual_seed(3)
    q, k = torch.randn(64), torch.randn(64)
    cos, sin = _tables(40, 64, "half")
    dot = lambda p, t: float(apply_rope(q[None], cos[p:p + 1], sin[p:p + 1])[0]  # noqa: E731
                             @ apply_rope(k[None], cos[t:t + 1], sin[t:t + 1])[0])
    assert dot(30, 10) == pytest.approx(dot(25, 5), abs=1e-4)


def test_tables_match_the_models_rotary_embedding():
    from transformers import LlamaConfig
    from transformers.models.llama.modeling_llama import LlamaRotaryEmbedding

    for scaling in (None, {"rope_type": "linear", "factor": 4.0}, {"rope_type": "llama3", "factor": 8.0,
                    "low_freq_factor": 1.0, "high_freq_factor": 4.0, "original_max_position_embeddings": 64}):
        cfg = LlamaConfig(hidden_size=128, num_attention_heads=2, num_key_value_heads=1, max_position_embeddings=512,
                          rope_scaling=scaling)
        emb = LlamaRotaryEmbedding(cfg)
        pos = torch.arange(300)[None]
        cos, sin = emb(torch.zeros(1, 300, 128), pos)
        mine_cos, mine_sin = rope_tables(emb.inv_freq, pos, emb.attention_scaling)
        assert torch.equal(mine_cos, cos) and torch.equal(mine_sin, sin)  # the model's own, to the bit


def test_bad_input_raises_naming_what_is_allowed():
    k = torch.randn(1, 1, 4, 8)
    cos, sin = _tables(4, 8, "half")
    with pytest.raises(ValueError, match="layout must be one of"):
        apply_rope(k, cos, sin, "neox")
    with pytest.raises(ValueError, match="cover 4 positions, x holds 5"):
        apply_rope(torch.randn(1, 1, 5, 8), cos, sin)
    with pytest.raises(ValueError, match="rotary width .* <= head_dim 4"):
        apply_rope(torch.randn(1, 1, 4, 4), cos, sin)
    with pytest.raises(ValueError, match="same shape"):
        apply_rope(k, cos, sin[:, :4])
    with pytest.raises(TypeError, match="floating-point"):
        apply_rope(k.long(), cos, sin)
    with pytest.raises(ValueError, match="cos\\^2 \\+ sin\\^2 must be > 0"):
        remove_rope(k, cos * 0, sin * 0)
    with pytest.raises(TypeError, match="positions must be integers"):
        rope_tables(torch.ones(4), torch.arange(4.0))
    with pytest.raises(ValueError, match="inv_freq must be"):
        rope_tables(torch.ones(2, 2), torch.arange(4))


def test_non_finite_keys_stay_where_they_are():
    """NaN / Inf in a key stays in its own channel pair (no silent spreading to other channels)."""
    k = torch.zeros(1, 1, 3, 8)
    k[0, 0, 1, 0] = float("nan")
    cos, sin = _tables(3, 8, "half")
    out = apply_rope(k, cos, sin)
    assert torch.isnan(out[0, 0, 1, [0, 4]]).all() and torch.isfinite(out[0, 0, 1, [1, 2, 3, 5, 6, 7]]).all()
    assert torch.isfinite(out[0, 0, [0, 2]]).all()


def test_bf16_in_bf16_out_float32_inside():
    k = torch.randn(1, 1, 6, 16).bfloat16()
    cos, sin = _tables(6, 16, "half")
    out = apply_rope(k, cos, sin)
    assert out.dtype == torch.bfloat16
    torch.testing.assert_close(remove_rope(out, cos, sin).float(), k.float(), rtol=0.02, atol=0.02)


@pytest.mark.parametrize("layout", ["half", "interleaved"])
@pytest.mark.parametrize("r", [64, 32])
def test_rotate_equals_the_table_functions(layout, r):
    """The read path's rotation (one cosine and sine per pair, no table) against apply_rope and
    remove_rope with rope_tables, per-head positions and a YaRN-like scaling included."""
    from kv_cache.compression.rope import rotate

    g = torch.Generator().manual_seed(0)
    x = torch.randn(2, 3, 7, 64, generator=g)
    inv_freq = 1.0 / (10000 ** (torch.arange(0, r, 2).float() / r))
    pos = torch.randint(0, 5000, (2, 3, 7), generator=g)
    cos, sin = rope_tables(inv_freq, pos, 1.2, layout)
    torch.testing.assert_close(rotate(x, pos, inv_freq, 1.2, layout), apply_rope(x, cos, sin, layout),
                               rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(rotate(x, pos, inv_freq, 1.2, layout, inverse=True), remove_rope(x, cos, sin, layout),
                               rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(rotate(rotate(x, pos, inv_freq, 1.2, layout), pos, inv_freq, 1.2, layout,
                                      inverse=True), x, rtol=1e-5, atol=1e-5)
    with pytest.raises(TypeError, match="integers"):
        rotate(x, pos.float(), inv_freq)
    with pytest.raises(ValueError, match="scaling"):
        rotate(x, pos, inv_freq, 0.0)
