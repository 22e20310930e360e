"""Metadata thrift: 8-bit zero points (``QuantConfig.zero_dtype``) and a narrower residual
(``QuantConfig.residual_dtype``); math dictionary §18.7."""

from __future__ import annotations

import pytest
import torch

from kv_cache import QuantConfig
from kv_cache.cache.packed import PackedKV, narrow_zero_points
from kv_cache.cache.storage import make_storage
from kv_cache.kernels import dequantize_block, quantize_block


def _x(R=3, N=32, d=16, seed=0, offset=0.0):
    g = torch.Generator().manual_seed(seed)
    return torch.randn(R, N, d, generator=g) + offset


def _with_zeros(x):
    """Every group of 8 tokens and of 8 channels holds a 0, so its zero point is in [0, 2**bits - 1]."""
    N, d = x.shape[-2:]
    t, c = torch.arange(N)[:, None], torch.arange(d)[None, :]
    return x.masked_fill((t - c) % 8 == 0, 0.0)  # one 0 per 8 tokens of a channel and per 8 channels of a token


@pytest.mark.parametrize("zero_dtype", [torch.int8, torch.uint8])
@pytest.mark.parametrize("bits", [2, 3, 4])
@pytest.mark.parametrize("grouping, group", [("channel", 8), ("token", 8), ("token", 16)])
def test_8bit_zero_points_equal_int16_when_they_fit(zero_dtype, bits, grouping, group):
    x = _with_zeros(_x())  # every range holds 0, so z in [0, 2**bits - 1]
    ref = quantize_block(x, bits, grouping, group, scale_dtype=torch.float16)
    got = narrow_zero_points(ref, x, zero_dtype)
    assert got.zero.dtype == zero_dtype and ref.zero.dtype == torch.int16
    assert torch.equal(got.zero.to(torch.int16), ref.zero)
    assert torch.equal(got.codes, ref.codes) and torch.equal(got.scale, ref.scale)
    assert got.zero.nbytes * 2 == ref.zero.nbytes
    torch.testing.assert_close(dequantize_block(got), dequantize_block(ref), rtol=0, atol=0)


@pytest.mark.parametrize("zero_dtype, offset", [(torch.int8, 60.0), (torch.int8, -60.0), (torch.uint8, 5.0),
                                                (torch.uint8, -500.0)])
@pytest.mark.parametrize("grouping", ["channel", "token"])
def test_zero_points_that_do_not_fit_widen_the_scale(zero_dtype, offset, grouping):
    """Far from 0 the int16 zero point overflows 8 bits: it saturates and the grid still covers the range."""
    bits, group = 2, 8
    x = _x(offset=offset)
    x[0, :, :] -= offset  # row 0 stays around 0: its groups fit and must not change
    ref = quantize_block(x, bits, grouping, group, scale_dtype=torch.float16)
    info = torch.iinfo(zero_dtype)
    bad = (ref.zero < info.min) | (ref.zero > info.max)
    assert bool(bad.any()) and not bool(bad[0].any())
    got = narrow_zero_points(ref, x, zero_dtype)
    assert got.zero.dtype == zero_dtype
    assert torch.equal(got.zero[~bad].to(torch.int16), ref.zero[~bad])
    assert torch.equal(got.scale[~bad], ref.scale[~bad])
    xh, xr = dequantize_block(got), dequantize_block(ref)
    torch.testing.assert_close(xh[0], xr[0], rtol=0, atol=0)
    # Every element is within half a (widened) step: the grid covers each group's range.
    from kv_cache.kernels.reference import expand_meta

    step = expand_meta(got, got.scale)
    assert bool(((xh - x).abs() <= step / 2 + 1e-4 * x.abs().clamp(min=1)).all())
    # The widened scale is the smallest that covers the range: hi / (L - z) or lo / -z.
    L = 2**bits - 1
    z = got.zero.float()[bad]
    s = got.scale.float()[bad]
    lo_grid, hi_grid = -z * s, (L - z) * s
    xg = x.view(3, 4, 8, 16) if grouping == "channel" else x.view(3, 32, 2, 8)
    red = 2 if grouping == "channel" else 3
    lo, hi = xg.amin(red)[bad], xg.amax(red)[bad]
    assert bool((lo_grid <= lo + 1e-4 * lo.abs()).all()) and bool((hi_grid >= hi - 1e-4 * hi.abs()).all())
    assert bool(((z == info.min) | (z == info.max)).all())


def test_packed_kv_stores_8bit_zero_points_and_counts_them():
    k = _with_zeros(_x(R=6, N=32, d=16, seed=1)).view(2, 3, 32, 16)
    v = _with_zeros(_x(R=6, N=32, d=16, seed=2)).view(2, 3, 32, 16)
    out = {}
    for zd in (torch.int16, torch.int8, torch.uint8):
        q = QuantConfig.kivi(bits=2, group_size=8, residual_length=8, zero_dtype=zd)
        p = PackedKV(q, torch.float32, 16, track_groups=True, layer=0)
        p.append(k, v)
        cats = dict.fromkeys(("codes", "scales", "zero_points", "residual", "indices", "tables"), 0)
        p.add_nbytes(cats)
        assert p.k_zero.dtype == zd and p.v_zero.dtype == zd
        out[zd] = (p.dequantize(), cats["zero_points"])
        p.gather(torch.tensor([0, 3, 9, 20])[None, None].expand(2, 3, 4).contiguous())  # eviction keeps the dtype
        assert p.k_zero.dtype == zd
    assert out[torch.int8][1] * 2 == out[torch.int16][1] == out[torch.uint8][1] * 2
    for zd in (torch.int8, torch.uint8):
        for a, b in zip(out[zd][0], out[torch.int16][0]):
            torch.testing.assert_close(a, b, rtol=0, atol=0)


@pytest.mark.parametrize("kw, match", [
    (dict(zero_dtype=torch.float16),
     r"zero_dtype must be one of torch.int16, torch.int8, torch.uint8; got torch.float16"),
    (dict(zero_dtype="int8"), r"zero_dtype must be one of torch.int16, torch.int8, torch.uint8; got 'int8'"),
    (dict(zero_dtype=torch.int32), r"got torch.int32"),
    (dict(zero_dtype=torch.int8, symmetric=True), r"asymmetric uniform levels only .*got symmetric=True"),
    (dict(bits=2, zero_dtype=torch.uint8, key_grouping="token", levels="lloyd_max"),
     r"asymmetric uniform levels only .*levels='lloyd_max'"),
    (dict(bits=8, zero_dtype=torch.int8), r"int8 cannot hold the zero points \(0..255\) of 8-bit codes; use "
                                          r"torch.uint8 or torch.int16 \(bits in use: \[8\]\)"),
    (dict(bits=2, layer_bits={0: 8}, zero_dtype=torch.int8), r"bits in use: \[2, 8\]"),
    (dict(residual_dtype=torch.int8), r"residual_dtype must be one of None, torch.float16, torch.bfloat16, "
                                      r"torch.float32; got torch.int8"),
    (dict(residual_dtype="float16"), r"residual_dtype must be one of .*; got 'float16'"),
    (dict(clip_keys=float("nan")), r"clip_keys must be a float in \(0, 1\]; got nan"),
    (dict(clip_values=True), r"clip_values must be a float in \(0, 1\]; got True"),
])
def test_bad_values_name_allowed_and_received(kw, match):
    with pytest.raises(ValueError, match=match):
        QuantConfig.kivi(**kw)


def test_repr_shows_new_fields_only_when_set():
    base = QuantConfig.kivi(bits=2)
    assert "zero_dtype" not in repr(base) and "residual_dtype" not in repr(base)
    assert repr(base) == ("QuantConfig(bits=2, group_size=32, residual_length=32, sink_tokens=0, symmetric=False, "
                          "scale_dtype=torch.float16)")
    q = QuantConfig.kivi(bits=2, zero_dtype=torch.uint8, residual_dtype=torch.float16)
    assert repr(q).endswith("zero_dtype=torch.uint8, residual_dtype=torch.float16)")
    assert QuantConfig.kivi(bits=8, zero_dtype=torch.uint8).zero_dtype == torch.uint8


def test_packed_kv_quantizes_a_narrow_residual_in_the_model_dtype():
    """Tokens handed over in float16 (a float16 residual) are quantized as the float32 model's would be."""
    q = QuantConfig.kivi(bits=4, group_size=8, residual_length=8, rotation="hadamard")
    k, v = _x(R=2, N=16, d=16, seed=3).view(1, 2, 16, 16), _x(R=2, N=16, d=16, seed=4).view(1, 2, 16, 16)
    kh, vh = k.half(), v.half()
    a = PackedKV(q, torch.float32, 16, track_groups=False)
    a.append(kh, vh)
    b = PackedKV(q, torch.float32, 16, track_groups=False)
    b.append(kh.float(), vh.float())
    assert torch.equal(a.k_codes, b.k_codes) and torch.equal(a.v_scale, b.v_scale)
    ka, _ = a.dequantize()
    assert ka.dtype == torch.float32


@pytest.mark.parametrize("residual_dtype", [torch.float16, torch.bfloat16])
def test_storage_keeps_residual_and_sinks_in_residual_dtype(residual_dtype):
    q = QuantConfig.kivi(bits=4, group_size=8, residual_length=8, sink_tokens=4, residual_dtype=residual_dtype)
    k, v = _x(R=2, N=22, d=16, seed=5).view(1, 2, 22, 16), _x(R=2, N=22, d=16, seed=6).view(1, 2, 22, 16)
    st = make_storage(q, k[:, :, :0], v[:, :, :0], track_groups=False)
    st.append(k, v)
    assert st.keys.dtype == st.sink_keys.dtype == st.values.dtype == st.sink_values.dtype == residual_dtype
    rk, rv = st.read()
    assert rk.dtype == torch.float32 and rk.shape == k.shape
    torch.testing.assert_close(rk[:, :, :4], k[:, :, :4].to(residual_dtype).float(), rtol=0, atol=0)
    torch.testing.assert_close(rk[:, :, -st.keys.shape[2]:], k[:, :, -st.keys.shape[2]:].to(residual_dtype).float(),
                               rtol=0, atol=0)
    cats = st.nbytes_by_category()
    n_full = 4 + st.keys.shape[2]
    assert cats["residual"] == 2 * 1 * 2 * n_full * 16 * 2  # keys + values, 2 bytes each


# -- 8-bit log-coded norms (QuantConfig.kivi(scale_dtype=torch.uint8), math dictionary §18.8) --

def test_log_scale_codes_reference_and_bounds():
    from kv_cache.compression.codebook import (LOG_SCALE_MIN_EXP, LOG_SCALE_STEP, decode_log_scale,
                                               encode_log_scale, log_scale_range)

    lo, hi = log_scale_range()
    s = torch.cat([torch.zeros(1), torch.logspace(-3.9, 2.45, 5000), torch.tensor([lo, hi, lo / 10])])
    c = encode_log_scale(s)
    ref = torch.round((torch.log2(s.double().clamp_min(lo)) - LOG_SCALE_MIN_EXP) / LOG_SCALE_STEP) + 1
    ref = torch.where(s > 0, ref.clamp(1, 255), torch.zeros_like(ref)).to(torch.uint8)
    assert torch.equal(c, ref) and c[0] == 0 and c[-3] == 1 and c[-2] == 255 and c[-1] == 1
    d = decode_log_scale(c)
    rel = (d[1:-3] / s[1:-3] - 1).abs()
    assert float(rel.max()) <= 2 ** (LOG_SCALE_STEP / 2) - 1 + 1e-6  # within half a step: 2.9%
    assert d[0] == 0 and decode_log_scale(c, torch.float16).dtype == torch.float16
    assert torch.equal(encode_log_scale(decode_log_scale(c[1:])), c[1:])  # codes are fixed points
    for bad, match in ((torch.tensor([float("nan")]), "NaN"), (torch.tensor([float("inf")]), "Inf|NaN"),
                       (torch.tensor([-1.0]), ">= 0"), (torch.tensor([hi * 1.1]), "hold")):
        with pytest.raises(ValueError, match=match):
            encode_log_scale(bad)
    with pytest.raises(TypeError, match="floating"):
        encode_log_scale(torch.tensor([1, 2]))
    with pytest.raises(TypeError, match="uint8"):
        decode_log_scale(torch.tensor([1.0]))
    assert encode_log_scale(torch.zeros(0)).shape == (0,)


def test_packed_kv_with_log_coded_norms_matches_fp32_norms_within_a_step():
    """Same codes as float32 norms (norm-only codes do not depend on the scale), norms within
    2.9%, half the fp16 metadata bytes, and the attention kernels read them."""
    from kv_cache.compression.codebook import decode_log_scale

    base = dict(bits=3, group_size=8, residual_length=8, key_grouping="token", levels="lloyd_max",
                rotation="hadamard", channel_group=16)
    g = torch.Generator().manual_seed(1)
    k, v = torch.randn(2, 3, 24, 16, generator=g) * 4, torch.randn(2, 3, 24, 16, generator=g) * 0.05
    ref = PackedKV(QuantConfig.kivi(**base, scale_dtype=torch.float32), torch.float32, 16, False)
    log = PackedKV(QuantConfig.kivi(**base, scale_dtype=torch.uint8), torch.float32, 16, False)
    fp16 = PackedKV(QuantConfig.kivi(**base), torch.float32, 16, False)
    for p in (ref, log, fp16):
        p.append(k, v)
    assert log.k_scale.dtype == torch.uint8 and log.v_scale.dtype == torch.uint8
    assert torch.equal(log.k_codes, ref.k_codes) and torch.equal(log.v_codes, ref.v_codes)
    for a, b in ((log.k_scale, ref.k_scale), (log.v_scale, ref.v_scale)):
        assert float((decode_log_scale(a) / b - 1).abs().max()) < 0.03
    assert log.k_scale.nbytes * 2 == fp16.k_scale.nbytes
    (kd, vd), (kr, vr) = log.dequantize(), ref.dequantize()
    assert float((kd - kr).norm() / kr.norm()) < 0.03 and float((vd - vr).norm() / vr.norm()) < 0.03
    kq, vq = log.qblocks()  # the kernels read the 8-bit codes through the table: no float copy per call
    assert kq.scale.dtype == torch.uint8 and vq.scale.dtype == torch.uint8
    assert torch.equal(kq.scale_values(), decode_log_scale(log.k_scale).reshape(6, 24, -1))
    from kv_cache.kernels import attend_block, dequantize_block, reference

    torch.testing.assert_close(dequantize_block(vq), reference.dequantize_block(vq), rtol=0, atol=0)
    q = torch.randn(6, 2, 16, generator=g)
    got, want = attend_block(q, kq, vq, 0.25), reference.attend_block(q, kq, vq, 0.25)
    torch.testing.assert_close(got[0], want[0], rtol=1e-5, atol=1e-5)


def test_log_coded_norms_need_norm_only_levels():
    with pytest.raises(ValueError, match="needs norm-only scales"):
        QuantConfig.kivi(bits=2, scale_dtype=torch.uint8)
    with pytest.raises(ValueError, match="torch.uint8; got torch.int8"):
        QuantConfig.kivi(bits=2, scale_dtype=torch.int8)
    q = QuantConfig.kivi(bits=2, key_grouping="token", levels="lloyd_max", scale_dtype=torch.uint8)
    assert "scale_dtype=torch.uint8" in repr(q)


def test_log_coded_cache_in_model_generate_and_accounting(stories):
    from kv_cache import CompressedCache, compress
    from kv_cache.eval.accounting import walked_nbytes
    from kv_cache.spec.grammar import parse_quant

    from kv_cache.generation import forward_at

    model, tok = stories
    ids = tok("Once upon a time there was a little girl who liked to play in the park.", return_tensors="pt").input_ids
    cont = tok(["She ran to the swings and her mom pushed her high into the sky."], return_tensors="pt").input_ids[:, 1:]
    out = {}
    for spec in ("q3g4r4s2htc16l", "q3g4r4s2htc16le"):
        cache = CompressedCache(model.config, quant=parse_quant(spec))
        with torch.no_grad(), compress(model, cache):
            forward_at(model, cache, ids, 0)
            out[spec] = forward_at(model, cache, cont, ids.shape[1])  # a continuation: it reads the cache
        rep = cache.memory_report()
        assert rep.total_bytes == walked_nbytes(cache)
        out[spec + "scales"] = rep.scales_bytes
    assert out["q3g4r4s2htc16lescales"] * 2 == out["q3g4r4s2htc16lscales"]
    # 8-bit log-coded norms cost little next to float16 ones: measured max |d logit| 0.43 on this
    # continuation, where a 2-bit layout differs by 10.6 and uniform levels by 8.8
    assert (out["q3g4r4s2htc16le"] - out["q3g4r4s2htc16l"]).abs().max().item() < 1.0


def test_qblock_scale_table_is_validated():
    """uint8 scales are codes and need their table; a table with float scales is refused."""
    from kv_cache.compression.codebook import log_scale_table
    from kv_cache.kernels import QBlock, uniform_lut

    codes, lut = torch.zeros(1, 2, 8, dtype=torch.uint8), uniform_lut(4, False)
    with pytest.raises(ValueError, match="uint8 scale codes need scale_table"):
        QBlock(codes, 4, lut, "token", torch.zeros(1, 2, 1, dtype=torch.uint8), None, 16)
    with pytest.raises(ValueError, match="uint8 scale codes need scale_table"):
        QBlock(codes, 4, lut, "token", torch.zeros(1, 2, 1, dtype=torch.uint8), None, 16,
               scale_table=torch.zeros(255))
    with pytest.raises(ValueError, match="applies to uint8 scale codes only"):
        QBlock(codes, 4, lut, "token", torch.zeros(1, 2, 1), None, 16, scale_table=log_scale_table())
    with pytest.raises(TypeError, match="or uint8 codes with scale_table"):
        QBlock(codes, 4, lut, "token", torch.zeros(1, 2, 1, dtype=torch.int32), None, 16)
    ok = QBlock(codes, 4, lut, "token", torch.full((1, 2, 1), 7, dtype=torch.uint8), None, 16,
                scale_table=log_scale_table())
    assert torch.equal(ok.scale_values(), log_scale_table()[7].expand(1, 2, 1))
