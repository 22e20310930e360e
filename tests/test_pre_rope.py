"""Keys stored before RoPE (``QuantConfig(pre_rope=True)``, math dictionary §29).

Model-free: each layer's frame read from the config (rope types, partial rotary, per-layer-type
bases, layers without RoPE) equals the model's own rotary embedding, and the configs it cannot
serve are refused. On tiny random models: an 8-bit pre-RoPE cache gives the full cache's logits
on both attention paths, for every rope type (dynamic NTK past its original context included);
positions travel through eviction; every byte is counted; what is not supported yet says so.
"""

from __future__ import annotations

import pytest
import torch
from transformers import AutoConfig, AutoModelForCausalLM, DynamicCache

import kv_cache
from kv_cache import H2O, CompressedCache, QuantConfig, SnapKV, StreamingLLM
from kv_cache.compression.positions import pack_mask, unpack_mask
from kv_cache.cache.packed import _held
from kv_cache.cache.pre_rope_layer import BITMAP_SLACK, grow_mask
from kv_cache.cache.rope_frame import rope_frames
from kv_cache.spec import parse_ours

BASE = dict(vocab_size=256, hidden_size=64, intermediate_size=96, num_hidden_layers=2, num_attention_heads=4,
            num_key_value_heads=2, head_dim=32, max_position_embeddings=64, pad_token_id=0, bos_token_id=1,
            eos_token_id=2)
ROPE_TYPES = {
    "default": {"rope_type": "default", "rope_theta": 10000.0},
    "linear": {"rope_type": "linear", "factor": 2.0, "rope_theta": 10000.0},
    "dynamic": {"rope_type": "dynamic", "factor": 2.0, "rope_theta": 10000.0},
    "yarn": {"rope_type": "yarn", "factor": 4.0, "rope_theta": 10000.0, "original_max_position_embeddings": 32},
    "llama3": {"rope_type": "llama3", "factor": 8.0, "rope_theta": 500000.0, "low_freq_factor": 1.0,
               "high_freq_factor": 4.0, "original_max_position_embeddings": 32},
}


def _config(model_type: str = "llama", **kw):
    return AutoConfig.for_model(model_type, **{**BASE, **kw})


def _model(model_type: str = "llama", **kw):
    torch.manual_seed(0)
    model = AutoModelForCausalLM.from_config(_config(model_type, **kw), attn_implementation="eager").eval()
    with torch.no_grad():
        for p in model.parameters():
            if p.dim() == 2:
                p.mul_(2.5)
    return model


def _q8(pre_rope: bool = True, **more) -> QuantConfig:
    """Per-token keys at 8 bits, before RoPE (or after: the same layout, to compare with); the
    frame's round trip is what is left to see."""
    return QuantConfig(bits=8, pre_rope=pre_rope, key_grouping="token", rotation="hadamard", center_keys=True,
                       group_size=1, residual_length=0, channel_group=None, **more)


def _own_tables(model, positions: torch.Tensor, layer_type: str | None = None):
    rotary = model.model.rotary_emb
    x = torch.zeros(1, 1, dtype=torch.float32)
    kw = {} if layer_type is None else {"layer_type": layer_type}
    return rotary(x, positions[None], **kw)


# ---------------------------------------------------------------------- the frame, model-free
@pytest.mark.parametrize("rope", list(ROPE_TYPES))
def test_the_frame_is_the_models_own(rope):
    model = _model(rope_parameters=ROPE_TYPES[rope])
    frame = rope_frames(model.config, 32)[0]
    pos = torch.arange(0, 48)
    cos, sin = frame.tables(pos, torch.device("cpu"))
    own_cos, own_sin = _own_tables(model, pos)
    torch.testing.assert_close(cos, own_cos[0], rtol=0, atol=1e-6)
    torch.testing.assert_close(sin, own_sin[0], rtol=0, atol=1e-6)


def test_partial_rotary_rotates_its_channels_only():
    cfg = _config("phi", rope_parameters={"rope_type": "default", "rope_theta": 10000.0,
                                          "partial_rotary_factor": 0.5})
    frame = rope_frames(cfg, 32)[0]
    assert frame.inv_freq.numel() == 8  # 16 of 32 channels turn
    k = torch.randn(1, 2, 5, 32)
    pos = torch.arange(5)
    stored = frame.remove(k, pos)
    torch.testing.assert_close(stored[..., 16:], k[..., 16:])
    torch.testing.assert_close(frame.apply(stored, pos), k, rtol=0, atol=1e-5)


def test_per_layer_type_bases_and_layers_without_rope():
    model = _model("gemma3_text", sliding_window=16, layer_types=["sliding_attention", "full_attention"])
    frames = rope_frames(model.config, 32)
    pos = torch.arange(40)
    for frame, kind in zip(frames, ["sliding_attention", "full_attention"]):
        torch.testing.assert_close(frame.tables(pos, torch.device("cpu"))[0], _own_tables(model, pos, kind)[0][0],
                                   rtol=0, atol=1e-6)
    assert not torch.equal(frames[0].inv_freq, frames[1].inv_freq)  # local 10K, global 1M bases
    cfg = _config("smollm3", no_rope_layers=[1, 0])
    assert [f is None for f in rope_frames(cfg, 32)] == [False, True]
    assert rope_frames(_config("cohere2"), 32)[0].layout == "interleaved"


@pytest.mark.parametrize("kind,kw,match", [
    ("no rope", dict(model_type="gpt2"), "has none"),
    ("mrope", dict(rope_parameters={"rope_type": "default", "rope_theta": 1e6, "mrope_section": [4, 6, 6]}),
     "multimodal RoPE"),
    ("unknown type", dict(rope_parameters={"rope_type": "spiral", "rope_theta": 1e4}), "spiral"),
])
def test_models_the_frame_cannot_serve_are_refused(kind, kw, match):
    model_type = kw.pop("model_type", "llama")
    cfg = AutoConfig.for_model(model_type, **({**BASE, **kw} if model_type == "llama" else
                                              dict(n_layer=2, n_head=2, n_embd=64)))
    with pytest.raises(ValueError, match=match) as err:
        CompressedCache(cfg, quant=QuantConfig(bits=4, pre_rope=True, key_grouping="token"))
    assert "pre_rope=False" in str(err.value)


# ---------------------------------------------------------------------- the kept arrivals' bitmap
def test_the_bitmap_round_trips_and_reads_right_aligned():
    from kv_cache.compression.positions import kept_mask, pack_mask, slot_positions, unpack_mask

    mask = torch.rand(2, 3, 21, generator=torch.Generator().manual_seed(0)) < 0.4
    packed = pack_mask(mask)
    assert packed.shape == (2, 3, 3) and packed.dtype == torch.uint8
    assert torch.equal(unpack_mask(packed, 21), mask)
    L = int(mask.sum(-1).max())
    pos = slot_positions(mask, L)
    for b in range(2):
        for h in range(3):
            kept = mask[b, h].nonzero().squeeze(1)
            assert torch.equal(pos[b, h, L - kept.numel():], kept)
    # keeping slots by index (rectangular) or by mask (ragged) gives back the arrivals they held
    rect = torch.arange(8).expand(2, 3, 8)
    assert torch.equal(kept_mask(rect, torch.tensor([1, 5]).expand(2, 3, 2), 10).nonzero()[:, 2].unique(),
                       torch.tensor([1, 5]))
    slots = torch.zeros(2, 3, 8, dtype=torch.bool)
    slots[0, 0, 7] = True
    assert kept_mask(rect + 2, slots, 10).nonzero().tolist() == [[0, 0, 9]]
    with pytest.raises(TypeError, match="bool"):
        pack_mask(mask.int())
    with pytest.raises(ValueError, match="more than its"):
        slot_positions(mask, 1)


# ---------------------------------------------------------------------- exact on tiny models
def _run(model, cache, ids, split: int, native: bool):
    ctx = kv_cache.compress(model, cache) if native else torch.no_grad()
    with torch.no_grad(), ctx:
        out = [model(ids[:, :split], past_key_values=cache).logits]
        out += [model(ids[:, i:i + 1], past_key_values=cache).logits for i in range(split, ids.shape[1])]
    return torch.cat(out, dim=1)


@pytest.mark.parametrize("native", [False, True], ids=["reference", "native"])
@pytest.mark.parametrize("rope", list(ROPE_TYPES))
def test_eight_bit_pre_rope_matches_the_full_cache(rope, native):
    """Past ``max_position_embeddings`` (64) too: dynamic NTK changes the model's frequencies
    there, the frame keeps its own, and the keys read back are still the model's."""
    model = _model(rope_parameters=ROPE_TYPES[rope])
    ids = torch.randint(3, 256, (1, 90), generator=torch.Generator().manual_seed(0))
    with torch.no_grad():
        ref = _run(model, DynamicCache(config=model.config), ids, 50, False)
    got = _run(model, CompressedCache(model.config, quant=_q8(), fidelity_threshold=1e9), ids, 50, native)
    assert (got - ref).abs().max() < 0.05 * ref.abs().max()


@pytest.mark.parametrize("native", [False, True], ids=["reference", "native"])
def test_per_channel_groups_before_rope_match_the_full_cache(native):
    """The default layout's per-channel key groups (KIVI at 8 bits: a 32-token residual, groups
    flushed 32 at a time) stored before RoPE: the keys read back are the model's."""
    model = _model(rope_parameters=ROPE_TYPES["yarn"])
    ids = torch.randint(3, 256, (1, 90), generator=torch.Generator().manual_seed(0))
    with torch.no_grad():
        ref = _run(model, DynamicCache(config=model.config), ids, 50, False)
    q = QuantConfig(bits=8, pre_rope=True)
    assert q.key_grouping == "channel"
    got = _run(model, CompressedCache(model.config, quant=q, fidelity_threshold=1e9), ids, 50, native)
    assert (got - ref).abs().max() < 0.05 * ref.abs().max()


@pytest.mark.parametrize("scale", [True, "sqrt"])
@pytest.mark.parametrize("native", [False, True], ids=["reference", "native"])
def test_scaled_channels_are_scaled_back(native, scale):
    """``scale_keys``: keys held as ``(k - mu) / sigma`` (or ``/ sqrt(sigma)``, the default's
    half-whitening) come back as the model's."""
    model = _model("qwen2")
    ids = torch.randint(3, 256, (1, 80), generator=torch.Generator().manual_seed(7))
    with torch.no_grad():
        ref = _run(model, DynamicCache(config=model.config), ids, 60, False)
    q = _q8(scale_keys=scale)
    cache = CompressedCache(model.config, quant=q, fidelity_threshold=1e9)
    got = _run(model, cache, ids, 60, native)
    assert cache.layers[0].key_offset.shape[2] == 2  # the mean and the scale, counted in the bytes
    assert (got - ref).abs().max() < 0.05 * ref.abs().max()
    with pytest.raises(ValueError, match="pre_rope=True and center_keys=True"):
        QuantConfig(bits=4, pre_rope=False, scale_keys=scale)
    with pytest.raises(ValueError, match=r"scale_keys must be one of \[False, True, 'sqrt'\].*got 'half'"):
        QuantConfig(bits=4, scale_keys="half")


def test_pre_rope_codes_beat_post_rope_codes_on_an_offset_channel():
    """A key bias (Qwen2) is a constant before RoPE and turns with position after it: centering
    removes it only before RoPE, so 2-bit per-token codes err less there."""
    model = _model("qwen2")
    ids = torch.randint(3, 256, (1, 96), generator=torch.Generator().manual_seed(1))
    with torch.no_grad():
        for layer in model.model.layers:
            layer.self_attn.k_proj.bias.copy_(torch.linspace(-8, 8, layer.self_attn.k_proj.bias.numel()))
        ref = _run(model, DynamicCache(config=model.config), ids, 64, False)
    errs = {}
    for pre in (False, True):
        cache = CompressedCache(model.config, quant=QuantConfig(bits=2, key_grouping="token", pre_rope=pre),
                                fidelity_threshold=1e9)
        errs[pre] = float((_run(model, cache, ids, 64, True) - ref)[:, 64:].abs().mean())
    assert errs[True] < errs[False]


@pytest.mark.parametrize("policy", [StreamingLLM(budget=40), H2O(budget=40, recent_window=8),
                                    SnapKV(budget=40, recent_window=8),
                                    SnapKV(budget=0.3, recent_window=4, scope="layer"),
                                    SnapKV(budget=0.3, recent_window=4, scope="model")],
                         ids=["streaming", "h2o", "snapkv", "snapkv-layer", "snapkv-model"])
def test_positions_travel_through_eviction(policy):
    """The same tokens are kept with keys stored before or after RoPE; the pre-RoPE cache
    rotates each kept key by its own position, so both give the same logits."""
    model = _model()
    ids = torch.randint(3, 256, (1, 80), generator=torch.Generator().manual_seed(2))
    outs = []
    for pre in (False, True):
        cache = CompressedCache(model.config, quant=_q8(pre), eviction=policy, fidelity_threshold=1e9)
        outs.append(_run(model, cache, ids, 60, True))
        layer = cache.layers[0]
        if pre:
            if policy.scope != "head":
                assert any(lay.storage.ragged for lay in cache.layers)  # heads hold different numbers
            assert layer.kept_arrivals is not None and layer.kept_arrivals.dtype == torch.uint8
            pos = layer.stored_positions()
            assert pos.shape[2] == layer.storage.length
            lengths = layer.storage.head_lengths()
            for b in range(pos.shape[0]):
                for h in range(pos.shape[1]):  # each head's kept arrivals in order, right-aligned
                    row = pos[b, h, pos.shape[2] - int(lengths[b, h]):]
                    assert bool((row.diff() > 0).all())
    assert (outs[0] - outs[1]).abs().max() < 0.05 * outs[0].abs().max()


@pytest.mark.parametrize("policy", [H2O(budget=40, recent_window=8), SnapKV(budget=40, recent_window=8),
                                    SnapKV(budget=0.3, recent_window=4, scope="model")],
                         ids=["h2o", "snapkv", "snapkv-model"])
def test_positions_tracked_after_rope_name_the_kept_tokens(policy):
    """``CompressedCache(track_positions=True)`` stores keys after RoPE (as given) and keeps
    which arrivals each head holds, through a prefill's eviction and H2O's eviction at every
    decoded token: the key in each kept slot is the full cache's key at that position (up to the
    float32 rounding of a batched prefill against single steps; a wrong position is off by O(1))
    (what the transform codec relies on to code keys before RoPE, §27.6)."""
    model = _model()
    ids = torch.randint(3, 256, (1, 70), generator=torch.Generator().manual_seed(4))
    full = DynamicCache()
    with torch.no_grad():
        model(ids, past_key_values=full)
    cache = CompressedCache(model.config, eviction=policy, track_positions=True, fidelity_threshold=1e9)
    _run(model, cache, ids, 56, True)
    for i, layer in enumerate(cache.layers):
        assert layer.kept_arrivals is not None and layer.rope_frame is None
        want = full.layers[i].keys  # [1, H, 70, d]
        pos = layer.stored_positions()
        lengths = layer.storage.head_lengths()
        keys = layer.stored_states()[0]
        for h in range(pos.shape[1]):
            n = int(lengths[0, h])
            p = pos[0, h, pos.shape[2] - n:]
            # a decoded token's key past layer 0 depends on the evicted cache it attended: prompt tokens there
            sel = torch.ones_like(p, dtype=torch.bool) if i == 0 else p < 56
            assert int(sel.sum()) >= 8
            got = keys[0, h, keys.shape[2] - n:]
            torch.testing.assert_close(got[sel], want[0, h, p[sel]], rtol=1e-4, atol=1e-5)
    untracked = CompressedCache(model.config, eviction=policy, fidelity_threshold=1e9)
    _run(model, untracked, ids, 56, True)
    assert all(layer.kept_arrivals is None for layer in untracked.layers)
    held = cache.memory_report().indices_bytes - untracked.memory_report().indices_bytes
    # the bitmap is counted, with the room it grows into while decoding (at most BITMAP_SLACK bytes a row)
    assert held == sum(_held(layer.kept_arrivals).nbytes for layer in cache.layers) > 0
    assert all(_held(layer.kept_arrivals).shape[2] <= -(-layer._arrived // 8) + BITMAP_SLACK for layer in cache.layers)


@pytest.mark.parametrize("policy", [None, H2O(budget=56, recent_window=8), SnapKV(budget=56, recent_window=8)],
                         ids=["no-eviction", "h2o", "snapkv"])
@pytest.mark.parametrize("layout", ["channel", "token"])
def test_pre_rope_keys_are_read_from_their_codes(policy, layout):
    """Keys before RoPE, per-channel groups (``q<b>db``) or per-token codes in a Hadamard space
    (``q<b>dtb``), are read from their codes: the view holds the packed block with its positions
    (:class:`~kv_cache.kernels.KeyRope`, §29.8), not a dequantized copy, and the query is not
    rotated; it reads the same keys as the dense path, and after eviction the logits equal a
    post-RoPE cache's keeping the same tokens."""
    from kv_cache.attention.blocks import QuantBlock
    from kv_cache.attention.dense import materialize

    model = _model(rope_parameters=ROPE_TYPES["yarn"])
    ids = torch.randint(3, 256, (1, 110), generator=torch.Generator().manual_seed(5))
    outs = []
    for pre in (False, True):
        quant = QuantConfig(bits=8, pre_rope=pre) if layout == "channel" else _q8(pre)
        cache = CompressedCache(model.config, quant=quant, eviction=policy, fidelity_threshold=1e9)
        outs.append(_run(model, cache, ids, 96, True))
    for layer in cache.layers:
        view = layer.stored_blocks()
        packed = [b for b in view if isinstance(b, QuantBlock)]
        assert len(packed) == 1 and packed[0].keys.rope is not None
        assert (packed[0].keys.rope.signs is not None) == (layout == "token")
        assert packed[0].rotation is None or not packed[0].rotation.keys
        assert packed[0].keys.rope.positions.shape == (2, packed[0].length)
        keys, values, _ = materialize(view)
        want_keys, want_values = layer.stored_states()
        torch.testing.assert_close(keys, want_keys.float(), rtol=1e-3, atol=1e-3)
        torch.testing.assert_close(values, want_values.float())
        if policy is not None:
            assert layer.kept_arrivals is not None
    assert (outs[0] - outs[1]).abs().max() < 0.05 * outs[0].abs().max()


@pytest.mark.parametrize("scope", ["layer", "model"])
def test_ragged_heads_are_read_from_their_codes(scope):
    """Heads holding different numbers of tokens (a shared budget) in the packed ragged layout:
    the frozen buffer's packed keys carry their positions laid out like the codes, its sinks and
    full-precision part are turned in the view, and decoded tokens land in a turned tail; the
    view reads the dense path's keys, and the logits equal a post-RoPE cache's."""
    from kv_cache.attention.dense import materialize
    from kv_cache.attention.flat import FlatRaggedBlock

    model = _model()
    ids = torch.randint(3, 256, (1, 100), generator=torch.Generator().manual_seed(9))
    outs = []
    for pre in (False, True):
        cache = CompressedCache(model.config, quant=_q8(pre),
                                eviction=SnapKV(budget=0.4, recent_window=4, scope=scope), fidelity_threshold=1e9)
        outs.append(_run(model, cache, ids, 80, True))
    seen = 0
    for layer in cache.layers:
        view = layer.stored_blocks()
        flat = [b for b in view if isinstance(b, FlatRaggedBlock)]
        if not flat:
            continue
        seen += 1
        assert flat[0].key_rope is not None and flat[0].key_rope.positions.stride(0) == 0
        keys, values, held = materialize(view)
        want_keys, want_values = layer.stored_states()
        keep = held if held is not None else torch.ones(keys.shape[:3], dtype=torch.bool)
        torch.testing.assert_close(keys[keep], want_keys.float()[keep], rtol=1e-3, atol=1e-3)
    assert seen
    assert (outs[0] - outs[1]).abs().max() < 0.05 * outs[0].abs().max()


@pytest.mark.parametrize("scope", ["head", "layer"])
def test_the_evicted_tier_keeps_its_positions(scope):
    """Tokens a one-shot policy does not keep are demoted (``evicted_bits``), rotated back at
    their own positions: the same logits as the post-RoPE tiers."""
    model = _model()
    ids = torch.randint(3, 256, (1, 80), generator=torch.Generator().manual_seed(4))
    outs = []
    for pre in (False, True):
        q = _q8(pre, evicted_bits=8)
        cache = CompressedCache(model.config, quant=q, eviction=SnapKV(budget=0.3, recent_window=4, scope=scope),
                                fidelity_threshold=1e9)
        outs.append(_run(model, cache, ids, 60, True))
        assert all(layer.demoted is not None for layer in cache.layers)
        if pre:
            layer = cache.layers[0]
            held = layer.held_tensors()
            assert "demoted_arrivals" in held
            kept = unpack_mask(layer.kept_arrivals, layer._arrived)
            demoted = unpack_mask(layer.demoted_arrivals, 8 * layer.demoted_arrivals.shape[-1])[..., :layer._arrived]
            demoted = torch.nn.functional.pad(demoted, (0, kept.shape[-1] - demoted.shape[-1]))
            assert not bool((kept & demoted).any()) and bool((kept | demoted)[..., :60].all())
    assert (outs[0] - outs[1]).abs().max() < 0.05 * outs[0].abs().max()


def test_every_byte_is_counted():
    model = _model()
    ids = torch.randint(3, 256, (1, 80), generator=torch.Generator().manual_seed(3))
    cache = CompressedCache(model.config, quant=QuantConfig(bits=4, pre_rope=True, key_grouping="token"),
                            eviction=StreamingLLM(budget=40), fidelity_threshold=1e9)
    _run(model, cache, ids, 60, True)
    layer = cache.layers[0]
    held = layer.held_tensors()
    assert "kept_arrivals" in held and "rope.inv_freq" in held
    assert held["kept_arrivals"].shape == (1, 2, 10)  # one bit per token seen (80) and KV head
    assert sum(layer.nbytes_by_category().values()) == sum(t.nbytes for t in held.values())


def test_quantized_on_arrival_with_one_norm_per_vector():
    q = QuantConfig(bits=3, pre_rope=True, key_grouping="token")
    assert (q.key_grouping, q.residual_length, q.group_size, q.center_keys) == ("token", 0, 1, True)
    assert q.scale_dtype == torch.uint8 and q.channel_group == "head"
    cache, _ = parse_ours("q3dtb", None)[0].make(_model())
    assert cache.quant == q
    assert q == QuantConfig(bits=3) and q.scale_keys == "sqrt"  # the default since wave 6
    channel = QuantConfig(bits=3, pre_rope=True, key_grouping="channel")  # per-channel groups, keys before RoPE
    assert (channel.key_grouping, channel.group_size, channel.residual_length) == ("channel", 32, 32)
    assert parse_ours("q3dbm", None)[0].make(_model())[0].quant == channel


@pytest.mark.parametrize("make,match", [
    (lambda cfg: QuantConfig(bits=4, pre_rope="yes"), "True or False"),
])
def test_what_is_not_supported_yet_says_so(make, match):
    with pytest.raises(ValueError, match=match):
        make(_config())


@pytest.mark.parametrize("policy,evicted", [(None, None), (SnapKV(budget=0.3, recent_window=4), None),
                                            (SnapKV(budget=0.3, recent_window=4, scope="layer"), 2)],
                         ids=["no-eviction", "snapkv", "tiers-ragged"])
def test_a_saved_cache_keeps_its_positions(tmp_path, policy, evicted):
    from kv_cache.cache.serialize import load_cache, save_cache

    model = _model()
    ids = torch.randint(3, 256, (1, 80), generator=torch.Generator().manual_seed(5))
    cache = CompressedCache(model.config, quant=QuantConfig(bits=4, pre_rope=True, evicted_bits=evicted),
                            eviction=policy, fidelity_threshold=1e9)
    _run(model, cache, ids[:, :70], 60, True)
    save_cache(cache, tmp_path / "c.kvc")
    loaded, _ = load_cache(tmp_path / "c.kvc", model_config=model.config)
    for a, b in zip(cache.layers, loaded.layers):
        assert a._arrived == b._arrived and b.rope_frame is not None
        assert torch.equal(a.stored_positions().expand(b.stored_positions().shape), b.stored_positions())
    with torch.no_grad(), kv_cache.compress(model, cache):
        want = model(ids[:, 70:], past_key_values=cache).logits
    with torch.no_grad(), kv_cache.compress(model, loaded):
        got = model(ids[:, 70:], past_key_values=loaded).logits
    torch.testing.assert_close(got, want)


def test_a_damaged_bitmap_is_refused(tmp_path):
    from kv_cache.cache.serialize import load_cache, save_cache
    from kv_cache.cache.serialize_state import _decode_positions

    model = _model()
    cache = CompressedCache(model.config, quant=QuantConfig(bits=4, pre_rope=True, key_grouping="token"),
                            eviction=SnapKV(budget=0.3, recent_window=4), fidelity_threshold=1e9)
    _run(model, cache, torch.randint(3, 256, (1, 70), generator=torch.Generator().manual_seed(6)), 60, True)
    save_cache(cache, tmp_path / "ok.kvc")  # an intact file loads
    load_cache(tmp_path / "ok.kvc", model_config=model.config)
    layer = cache.layers[0]

    class Reader:
        def tensor(self, name):
            return torch.zeros_like(layer.kept_arrivals)  # no arrival kept: the heads hold tokens
    with pytest.raises(ValueError, match="kept_arrivals does not match"):
        _decode_positions(layer, {"arrived": layer._arrived, "kept_arrivals": "x"}, Reader())
    with pytest.raises(ValueError, match="needs its arrivals"):
        _decode_positions(layer, {"arrived": 3}, Reader())


def test_a_dense_read_says_so_once():
    """Keys before RoPE in a Hadamard space of a head_dim that is not a power of two cannot be
    turned from their codes in the kernels (§29.8): the layer reads a dense dequantized copy, and
    the cache says so once, with a PerformanceWarning, whatever the layers and steps."""
    import warnings

    from kv_cache import PerformanceWarning

    model = _model(head_dim=48, hidden_size=96, num_attention_heads=2, num_key_value_heads=1)
    ids = torch.randint(3, 256, (1, 40), generator=torch.Generator().manual_seed(5))
    cache = CompressedCache(model.config, quant=QuantConfig(bits=4, pre_rope=True, key_grouping="token"),
                            fidelity_threshold=1e9)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        _run(model, cache, ids, 30, True)
    perf = [w for w in caught if issubclass(w.category, PerformanceWarning)]
    assert len(perf) == 1 and "head_dim 48, not a power of two" in str(perf[0].message)
    fast = CompressedCache(model.config, quant=QuantConfig(bits=4, pre_rope=True, key_grouping="token",
                                                           rotation=None), fidelity_threshold=1e9)
    with warnings.catch_warnings():
        warnings.simplefilter("error", PerformanceWarning)
        _run(model, fast, ids, 30, True)  # no rotation: the kernels turn the keys from their codes


@pytest.mark.parametrize("arrivals", [0, 1, 7, 8, 13, 100])
def test_the_kept_arrivals_grow_in_place(arrivals):
    """Decoding after an eviction sets each arrival's bit in place (O(1) per step, no unpack and
    repack of the whole bitmap); every prefix read back is the bitmap it was."""
    torch.manual_seed(0)
    mask = torch.rand(2, 3, arrivals) < 0.5
    packed = pack_mask(mask) if arrivals else torch.zeros(2, 3, 0, dtype=torch.uint8)
    views, n = [], arrivals
    for add in (1, 1, 3, 9, 1, 30, 700, 1, 1):
        packed = grow_mask(packed, n, add)
        n += add
        mask = torch.cat([mask, torch.ones(2, 3, add, dtype=torch.bool)], 2)
        views.append((packed, n, mask))
    for view, count, want in views:  # earlier views still read their own arrivals
        assert torch.equal(unpack_mask(view, count), want)
    assert _held(packed).shape[2] <= -(-n // 8) + BITMAP_SLACK
