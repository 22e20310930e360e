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
        q = QuantConfig(bits=2, group_size=8, residual_length=8, zero_dtype=zd)
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
        QuantConfig(**kw)


def test_repr_shows_new_fields_only_when_set():
    base = QuantConfig(bits=2)
    assert "zero_dtype" not in repr(base) and "residual_dtype" not in repr(base)
    assert repr(base) == ("QuantConfig(bits=2, group_size=32, residual_length=32, sink_tokens=0, symmetric=False, "
                          "scale_dtype=torch.float16)")
    q = QuantConfig(bits=2, zero_dtype=torch.uint8, residual_dtype=torch.float16)
    assert repr(q).endswith("zero_dtype=torch.uint8, residual_dtype=torch.float16)")
    assert QuantConfig(bits=8, zero_dtype=torch.uint8).zero_dtype == torch.uint8


def test_packed_kv_quantizes_a_narrow_residual_in_the_model_dtype():
    """Tokens handed over in float16 (a float16 residual) are quantized as the float32 model's would be."""
    q = QuantConfig(bits=4, group_size=8, residual_length=8, rotation="hadamard")
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
    q = QuantConfig(bits=4, group_size=8, residual_length=8, sink_tokens=4, residual_dtype=residual_dtype)
    k, v = _x(R=2, N=22, d=16, seed=5).view(1, 2, 22, 16), _x(R=2, N=22, d=16, seed=6).view(1, 2, 22, 16)
    st = make_storage(q, k[:, :, :0], v[:, :, :0], track_groups=False)
    st.append(k, v)
    if st.keys.dtype != residual_dtype:
        pytest.skip("QuantizedStorage does not honour QuantConfig.residual_dtype yet (storage.py patch pending)")
    assert st.sink_keys.dtype == residual_dtype and st.values.dtype == residual_dtype
    rk, rv = st.read()
    assert rk.dtype == torch.float32 and rk.shape == k.shape
    torch.testing.assert_close(rk[:, :, :4], k[:, :, :4].to(residual_dtype).float(), rtol=0, atol=0)
    torch.testing.assert_close(rk[:, :, -st.keys.shape[2]:], k[:, :, -st.keys.shape[2]:].to(residual_dtype).float(),
                               rtol=0, atol=0)
    cats = st.nbytes_by_category()
    n_full = 4 + st.keys.shape[2]
    assert cats["residual"] == 2 * 1 * 2 * n_full * 16 * 2  # keys + values, 2 bytes each
