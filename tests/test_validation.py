"""Every validation path of kv_cache.compression raises a clear error (layer 1)."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from kv_cache.compression import (
    dequantize,
    keep_recent_and_heavy_hitters,
    pack_bits,
    pool_scores,
    quantization_error,
    quantize,
    quantize_per_channel_symmetric,
    reduce_gqa,
    resolve_budget,
    select_tokens,
    snapkv_scores,
    snapkv_select,
    unpack_bits,
    window_attention,
)

X = np.random.default_rng(0).standard_normal((8, 4)).astype(np.float32)


@pytest.mark.parametrize("bits", [0, 1, 5, 6, 7, 16, 4.0, True, "4"])
def test_unsupported_bits(bits):
    with pytest.raises(ValueError, match=r"bits must be one of \[2, 3, 4, 8\]; got"):
        quantize(X, bits)
    if not isinstance(bits, (str, float)):
        with pytest.raises(ValueError, match="bits must be one of"):
            pack_bits(torch.zeros(4, dtype=torch.uint8), bits)


@pytest.mark.parametrize("bad", [np.nan, np.inf, -np.inf])
def test_non_finite_input(bad):
    x = X.copy()
    x[3, 2] = bad
    with pytest.raises(ValueError, match="non-finite"):
        quantize(x, 4)
    with pytest.raises(ValueError, match="non-finite"):
        keep_recent_and_heavy_hitters(x, 4, 1)
    with pytest.raises(ValueError, match="non-finite"):
        quantization_error(x, quantize(X, 4))


def test_empty_input():
    with pytest.raises(ValueError, match="empty"):
        quantize(np.zeros((0, 4), np.float32), 4)
    with pytest.raises(ValueError, match="empty"):
        snapkv_select(np.zeros(0, np.float32), 4, 1)


@pytest.mark.parametrize(
    "x", [np.arange(8, dtype=np.int32).reshape(2, 4), np.ones((2, 4), bool), np.ones((2, 4), np.complex64),
          torch.ones(2, 4, dtype=torch.int8)]
)
def test_unsupported_dtypes(x):
    with pytest.raises(TypeError, match="floating dtype"):
        quantize(x, 4)


def test_not_an_array():
    with pytest.raises(TypeError, match="numpy.ndarray or a torch.Tensor; got list"):
        quantize([[1.0, 2.0]], 4)
    with pytest.raises(TypeError, match="QuantizedTensor"):
        dequantize(X)


def test_wrong_rank():
    with pytest.raises(ValueError, match=r"^x must be rank >= 2 when axis=None .*; got rank 1 with shape \(5,\)$"):
        quantize_per_channel_symmetric(np.ones(5, np.float32), 4)
    with pytest.raises(ValueError, match=r"^scores must be rank >= 1 \[\.\.\., num_tokens\]; got rank 0"):
        select_tokens(torch.tensor(1.0), 1)
    with pytest.raises(ValueError, match=r"rank 2 \[num_steps, num_tokens\]"):
        keep_recent_and_heavy_hitters(np.ones((2, 3, 4), np.float32), 2, 1)
    with pytest.raises(ValueError, match=r"rank 1 \[num_tokens\]"):
        snapkv_select(np.ones((2, 3), np.float32), 2, 1)
    with pytest.raises(ValueError, match="rank 4"):
        window_attention(torch.ones(1, 2, 3), torch.ones(1, 2, 3, 4))


def test_bad_axis_and_group_size():
    with pytest.raises(ValueError, match=r"axis must be in \[-2, 1\]"):
        quantize(X, 4, axis=2)
    with pytest.raises(ValueError, match="group_size must be >= 1; got 0"):
        quantize(X, 4, group_size=0)
    with pytest.raises(TypeError, match="group_size must be an int"):
        quantize(X, 4, group_size=2.5)
    # A group larger than the axis is the whole axis, not an error.
    assert quantize(X, 4, axis=0, group_size=1000).group_size == 8


def test_scale_dtype_too_narrow():
    with pytest.raises(ValueError, match="cannot represent the scales"):
        quantize(np.full((4, 2), 1e30, np.float32) * np.array([1, 2], np.float32), 8, axis=0,
                 scale_dtype=np.float16)


def test_shape_mismatch_in_error_metrics():
    with pytest.raises(ValueError, match="shape"):
        quantization_error(X[:4], quantize(X, 4))


@pytest.mark.parametrize(
    "budget,window,match",
    [(2, 3, "budget must be >= recent_window"), (0, 0, "budget must be >= 1"), (4, -1, "recent_window must be >= 0")],
)
def test_selection_budget_validation(budget, window, match):
    h = np.ones((2, 10), np.float32)
    with pytest.raises(ValueError, match=match):
        keep_recent_and_heavy_hitters(h, budget, window)
    with pytest.raises(ValueError, match=match):
        snapkv_select(h[0], budget, window)


def test_budget_larger_than_sequence_keeps_all():
    np.testing.assert_array_equal(snapkv_select(np.ones(5, np.float32), 50, 2), np.arange(5))


def test_resolve_budget_validation():
    assert resolve_budget(0.5, 10) == 5 and resolve_budget(100, 10) == 10 and resolve_budget(0.01, 10) == 1
    for bad, err in ((0.0, ValueError), (1.5, ValueError), (-3, ValueError), (0, ValueError),
                     ("a", TypeError), (True, TypeError), (float("nan"), ValueError)):
        with pytest.raises(err):
            resolve_budget(bad, 10)
    with pytest.raises(ValueError, match="total_tokens must be >= 1"):
        resolve_budget(4, 0)


def test_pooling_and_gqa_validation():
    s = torch.ones(1, 4, 10)
    with pytest.raises(ValueError, match="kernel_size must be odd"):
        pool_scores(s, 4)
    with pytest.raises(ValueError, match=r"pooling must be one of \['avg', 'max'\]"):
        pool_scores(s, 3, "median")
    with pytest.raises(ValueError, match="multiple of num_kv_heads"):
        reduce_gqa(s, 3)
    with pytest.raises(ValueError, match=r"how must be one of \['mean', 'max'\]"):
        reduce_gqa(s, 2, "sum")
    with pytest.raises(ValueError, match="rank 4"):
        snapkv_scores(s, 2)
    with pytest.raises(ValueError, match="window"):
        window_attention(torch.ones(1, 2, 5, 4), torch.ones(1, 1, 3, 4))
    with pytest.raises(TypeError, match="valid must be a bool"):
        select_tokens(s, 3, valid=torch.ones(10))


def test_unpack_validation():
    with pytest.raises(ValueError, match="need"):
        unpack_bits(torch.zeros(3, dtype=torch.uint8), 4, 100)
    with pytest.raises(TypeError, match="uint8"):
        unpack_bits(torch.zeros(3, dtype=torch.int32), 4, 6)
    with pytest.raises(TypeError, match="integer dtype"):
        pack_bits(torch.zeros(3), 4)
