"""Property tests (hypothesis) for quantization, packing and selection (layer 1)."""

from __future__ import annotations

import numpy as np
import torch
from hypothesis import given, settings
from hypothesis import strategies as st
from hypothesis.extra.numpy import arrays

from kv_cache.compression import (
    dequantize,
    pack_bits,
    packed_nbytes,
    quantize,
    select_tokens,
    snapkv_select,
    unpack_bits,
)

finite = st.floats(-1e4, 1e4, allow_nan=False, allow_infinity=False, width=32)
shapes = st.tuples(st.integers(1, 40), st.integers(1, 9))


@settings(max_examples=60, deadline=None)
@given(arrays(np.float32, shapes, elements=finite), st.sampled_from([2, 3, 4, 8]), st.booleans(),
       st.sampled_from([None, 1, 3, 8]), st.sampled_from([0, 1]))
def test_round_trip_error_bound(x, bits, symmetric, group, axis):
    """|x - x_hat| <= scale / 2 (+ float32 rounding) for every element, per its group's scale."""
    qt = quantize(x, bits, axis=axis, group_size=group, symmetric=symmetric)
    xh = dequantize(qt)
    g = qt.group_size
    scale = np.repeat(qt.scale, g, axis=axis).take(np.arange(x.shape[axis]), axis=axis)
    tol = scale / 2 * (1 + 1e-5) + np.abs(x) * 2e-7 + 1e-30
    assert np.all(np.abs(x - xh) <= tol)


@settings(max_examples=40, deadline=None)
@given(arrays(np.float32, st.tuples(st.integers(2, 64), st.integers(1, 6)), elements=finite))
def test_error_monotone_in_bits(x):
    """Per-element error can tie, so the monotone quantity is the guaranteed bound scale/2: it
    shrinks with every added bit, except where the zero-point range guard floors the scale at
    ``max|x| * 2**-14`` (a group that varies by a tiny fraction of its magnitude, e.g. 9004..9009),
    where it stays at that floor."""
    bounds = []
    for b in (2, 3, 4, 8):
        qt = quantize(x, b, axis=0)
        err = np.abs(x - dequantize(qt)).max(0)
        assert np.all(err <= qt.scale[0] / 2 * (1 + 1e-5) + np.abs(x).max(0) * 2e-7)
        bounds.append(qt.scale[0] / 2)
    nonconst = x.min(0) != x.max(0)
    floor = np.abs(x).max(0).astype(np.float64) * 2.0**-14 / 2 * (1 + 1e-6)  # the guard's bound
    for i in range(3):
        hi, lo = bounds[i][nonconst], bounds[i + 1][nonconst]
        guarded = lo <= floor[nonconst]
        assert np.all(lo[~guarded] < hi[~guarded])
        assert np.all(lo[guarded] <= hi[guarded])


@settings(max_examples=80, deadline=None)
@given(st.sampled_from([2, 3, 4, 8]), st.integers(0, 300), st.integers(0, 2**31 - 1))
def test_packing_round_trip(bits, n, seed):
    g = torch.Generator().manual_seed(seed)
    codes = torch.randint(0, 2**bits, (n,), generator=g, dtype=torch.int64).to(torch.uint8)
    packed = pack_bits(codes, bits)
    assert packed.dtype == torch.uint8 and packed.numel() == packed_nbytes(n, bits)
    assert packed.numel() <= n * bits // 8 + 3
    assert torch.equal(unpack_bits(packed, bits, n), codes)


@settings(max_examples=80, deadline=None)
@given(arrays(np.float32, st.integers(1, 60), elements=st.floats(0, 1, width=32)),
       st.integers(1, 80), st.integers(0, 10))
def test_selection_invariants(scores, budget, window):
    window = min(window, budget)
    keep = snapkv_select(scores, budget, window)
    T = scores.shape[0]
    assert keep.shape[0] == min(budget, T)
    assert np.all(np.diff(keep) > 0)  # sorted, unique
    assert set(range(max(0, T - window), T)) <= set(keep.tolist())  # recent window kept
    rest = np.setdiff1d(np.arange(T - window if window else T), keep)
    kept_scored = np.setdiff1d(keep, np.arange(T - window, T))
    if rest.size and kept_scored.size:  # every kept scored token beats every dropped one
        assert scores[kept_scored].min() >= scores[rest].max()


@settings(max_examples=40, deadline=None)
@given(arrays(np.float32, st.tuples(st.integers(1, 3), st.integers(1, 4), st.integers(1, 30)),
              elements=st.floats(0, 1, width=32)),
       st.integers(1, 40), st.integers(0, 3), st.integers(0, 3))
def test_batched_selection_matches_per_row(scores, budget, window, sinks):
    budget = max(budget, window + sinks)
    t = torch.from_numpy(scores)
    idx = select_tokens(t, budget, recent_window=window, sink_tokens=sinks)
    T = scores.shape[-1]
    assert idx.shape == (*scores.shape[:-1], min(budget, T))
    for b in range(scores.shape[0]):
        for h in range(scores.shape[1]):
            row = idx[b, h].tolist()
            assert row == sorted(set(row))
            forced = set(range(min(sinks, T))) | set(range(max(0, T - window), T))
            assert forced <= set(row)
            if sinks == 0:
                assert row == snapkv_select(scores[b, h], budget, window).tolist()


@settings(max_examples=30, deadline=None)
@given(arrays(np.float32, st.tuples(st.integers(1, 3), st.integers(1, 20), st.integers(1, 16)),
              elements=finite), st.sampled_from([2, 3, 4, 8]), st.sampled_from([-1, -2]))
def test_numpy_torch_agreement(x, bits, axis):
    a = quantize(x, bits, axis=axis, group_size=4)
    b = quantize(torch.from_numpy(x), bits, axis=axis, group_size=4)
    np.testing.assert_array_equal(a.data, b.data.numpy())
    np.testing.assert_array_equal(dequantize(a), dequantize(b).numpy())


def test_pack_bits_leaves_its_input_untouched():
    for bits in (2, 3, 4):
        codes = torch.randint(0, 2**bits, (64,), dtype=torch.uint8)
        before = codes.clone()
        pack_bits(codes, bits)
        assert torch.equal(codes, before)
