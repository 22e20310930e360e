"""The packed ragged layout: every row's kept tokens in one buffer per layer (math dictionary §15.7, §19.2).

Model-free: the kernels read flat ragged blocks as per-row calls do; the storage holds exactly the
kept tokens (no padding), attends like the one-storage-per-row layout it replaces through one
kernel call per layer, survives appends, a later eviction and batch selection; bad blocks raise.
"""

from __future__ import annotations

import copy

import pytest
import torch

from kv_cache.attention import blocks as blocks_mod
from kv_cache.attention.blocks import fused_decode
from kv_cache.cache.config import QuantConfig
from kv_cache.cache.packed_ragged import PackedRaggedStorage
from kv_cache.cache.ragged import RaggedStorage
from kv_cache.cache.storage import FullPrecisionStorage, make_storage
from kv_cache.kernels import QBlock, attend_block, attend_mixed, quantize_block, reference

D = 64


def _flat(blocks: list[QBlock]) -> QBlock:
    """Per-row one-row blocks concatenated into one flat ragged block."""
    R = len(blocks)
    lens = [b.codes.shape[1] for b in blocks]
    off = torch.tensor([sum(lens[:r]) for r in range(R)], dtype=torch.int64)
    cat = lambda ts: torch.cat(ts, 1)  # noqa: E731
    b0 = blocks[0]
    gid = None
    if b0.grouping == "channel":
        first = [sum(b.scale.shape[1] for b in blocks[:r]) for r in range(R)]
        gid = cat([(torch.arange(b.codes.shape[1], dtype=torch.int32) // b.group_size + first[r]).reshape(1, -1)
                   for r, b in enumerate(blocks)])
    zero = None if b0.zero is None else cat([b.zero for b in blocks])

    def e(t):
        return None if t is None else t.expand(R, *t.shape[1:])

    return QBlock(e(cat([b.codes for b in blocks])), b0.bits, b0.lut, b0.grouping, e(cat([b.scale for b in blocks])),
                  e(zero), b0.group_size, e(gid), None, off, torch.tensor(lens, dtype=torch.int32))


def _rows(lens, bits, grouping, gs, seed=0):
    g = torch.Generator().manual_seed(seed)
    out = []
    for n in lens:
        x = torch.randn(1, max(n, gs if grouping == "channel" else 1), D, generator=g)
        b = quantize_block(x, bits, grouping, gs)
        if n == 0:  # an empty row
            b = QBlock(b.codes[:, :0], b.bits, b.lut, b.grouping, b.scale[:, :0], None if b.zero is None
                       else b.zero[:, :0], b.group_size)
        out.append(b)
    return out


@pytest.mark.parametrize("bits", [2, 3, 4])
@pytest.mark.parametrize("key_grouping", ["channel", "token"])
def test_flat_ragged_blocks_equal_per_row_calls(bits, key_grouping):
    lens = [37, 120, 0, 64, 9]
    R, G = len(lens), 3
    ks = _rows(lens, bits, key_grouping, 1 if key_grouping == "channel" else 32)
    vs = _rows(lens, bits, "token", 32, seed=1)
    kf, vf = _flat(ks), _flat(vs)
    q = torch.randn(R, G, D)
    start = torch.tensor([3, 0, 0, 10, 0], dtype=torch.int32)
    out, lse, _ = attend_block(q, kf, vf, 0.125, start=start)
    ro, rl, _ = reference.attend_block(q, kf, vf, 0.125, start=start)
    assert torch.allclose(out, ro, atol=1e-5) and torch.equal(torch.isinf(lse), torch.isinf(rl))
    assert torch.allclose(lse[~torch.isinf(lse)], rl[~torch.isinf(rl)], atol=1e-5)
    assert bool(torch.isinf(lse[2]).all()) and bool((out[2] == 0).all())  # the empty row sees nothing
    for r, n in enumerate(lens):
        if n:
            o1, l1, _ = attend_block(q[r:r + 1].contiguous(), ks[r], vs[r], 0.125, start=start[r:r + 1])
            assert torch.allclose(o1, out[r:r + 1], atol=1e-5) and torch.allclose(l1, lse[r:r + 1], atol=1e-5)
    # one mixed call: a flat packed block, an extra flat packed block, a rectangular and a flat dense block
    fk, fv = torch.randn(1, 1, sum(lens), D), torch.randn(1, 1, sum(lens), D)
    dense = [(torch.randn(1, R, 4, D), torch.randn(1, R, 4, D), None),
             (fk.expand(1, R, -1, -1), fv.expand(1, R, -1, -1), start, kf.offsets, kf.lengths)]
    packed = [(kf, vf, None), (kf, vf, start, q, None)]
    o, l_ = attend_mixed(q, 0.125, packed=packed, dense=dense)
    ro, rl = reference.attend_mixed(q, 0.125, packed=packed, dense=dense)
    assert torch.allclose(o, ro, atol=1e-5) and torch.allclose(l_, rl, atol=1e-5)


def test_flat_ragged_block_errors():
    ks = _rows([4, 5], 4, "token", 32)
    kf = _flat(ks)
    with pytest.raises(ValueError, match="both offsets and lengths"):
        QBlock(kf.codes, 4, kf.lut, "token", kf.scale, kf.zero, 32, offsets=kf.offsets)
    with pytest.raises(ValueError, match="offsets must be torch.int64"):
        QBlock(kf.codes, 4, kf.lut, "token", kf.scale, kf.zero, 32, offsets=kf.offsets.int(), lengths=kf.lengths)
    with pytest.raises(ValueError, match="share their offsets"):
        attend_block(torch.randn(2, 1, D), kf, _flat(_rows([5, 4], 4, "token", 32)), 0.125)
    with pytest.raises(ValueError, match="needs both offsets and lengths"):
        attend_mixed(torch.randn(2, 1, D), 0.125, dense=[(torch.randn(1, 2, 3, D), torch.randn(1, 2, 3, D), None,
                                                          torch.zeros(2, dtype=torch.int64), None)])


QUANTS = {"fp": None, "q4": QuantConfig(bits=4, group_size=8, residual_length=8, sink_tokens=4),
          "q2-token-keys": QuantConfig(bits=2, group_size=8, residual_length=8, sink_tokens=4, key_grouping="token"),
          "q3-hadamard": QuantConfig(bits=3, group_size=8, residual_length=8, sink_tokens=4, rotation="hadamard")}


def _storage(quant, B=2, H=3, T=70, seed=0):
    g = torch.Generator().manual_seed(seed)
    k, v = torch.randn(B, H, T, D, generator=g), torch.randn(B, H, T, D, generator=g)
    st = make_storage(quant, k[:, :, :0], v[:, :, :0], track_groups=True, layer=1)
    st.append(k, v)
    return st


def _keeps(st, seed=0, keep_tail=0):
    """Per row: the protected slots and a random, row-dependent share of the others."""
    g = torch.Generator().manual_seed(seed)
    lead, trail = st.protected()
    out = []
    for r, n in enumerate(st.head_lengths().flatten().tolist()):
        mid = torch.arange(lead, n - trail)
        pick = mid[torch.rand(mid.numel(), generator=g) < 0.2 + 0.15 * r]
        out.append(torch.cat([torch.arange(lead), pick, torch.arange(n - trail, n)]))
    return out


def _per_block(view, q, scaling, starts):
    """The per-block path: each block attended alone, merged by log-sum-exp."""
    parts, offset = [], 0
    for blk in view:
        s = None if starts is None else (starts - offset).clamp(0, blk.length)
        o, lse, _ = blk.attend(q, scaling, s, None)
        parts.append((o, lse))
        offset += blk.length
    return blocks_mod.merge(parts)


def _decode(st, q, k1, v1):
    view = st.attention_update(k1, v1)
    return fused_decode(view, q, 0.125, st.starts())


@pytest.mark.parametrize("quant", list(QUANTS))
def test_packed_ragged_storage_matches_the_per_row_layout(quant, monkeypatch):
    q_cfg = QUANTS[quant]
    base = _storage(q_cfg)
    keeps = _keeps(base)
    lead = [0] * len(keeps)
    flat = PackedRaggedStorage.split(copy.deepcopy(base), keeps, lead)
    rows = RaggedStorage.split(copy.deepcopy(base), keeps, lead)
    assert isinstance(flat, PackedRaggedStorage) and flat.ragged
    assert flat.head_lengths().tolist() == rows.head_lengths().tolist()
    assert flat.starts().tolist() == rows.starts().tolist()
    # one buffer, no padding: the buffers hold the kept tokens, nothing more
    held = sum(flat.fp_len) + sum(flat.q_len) + 6 * flat.tail.length  # the tail: sinks + residual, every row
    assert held == int(flat.head_lengths().sum())
    assert flat.nbytes_by_category() and sum(flat.nbytes_by_category().values()) == sum(
        t.nbytes for t in flat.named_tensors().values())
    calls = {"n": 0}
    real = blocks_mod.attend_mixed

    def counting(*a, **kw):
        calls["n"] += 1
        return real(*a, **kw)

    g = torch.Generator().manual_seed(5)
    for step in range(12):  # decoding: the tails flush into packed codes on the way
        q = torch.randn(2, 3, 3, D, generator=g)
        k1, v1 = torch.randn(2, 3, 1, D, generator=g), torch.randn(2, 3, 1, D, generator=g)
        want = _decode(rows, q, k1, v1)
        monkeypatch.setattr(blocks_mod, "attend_mixed", counting)
        calls["n"] = 0
        got = _decode(flat, q, k1, v1)
        monkeypatch.setattr(blocks_mod, "attend_mixed", real)
        assert calls["n"] == 1  # the whole layer in one kernel call
        assert torch.allclose(got[0], want[0], atol=1e-5) and torch.allclose(got[1], want[1], atol=1e-5)
    assert flat.head_lengths().tolist() == rows.head_lengths().tolist()
    # a later eviction (KVzap while decoding) reaches into the tail; then both decode alike again
    keeps2 = _keeps(flat, seed=3)
    flat.keep_rows(keeps2, lead)
    rows.keep_rows(keeps2, lead)
    assert flat.head_lengths().tolist() == rows.head_lengths().tolist()
    q = torch.randn(2, 3, 3, D, generator=g)
    k1, v1 = torch.randn(2, 3, 1, D, generator=g), torch.randn(2, 3, 1, D, generator=g)
    want, got = _decode(rows, q, k1, v1), _decode(flat, q, k1, v1)
    assert torch.allclose(got[0], want[0], atol=1e-5)
    # the row-by-row path (a question after the context) equals the one call
    view = flat.blocks()
    st = flat.starts()
    o, lse = _per_block(view, q, 0.125, st)
    one = fused_decode(view, q, 0.125, st)
    assert torch.allclose(o, one[0], atol=1e-5)
    # batch selection keeps each row's tokens
    flat.map_tensors(lambda t: t.index_select(0, torch.tensor([1])))
    rows.map_tensors(lambda t: t.index_select(0, torch.tensor([1])))
    q1, k2, v2 = q[1:], k1[1:], v1[1:]
    assert torch.allclose(_decode(flat, q1, k2, v2)[0], _decode(rows, q1, k2, v2)[0], atol=1e-5)


def test_full_precision_rows_share_one_buffer_and_keep_their_tokens():
    k, v = torch.randn(1, 2, 6, 4), torch.randn(1, 2, 6, 4)
    st = FullPrecisionStorage(k.clone(), v.clone())
    rag = st.keep_rows([torch.tensor([0, 3, 5]), torch.tensor([2])], [0, 0])
    assert isinstance(rag, PackedRaggedStorage) and rag.fp_keys.shape == (1, 1, 4, 4)
    assert torch.equal(rag.fp_keys[0, 0], torch.cat([k[0, 0, [0, 3, 5]], k[0, 1, [2]]]))
    rag.append(torch.ones(1, 2, 2, 4), torch.ones(1, 2, 2, 4))  # into the rectangular tail
    assert rag.head_lengths().tolist() == [[5, 3]] and rag.tail.length == 2
    rag.keep_rows([torch.tensor([1, 4]), torch.tensor([0, 1])], [0, 0])  # row 1 keeps 1 buffer + 1 tail token
    assert rag.head_lengths().tolist() == [[2, 2]] and rag.tail.length == 0
    assert torch.equal(rag.fp_keys[0, 0], torch.cat([k[0, 0, [3]], torch.ones(1, 4), k[0, 1, [2]],
                                                     torch.ones(1, 4)]))
    with pytest.raises(RuntimeError, match="only the native attention"):
        rag.read()
    with pytest.raises(RuntimeError, match="share one buffer"):
        rag.row(0, 0)


@pytest.mark.parametrize("quant", [QuantConfig(bits=4, evicted_bits=2), QuantConfig(bits=4, group_size=4, evicted_bits=2),
                                   QuantConfig(bits=3, evicted_bits=2, rotation="hadamard", key_grouping="token",
                                               levels="lloyd_max")])
def test_evicted_tier_rows_keep_the_space_their_codes_were_made_in(quant):
    """The evicted tier's rows are each quantized as a one-head storage (every row in head 0's
    rotation, log-coded scales): in one buffer they attend exactly as row by row."""
    g = torch.Generator().manual_seed(0)
    evicted = quant.evicted_config()
    rows = []
    for n in [40, 7, 33, 64, 0, 12]:
        st = make_storage(evicted, torch.zeros(1, 1, 0, D), torch.zeros(1, 1, 0, D), track_groups=False, layer=2)
        if n:
            st.append(torch.randn(1, 1, n, D, generator=g), torch.randn(1, 1, n, D, generator=g))
        rows.append(st)
    per_row = RaggedStorage(copy.deepcopy(rows), 2, 3)
    flat = PackedRaggedStorage.from_rows(copy.deepcopy(rows), 2, 3)
    assert isinstance(flat, PackedRaggedStorage)
    q = torch.randn(2, 3, 4, D, generator=g)
    want = _per_block(per_row.blocks(), q, 0.2, per_row.starts())  # row by row (an empty row included)
    got = fused_decode(flat.blocks(), q, 0.2, flat.starts())
    assert torch.allclose(got[0], want[0], atol=1e-5) and torch.allclose(got[1], want[1], atol=1e-5)


@pytest.mark.parametrize("quant", [QuantConfig(bits=4, evicted_bits=2), None])
def test_model_answers_equal_the_per_row_layout(stories, monkeypatch, quant):
    """A question after a compressed context (the row-by-row path) and the next decoded token (one
    call per layer) give the per-row layout's logits: KVzip's model-wide budget, tiers included."""
    from kv_cache import CompressedCache, KVzip, compress, prefill
    from kv_cache.cache import storage as storage_mod
    from kv_cache.cache import tiers as tiers_mod

    model, tok = stories
    ids = tok("Once upon a time there was a little girl named Lily. She loved to play outside with her ball. " * 6,
              return_tensors="pt").input_ids
    question = tok(" Lily loved to", return_tensors="pt", add_special_tokens=False).input_ids

    def answer():
        cache = CompressedCache(model.config, quant=quant, eviction=KVzip(budget=0.25, scope="model"))
        with torch.no_grad():
            prefill(model, cache, ids, tokenizer=tok)
            with compress(model, cache):
                first = model(input_ids=question, past_key_values=cache, use_cache=True).logits
                nxt = model(input_ids=first[:, -1:].argmax(-1), past_key_values=cache, use_cache=True).logits
        return cache, first, nxt

    flat_cache, flat_q, flat_next = answer()
    assert any(isinstance(layer.storage, PackedRaggedStorage) for layer in flat_cache.layers)
    monkeypatch.setattr(storage_mod.LayerStorage, "keep_rows",
                        lambda self, keeps, lead, in_place=True: RaggedStorage.split(self, keeps, lead))
    monkeypatch.setattr(tiers_mod.PackedRaggedStorage, "from_rows",
                        classmethod(lambda cls, rows, B, H, lead=None: RaggedStorage(rows, B, H, lead)))
    rows_cache, rows_q, rows_next = answer()
    assert all(not isinstance(layer.storage, PackedRaggedStorage) for layer in rows_cache.layers)
    assert torch.allclose(flat_q, rows_q, atol=1e-4) and torch.allclose(flat_next, rows_next, atol=1e-4)
