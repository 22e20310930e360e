"""``QuantConfig(bits=b)``'s defaults: the measured layout at 2-4 bits (per-token keys before RoPE,
centered and half-whitened; rotated Lloyd-Max keys and values; math dictionary §29.7), the
per-channel layout after RoPE one argument away (``pre_rope=False``, §25), KIVI with 8 bits."""

from __future__ import annotations

import dataclasses

import pytest
import torch

from kv_cache import CompressedCache, QuantConfig, compress
from kv_cache.cache.config import AUTO, BEST_LAYOUT, DEFAULT_LAYOUT, KIVI_LAYOUT, PRE_ROPE_LAYOUT
from kv_cache.eval.accounting import walked_nbytes
from kv_cache.spec.grammar import parse_method, parse_quant


def _layout(q: QuantConfig, names=BEST_LAYOUT) -> dict:
    return {name: getattr(q, name) for name in names}


@pytest.mark.parametrize("bits", [2, 3, 4])
def test_low_bit_defaults_are_the_best_layout(bits):
    q = QuantConfig(bits=bits)
    assert _layout(q, DEFAULT_LAYOUT) == DEFAULT_LAYOUT
    assert q.channel_group_for(64) == 64 and q.channel_group_for(128) == 128  # one norm per vector
    assert AUTO not in {str(v) for v in dataclasses.asdict(q).values()}  # every field is concrete
    # the per-channel layout after RoPE (the default before wave 6): one argument away, and what
    # a model whose RoPE cannot be removed gets
    assert _layout(QuantConfig(bits=bits, pre_rope=False)) == BEST_LAYOUT
    assert QuantConfig(bits=bits).after_rope() == QuantConfig(bits=bits, pre_rope=False)
    assert _layout(QuantConfig(bits=bits, key_grouping="channel")) == BEST_LAYOUT
    with pytest.raises(ValueError, match="asked for explicitly"):
        QuantConfig(bits=bits, pre_rope=True).after_rope()


def test_eight_bits_and_kivi_keep_the_original_layout():
    assert _layout(QuantConfig(bits=8), KIVI_LAYOUT) == KIVI_LAYOUT
    assert _layout(QuantConfig(bits=2, layer_bits={3: 8}), KIVI_LAYOUT) == KIVI_LAYOUT  # no Lloyd-Max levels at 8 bits
    assert _layout(QuantConfig(bits=8, key_bits=4), KIVI_LAYOUT) == KIVI_LAYOUT
    for bits in (2, 3, 4, 8):
        q = QuantConfig.kivi(bits=bits)
        assert _layout(q, KIVI_LAYOUT) == KIVI_LAYOUT
        # exactly the string the committed evidence was resolved with (kvcache eval resumes by it)
        assert repr(q) == (f"QuantConfig(bits={bits}, group_size=32, residual_length=32, sink_tokens=0, "
                           "symmetric=False, scale_dtype=torch.float16)")
    assert QuantConfig.kivi(bits=4, rotation="hadamard").rotation == "hadamard"  # arguments win


def test_explicit_fields_win_and_dependent_fields_follow():
    q = QuantConfig(bits=4, key_grouping="token", pre_rope=False)  # a wave-4 default: per-token keys after RoPE
    assert (q.group_size, q.residual_length, q.levels, q.scale_dtype, q.channel_group, q.center_keys) == (
        4, 4, "lloyd_max", torch.uint8, "head", True)
    assert q.scale_keys is False  # a key scale needs keys before RoPE
    q = QuantConfig(bits=4, scale_keys=False)  # wave 5's per-token codes before RoPE
    assert _layout(q, PRE_ROPE_LAYOUT) == PRE_ROPE_LAYOUT
    assert q.rotation == "hadamard" and q.sink_tokens == 4
    q = QuantConfig(bits=4, levels="uniform")  # uniform levels everywhere: KIVI's keys and fp16 scales
    assert (q.group_size, q.levels, q.scale_dtype, q.center_keys) == (32, "uniform", torch.float16, False)
    q = QuantConfig(bits=2, levels="uniform")  # uniform levels: fp16 scales and zero points, 32-channel groups
    assert (q.scale_dtype, q.channel_group_for(64), q.key_grouping) == (torch.float16, 32, "channel")
    q = QuantConfig(bits=3, rotation=None, sink_tokens=0, residual_dtype=None, scale_dtype=torch.float16)
    assert (q.rotation, q.sink_tokens, q.residual_dtype, q.scale_dtype, q.levels) == (
        None, 0, None, torch.float16, "lloyd_max")
    q = QuantConfig(bits=2, channel_group=16)
    assert q.channel_group_for(64) == 16
    with pytest.raises(ValueError, match='channel_group must be an int >= 1, "head" or None; got 0'):
        QuantConfig(bits=2, channel_group=0)
    with pytest.raises(ValueError, match="needs norm-only scales"):
        QuantConfig(bits=2, levels="uniform", scale_dtype=torch.uint8)


def test_replace_and_equality_keep_concrete_values():
    q = QuantConfig(bits=2)
    assert dataclasses.replace(q, bits=3) == QuantConfig(bits=3)
    with pytest.raises(ValueError, match="supports bits"):  # replace passes the resolved (Lloyd-Max) fields on
        dataclasses.replace(q, bits=8)
    assert QuantConfig(bits=2) == QuantConfig(bits=2) and hash(QuantConfig(bits=2)) == hash(QuantConfig(bits=2))


def test_specs_start_from_kivi_or_from_the_defaults():
    assert parse_quant("q4") == QuantConfig.kivi(bits=4)
    assert parse_quant("q4d") == QuantConfig(bits=4)
    assert parse_quant("q2ds0") == QuantConfig(bits=2, sink_tokens=0)
    assert parse_quant("q3dk4") == QuantConfig(bits=3, key_bits=4)
    assert parse_method("q2d+h2o@0.5").resolved.startswith(f"kv_cache quant={QuantConfig(bits=2)!r}")
    with pytest.raises(ValueError, match="unknown method|cannot parse"):
        parse_method("q4gd")  # d comes right after the bits


def test_default_cache_in_generate_counts_every_byte(stories, tmp_path):
    from kv_cache.cache.serialize import load_cache, save_cache

    model, tok = stories
    ids = tok("Once upon a time there was a little girl who liked to play in the park with her dog. " * 3,
              return_tensors="pt").input_ids
    cache = CompressedCache(model.config, quant=QuantConfig(bits=2))
    with compress(model, cache):
        out = model.generate(ids, past_key_values=cache, max_new_tokens=6, do_sample=False)
    assert out.shape[1] == ids.shape[1] + 6
    rep = cache.memory_report()
    assert rep.total_bytes == walked_nbytes(cache)
    layer = cache.layers[0].storage
    # per-channel keys: float16 scales and zero points per 32-token group; values: 8-bit log-coded norms
    assert layer.packed.k_scale.dtype == torch.float16 and layer.packed.v_scale.dtype == torch.uint8
    assert layer.sink_keys.dtype == torch.float16 and not layer.packed.rotation.keys
    assert layer.packed.rotation is not None and layer.n_sinks == 4
    path = tmp_path / "c.kvc"
    save_cache(cache, path, model_config=model.config)
    loaded, _ = load_cache(path, model_config=model.config)
    assert loaded.quant == cache.quant  # concrete fields round-trip


def _tiny(model_type: str, **kw):
    from transformers import AutoConfig

    base = dict(vocab_size=128, hidden_size=128, intermediate_size=64, num_hidden_layers=2, num_attention_heads=2,
                num_key_value_heads=1, max_position_embeddings=256)
    return AutoConfig.for_model(model_type, **{**base, **kw})


def test_the_default_follows_the_model():
    """The rule read from the model (math dictionary §29.7): heads of 64 channels or more with a
    RoPE the cache can remove get per-token keys before RoPE (a frame per layer, the mean and the
    half-whitening scale held per channel and counted); narrower heads keep per-channel groups
    after RoPE, as does a model without RoPE, with a warning; an explicit pre_rope=True is refused."""
    from transformers import AutoModelForCausalLM

    config = _tiny("llama", head_dim=64)
    torch.manual_seed(0)
    model = AutoModelForCausalLM.from_config(config).eval()
    cache = CompressedCache(config, quant=QuantConfig(bits=4))
    assert cache.quant == QuantConfig(bits=4) and cache.quant.scale_keys == "sqrt"
    assert all(layer.rope_frame is not None for layer in cache.layers)
    ids = torch.randint(3, 128, (1, 40), generator=torch.Generator().manual_seed(0))
    with torch.no_grad(), compress(model, cache):
        model(ids, past_key_values=cache)
    assert cache.layers[0].key_offset.shape[2] == 2  # mean and scale
    assert cache.memory_report().total_bytes == walked_nbytes(cache)

    narrow = CompressedCache(_tiny("llama", head_dim=32), quant=QuantConfig(bits=3))
    assert narrow.quant == QuantConfig(bits=3, pre_rope=False)
    assert all(layer.rope_frame is None for layer in narrow.layers)
    assert CompressedCache(_tiny("llama", head_dim=32), quant=QuantConfig(bits=3, pre_rope=True)).quant.pre_rope

    no_rope = _tiny("gpt2", n_embd=128, n_head=2, n_layer=1)
    with pytest.warns(UserWarning, match="stores keys before RoPE by default"):
        cache = CompressedCache(no_rope, quant=QuantConfig(bits=2))
    assert cache.quant == QuantConfig(bits=2, pre_rope=False)
    with pytest.raises(ValueError, match="has none"):
        CompressedCache(no_rope, quant=QuantConfig(bits=2, pre_rope=True))


def test_files_written_before_the_new_fields_load_as_before():
    """A saved layout without ``pre_rope`` / ``scale_keys`` (a ``.kvc`` file or plan from before
    they existed) means what it meant then: keys after RoPE, unscaled, not today's default."""
    from kv_cache.cache.serialize_state import decode_quant, encode_quant

    old = QuantConfig(bits=4, pre_rope=False)
    saved = encode_quant(old)
    assert "pre_rope" not in saved and "scale_keys" not in saved
    assert decode_quant(saved) == old
    new = encode_quant(QuantConfig(bits=4))
    assert new["pre_rope"] is True and new["scale_keys"] == "sqrt" and decode_quant(new) == QuantConfig(bits=4)
