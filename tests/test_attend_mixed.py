"""``attend_mixed`` (a layer's decode attention in one kernel call) and ``fused_decode``.

Model-free: the compiled kernel against its torch reference on every code path, against a
float64 softmax over the concatenated blocks (dtypes, left padding, rotated packed blocks,
no packed block, no dense block), the decode fast path against the per-block path, and
argument validation. Tolerances as in ``test_kernels.py`` (float32 sums of O(1) terms).
"""

from __future__ import annotations

import pytest
import torch

from kv_cache import QuantConfig
from kv_cache.attention.blocks import FullBlock, QuantBlock, fused_decode, merge
from kv_cache.cache.storage import PackedKV
from kv_cache.kernels import attend_mixed, ops, quantize_block, reference
from kv_cache.kernels.reference import dequantize_block as ref_dequantize
from test_kernels import ATOL, RTOL, compiled  # noqa: F401  (fixture)

B, H, G, D = 2, 3, 4, 64
R = B * H


def _layer(dtype=torch.float32, rotated=False, seed=0):
    gen = torch.Generator().manual_seed(seed)
    k = quantize_block(torch.randn(R, 256, D, generator=gen), 4, "channel", 128)
    v = quantize_block(torch.randn(R, 256, D, generator=gen), 2, "token", 32)
    start = torch.tensor([0, 3, 0, 7, 0, 300], dtype=torch.int32)  # the last row: all padding
    buf = torch.randn(B, H, 40, D, generator=gen).to(dtype)  # a residual as a view of a larger buffer
    res = (buf[:, :, :17], torch.randn(B, H, 17, D, generator=gen).to(dtype), None)
    sinks = (torch.randn(B, H, 4, D, generator=gen).to(dtype), torch.randn(B, H, 4, D, generator=gen).to(dtype),
             torch.tensor([0, 1, 2, 4, 0, 0], dtype=torch.int32))
    q = torch.randn(R, G, D, generator=gen)
    kw = {"packed": (k, v, start), "dense": [sinks, res]}
    if rotated:
        kw["q_packed"] = torch.randn(R, G, D, generator=gen)
        kw["value_inverse"] = torch.linalg.qr(torch.randn(H, D, D, generator=gen))[0].contiguous()
    return q, kw


def _oracle(q, packed=None, dense=(), q_packed=None, value_inverse=None, scaling=0.125):
    """float64: one softmax over the concatenation; the packed share rotated back first."""
    qd = q.double()
    logit_blocks, values = [], []
    if packed is not None:
        k, v, st = packed
        kx, vx = ref_dequantize(k).double(), ref_dequantize(v).double()
        qp = (q if q_packed is None else q_packed).double()
        s = (qp @ kx.transpose(1, 2)) * scaling
        if st is not None:
            s = s.masked_fill((torch.arange(kx.shape[1]) < st.long()[:, None])[:, None], float("-inf"))
        if value_inverse is not None:  # p @ (v M) = (p @ v) M
            vx = (vx.reshape(B, H, -1, D) @ value_inverse.double()[None]).reshape(R, -1, D)
        logit_blocks.append(s)
        values.append(vx)
    for k, v, st in dense:
        n = k.shape[2]
        s = (qd @ k.double().reshape(R, n, D).transpose(1, 2)) * scaling
        if st is not None:
            s = s.masked_fill((torch.arange(n) < st.long()[:, None])[:, None], float("-inf"))
        logit_blocks.append(s)
        values.append(v.double().reshape(R, n, -1))
    s = torch.cat(logit_blocks, -1)
    lse = torch.logsumexp(s, -1)
    p = torch.softmax(s, -1).nan_to_num(0.0)
    return p @ torch.cat(values, 1), lse


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16, torch.bfloat16])
@pytest.mark.parametrize("rotated", [False, True])
def test_mixed_matches_one_softmax(compiled, dtype, rotated):  # noqa: F811
    q, kw = _layer(dtype, rotated)
    out, lse = attend_mixed(q, 0.125, **kw)
    ref, ref_lse = _oracle(q, **kw)
    valid = torch.isfinite(ref_lse)
    torch.testing.assert_close(out.double(), ref, rtol=RTOL, atol=ATOL)
    torch.testing.assert_close(lse.double()[valid], ref_lse[valid], rtol=0, atol=ATOL)


@pytest.mark.parametrize("which", ["dense_only", "packed_only", "one_token"])
def test_mixed_single_kinds(compiled, which):  # noqa: F811
    q, kw = _layer()
    if which == "dense_only":
        kw = {"dense": kw["dense"]}
    elif which == "packed_only":
        kw = {"packed": kw["packed"]}
    else:  # decoding's new token alone, as a [B, H, 1, d] block with arbitrary strides
        tok = torch.randn(B, H, 5, D)[:, :, 2:3]
        kw = {"packed": kw["packed"], "dense": [(tok, tok * 2, None)]}
    out, lse = attend_mixed(q, 0.125, **kw)
    ref, ref_lse = _oracle(q, **kw)
    valid = torch.isfinite(ref_lse)
    torch.testing.assert_close(out.double(), ref, rtol=RTOL, atol=ATOL)
    torch.testing.assert_close(lse.double()[valid], ref_lse[valid], rtol=0, atol=ATOL)


def test_row_without_tokens_is_zero_with_minus_inf_lse(compiled):  # noqa: F811
    q, kw = _layer()
    k, v, _ = kw["packed"]
    everything_masked = torch.full((R,), 1000, dtype=torch.int32)
    out, lse = attend_mixed(q, 0.125, packed=(k, v, everything_masked))
    assert torch.isneginf(lse).all() and (out == 0).all()


@pytest.mark.parametrize("rotation", [None, "hadamard"])
@pytest.mark.parametrize("padded", [False, True])
def test_fused_decode_matches_the_per_block_path(rotation, padded):
    """The decode fast path of the attention function against attending block by block."""
    torch.manual_seed(0)
    Bm, Hm, Gm, d = 2, 2, 3, 32
    cfg = QuantConfig.kivi(bits=4, group_size=8) if rotation is None else QuantConfig(bits=4, group_size=8)
    packed = PackedKV(cfg, torch.float32, d, track_groups=False)
    packed.append(torch.randn(Bm, Hm, 24, d), torch.randn(Bm, Hm, 24, d))
    view = [FullBlock(torch.randn(Bm, Hm, 3, d), torch.randn(Bm, Hm, 3, d)),
            QuantBlock(*packed.qblocks(), batch=Bm, kv_heads=Hm, rotation=packed.rotation),
            FullBlock(torch.randn(Bm, Hm, 5, d), torch.randn(Bm, Hm, 5, d))]
    q = torch.randn(Bm, Hm, Gm, d)
    starts = torch.tensor([[0, 0], [6, 6]]) if padded else None
    got, got_lse = fused_decode(view, q, 0.2, starts)
    parts, off = [], 0
    for blk in view:
        st = None if starts is None else (starts - off).clamp(0, blk.length)
        out, lse, _ = blk.attend(q, 0.2, st, None)
        parts.append((out, lse))
        off += blk.length
    want, want_lse = merge(parts)
    torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(got_lse, want_lse, rtol=1e-5, atol=1e-5)


def test_fused_decode_declines_views_it_cannot_take():
    q = torch.randn(1, 1, 2, 8)
    assert fused_decode([], q, 1.0, None) is None

    class Other:
        length = 1
    assert fused_decode([Other()], q, 1.0, None) is None


def test_mixed_validation():
    q, kw = _layer()
    k, v, st = kw["packed"]
    with pytest.raises(ValueError, match="needs a packed block or at least one dense block"):
        attend_mixed(q, 0.125)
    with pytest.raises(TypeError, match="float32"):
        attend_mixed(q.double(), 0.125, packed=(k, v, st))
    with pytest.raises(TypeError, match="finite float"):
        attend_mixed(q, float("nan"), packed=(k, v, st))
    with pytest.raises(TypeError, match=r"must be one of .*float32.*; got torch.int32"):
        attend_mixed(q, 0.125, dense=[(torch.zeros(B, H, 2, D, dtype=torch.int32),) * 2 + (None,)])
    with pytest.raises(ValueError, match="rank-4"):
        attend_mixed(q, 0.125, dense=[(torch.zeros(R, 2, D), torch.zeros(R, 2, D), None)])
    with pytest.raises(ValueError, match="B \\* H = R"):
        attend_mixed(q, 0.125, dense=[(torch.zeros(1, H, 2, D), torch.zeros(1, H, 2, D), None)])
    with pytest.raises(ValueError, match="q has d=64"):
        attend_mixed(q, 0.125, dense=[(torch.zeros(B, H, 2, 32), torch.zeros(B, H, 2, 32), None)])
    with pytest.raises(ValueError, match="apply to the packed block"):
        attend_mixed(q, 0.125, dense=kw["dense"], value_inverse=torch.zeros(H, D, D))
    with pytest.raises(ValueError, match="value_inverse must be float32"):
        attend_mixed(q, 0.125, packed=(k, v, st), value_inverse=torch.zeros(4, D, D))
    with pytest.raises(ValueError, match="q_packed must have q's shape"):
        attend_mixed(q, 0.125, packed=(k, v, st), q_packed=torch.zeros(R, 1, D))
    with pytest.raises(TypeError, match="tuple"):
        attend_mixed(q, 0.125, packed=[k, v, st])


def test_reference_and_ops_share_the_contract():
    """The torch fallback (no compiled kernels) is the reference itself."""
    q, kw = _layer(rotated=True)
    a = reference.attend_mixed(q, 0.125, **kw)
    b = ops.attend_mixed(q, 0.125, **kw)
    torch.testing.assert_close(a[0], b[0], rtol=RTOL, atol=ATOL)


@pytest.mark.parametrize("grouping,gs,with_gid", [("channel", 8, False), ("channel", 8, True), ("token", 16, False)])
def test_leading_part_of_a_buffer_is_read_in_place(compiled, grouping, gs, with_gid):  # noqa: F811
    """A block whose tensors are the first N of `cap` slots per row (a packed slot with room,
    math dictionary §12) is attended without a copy and equals the reference."""
    from kv_cache.kernels import QBlock, attend_block
    from kv_cache.kernels.ops import _p

    gen = torch.Generator().manual_seed(3)
    rows, n, cap, d = 3, 40, 64, 32
    kb = quantize_block(torch.randn(rows, cap, d, generator=gen), 4, grouping, gs)
    vb = quantize_block(torch.randn(rows, cap, d, generator=gen), 2, "token", 16)

    def lead(b, gid=None):
        m = n // b.group_size if b.grouping == "channel" else n
        return QBlock(b.codes[:, :n], b.bits, b.lut, b.grouping, b.scale[:, :m],
                      None if b.zero is None else b.zero[:, :m], b.group_size, gid)

    gid = None
    if with_gid:
        gid = (torch.arange(cap, dtype=torch.int32) // gs).expand(rows, cap).contiguous()[:, :n]
    k, v = lead(kb, gid), lead(vb)
    assert not k.codes.is_contiguous() and _p(k.codes) is k.codes and _p(v.scale) is v.scale
    if gid is not None:
        assert _p(gid) is gid
    q = torch.randn(rows, 2, d, generator=gen)
    got, want = attend_block(q, k, v, 0.2), reference.attend_block(q, k, v, 0.2)
    torch.testing.assert_close(got[0], want[0], rtol=RTOL, atol=ATOL)
    torch.testing.assert_close(got[1], want[1], rtol=0, atol=ATOL)


@pytest.mark.parametrize("quant", ["kivi", "default"])
def test_decoding_takes_the_one_call_path(stories, monkeypatch, quant):
    """Every decoding step of every layer goes through one kernel call (no silent fallback to
    the per-block path), for the KIVI layout and the default (rotated, log-coded norms)."""
    from kv_cache import CompressedCache, compress
    from kv_cache.attention import function

    model, tok = stories
    calls = {"fused": 0, "none": 0}
    real = function.fused_decode

    def counting(*args):
        out = real(*args)
        calls["fused" if out is not None else "none"] += 1
        return out

    monkeypatch.setattr(function, "fused_decode", counting)
    q = QuantConfig.kivi(bits=4, group_size=8, residual_length=8) if quant == "kivi" else QuantConfig(bits=4)
    cache = CompressedCache(model.config, quant=q)
    ids = tok("Once upon a time there was a little girl named Lily. " * 6, return_tensors="pt").input_ids
    with compress(model, cache), torch.no_grad():
        model.generate(ids, past_key_values=cache, max_new_tokens=5, do_sample=False)
    assert calls["none"] == 0 and calls["fused"] == 4 * model.config.num_hidden_layers


# The two paths agree to float32 rounding on the same stored state (1e-7 per layer). q4d keeps its
# residual and sinks in float16, so a 1e-7 difference in a decoded token's key can round to the
# other side of a float16 step (2^-11 relative) and grow from there (1e-5, 1e-5, 1.3e-4, 1.1e-3 over
# four steps, measured): the comparison stores them in float32, where the paths must agree.
_FP32_RESIDUAL = dict(residual_dtype=torch.float32)


@pytest.mark.parametrize("case, window", [("kvzip-model-q4", 0), ("kvzip-head-fp", 0), ("tiers-kvzip-model", 0),
                                          ("kvzip-head-fp", 0.5), ("tiers-kvzip-model", 0.5),
                                          ("kvzip-model-q4", 0.5)])
def test_ragged_decoding_in_one_call_per_row_matches_the_per_block_path(stories, monkeypatch, case, window):
    """Heads of different lengths (a model-wide KVzip budget) and precision tiers (two packed
    blocks per row) decode through one call per layer (every row's tokens in one buffer), with the logits of the per-block path."""
    from kv_cache import CompressedCache, KVzip, compress, prefill
    from kv_cache.attention import function
    from kv_cache.cache.packed_ragged import PackedRaggedStorage

    model, tok = stories
    quant = {"kvzip-model-q4": QuantConfig(bits=4, group_size=4, **_FP32_RESIDUAL), "kvzip-head-fp": None,
             "tiers-kvzip-model": QuantConfig(bits=4, group_size=4, evicted_bits=2, **_FP32_RESIDUAL)}[case]
    scope = "head" if case == "kvzip-head-fp" else "model"
    ids = tok("Once upon a time there was a little girl named Lily. She loved to play outside. " * 5,
              return_tensors="pt").input_ids
    real = function.fused_decode
    runs = {}
    for mode in ("one-call", "per-block"):
        calls = {"fused": 0}

        def counting(*args, mode=mode, calls=calls):
            out = real(*args) if mode == "one-call" else None
            calls["fused"] += out is not None
            return out

        monkeypatch.setattr(function, "fused_decode", counting)
        cache = CompressedCache(model.config, quant=quant, eviction=KVzip(budget=0.3, scope=scope, chunk_size=64,
                                                                             recent_window=window))
        with torch.no_grad():
            logits, _ = prefill(model, cache, ids, tokenizer=tok)
            assert any(isinstance(layer.storage, PackedRaggedStorage) for layer in cache.layers) or scope == "head"
            nxt, steps = logits[:, -1:].argmax(-1), []
            with compress(model, cache):
                for i in range(4):
                    out = model(input_ids=nxt, past_key_values=cache, use_cache=True,
                                position_ids=torch.tensor([[ids.shape[1] + i]]))
                    steps.append(out.logits[:, -1])
                    nxt = out.logits[:, -1:].argmax(-1)
        runs[mode] = (torch.stack(steps), calls["fused"])
    assert runs["one-call"][1] == 4 * model.config.num_hidden_layers and runs["per-block"][1] == 0
    torch.testing.assert_close(runs["one-call"][0], runs["per-block"][0], rtol=0, atol=1e-4)


def test_packed_blocks_in_their_own_spaces_merge_into_one_softmax(compiled):  # noqa: F811
    """Two packed blocks stored in different rotated spaces (each with its own rotated query and
    inverse) plus full-precision blocks, in one call: the merge of the blocks attended alone."""
    from kv_cache.kernels.reference import merge_parts

    q, kw = _layer(rotated=True, seed=5)
    gen = torch.Generator().manual_seed(9)
    k2 = quantize_block(torch.randn(R, 64, D, generator=gen), 2, "token", 64)
    v2 = quantize_block(torch.randn(R, 64, D, generator=gen), 2, "token", 64)
    q2 = torch.randn(R, G, D, generator=gen)
    inv2 = torch.linalg.qr(torch.randn(H, D, D, generator=gen))[0].contiguous()
    k, v, st = kw["packed"]
    first = (k, v, st, kw["q_packed"], kw["value_inverse"])
    second = (k2, v2, torch.tensor([0, 0, 9, 0, 0, 64], dtype=torch.int32), q2, inv2)
    out, lse = attend_mixed(q, 0.125, packed=[first, second], dense=kw["dense"])
    parts = [attend_mixed(q, 0.125, packed=(k, v, st), q_packed=kw["q_packed"], value_inverse=kw["value_inverse"]),
             attend_mixed(q, 0.125, packed=(k2, v2, second[2]), q_packed=q2, value_inverse=inv2),
             attend_mixed(q, 0.125, dense=kw["dense"])]
    want, want_lse = merge_parts(parts)
    torch.testing.assert_close(out, want, rtol=RTOL, atol=ATOL)
    torch.testing.assert_close(lse, want_lse, rtol=0, atol=ATOL)


@pytest.mark.parametrize("dv", [64, 80, 96, 16])
def test_hadamard_signs_as_value_inverse_equal_the_rotation_matrix(compiled, dv):  # noqa: F811
    """``value_inverse`` as a Hadamard rotation's int8 signs (the kernel's butterflies, block
    by block for 80 = 64 + 16 and 96 = 64 + 32) against the same rotation's dense ``R^T``
    (:meth:`Rotation.inverse_matrices`), for the call's packed block and an extra one."""
    from kv_cache.cache.packed import Rotation

    gen = torch.Generator().manual_seed(dv)
    rot, rot2 = Rotation(3, H, dv, 0, "cpu"), Rotation(4, H, dv, 0, "cpu")
    assert rot.value_inverse().dtype == torch.int8 and rot.value_inverse() is rot.signs
    k = quantize_block(torch.randn(R, 96, dv, generator=gen), 4, "channel", 32)
    v = quantize_block(torch.randn(R, 96, dv, generator=gen), 4, "token", 16)
    k2 = quantize_block(torch.randn(R, 32, dv, generator=gen), 2, "token", 16)
    v2 = quantize_block(torch.randn(R, 32, dv, generator=gen), 2, "token", 16)
    q, qp, q2 = (torch.randn(R, G, dv, generator=gen) for _ in range(3))
    res = (torch.randn(B, H, 5, dv, generator=gen), torch.randn(B, H, 5, dv, generator=gen), None)
    st = torch.tensor([0, 3, 0, 7, 0, 1], dtype=torch.int32)
    got = attend_mixed(q, 0.2, packed=[(k, v, st, qp, rot.signs), (k2, v2, None, q2, rot2.signs)], dense=[res])
    want = attend_mixed(q, 0.2, packed=[(k, v, st, qp, rot.inverse_matrices()), (k2, v2, None, q2, rot2.inverse_matrices())],
                        dense=[res])
    torch.testing.assert_close(got[0], want[0], rtol=RTOL, atol=ATOL)
    torch.testing.assert_close(got[1], want[1], rtol=0, atol=ATOL)
    one = attend_mixed(q, 0.2, packed=(k, v, st), q_packed=qp, value_inverse=rot.signs)
    ref = reference.attend_mixed(q, 0.2, packed=(k, v, st), q_packed=qp, value_inverse=rot.inverse_matrices())
    torch.testing.assert_close(one[0], ref[0], rtol=RTOL, atol=ATOL)


def test_value_inverse_signs_validation():
    q, kw = _layer()
    k, v, st = kw["packed"]
    for bad in (torch.ones(H, D + 2, dtype=torch.int8), torch.ones(4, D, dtype=torch.int8),
                torch.ones(H, D, dtype=torch.int16), torch.ones(H, 1, D, dtype=torch.int8),
                torch.ones(0, D, dtype=torch.int8), torch.ones(H, D)):
        with pytest.raises(ValueError, match=r"int8 \[H, d_v\] = \[H, 64\] \(Hadamard signs, d_v even\).*got"):
            attend_mixed(q, 0.125, packed=(k, v, st), value_inverse=bad)
    q3 = torch.randn(R, G, 6)
    k3 = quantize_block(torch.randn(R, 8, 6), 4, "token", 2)
    odd = quantize_block(torch.randn(R, 8, 7), 8, "token", 7)
    attend_mixed(q3, 0.125, packed=(k3, k3, None), value_inverse=torch.ones(H, 6, dtype=torch.int8))  # 6 = 4 + 2
    with pytest.raises(ValueError, match="d_v even"):
        attend_mixed(q3, 0.125, packed=(k3, odd, None), value_inverse=torch.ones(H, 7, dtype=torch.int8))
