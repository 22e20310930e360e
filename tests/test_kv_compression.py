"""The seed's contract for kv_cache.compression (layer 1 and 2: model-free + reference)."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from kv_cache.compression import (
    QuantizedTensor,
    compression_ratio,
    cumulative_attention_scores,
    dequantize,
    keep_recent_and_heavy_hitters,
    metadata_bits_per_element,
    pack_bits,
    packed_nbytes,
    quantization_error,
    quantize,
    quantize_per_channel_asymmetric,
    quantize_per_channel_symmetric,
    snapkv_select,
    total_gain,
    unpack_bits,
)

BITS = (2, 3, 4, 8)


def _ref_symmetric(x: np.ndarray, bits: int):
    """The seed's numpy code, verbatim apart from the int8 storage (reference)."""
    flat = x.reshape(-1, x.shape[-1]).astype(np.float32)
    qmax = (1 << (bits - 1)) - 1
    abs_max = np.clip(np.max(np.abs(flat), axis=0), 1e-8, None)
    scale = abs_max / qmax
    q = np.clip(np.round(flat / scale), -qmax, qmax)
    return q, scale


def _ref_asymmetric(x: np.ndarray, bits: int):
    flat = x.reshape(-1, x.shape[-1]).astype(np.float32)
    qmin, qmax = 0, (1 << bits) - 1
    c_min, c_max = flat.min(0), flat.max(0)
    scale = np.clip(c_max - c_min, 1e-8, None) / (qmax - qmin)
    zp = np.round(qmin - c_min / scale)
    q = np.clip(np.round(flat / scale) + zp, qmin, qmax)
    return q, scale, zp


@pytest.mark.parametrize("bits", BITS)
@pytest.mark.parametrize("n", [1, 7, 97, 1000])
def test_symmetric_matches_seed_reference(bits, n):
    x = np.random.default_rng(n).standard_normal((n, 16)).astype(np.float32) * 3
    x[0, 0] += 0.5  # make sure no channel is constant when n == 1 ... except n == 1
    qt = quantize_per_channel_symmetric(x, bits)
    q_ref, scale_ref = _ref_symmetric(x, bits)
    nonconst = x.min(0) != x.max(0)
    np.testing.assert_array_equal(qt.codes()[:, nonconst], q_ref[:, nonconst])
    np.testing.assert_allclose(qt.scale[0, nonconst], scale_ref[nonconst], rtol=0, atol=0)
    assert qt.zero_point.nbytes == 0
    xh = dequantize(qt)
    assert xh.dtype == np.float32 and xh.shape == x.shape
    np.testing.assert_allclose(xh[:, nonconst], (q_ref * scale_ref)[:, nonconst], rtol=1e-6, atol=1e-7)


@pytest.mark.parametrize("bits", BITS)
@pytest.mark.parametrize("n", [2, 7, 97, 1000])
def test_asymmetric_matches_seed_reference(bits, n):
    x = np.random.default_rng(n).standard_normal((n, 16)).astype(np.float32) + 0.3
    qt = quantize_per_channel_asymmetric(x, bits)
    q_ref, scale_ref, zp_ref = _ref_asymmetric(x, bits)
    np.testing.assert_array_equal(qt.codes(), q_ref)
    np.testing.assert_array_equal(qt.zero_point[0], zp_ref)
    np.testing.assert_allclose(qt.scale[0], scale_ref, rtol=0, atol=0)
    np.testing.assert_allclose(dequantize(qt), (q_ref - zp_ref) * scale_ref, rtol=1e-6, atol=1e-6)


def test_quantized_tensor_fields_and_real_storage():
    x = np.random.default_rng(0).standard_normal((64, 32)).astype(np.float32)
    qt = quantize(x, 4, axis=-2, group_size=16)
    assert isinstance(qt, QuantizedTensor)
    assert qt.data.dtype == np.uint8 and qt.data.nbytes == 64 * 32 // 2  # really 4 bits
    assert qt.scale.shape == (4, 32) and qt.zero_point.shape == (4, 32)
    assert qt.zero_point.dtype == np.int16
    assert (qt.bits, qt.shape, qt.axis, qt.group_size, qt.symmetric) == (4, (64, 32), 0, 16, False)
    assert qt.nbytes == qt.data.nbytes + qt.scale.nbytes + qt.zero_point.nbytes
    # 4 bits + (32-bit scale + 16-bit zero point) / 16 elements
    assert qt.bits_per_element == pytest.approx(metadata_bits_per_element(4, 16, 32, 16)) == 7.0


@pytest.mark.parametrize("bits,expected", [(2, 1000 // 4), (3, 375), (4, 500), (8, 1000)])
def test_packed_storage_is_dense(bits, expected):
    x = np.random.default_rng(1).standard_normal((1000, 1)).astype(np.float32)
    qt = quantize(x, bits, axis=0)
    assert qt.data.nbytes == expected == packed_nbytes(1000, bits)


def test_three_bit_stays_dense_for_odd_sizes():
    codes = torch.arange(13, dtype=torch.uint8) % 8
    packed = pack_bits(codes, 3)
    assert packed.numel() == 6  # ceil(13 / 8) words of 3 bytes
    assert torch.equal(unpack_bits(packed, 3, 13), codes)


def test_quantization_error_metrics():
    x = np.random.default_rng(2).standard_normal((128, 8)).astype(np.float32)
    qt = quantize_per_channel_symmetric(x, 8)
    m = quantization_error(x, qt)
    err = np.abs(x - dequantize(qt))
    assert m["rmse"] == pytest.approx(float(np.sqrt(np.mean(err**2))), rel=1e-5)
    assert m["max_abs_error"] == pytest.approx(float(err.max()), rel=1e-6)
    assert m["mean_abs_error"] == pytest.approx(float(err.mean()), rel=1e-5)
    assert m["compression_ratio"] == pytest.approx(
        x.nbytes / (qt.data.nbytes + qt.scale.nbytes + qt.zero_point.nbytes)
    )
    assert m["max_abs_error"] <= float(qt.scale.max()) / 2 + 1e-7


def test_error_decreases_with_bits():
    x = np.random.default_rng(3).standard_normal((512, 16)).astype(np.float32)
    rmse = [quantization_error(x, quantize(x, b, axis=0))["rmse"] for b in BITS]
    assert rmse == sorted(rmse, reverse=True) and rmse[-1] < rmse[0] / 20


@pytest.mark.parametrize("symmetric", [True, False])
@pytest.mark.parametrize("bits", BITS)
def test_constant_and_zero_channels_round_trip_exactly(bits, symmetric):
    x = np.zeros((33, 5), np.float32)
    x[:, 1] = 0.1
    x[:, 2] = -3.3
    x[:, 3] = 1e-12
    x[:, 4] = 7e4
    qt = quantize(x, bits, axis=0, symmetric=symmetric)
    np.testing.assert_array_equal(dequantize(qt), x)
    z = torch.zeros(2, 3, 4, 8, dtype=torch.float16)
    qt = quantize(z, bits, axis=-2, group_size=2, symmetric=symmetric)
    assert torch.equal(dequantize(qt), z)
    # an all-zero group next to live ones, with float16 scales (padding tokens' zero keys)
    y = torch.zeros(1, 1, 32, 8)
    y[..., 1] = torch.linspace(-1, 1, 32)
    for store in (torch.float16, torch.bfloat16):
        qt = quantize(y, bits, axis=-2, group_size=32, symmetric=symmetric, scale_dtype=store)
        assert torch.equal(dequantize(qt)[..., 0], y[..., 0])


def test_near_constant_channel_zero_point_fits_int16():
    x = np.full((64, 2), 1000.0, np.float32)
    x[::2, 0] += 0.001  # varies by 1e-6 of its magnitude
    qt = quantize(x, 8, axis=0)
    assert np.abs(qt.zero_point).max() < 2**15
    assert np.abs(dequantize(qt) - x).max() <= 1000.0 * 2**-15


def test_dtype_policy_table():
    cases = [
        (np.float16, np.float32, np.float16),
        (np.float32, np.float32, np.float32),
        (np.float64, np.float64, np.float64),
    ]
    for in_dtype, scale_dtype, out_dtype in cases:
        x = np.random.default_rng(0).standard_normal((16, 4)).astype(in_dtype)
        qt = quantize(x, 4, axis=0)
        assert qt.scale.dtype == scale_dtype
        assert dequantize(qt).dtype == out_dtype
    xb = torch.randn(16, 4).to(torch.bfloat16)
    qt = quantize(xb, 4, axis=0)
    assert qt.scale.dtype == torch.float32 and dequantize(qt).dtype == torch.bfloat16
    qt = quantize(xb, 4, axis=0, scale_dtype=torch.float16)
    assert qt.scale.dtype == torch.float16
    assert dequantize(qt, dtype=torch.float32).dtype == torch.float32


def test_numpy_and_torch_give_identical_codes():
    x = np.random.default_rng(4).standard_normal((2, 3, 50, 8)).astype(np.float16)
    for axis, g in ((-2, 16), (-1, 4), (None, None)):
        a = quantize(x, 3, axis=axis, group_size=g)
        b = quantize(torch.from_numpy(x), 3, axis=axis, group_size=g)
        np.testing.assert_array_equal(a.data, b.data.numpy())
        np.testing.assert_array_equal(a.scale, b.scale.numpy())
        np.testing.assert_array_equal(dequantize(a), dequantize(b).numpy())


# ---------------------------------------------------------------- selection (seed API)


def test_cumulative_attention_scores():
    h = np.array([[0.5, 0.25, 0.25], [0.1, 0.1, 0.8]], np.float32)
    np.testing.assert_allclose(cumulative_attention_scores(h), [0.6, 0.35, 1.05])
    assert cumulative_attention_scores(h).dtype == np.float32
    with pytest.raises(ValueError, match="rank 2"):
        cumulative_attention_scores(h[0])


def test_keep_recent_and_heavy_hitters_seed_semantics():
    h = np.zeros((3, 10), np.float32)
    h[:, 2] = 1.0
    h[:, 5] = 0.5
    h[:, 9] = 9.0  # inside the recent window anyway
    keep = keep_recent_and_heavy_hitters(h, budget=5, recent_window=3)
    np.testing.assert_array_equal(keep, [2, 5, 7, 8, 9])
    assert keep.dtype == np.int32


def test_snapkv_select_seed_semantics_and_ties():
    s = np.array([0.3, 0.3, 0.1, 0.9, 0.3, 0.0, 0.0], np.float32)
    # budget 4, window 2: recent {5, 6}; top-2 of the rest: 3 (0.9) then the earliest 0.3 -> 0
    np.testing.assert_array_equal(snapkv_select(s, 4, 2), [0, 3, 5, 6])
    np.testing.assert_array_equal(snapkv_select(s, 100, 2), np.arange(7))


def test_compression_ratio_and_total_gain():
    assert compression_ratio(100, 25) == 4.0
    for bad in ((0, 1), (10, 0), (10, 11), (-1, -1)):
        with pytest.raises(ValueError, match="0 < kept_tokens <= total_tokens"):
            compression_ratio(*bad)
    assert total_gain(2.0, 0.5, 100, 50) == 8.0
    with pytest.raises(ValueError, match="> 0"):
        total_gain(2.0, 0.0, 100, 50)
