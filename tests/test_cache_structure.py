"""The cache's inner seams: storage layouts, the observer seam, policies that cannot act, byte counts."""

from __future__ import annotations

import pytest
import torch
from transformers import LlamaConfig

from kv_cache import H2O, CompressedCache, QuantConfig, SnapKV, StreamingLLM, compress
from kv_cache.cache.report import fp16_kv_bytes, kv_geometry
from kv_cache.cache.packed import _capacity
from kv_cache.cache.storage import FullPrecisionStorage, QuantizedStorage, make_storage
from kv_cache.compression import dequantize, quantize
from kv_cache.eval.runner import held_nbytes, walked_nbytes

from test_cache import tiny

# --------------------------------------------------------------------------- storage, model-free


def _kv(b=2, h=3, n=70, d=16, seed=0):
    g = torch.Generator().manual_seed(seed)
    return torch.randn(b, h, n, d, generator=g), torch.randn(b, h, n, d, generator=g)


def test_full_precision_storage_is_a_dynamic_cache():
    k, v = _kv()
    st = make_storage(None, k[:, :, :0], v[:, :, :0], track_groups=False)
    assert isinstance(st, FullPrecisionStorage)
    out_k, out_v = st.update(k[:, :, :50], v[:, :, :50])
    out_k, out_v = st.update(k[:, :, 50:], v[:, :, 50:])
    assert torch.equal(out_k, k) and torch.equal(out_v, v) and st.length == 70
    assert st.nbytes_by_category()["residual"] == k.nbytes + v.nbytes


@pytest.mark.parametrize("bits", [2, 3, 4, 8])
@pytest.mark.parametrize("sinks", [0, 3])
def test_quantized_storage_layout_and_reads(bits, sinks):
    """sinks | packed blocks of group_size | residual; reads are the quantizer's round trip."""
    q = QuantConfig.kivi(bits=bits, group_size=16, residual_length=16, sink_tokens=sinks)
    k, v = _kv()
    st = make_storage(q, k[:, :, :0], v[:, :, :0], track_groups=False)
    assert isinstance(st, QuantizedStorage)
    got_k, got_v = st.update(k[:, :, :37], v[:, :, :37])
    assert torch.equal(got_k, k[:, :, :37])  # this call's tokens come back as given
    got_k, got_v = st.update(k[:, :, 37:], v[:, :, 37:])
    n_packed = ((70 - sinks) // 16) * 16 if (70 - sinks) >= 16 else 0
    # 37 - sinks tokens were flushed in whole groups at the first call, the rest at the second
    first = ((37 - sinks) // 16) * 16
    second = ((70 - sinks - first) // 16) * 16
    assert st.n_sinks == sinks and st.packed.length == first + second <= n_packed
    assert st.length == 70 and st.protected() == (sinks, 70 - sinks - first - second)
    # Stored-before tokens of the second call: sinks exact, packed = quantize round trip.
    assert torch.equal(got_k[:, :, :sinks], k[:, :, :sinks])
    blk = k[:, :, sinks:sinks + first]
    ref = dequantize(quantize(blk, bits, axis=-2, group_size=16, scale_dtype=torch.float16))
    assert torch.equal(got_k[:, :, sinks:sinks + first], ref)
    ref_v = dequantize(quantize(v[:, :, sinks:sinks + first], bits, axis=-1, group_size=16,
                                scale_dtype=torch.float16))
    assert torch.equal(got_v[:, :, sinks:sinks + first], ref_v)
    cats = st.nbytes_by_category()
    assert sum(cats.values()) == sum(t.nbytes for t in st.named_tensors().values())
    # codes held: the tokens plus the room a decoding-size append leaves (GROW_TOKENS, <= 1/8 of the tokens)
    cap = _capacity(st.packed.k_codes)
    assert st.packed.length <= cap <= st.packed.length + st.packed.length // 8
    assert cats["codes"] == 2 * 2 * 3 * cap * 16 * bits // 8


def test_quantized_storage_gather_keeps_protected_and_frees_groups():
    q = QuantConfig.kivi(bits=4, group_size=8, residual_length=8, sink_tokens=2)
    k, v = _kv(b=1, h=2, n=42)
    st = make_storage(q, k[:, :, :0], v[:, :, :0], track_groups=True)
    st.append(k, v)
    lead, trail = st.protected()
    assert (lead, trail) == (2, 0) and st.packed.length == 40
    before_k, before_v = st.read()
    # keep the sinks, then group 0 and group 4 of head 0, groups 1 and 4 of head 1 (16 packed each)
    h0 = list(range(2, 10)) + list(range(34, 42))
    h1 = list(range(10, 18)) + list(range(34, 42))
    keep = torch.tensor([[[0, 1] + h0, [0, 1] + h1]])
    st.gather(keep)
    assert st.length == 18 and st.packed.k_scale.shape[2] == 3  # groups 0, 1, 4 survive
    after_k, after_v = st.read()
    for h, idx in enumerate([[0, 1] + h0, [0, 1] + h1]):
        assert torch.equal(after_k[0, h], before_k[0, h, idx])
        assert torch.equal(after_v[0, h], before_v[0, h, idx])


# --------------------------------------------------------------------------- policies that cannot act

BUDGET = 24
POLICY_MAKERS = {
    "snapkv": lambda: SnapKV(budget=BUDGET, recent_window=4),
    "h2o": lambda: H2O(budget=BUDGET, recent_window=4),
    "streaming": lambda: StreamingLLM(budget=BUDGET, recent_window=8, sink_tokens=2),
}


def _run(model, cache, ids, how):
    with torch.no_grad():
        if how == "generate":
            model.generate(ids, past_key_values=cache, max_new_tokens=6, min_new_tokens=6, do_sample=False,
                           pad_token_id=0)
        else:
            out = model(ids, past_key_values=cache, use_cache=True)
            for _ in range(6):
                out = model(out.logits[:, -1:].argmax(-1), past_key_values=cache, use_cache=True)


@pytest.mark.parametrize("how", ["generate", "forward"])
@pytest.mark.parametrize("quant", [None, QuantConfig.kivi(bits=4, group_size=4, residual_length=4)])
@pytest.mark.parametrize("in_context", [True, False])
@pytest.mark.parametrize("policy", sorted(POLICY_MAKERS))
def test_every_policy_acts_or_raises(policy, in_context, quant, how):
    """Never keep everything quietly: evict within the budget, or raise the documented error."""
    model = tiny(LlamaConfig, 4, 2)
    ids = torch.randint(3, 97, (1, 60))
    cache = CompressedCache(model.config, quant=quant, eviction=POLICY_MAKERS[policy]())
    if not in_context and cache.needs_hooks:
        with pytest.raises(RuntimeError, match=r"kv_cache\.compress\(model, cache\)"):
            _run(model, cache, ids, how)
        return
    if in_context:
        with compress(model, cache):
            _run(model, cache, ids, how)
    else:
        _run(model, cache, ids, how)
    assert cache.get_seq_length() == (65 if how == "generate" else 66)  # generate never feeds its last token
    kept = [layer.kept_length() for layer in cache.layers]
    limit = BUDGET + (0 if policy != "snapkv" else 6)  # SnapKV evicts once, then decoding appends
    assert all(k <= limit for k in kept), kept


def test_streaming_without_context_matches_with_context():
    model = tiny(LlamaConfig, 4, 2)
    ids = torch.randint(3, 97, (1, 60))
    caches = [CompressedCache(model.config, eviction=StreamingLLM(budget=BUDGET, recent_window=8, sink_tokens=2))
              for _ in range(2)]
    _run(model, caches[0], ids, "forward")
    with compress(model, caches[1], attention="reference"):  # the same sdpa attention: bit-identical
        _run(model, caches[1], ids, "forward")
    for a, b in zip(caches[0].layers, caches[1].layers):
        assert torch.equal(a.storage.keys, b.storage.keys)


def test_streaming_batch_without_context_raises():
    """Without the mask the cache cannot tell left padding from sink tokens."""
    model = tiny(LlamaConfig, 4, 2)
    cache = CompressedCache(model.config, eviction=StreamingLLM(budget=BUDGET, recent_window=8, sink_tokens=2))
    with pytest.raises(RuntimeError, match="padding"):
        _run(model, cache, torch.randint(3, 97, (2, 30)), "forward")


# --------------------------------------------------------------------------- the observer seam


def test_observer_seam_is_public_and_policy_agnostic():
    snap, h2o, stream = SnapKV(budget=64, recent_window=16), H2O(budget=64), StreamingLLM(budget=64)
    assert snap.query_window(100, 64) == 16 and snap.query_window(5, 64) == 5
    assert h2o.query_window(100, 64) == 100 and h2o.query_window(1, 64) == 1
    assert stream.query_window(100, 64) == 0
    model = tiny(LlamaConfig, 4, 2)
    cache = CompressedCache(model.config, eviction=snap)
    assert not cache.observed
    with compress(model, cache, attention="reference"):
        assert cache.observed
        layer = cache.layers[0]
        k = torch.randn(1, 2, 100, 16)
        layer.update(k, k)
        assert layer.awaits_observation and layer.query_window(100) == 16
        layer.observe(torch.randn(1, 4, 16, 16), None, 0.25)
        assert not layer.awaits_observation and layer.kept_length() == 64
    assert not cache.observed


# --------------------------------------------------------------------------- bytes counted in one place


def test_fp16_reference_formula():
    model = tiny(LlamaConfig, 4, 2)
    g = kv_geometry(model.config)
    assert (g.layers, g.kv_heads, g.head_dim) == (2, 2, 16)
    assert fp16_kv_bytes(model.config, 100, batch=3) == 2 * 2 * 3 * 2 * 16 * 100 * 2
    assert fp16_kv_bytes(model.config, 100, layers=1) == 2 * 2 * 2 * 16 * 100


@pytest.mark.parametrize("quant", [None, QuantConfig.kivi(bits=3, group_size=8, residual_length=8, sink_tokens=2)])
def test_memory_report_equals_the_generic_tensor_walk(quant):
    """Quantized, evicted, batched: the report, the held tensors and the runner's walk agree."""
    model = tiny(LlamaConfig, 4, 2)
    ids = torch.randint(3, 97, (3, 70))
    mask = torch.ones_like(ids)
    mask[1, :9] = 0  # left padding
    cache = CompressedCache(model.config, quant=quant, eviction=H2O(budget=40, recent_window=0.5))
    with torch.no_grad(), compress(model, cache):
        model.generate(ids, attention_mask=mask, past_key_values=cache, max_new_tokens=5, min_new_tokens=5, do_sample=False,
                       pad_token_id=0)
    rep = cache.memory_report()
    assert rep.total_bytes == walked_nbytes(cache) == held_nbytes(cache)
    assert rep.total_bytes == sum(t.nbytes for t in cache.held_tensors().values())
    assert rep.scores_bytes > 0 and (quant is None or rep.codes_bytes > 0)
    assert rep.tokens_seen == 74  # generate never feeds its last token
    assert rep.fp16_bytes == fp16_kv_bytes(model.config, 74, batch=3)


# --------------------------------------------------------------------------- low-bit layouts (rotation, codebook)

LAYOUTS = {
    "k3v2": QuantConfig.kivi(bits=2, key_bits=3, group_size=8, residual_length=8),
    "rotated-per-channel": QuantConfig.kivi(bits=2, group_size=8, residual_length=8, rotation="hadamard"),
    "rotated-per-token": QuantConfig.kivi(bits=2, group_size=8, residual_length=8, rotation="hadamard",
                                     key_grouping="token", channel_group=16),
    "rotated-lloyd-max": QuantConfig.kivi(bits=2, group_size=8, residual_length=8, rotation="hadamard",
                                     key_grouping="token", channel_group=16, levels="lloyd_max"),
    "layer-bits": QuantConfig.kivi(bits=2, group_size=8, residual_length=8, layer_bits={0: 4}),
}


@pytest.mark.parametrize("name", sorted(LAYOUTS))
def test_low_bit_layouts_read_back_their_reference(name):
    """Each layout stores what the plain pipeline gives: rotate -> quantize -> dequantize -> rotate back
    (keys only when grouped per token: per-channel keys are never rotated, math dictionary §25.3)."""
    from kv_cache.compression import RandomizedHadamard, dequantize_norm_codebook, quantize_norm_codebook

    q = LAYOUTS[name]
    k, v = _kv(b=1, h=2, n=32)
    st = make_storage(q, k[:, :, :0], v[:, :, :0], track_groups=False, layer=0)
    st.append(k, v)
    got_k, got_v = st.read()
    kb, vb = q.bits_for(0)
    rots = None
    if q.rotation:
        rots = [RandomizedHadamard.for_head(16, 0, h, q.rotation_seed) for h in range(2)]
        if q.key_grouping == "token":
            k = torch.stack([rots[h].forward(k[:, h]) for h in range(2)], 1)
        v = torch.stack([rots[h].forward(v[:, h]) for h in range(2)], 1)
    if q.levels == "lloyd_max":
        def rt(x, bits):
            codes, scale = quantize_norm_codebook(x, bits, group_size=q.channel_group)
            return dequantize_norm_codebook(codes, scale.half().float(), bits)
        ref_k, ref_v = rt(k, kb), rt(v, vb)
    else:
        key_axis, key_group = (-2, q.group_size) if q.key_grouping == "channel" else (-1, q.channel_group_for(16))
        ref_k = dequantize(quantize(k, kb, axis=key_axis, group_size=key_group, scale_dtype=torch.float16))
        ref_v = dequantize(quantize(v, vb, axis=-1, group_size=q.channel_group_for(16), scale_dtype=torch.float16))
    if rots:
        if q.key_grouping == "token":
            ref_k = torch.stack([rots[h].inverse(ref_k[:, h]) for h in range(2)], 1)
        ref_v = torch.stack([rots[h].inverse(ref_v[:, h]) for h in range(2)], 1)
    torch.testing.assert_close(got_k, ref_k, rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(got_v, ref_v, rtol=1e-5, atol=1e-5)
    cats = st.nbytes_by_category()
    assert cats["codes"] == 2 * 32 * 16 * (kb + vb) // 8
    assert cats["tables"] == (2 * 16 if q.rotation else 0)  # int8 signs per KV head
    assert sum(cats.values()) == sum(t.nbytes for t in st.named_tensors().values())


def test_quant_config_options_are_validated():
    with pytest.raises(ValueError, match=r"key_bits must be one of \[2, 3, 4, 8\]; got 5"):
        QuantConfig.kivi(key_bits=5)
    with pytest.raises(ValueError, match=r"rotation must be one of \[None, 'hadamard', 'calibrated'\]; got 'random'"):
        QuantConfig.kivi(rotation="random")
    lm = QuantConfig.kivi(levels="lloyd_max")  # per-channel keys keep uniform levels; values take Lloyd-Max
    assert lm.key_grouping == "channel" and lm.levels == "lloyd_max"
    with pytest.raises(ValueError, match=r"lloyd_max' supports bits \[1, 2, 3, 4\]; got \[2, 8\]"):
        QuantConfig.kivi(bits=2, key_grouping="token", levels="lloyd_max", layer_bits={3: 8})
    with pytest.raises(ValueError, match="layer_bits maps layer indices"):
        QuantConfig.kivi(layer_bits={-1: 4})
    with pytest.raises(ValueError, match=r"channel_group \(24\) must divide head_dim \(64\)"):
        QuantConfig.kivi(key_grouping="token", channel_group=24).check_head_dim(64)
    # Unused new options print nothing: kvcache eval resumes by this string.
    assert repr(QuantConfig.kivi(bits=4)) == ("QuantConfig(bits=4, group_size=32, residual_length=32, sink_tokens=0, "
                                         "symmetric=False, scale_dtype=torch.float16)")
    assert QuantConfig.kivi(bits=2, key_bits=3, layer_bits={0: 4}).bits_for(0) == (4, 4)
    assert QuantConfig.kivi(bits=2, key_bits=3).bits_for(5) == (3, 2)


def test_compact_rows_compiled_and_torch_agree(monkeypatch):
    from kv_cache.kernels import compact_rows_, ops

    g = torch.Generator().manual_seed(0)
    for dtype in (torch.float32, torch.float16, torch.uint8, torch.int32):
        buf = (torch.rand(6, 50, 3, 5, generator=g) * 100).to(dtype)
        keep = torch.stack([torch.sort(torch.randperm(50, generator=g)[:37]).values for _ in range(6)])
        want = torch.stack([buf[r, keep[r]] for r in range(6)])
        got = compact_rows_(buf.clone(), keep)[:, :37]
        monkeypatch.setattr(ops, "_compiled", lambda *t: None)  # the torch path
        got_torch = compact_rows_(buf.clone(), keep)[:, :37]
        monkeypatch.undo()
        assert torch.equal(got, want) and torch.equal(got_torch, want)
    with pytest.raises(TypeError, match="int64"):
        compact_rows_(torch.zeros(2, 4, 3), torch.zeros(2, 3, dtype=torch.int32))
    with pytest.raises(ValueError, match="cap >= 5"):
        compact_rows_(torch.zeros(2, 4, 3), torch.zeros(2, 5, dtype=torch.int64))


def test_h2o_steady_state_compacts_in_place_and_snapkv_frees():
    """Append one, evict one: the buffers stay put; a one-shot eviction returns the memory."""
    model = tiny(LlamaConfig, 4, 2)
    ids = torch.randint(3, 97, (1, 60))
    cache = CompressedCache(model.config, eviction=H2O(budget=24))
    with torch.no_grad(), compress(model, cache):
        out = model(ids, past_key_values=cache)
        nxt = out.logits[:, -1:].argmax(-1)
        out = model(nxt, past_key_values=cache)
        ptr = cache.layers[0].storage.named_tensors()["keys"].data_ptr()
        for _ in range(5):
            out = model(out.logits[:, -1:].argmax(-1), past_key_values=cache)
            st = cache.layers[0].storage
            assert st.named_tensors()["keys"].data_ptr() == ptr and st.length == 24
    assert cache.memory_report().residual_bytes == sum(  # the whole buffers are counted
        layer.storage.named_tensors()["keys"].nbytes * 2 for layer in cache.layers)
    snap = CompressedCache(model.config, eviction=SnapKV(budget=16, recent_window=4))
    with torch.no_grad(), compress(model, snap):
        model(ids, past_key_values=snap)
    assert snap.layers[0].storage.named_tensors()["keys"].shape[2] == 16  # 60 -> 16 slots held


def test_clipping_shrinks_each_group_range_about_its_midpoint():
    from kv_cache.cache.packed import clip_groups

    x = torch.tensor([[[0.0, 10.0], [4.0, 2.0], [10.0, 0.0], [6.0, 4.0]]])  # [R=1, N=4, d=2]
    per_token = clip_groups(x, 0.8, axis=2, group=2)  # each token's 2 channels: range shrinks by 20%
    assert torch.equal(per_token[0, 0], torch.tensor([1.0, 9.0])) and torch.equal(per_token[0, 1], torch.tensor([3.8, 2.2]))
    per_channel = clip_groups(x, 0.5, axis=1, group=4)  # channel 0 over 4 tokens: [0, 10] -> [2.5, 7.5]
    assert torch.equal(per_channel[0, :, 0], torch.tensor([2.5, 4.0, 7.5, 6.0]))
    assert torch.equal(clip_groups(x, 1.0, axis=1, group=4), x)
    q = QuantConfig.kivi(bits=2, group_size=8, residual_length=8, key_grouping="token", channel_group=16,
                    clip_keys=0.9, clip_values=0.8)
    k, v = _kv(b=1, h=2, n=32)
    st = make_storage(q, k[:, :, :0], v[:, :, :0], track_groups=False)
    st.append(k, v)
    got_k, _ = st.read()
    ref = dequantize(quantize(clip_groups(k.reshape(2, 32, 16), 0.9, 2, 16), 2, axis=-1, group_size=16,
                              scale_dtype=torch.float16)).reshape(1, 2, 32, 16)
    torch.testing.assert_close(got_k, ref, rtol=1e-6, atol=1e-6)
    with pytest.raises(ValueError, match=r"clip_keys must be a float in \(0, 1\]; got 1.5"):
        QuantConfig.kivi(clip_keys=1.5)
    with pytest.raises(ValueError, match="uniform levels only"):
        QuantConfig.kivi(key_grouping="token", levels="lloyd_max", clip_values=0.9)


def test_packed_slots_grow_into_room_without_moving_earlier_views():
    """Decoding-size appends write into a slot's room in place; a view handed out earlier still
    reads the same tokens; the held tensor is the whole buffer (room counted)."""
    from kv_cache.cache.packed import _cat, _held

    a = torch.arange(2 * 3 * 4 * 2, dtype=torch.float32).reshape(2, 3, 4, 2)
    s = _cat(a, torch.zeros(2, 3, 1, 2), slack=3)  # outgrows a: a new buffer with room for 3
    assert s.shape[2] == 5 and _capacity(s) == 8 and _held(s).shape[2] == 8
    early = s[:, :, :5]
    t = _cat(s, torch.ones(2, 3, 2, 2), slack=3)  # fits: written in place
    assert t.data_ptr() == s.data_ptr() and t.shape[2] == 7 and torch.equal(early, s)
    assert torch.equal(t[:, :, :4], a) and torch.equal(t[:, :, 5:], torch.ones(2, 3, 2, 2))
    u = _cat(t, torch.full((2, 3, 2, 2), 2.0))  # no room: an exact new buffer
    assert _capacity(u) == 9 and torch.equal(u[:, :, :7], t) and _held(u) is u


def test_qblocks_are_views_kept_until_a_slot_changes():
    """The kernel blocks view the held slots (room included: no copy) and are reused by later
    decoding steps until an append, gather or map reassigns a slot."""
    from kv_cache.cache.storage import PackedKV

    p = PackedKV(QuantConfig(bits=4, group_size=4), torch.float32, 64, track_groups=False)
    p.append(torch.randn(1, 3, 64, 64), torch.randn(1, 3, 64, 64))
    p.append(torch.randn(1, 3, 4, 64), torch.randn(1, 3, 4, 64))  # a decoding flush: room made
    assert _capacity(p.k_codes) > p.length
    kq, vq = p.qblocks()
    assert kq.codes.untyped_storage().data_ptr() == p.k_codes.untyped_storage().data_ptr()
    assert vq.scale.untyped_storage().data_ptr() == p.v_scale.untyped_storage().data_ptr()
    assert p.qblocks()[0] is kq
    p.append(torch.randn(1, 3, 4, 64), torch.randn(1, 3, 4, 64))  # into the room, in place
    kq2, _ = p.qblocks()
    assert kq2 is not kq and kq2.codes.shape[1] == 72
    assert kq2.codes.untyped_storage().data_ptr() == kq.codes.untyped_storage().data_ptr()


def test_storage_layouts_are_a_registered_contract():
    """Layouts register with their saved FIELDS; rows' lengths and starts come from the layout, and a
    rectangular layout turns ragged through keep_rows (no isinstance in the layer or the tiers)."""
    import torch

    from kv_cache.cache.packed_ragged import PackedRaggedStorage
    from kv_cache.cache.serialize_state import STORAGE_CLASSES
    from kv_cache.cache.storage import LAYOUTS, FullPrecisionStorage, LayerStorage, register_layout

    assert {"FullPrecisionStorage", "QuantizedStorage", "RaggedStorage", "PackedRaggedStorage"} <= set(LAYOUTS) <= set(STORAGE_CLASSES)
    for cls in LAYOUTS.values():
        assert issubclass(cls, LayerStorage) and cls.FIELDS
    with pytest.raises(TypeError, match="FIELDS"):
        register_layout(type("NoFields", (), {}))
    st = FullPrecisionStorage(torch.randn(1, 2, 5, 4), torch.randn(1, 2, 5, 4))
    assert st.head_lengths().tolist() == [[5, 5]] and st.starts() is None and not st.ragged
    rag = st.keep_rows([torch.tensor([0, 2, 4]), torch.tensor([1])], [0, 0])
    assert isinstance(rag, PackedRaggedStorage) and rag.ragged and rag.head_lengths().tolist() == [[3, 1]]
    assert rag.fp_keys.shape == (1, 1, 4, 4)  # one buffer: the 3 + 1 kept tokens, no padding
    assert torch.equal(rag.fp_keys[0, 0], torch.cat([st.keys[0, 0, [0, 2, 4]], st.keys[0, 1, [1]]]))
    assert rag.starts().tolist() == [[0, 2]]  # right-aligned: row 1 starts after 2 virtual slots
    assert rag.keep_rows([torch.tensor([1, 2]), torch.tensor([0])], [0, 0]) is rag
    assert rag.head_lengths().tolist() == [[2, 1]]
    assert torch.equal(rag.fp_keys[0, 0], torch.cat([st.keys[0, 0, [2, 4]], st.keys[0, 1, [1]]]))
