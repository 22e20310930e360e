"""kv_cache.kernels: compiled kernels vs the torch reference, exactness vs the quantizer,
attention vs a float64 oracle, validation, build/fallback behaviour. Model-free.

Tolerances: quantize and dequantize are compared *exactly* (same float32 operations in the
same order); attention is compared with ``rtol = atol = 1e-4`` on ``out`` and ``atol = 1e-4``
on ``lse`` and ``logits`` (float32 accumulation of 64-term dot products and of up to 1000
softmax terms against a float64 oracle; values are O(1)).

Every compiled test runs on each code path this CPU can run: the fastest ("best", AVX-512
here), AVX2 at most ("avx2") and the portable C++ path ("generic", what a CPU without AVX2
runs), selected with ``KV_CACHE_KERNELS``.
"""

from __future__ import annotations

import dataclasses
import logging
import os
import subprocess
import sys

import pytest
import torch

from kv_cache.compression.quantizer import QuantizedTensor, dequantize, quantize
from kv_cache.compression.rotation import hadamard_matrix
from kv_cache.kernels import KeyRope, QBlock, _build, arrival, ops, reference, uniform_lut

ATOL = RTOL = 1e-4
TORCH_ONLY = os.environ.get("KV_CACHE_KERNELS", "").strip().lower() == "torch"
SCALE_DTYPES = (torch.float32, torch.float16, torch.bfloat16)
MODES = ("asym", "sym", "codebook")


PATHS = {"best": "auto", "avx2": "avx2", "generic": "generic"}


@pytest.fixture(params=[*PATHS, "torch"])
def compiled(request, monkeypatch):
    """Select a code path of the ops: a compiled one (skipped when the compiled kernels are
    unavailable) or "torch", the reference fallback the ops use without them."""
    if request.param == "torch":
        monkeypatch.setattr(ops, "_compiled", lambda *tensors: None)
        return request.param
    if TORCH_ONLY or not _build.available():
        pytest.skip("compiled kernels unavailable (KV_CACHE_KERNELS=torch or the build failed)")
    monkeypatch.setenv("KV_CACHE_KERNELS", PATHS[request.param])
    if request.param != "best" and _build.isa() == _build.load().isa(0):
        pytest.skip(f"this CPU's best path is already {_build.isa()}")
    return request.param


@pytest.fixture
def paths(monkeypatch):
    """Callable yielding each compiled code path in turn (skips when the kernels are unavailable).

    Grid tests loop over the paths themselves so the (slower) torch reference runs once.
    """
    if TORCH_ONLY or not _build.available():
        pytest.skip("compiled kernels unavailable (KV_CACHE_KERNELS=torch or the build failed)")

    def each():
        seen = set()
        for name, value in PATHS.items():
            monkeypatch.setenv("KV_CACHE_KERNELS", value)
            if _build.isa() not in seen:  # e.g. "avx2" is "best" on a CPU without AVX-512
                seen.add(_build.isa())
                yield name

    return each


def _lut(bits: int, mode: str, gen: torch.Generator) -> torch.Tensor:
    if mode == "codebook":
        return torch.sort(torch.randn(1 << bits, generator=gen))[0] * 0.7
    return uniform_lut(bits, symmetric=mode == "sym")


def random_block(R, N, d, bits, grouping, gs, *, mode="asym", scale_dtype=torch.float32,
                 zero_dtype=torch.int16, gid=False, extra_groups=0, seed=0) -> QBlock:
    """A QBlock with random codes and metadata (not from a quantizer: covers every layout)."""
    gen = torch.Generator().manual_seed(seed)
    codes = torch.randint(0, 256, (R, N, d * bits // 8), dtype=torch.uint8, generator=gen)
    if grouping == "channel":
        ng = -(-N // gs) + extra_groups
        meta_shape = (R, ng, d)
    else:
        meta_shape = (R, N, d // gs)
    scale = (torch.rand(meta_shape, generator=gen) * 0.5 + 0.05).to(scale_dtype)
    zero = None
    if mode == "asym":
        hi = 1 << bits
        if zero_dtype.is_floating_point:
            zero = (torch.rand(meta_shape, generator=gen) * hi).to(zero_dtype)
        else:
            lo = -100 if zero_dtype in (torch.int16, torch.int8) else 0
            zero = torch.randint(lo, hi, meta_shape, generator=gen).to(zero_dtype)
    g = None
    if gid:
        g = torch.randint(0, meta_shape[1], (R, N), generator=gen, dtype=torch.int32)
        g = torch.sort(g, dim=1)[0].contiguous()  # mostly runs, as after eviction
        g[:, ::5] = torch.randint(0, meta_shape[1], g[:, ::5].shape, generator=gen, dtype=torch.int32)
    return QBlock(codes, bits, _lut(bits, mode, gen), grouping, scale, zero, gs, g)


def oracle_attend(q, k: QBlock, v: QBlock, scaling, start=None, length=None):
    """Plain float64 attention over the dequantized block."""
    kx = reference.dequantize_block(k).double()
    vx = reference.dequantize_block(v).double()
    s = scaling * torch.einsum("rgc,rtc->rgt", q.double(), kx)
    N = kx.shape[1]
    t = torch.arange(N)
    valid = torch.ones(q.shape[0], N, dtype=torch.bool)
    if start is not None:
        valid &= t >= start.long()[:, None]
    if length is not None:
        valid &= t < length.long()[:, None]
    s = s.masked_fill(~valid[:, None, :], float("-inf"))
    lse = torch.logsumexp(s, -1)
    p = torch.exp(s - torch.where(torch.isfinite(lse), lse, 0.0)[..., None])
    return torch.einsum("rgt,rtc->rgc", p, vx), lse, s


# ----------------------------------------------------------------------------- build / dispatch
@pytest.mark.skipif(TORCH_ONLY, reason="KV_CACHE_KERNELS=torch forces the torch fallback")
def test_compiled_extension_is_available():
    """CI fails here if the build silently broke (the ops would still pass on the fallback)."""
    assert _build.available(), f"the kv_cache kernels did not build: {_build.build_error()}"
    assert _build.isa() in ("avx512", "avx2", "generic")
    directory = _build.build_dir()
    assert directory.parent == _build.cache_home() / "ext"
    assert (directory / "BUILT").exists()
    # a second load imports the cached library without compiling
    assert _build._import_built(directory) is not None


def test_build_dir_follows_kv_cache_home(monkeypatch, tmp_path):
    monkeypatch.setenv("KV_CACHE_HOME", str(tmp_path))
    assert _build.build_dir().parent == tmp_path / "ext"
    assert len(_build.build_dir().name) == 16
    monkeypatch.delenv("KV_CACHE_HOME")
    assert _build.cache_home() == _build.Path.home() / ".cache" / "kv_cache"


def test_backend_env_is_validated(monkeypatch):
    monkeypatch.setenv("KV_CACHE_KERNELS", "cuda")
    with pytest.raises(ValueError, match="KV_CACHE_KERNELS must be one of"):
        _build.backend()


def test_failed_build_warns_once_and_falls_back(monkeypatch, caplog):
    monkeypatch.setattr(_build, "_module", None)
    monkeypatch.setattr(_build, "_tried", False)
    monkeypatch.setattr(_build, "_error", None)
    monkeypatch.setattr(_build, "_import_built", lambda directory: None)

    def broken(directory):
        raise OSError("no compiler")

    monkeypatch.setattr(_build, "_compile", broken)
    monkeypatch.setenv("KV_CACHE_KERNELS", "auto")
    with caplog.at_level(logging.WARNING, logger="kv_cache.kernels._build"):
        assert not _build.available()
        assert not _build.available()
        x = torch.randn(2, 8, 16)
        b = ops.quantize_block(x, 4, "channel", 8)  # served by the torch reference
    warnings = [r for r in caplog.records if "falling back" in r.getMessage()]
    assert len(warnings) == 1 and "no compiler" in warnings[0].getMessage()
    assert torch.equal(b.codes, reference.quantize_block(x, 4, "channel", 8).codes)
    with pytest.raises(RuntimeError, match="no compiler"):
        _build.load(raise_errors=True)


def test_concurrent_first_use_builds_once(monkeypatch):
    import threading
    import time

    monkeypatch.setattr(_build, "_module", None)
    monkeypatch.setattr(_build, "_tried", False)
    monkeypatch.setattr(_build, "_error", None)
    monkeypatch.setattr(_build, "_import_built", lambda directory: None)
    monkeypatch.setenv("KV_CACHE_KERNELS", "auto")
    calls, sentinel = [], object()

    def slow_compile(directory):
        calls.append(directory)
        time.sleep(0.2)
        return sentinel

    monkeypatch.setattr(_build, "_compile", slow_compile)
    got = []
    threads = [threading.Thread(target=lambda: got.append(_build.load())) for _ in range(8)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert len(calls) == 1 and got == [sentinel] * 8


def test_importing_kv_cache_compiles_nothing(tmp_path):
    code = "import kv_cache, kv_cache.kernels, sys; assert 'kv_cache_kernels' not in sys.modules"
    env = {**os.environ, "KV_CACHE_HOME": str(tmp_path)}
    subprocess.run([sys.executable, "-c", code], check=True, env=env, timeout=120)
    assert not (tmp_path / "ext").exists()


# ----------------------------------------------------------------------------- dequantize
@pytest.mark.parametrize("bits", [2, 3, 4, 8])
@pytest.mark.parametrize("grouping", ["channel", "token"])
@pytest.mark.parametrize("mode", MODES)
@pytest.mark.parametrize("N", [1, 7, 97, 1000])
def test_dequantize_matches_reference(paths, bits, grouping, mode, N):
    for i, (R, sdt) in enumerate([(1, torch.float32), (3, torch.float16), (3, torch.bfloat16)]):
        gs = (8, 32, 64)[i] if grouping == "token" else (1, 7, 128)[i]
        zdt = (torch.int16, torch.uint8, torch.float16)[i]
        blk = random_block(R, N, 64, bits, grouping, gs, mode=mode, scale_dtype=sdt, zero_dtype=zdt,
                           gid=grouping == "channel" and i == 1, seed=i)
        want32 = reference.dequantize_block(blk)
        for path in paths():
            for out_dtype in (torch.float32, torch.float16, torch.bfloat16):
                got = ops.dequantize_block(blk, out_dtype)
                want = want32.to(out_dtype)  # the reference rounds its float32 result the same way
                assert got.dtype == out_dtype and got.shape == (R, N, 64)
                assert torch.equal(got, want), (path, out_dtype, (got.float() - want.float()).abs().max())


@pytest.mark.parametrize("bits,d", [(2, 4), (2, 12), (3, 8), (3, 24), (4, 2), (4, 22), (8, 1), (8, 13)])
@pytest.mark.parametrize("grouping", ["channel", "token"])
def test_dequantize_odd_head_dims(compiled, bits, d, grouping):
    gs = 3 if grouping == "channel" else d
    for zdt in (torch.int8, torch.float32, torch.bfloat16):
        blk = random_block(2, 33, d, bits, grouping, gs, zero_dtype=zdt)
        assert torch.equal(ops.dequantize_block(blk), reference.dequantize_block(blk))


@pytest.mark.parametrize("bits", [2, 4])
@pytest.mark.parametrize("d", [16, 24, 40, 48, 80])
@pytest.mark.parametrize("mode", ["asym", "codebook"])
def test_dequantize_2_and_4_bit_widths(paths, bits, d, mode):
    """The vector paths' 2- and 4-bit lookups (AVX2: byte planes of the table, 16 or 32 codes at a
    time, then an 8-code tail) equal the table, bit for bit, at every split of the head dim."""
    for grouping, gs in (("token", d), ("channel", 5)):
        blk = random_block(2, 37, d, bits, grouping, gs, mode=mode, seed=d)
        want = reference.dequantize_block(blk)
        for path in paths():
            assert torch.equal(ops.dequantize_block(blk), want), (path, grouping)


def test_dequantize_equals_quantizer_dequantize(compiled):
    x = torch.randn(2, 256, 64, dtype=torch.float16)
    for grouping, axis, gs in (("channel", -2, 128), ("token", -1, 32)):
        for sym in (False, True):
            qt = quantize(x, 4, axis=axis, group_size=gs, symmetric=sym, scale_dtype=torch.float16)
            blk = ops.quantize_block(x, 4, grouping, gs, sym, torch.float16)
            assert torch.equal(ops.dequantize_block(blk, torch.float16), dequantize(qt))
            assert torch.equal(ops.dequantize_block(blk), dequantize(qt, dtype=torch.float32))


def test_dequantize_into_out_buffer(compiled):
    blk = random_block(2, 40, 32, 4, "token", 8, scale_dtype=torch.float16)
    buf = torch.full((3, 2, 40, 32), float("nan"), dtype=torch.bfloat16)
    for impl in (ops, reference):
        got = impl.dequantize_block(blk, torch.bfloat16, out=buf[1])
        assert got.data_ptr() == buf[1].data_ptr()
        assert torch.equal(buf[1], reference.dequantize_block(blk, torch.bfloat16))
        assert bool(buf[0].isnan().all()) and bool(buf[2].isnan().all())
        with pytest.raises(TypeError, match="out must have dtype"):
            impl.dequantize_block(blk, torch.float32, out=buf[1])
        with pytest.raises(ValueError, match="out must have shape"):
            impl.dequantize_block(blk, torch.bfloat16, out=buf[1, :, :16])
        with pytest.raises(ValueError, match="contiguous"):
            impl.dequantize_block(blk, torch.bfloat16, out=torch.empty(2, 32, 40, dtype=torch.bfloat16).mT)


def test_dequantize_bad_group_index_raises(compiled):
    blk = random_block(2, 20, 16, 4, "channel", 4, gid=True)
    bad = blk.gid.clone()
    bad[1, 7] = blk.scale.shape[1]
    bad_blk = QBlock(blk.codes, 4, blk.lut, "channel", blk.scale, blk.zero, 4, bad)
    for fn in (ops.dequantize_block, reference.dequantize_block):
        with pytest.raises(ValueError, match="outside"):
            fn(bad_blk)
    neg = blk.gid.clone()
    neg[0, 0] = -1
    with pytest.raises(ValueError, match="outside"):
        ops.dequantize_block(QBlock(blk.codes, 4, blk.lut, "channel", blk.scale, blk.zero, 4, neg))


# ----------------------------------------------------------------------------- quantize
def _channel_gs(N):
    return {1: 1, 7: 7, 97: 97, 1000: 125}[N]


@pytest.mark.parametrize("bits", [2, 3, 4, 8])
@pytest.mark.parametrize("grouping", ["channel", "token"])
@pytest.mark.parametrize("mode", MODES)
@pytest.mark.parametrize("N", [1, 7, 97, 1000])
def test_quantize_matches_reference(paths, bits, grouping, mode, N):
    gen = torch.Generator().manual_seed(N * 10 + bits)
    for R, xdt, sdt in ((1, torch.float32, torch.float32), (3, torch.float16, torch.float16),
                        (3, torch.bfloat16, torch.bfloat16)):
        x = (torch.randn(R, N, 64, generator=gen) * torch.rand(1, 1, 64, generator=gen) * 4).to(xdt)
        gs = _channel_gs(N) if grouping == "channel" else 16
        lut = _lut(bits, mode, gen) if mode == "codebook" else None
        want = reference.quantize_block(x, bits, grouping, gs, mode == "sym", sdt, lut)
        for path in paths():
            got = ops.quantize_block(x, bits, grouping, gs, mode == "sym", sdt, lut)
            assert torch.equal(got.codes, want.codes), path
            assert got.scale.dtype == sdt and torch.equal(got.scale, want.scale)
            assert (got.zero is None) == (want.zero is None)
            if got.zero is not None:
                assert got.zero.dtype == torch.int16 and torch.equal(got.zero, want.zero)
            assert torch.equal(got.lut, want.lut)


@pytest.mark.parametrize("bits", [2, 3, 4, 8])
@pytest.mark.parametrize("symmetric", [False, True])
def test_quantize_is_bit_exact_with_quantizer(paths, bits, symmetric):
    """Uniform levels: same codes, stored scales and int16 zero points as quantize()."""
    gen = torch.Generator().manual_seed(bits)
    x = torch.randn(3, 256, 32, generator=gen) * torch.logspace(-3, 2, 32)
    x[0, :128, 5] = 0.0  # all-zero group
    x[1, 128:, 9] = 2.5  # constant group
    x[2, :, 11] = torch.linspace(1.0, 1.0 + 1e-6, 256)  # zero-point guard binds
    for xdt, sdt in ((torch.float32, torch.float32), (torch.float16, torch.float16),
                     (torch.bfloat16, torch.bfloat16), (torch.float16, torch.float32)):
        xx = x.to(xdt)
        if sdt == torch.float16:  # 1e-8 / qmax (the all-zero group's scale) underflows float16
            xx[0, :128, 5] = 1.0
        configs = [("channel", -2, 128), ("token", -1, 32)]
        if sdt == torch.float32:  # small groups of tiny values have scales below float16's range
            configs += [("channel", -2, 32), ("token", -1, 8)]
        for grouping, axis, gs in configs:
            qt = quantize(xx, bits, axis=axis, group_size=gs, symmetric=symmetric, scale_dtype=sdt)
            for path in paths():
                blk = ops.quantize_block(xx, bits, grouping, gs, symmetric, sdt)
                assert torch.equal(blk.codes.reshape(-1), qt.data), path
                assert torch.equal(blk.scale, qt.scale)
                if symmetric:
                    assert blk.zero is None
                else:
                    assert torch.equal(blk.zero, qt.zero_point)


@pytest.mark.parametrize("bits", [2, 3, 4, 8])
@pytest.mark.parametrize("grouping", ["channel", "token"])
@pytest.mark.parametrize("symmetric", [False, True])
def test_round_trip_within_half_a_step(compiled, bits, grouping, symmetric):
    """|x - x_hat| <= scale / 2 for every x inside the representable range."""
    x = torch.randn(3, 256, 64, generator=torch.Generator().manual_seed(bits)) * 3
    gs = 64 if grouping == "channel" else 16
    blk = ops.quantize_block(x, bits, grouping, gs, symmetric)
    xh = ops.dequantize_block(blk)
    s = reference.expand_meta(blk, blk.scale)
    z = reference.expand_meta(blk, blk.zero) if blk.zero is not None else torch.zeros_like(s)
    lo = (blk.lut[0] - z) * s - s / 2
    hi = (blk.lut[-1] - z) * s + s / 2
    inside = (x >= lo) & (x <= hi)
    assert inside.float().mean() > 0.99
    err = (x - xh).abs()
    assert bool((err[inside] <= s[inside] * 0.5 * (1 + 1e-5) + 1e-7).all())


@pytest.mark.parametrize("grouping", ["channel", "token"])
def test_codebook_picks_the_nearest_level(compiled, grouping):
    gen = torch.Generator().manual_seed(3)
    lut = torch.tensor([-2.1, -1.3, -0.7, -0.2, 0.2, 0.7, 1.3, 2.1])
    x = torch.randn(2, 64, 32, generator=gen)
    x[1, :32, :] = 0.0  # zero RMS: scale 0, dequantizes to exactly 0
    blk = ops.quantize_block(x, 3, grouping, 32, lut=lut)
    s = reference.expand_meta(blk, blk.scale)
    v = torch.where(s != 0, x / s, 0.0)
    chosen = blk.lut[reference.unpack_codes(blk).long()]
    best = (v[..., None] - lut).abs().min(-1).values
    assert torch.allclose((v - chosen).abs(), best, atol=1e-6)
    xh = ops.dequantize_block(blk)
    assert torch.equal(xh[1, :32], torch.zeros(32, 32))
    rms = x.double().square().view(2, 2, 32, 32).mean(2).sqrt().float() if grouping == "channel" else None
    if rms is not None:
        assert torch.allclose(blk.scale, rms)


@pytest.mark.parametrize("grouping", ["channel", "token"])
@pytest.mark.parametrize("mode", MODES)
@pytest.mark.parametrize("bad", [float("nan"), float("inf"), float("-inf")])
def test_quantize_non_finite_raises(compiled, grouping, mode, bad):
    x = torch.randn(2, 16, 16)
    x[1, 9, 3] = bad
    lut = torch.linspace(-1, 1, 16) if mode == "codebook" else None
    for fn in (ops.quantize_block, reference.quantize_block):
        with pytest.raises(ValueError, match="non-finite"):
            fn(x, 4, grouping, 8, mode == "sym", torch.float32, lut)


def test_quantize_unrepresentable_scale_raises(compiled):
    x = torch.full((1, 8, 8), 1e30)
    x[0, 0, 0] = -1e30
    for fn in (ops.quantize_block, reference.quantize_block):
        with pytest.raises(ValueError, match="cannot represent"):
            fn(x, 4, "channel", 8, False, torch.float16)


@pytest.mark.parametrize("symmetric", [False, True])
def test_a_near_constant_group_codes_on_the_finest_float16_grid(paths, symmetric):
    """A group whose range is below float16's smallest scale (a pre-RoPE key channel a QK-norm
    gain nearly zeroes) is coded with scale 2**-24, the same on every path, not refused."""
    x = torch.randn(2, 32, 64, generator=torch.Generator().manual_seed(0))
    x[:, :, 5] = 1e-9 * torch.randn(2, 32, generator=torch.Generator().manual_seed(1))
    want = reference.quantize_block(x, 4, "channel", 32, symmetric, torch.float16)
    assert float(want.scale[:, :, 5].float().min()) == 2.0**-24
    back = reference.dequantize_block(want)
    assert float((back[:, :, 5] - x[:, :, 5]).abs().max()) <= 2.0**-24
    for path in paths():
        got = ops.quantize_block(x, 4, "channel", 32, symmetric, torch.float16)
        assert torch.equal(got.codes, want.codes) and torch.equal(got.scale, want.scale), path


# ----------------------------------------------------------------------------- attention
def _attend_case(R, N, G, kspec, vspec, seed):
    gen = torch.Generator().manual_seed(seed)
    k = random_block(R, N, 64, seed=seed, **kspec)
    v = random_block(R, N, 64, seed=seed + 1, **vspec)
    q = torch.randn(R, G, 64, generator=gen)
    return q, k, v


KV_SPECS = [
    # KIVI layout: per-channel keys, per-token values
    (dict(bits=4, grouping="channel", gs=32), dict(bits=4, grouping="token", gs=64)),
    (dict(bits=2, grouping="channel", gs=32, scale_dtype=torch.float16),
     dict(bits=2, grouping="token", gs=16, scale_dtype=torch.float16, zero_dtype=torch.uint8)),
    (dict(bits=3, grouping="channel", gs=7, mode="sym", gid=True, extra_groups=3),
     dict(bits=8, grouping="token", gs=32, mode="codebook", scale_dtype=torch.bfloat16)),
    (dict(bits=8, grouping="token", gs=8, zero_dtype=torch.float32),
     dict(bits=3, grouping="channel", gs=16, zero_dtype=torch.int8, gid=True)),
    (dict(bits=4, grouping="channel", gs=128, mode="codebook", scale_dtype=torch.bfloat16),
     dict(bits=4, grouping="channel", gs=5, mode="sym")),
    (dict(bits=2, grouping="token", gs=64, mode="sym"),
     dict(bits=4, grouping="token", gs=64, zero_dtype=torch.float16)),
]


@pytest.mark.parametrize("spec", range(len(KV_SPECS)))
@pytest.mark.parametrize("N", [1, 7, 97, 1000])
@pytest.mark.parametrize("R,G", [(1, 1), (3, 3), (3, 8)])
def test_attend_matches_float64_oracle(compiled, spec, N, R, G):
    kspec, vspec = KV_SPECS[spec]
    q, k, v = _attend_case(R, N, G, kspec, vspec, seed=spec * 7 + N)
    scaling = 64 ** -0.5
    want_out, want_lse, want_s = oracle_attend(q, k, v, scaling)
    for impl in (ops, reference):
        out, lse, logits = impl.attend_block(q, k, v, scaling, return_logits=True)
        assert out.dtype == lse.dtype == logits.dtype == torch.float32
        assert out.shape == (R, G, 64) and lse.shape == (R, G) and logits.shape == (R, G, N)
        torch.testing.assert_close(out.double(), want_out, rtol=RTOL, atol=ATOL)
        torch.testing.assert_close(lse.double(), want_lse, rtol=0, atol=ATOL)
        torch.testing.assert_close(logits.double(), want_s, rtol=0, atol=ATOL)
    assert impl.attend_block(q, k, v, scaling)[2] is None


@pytest.mark.parametrize("N", [7, 97, 1000])
def test_attend_masking(compiled, N):
    """Left padding (start), ragged lengths, and a row with no valid token at all."""
    R, G = 4, 3
    q, k, v = _attend_case(R, N, G, *KV_SPECS[0], seed=N)
    start = torch.tensor([0, 2, N // 2, 5], dtype=torch.int32)
    length = torch.tensor([N, N - 1, N // 2, 3], dtype=torch.int32)  # row 2 and 3: empty
    want_out, want_lse, want_s = oracle_attend(q, k, v, 0.2, start, length)
    for impl in (ops, reference):
        out, lse, logits = impl.attend_block(q, k, v, 0.2, start=start, length=length, return_logits=True)
        torch.testing.assert_close(out.double(), want_out, rtol=RTOL, atol=ATOL)
        torch.testing.assert_close(lse.double(), want_lse, rtol=0, atol=ATOL)
        torch.testing.assert_close(logits.double(), want_s, rtol=0, atol=ATOL)
        assert torch.equal(out[2:], torch.zeros(2, G, 64))
        assert bool(torch.isneginf(lse[2:]).all())
        assert bool(torch.isneginf(logits[1, :, :2]).all()) and bool(torch.isneginf(logits[1, :, -1]).all())
    # int64 start/length are accepted
    out64 = ops.attend_block(q, k, v, 0.2, start=start.long(), length=length.long())[0]
    torch.testing.assert_close(out64.double(), want_out, rtol=RTOL, atol=ATOL)


def test_attend_lse_merges_blocks(compiled):
    """Two halves merged by log-sum-exp equal attention over the whole block."""
    q, k, v = _attend_case(3, 600, 5, *KV_SPECS[1], seed=11)
    full_out, full_lse, _ = ops.attend_block(q, k, v, 0.125)
    half = torch.full((3,), 300, dtype=torch.int32)
    o1, l1, _ = ops.attend_block(q, k, v, 0.125, length=half)
    o2, l2, _ = ops.attend_block(q, k, v, 0.125, start=half)
    lse = torch.logaddexp(l1, l2)
    out = torch.exp(l1 - lse)[..., None] * o1 + torch.exp(l2 - lse)[..., None] * o2
    torch.testing.assert_close(out, full_out, rtol=RTOL, atol=ATOL)
    torch.testing.assert_close(lse, full_lse, rtol=0, atol=ATOL)


def test_attend_prefill_sized_G(compiled):
    q, k, v = _attend_case(2, 300, 130, *KV_SPECS[0], seed=5)
    want_out, want_lse, _ = oracle_attend(q, k, v, 0.125)
    out, lse, _ = ops.attend_block(q, k, v, 0.125)
    torch.testing.assert_close(out.double(), want_out, rtol=RTOL, atol=ATOL)
    torch.testing.assert_close(lse.double(), want_lse, rtol=0, atol=ATOL)


def test_attend_on_quantized_cache_layout(compiled):
    """End to end on quantize_block output (KIVI: keys per channel, values per token)."""
    gen = torch.Generator().manual_seed(0)
    keys = torch.randn(3, 512, 64, generator=gen).half()
    values = torch.randn(3, 512, 64, generator=gen).half()
    kb = ops.quantize_block(keys, 4, "channel", 128, scale_dtype=torch.float16)
    vb = ops.quantize_block(values, 4, "token", 64, scale_dtype=torch.float16)
    q = torch.randn(3, 3, 64, generator=gen)
    want_out, want_lse, _ = oracle_attend(q, kb, vb, 0.125)
    out, lse, _ = ops.attend_block(q, kb, vb, 0.125)
    torch.testing.assert_close(out.double(), want_out, rtol=RTOL, atol=ATOL)
    torch.testing.assert_close(lse.double(), want_lse, rtol=0, atol=ATOL)


def test_attend_bad_group_index_raises(compiled):
    q, k, v = _attend_case(2, 40, 3, *KV_SPECS[2], seed=1)
    bad = k.gid.clone()
    bad[0, -1] = k.scale.shape[1] + 4
    kb = QBlock(k.codes, k.bits, k.lut, k.grouping, k.scale, k.zero, k.group_size, bad)
    for impl in (ops, reference):
        with pytest.raises(ValueError, match="outside"):
            impl.attend_block(q, kb, v, 0.1)


# ----------------------------------------------------------------------------- validation
def test_qblock_validation():
    codes = torch.zeros(2, 5, 32, dtype=torch.uint8)
    lut = uniform_lut(4, False)
    scale = torch.ones(2, 1, 64)
    ok = dict(codes=codes, bits=4, lut=lut, grouping="channel", scale=scale, zero=None, group_size=8)
    QBlock(**ok)
    cases = [
        (dict(bits=5), ValueError, r"bits must be one of \[2, 3, 4, 8\]; got 5"),
        (dict(grouping="head"), ValueError, r"grouping must be one of \['channel', 'token'\]; got 'head'"),
        (dict(codes=codes.float()), TypeError, "codes must be uint8"),
        (dict(codes=codes[0]), ValueError, "codes must be rank 3"),
        (dict(codes=torch.zeros(2, 5, 4, dtype=torch.uint8), bits=3, lut=uniform_lut(3, False)), ValueError,
         "whole number"),
        (dict(lut=uniform_lut(2, False)), ValueError, r"lut must be float32 of shape \[16\]"),
        (dict(scale=scale.to(torch.float64)), TypeError, "scale must be one of"),
        (dict(scale=torch.ones(2, 1, 63)), ValueError, r"\[R, NG, d=64\]"),
        (dict(group_size=2), ValueError, "fewer than N=5"),
        (dict(group_size=0), ValueError, "group_size must be an int >= 1"),
        (dict(zero=torch.zeros(2, 1, 64, dtype=torch.int64)), TypeError, "zero must be None or one of"),
        (dict(zero=torch.zeros(2, 2, 64, dtype=torch.int16)), ValueError, "zero must have the shape"),
        (dict(gid=torch.zeros(2, 5, dtype=torch.int64)), TypeError, "gid must be int32"),
        (dict(gid=torch.zeros(2, 4, dtype=torch.int32)), ValueError, r"gid must be \[R, N\]"),
        (dict(grouping="token", scale=torch.ones(2, 5, 3), group_size=24), ValueError,
         "group_size dividing d=64"),
        (dict(grouping="token", scale=torch.ones(2, 5, 3), group_size=16), ValueError,
         r"\[R, N, d // group_size\]"),
    ]
    for change, exc, msg in cases:
        with pytest.raises(exc, match=msg):
            QBlock(**{**ok, **change})


@pytest.mark.parametrize("impl", [ops, reference])
def test_quantize_validation(impl):
    x = torch.randn(2, 16, 32)
    cases = [
        (dict(bits=1), ValueError, r"bits must be one of \[2, 3, 4, 8\]; got 1"),
        (dict(grouping="tokens"), ValueError, "grouping must be one of"),
        (dict(x=x[0]), ValueError, "x must be rank 3"),
        (dict(x=x.double()), TypeError, "x must be one of float16, bfloat16, float32"),
        (dict(x=x.long()), TypeError, "x must be one of"),
        (dict(x=x.numpy()), TypeError, "x must be a torch.Tensor"),
        (dict(x=torch.empty(2, 0, 32)), ValueError, "empty"),
        (dict(group_size=5), ValueError, "N a multiple of group_size; got N=16, group_size=5"),
        (dict(grouping="token", group_size=5), ValueError, "group_size dividing d=32"),
        (dict(x=torch.randn(2, 16, 5), bits=3, group_size=8), ValueError, "multiple of 8"),
        (dict(symmetric=1), TypeError, "symmetric must be a bool"),
        (dict(scale_dtype=torch.float64), TypeError, "scale_dtype must be one of"),
        (dict(lut=torch.linspace(-1, 1, 8)), ValueError, r"lut must be float32 of shape \[16\]"),
        (dict(lut=torch.linspace(1, -1, 16)), ValueError, "strictly increasing"),
    ]
    base = dict(x=x, bits=4, grouping="channel", group_size=8)
    for change, exc, msg in cases:
        with pytest.raises(exc, match=msg):
            impl.quantize_block(**{**base, **change})


@pytest.mark.parametrize("impl", [ops, reference])
def test_attend_and_dequantize_validation(impl):
    k = random_block(2, 10, 16, 4, "channel", 5)
    v = random_block(2, 10, 16, 4, "token", 16)
    q = torch.randn(2, 3, 16)
    cases = [
        (dict(q=q.half()), TypeError, "q must be float32"),
        (dict(q=q[0]), ValueError, "q must be rank 3"),
        (dict(q=torch.randn(3, 3, 16)), ValueError, "same rows R"),
        (dict(q=torch.randn(2, 3, 8)), ValueError, "q has d=8 but kblock holds d=16"),
        (dict(kblock="k"), TypeError, "kblock must be a QBlock"),
        (dict(vblock=random_block(2, 9, 16, 4, "token", 16)), ValueError, "same N tokens"),
        (dict(scaling=float("nan")), TypeError, "scaling must be a finite float"),
        (dict(scaling=None), TypeError, "scaling must be a finite float"),
        (dict(start=torch.zeros(3, dtype=torch.int32)), ValueError, r"start must have shape \[R\]"),
        (dict(length=torch.zeros(2)), TypeError, "length must be an integer tensor"),
    ]
    base = dict(q=q, kblock=k, vblock=v, scaling=0.25)
    for change, exc, msg in cases:
        with pytest.raises(exc, match=msg):
            impl.attend_block(**{**base, **change})
    with pytest.raises(TypeError, match="out_dtype must be one of"):
        impl.dequantize_block(k, torch.float64)
    with pytest.raises(TypeError, match="block must be a QBlock"):
        impl.dequantize_block(QuantizedTensor)


# ----------------------------------------------------------------------------- keys before RoPE
ROPE_KEYS = {  # key layouts read before RoPE: KIVI's per-channel groups, per-token codes (Hadamard space)
    "channel": dict(bits=4, grouping="channel", gs=32, scale_dtype=torch.float16),
    "channel-gid": dict(bits=4, grouping="channel", gs=32, scale_dtype=torch.float16, gid=True),
    "token-hadamard": dict(bits=3, grouping="token", gs=64, mode="codebook"),
    "token-zero": dict(bits=2, grouping="token", gs=16, zero_dtype=torch.float16),
}


def _rope_case(R, N, half, layout, seed, keys="channel"):
    """A key block with a :class:`KeyRope`: positions rising with gaps (eviction), one step back
    and a far position, the offset and scale of §29.7, an attention factor; per-token codebook
    keys stored in a randomized Hadamard space."""
    gen = torch.Generator().manual_seed(seed)
    k = random_block(R, N, 64, seed=seed, **ROPE_KEYS[keys])
    signs = None
    if keys == "token-hadamard":
        signs = torch.randint(0, 2, (R, 64), generator=gen).float() * 2 - 1
    v = random_block(R, N, 64, 4, "token", 64, seed=seed + 1)
    steps = torch.randint(1, 4, (R, N), generator=gen)
    pos = steps.cumsum(1) + torch.randint(0, 900, (R, 1), generator=gen)
    if N > 10:
        pos[:, 9] -= 2  # a step back: the kernel recomputes the angles there
        pos[0, -1] = 1500
    w = 1.0 / (10000.0 ** (torch.arange(0, 2 * half, 2, dtype=torch.float32) / (2 * half)))
    rope = KeyRope(pos.to(torch.int32).contiguous(), w, layout, 1.25, torch.randn(R, 64, generator=gen),
                   torch.rand(R, 64, generator=gen) + 0.5, signs)
    return dataclasses.replace(k, rope=rope), v, torch.randn(R, 3, 64, generator=gen)


def _rope_oracle_keys(k: QBlock) -> torch.Tensor:
    """The keys a pre-RoPE block holds, turned in float64 with angles ``p * w`` (no float32 product)."""
    r = k.rope
    x = reference.dequantize_block(dataclasses.replace(k, rope=None)).double()
    if r.signs is not None:  # x H / sqrt(d) * s, H the Sylvester matrix
        d = x.shape[-1]
        H = torch.ones(1, 1, dtype=torch.float64)
        while H.shape[0] < d:
            H = torch.cat((torch.cat((H, H), 1), torch.cat((H, -H), 1)), 0)
        x = (x @ H) / d ** 0.5 * r.signs.double()[:, None]
    x = x * r.scale.double()[:, None] + r.mean.double()[:, None]
    half = r.inv_freq.numel()
    ang = r.positions.double()[..., None] * r.inv_freq.double()
    c, s = ang.cos() * r.scaling, ang.sin() * r.scaling
    if r.layout == "half":
        a, b = x[..., :half], x[..., half:2 * half]
        rot = torch.cat((a * c - b * s, a * s + b * c), -1)
    else:
        a, b = x[..., 0:2 * half:2], x[..., 1:2 * half:2]
        rot = torch.stack((a * c - b * s, a * s + b * c), -1).flatten(-2)
    return torch.cat((rot, x[..., 2 * half:]), -1)


@pytest.mark.parametrize("layout", ["half", "interleaved"])
@pytest.mark.parametrize("half", [32, 12, 3])
@pytest.mark.parametrize("N,keys", [(1, "channel"), (97, "channel"), (416, "channel-gid"), (97, "token-hadamard"),
                                    (33, "token-zero")])
def test_keys_before_rope_are_turned_at_read(compiled, layout, half, N, keys):
    """Keys stored before RoPE (§29.8) equal a float64 oracle that turns each dequantized key by
    ``p * w``: per-channel and per-token codes (out of a Hadamard space first), full and partial
    rotary, both pair layouts, gaps and a step back in the positions, the offset and scale added
    back first, the attention factor on the turned pairs only."""
    k, v, q = _rope_case(3, N, half, layout, seed=N + half, keys=keys)
    start = torch.tensor([0, min(5, N - 1), 0], dtype=torch.int32)
    kx = _rope_oracle_keys(k)
    s = 0.125 * torch.einsum("rgc,rtc->rgt", q.double(), kx)
    s = s.masked_fill((torch.arange(N) < start.long()[:, None])[:, None], float("-inf"))
    lse = torch.logsumexp(s, -1)
    want = torch.einsum("rgt,rtc->rgc", torch.exp(s - lse[..., None]), reference.dequantize_block(v).double())
    for impl in (ops, reference):
        out, got_lse, logits = impl.attend_block(q, k, v, 0.125, start=start, return_logits=True)
        # float32 angle products (the reference) differ from exact ones by < 2**-24 * p * w rad
        torch.testing.assert_close(logits.double(), s, rtol=0, atol=2e-3)
        torch.testing.assert_close(got_lse.double(), lse, rtol=0, atol=2e-3)
        torch.testing.assert_close(out.double(), want, rtol=2e-3, atol=2e-3)
        torch.testing.assert_close(impl.dequantize_block(k).double(), kx, rtol=1e-3, atol=2e-3)
    dense = (torch.randn(1, 3, 4, 64), torch.randn(1, 3, 4, 64), None)
    got = ops.attend_mixed(q, 0.125, packed=(k, v, start), dense=[dense])
    ref = reference.attend_mixed(q, 0.125, packed=(k, v, start), dense=[dense])
    torch.testing.assert_close(got[0], ref[0], rtol=2e-3, atol=2e-3)
    torch.testing.assert_close(got[1], ref[1], rtol=0, atol=2e-3)


@pytest.mark.parametrize("first", [False, True])
def test_keys_before_rope_in_several_blocks_and_flat_rows(compiled, first):
    """Blocks stored before RoPE anywhere in a layer's call (a plain block first or not, two
    turned blocks), and a flat ragged block (every row's tokens in one buffer at its offset,
    positions laid out like the codes): as the torch reference."""
    k1, v1, q = _rope_case(3, 64, 32, "half", seed=1, keys="channel")
    k2, v2, _ = _rope_case(3, 40, 32, "half", seed=2, keys="token-hadamard")
    plain = dataclasses.replace(k1, rope=None)
    blocks = [(plain, v1, None, q, None), (k2, v2, None, q, None)] if not first else \
        [(k1, v1, None, q, None), (k2, v2, None, q, None)]
    dense = [(torch.randn(1, 3, 4, 64), torch.randn(1, 3, 4, 64), None)]
    got = ops.attend_mixed(q, 0.125, packed=blocks, dense=dense)
    want = reference.attend_mixed(q, 0.125, packed=blocks, dense=dense)
    torch.testing.assert_close(got[0], want[0], rtol=2e-3, atol=2e-3)
    torch.testing.assert_close(got[1], want[1], rtol=0, atol=2e-3)
    # a flat ragged block: row r holds lengths[r] tokens from offsets[r] of one [1, 90] buffer
    buf, vbuf, _ = _rope_case(1, 96, 32, "half", seed=3, keys="token-hadamard")
    offsets = torch.tensor([0, 40, 70], dtype=torch.int64)
    lengths = torch.tensor([40, 30, 26], dtype=torch.int32)

    def flat(b):
        e = {f: getattr(b, f).expand(3, *getattr(b, f).shape[1:]) for f in ("codes", "scale", "zero")
             if getattr(b, f) is not None}
        return dataclasses.replace(b, **e, offsets=offsets, lengths=lengths, rope=None)

    r = buf.rope
    pos = torch.arange(96, dtype=torch.int32).view(1, 96) * 3
    rope = dataclasses.replace(r, positions=pos.expand(3, 96), mean=r.mean.expand(3, 64).contiguous(),
                               scale=r.scale.expand(3, 64).contiguous(), signs=r.signs.expand(3, 64).contiguous())
    kf = dataclasses.replace(flat(buf), rope=rope)
    vf = flat(vbuf)
    got = ops.attend_block(q, kf, vf, 0.125)
    want = reference.attend_block(q, kf, vf, 0.125)
    torch.testing.assert_close(got[0], want[0], rtol=2e-3, atol=2e-3)
    torch.testing.assert_close(got[1], want[1], rtol=0, atol=2e-3)


def test_key_rope_validation():
    k, v, q = _rope_case(2, 40, 32, "half", seed=3)
    r = k.rope
    cases = [
        (dict(positions=r.positions.long()), ValueError, r"positions must be int32 \[R, N\]"),
        (dict(positions=r.positions[:, :5].contiguous()), ValueError, r"positions must be int32 \[R, N\]"),
        (dict(inv_freq=torch.ones(33)), ValueError, r"inv_freq must be float32 \[r/2\]"),
        (dict(inv_freq=torch.ones(0)), ValueError, r"inv_freq must be float32 \[r/2\]"),
        (dict(layout="spiral"), ValueError, "layout must be one of"),
        (dict(scaling=0.0), ValueError, "scaling must be a finite number > 0"),
        (dict(scaling=float("inf")), ValueError, "scaling must be a finite number > 0"),
        (dict(mean=torch.zeros(2, 63)), ValueError, r"mean must be float32 \[R, d\]"),
        (dict(scale=torch.zeros(2, 64, dtype=torch.float16)), ValueError, r"scale must be float32 \[R, d\]"),
        (dict(signs=torch.ones(3, 64)), ValueError, r"signs must be float32 \[H, d\]"),
    ]
    for change, exc, msg in cases:
        with pytest.raises(exc, match=msg):
            dataclasses.replace(k, rope=dataclasses.replace(r, **change))
    with pytest.raises(TypeError, match="rope must be a KeyRope"):
        dataclasses.replace(k, rope="yes")
    with pytest.raises(ValueError, match="applies to kblock only"):
        ops.attend_block(q, k, dataclasses.replace(v, rope=KeyRope(r.positions, r.inv_freq)), 0.125)



@pytest.mark.parametrize("bits", [2, 3, 4])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("group", [64, 32])
def test_code_tokens_match_their_composition(paths, monkeypatch, bits, dtype, group):
    """The fused store of a token-grouped layout (rotate, code, log-code the norm) gives the
    codes and norm codes of its torch composition, bit for bit, on every compiled path."""
    from kv_cache.cache.packed import _lloyd_max
    from kv_cache.compression.codebook import encode_log_scale

    torch.manual_seed(bits)
    x = (torch.randn(6, 37, 64) * torch.rand(1, 1, 64) * 3).to(dtype)
    x[0, 0] = 0.0  # a zero norm: code 0
    signs = (torch.randint(0, 2, (3, 64)) * 2 - 1).to(torch.int8)
    lut = _lloyd_max(bits, "cpu")
    rot = ((x.float().view(2, 3, 37, 64) * signs.float()[None, :, None, :])
           @ hadamard_matrix(64, dtype=torch.float32)).reshape(6, 37, 64)
    want = ops.quantize_block(rot, bits, "token", group, False, torch.float32, lut)
    for _ in paths():
        codes, norms = arrival.code_tokens_raw(x, bits, lut, group, signs)
        assert torch.equal(codes, want.codes)
        assert torch.equal(norms, encode_log_scale(want.scale))
        assert int(norms[0, 0, 0]) == 0
    monkeypatch.setattr(arrival, "_compiled", lambda *tensors: None)  # the torch path composes the same steps
    codes, norms = arrival.code_tokens_raw(x, bits, lut, group, signs)
    assert torch.equal(codes, want.codes) and torch.equal(norms, encode_log_scale(want.scale))


def test_code_tokens_refuse_bad_input():
    from kv_cache.cache.packed import _lloyd_max

    lut = _lloyd_max(4, "cpu")
    with pytest.raises(ValueError, match="signs must be int8"):
        arrival.code_tokens(torch.randn(4, 2, 64), 4, lut, 64, torch.ones(3, 64, dtype=torch.int8))
    with pytest.raises(ValueError, match="NaN|non-finite|Inf"):
        arrival.code_tokens(torch.full((3, 2, 64), float("nan")), 4, lut, 64)
    with pytest.raises(ValueError, match="8-bit log-coded norms hold"):
        arrival.code_tokens(torch.full((3, 2, 64), 1e4), 4, lut, 64)
    with pytest.raises(ValueError, match="empty"):
        arrival.code_tokens(torch.randn(3, 0, 64), 4, lut, 64)


@pytest.mark.parametrize("layout", ["half", "interleaved"])
@pytest.mark.parametrize("rows", [1, 2])
@pytest.mark.parametrize("scaling", [1.0, 1.25])
def test_turn_stored_keys_match_their_composition(monkeypatch, layout, rows, scaling):
    """The few keys a decoding step turns (the sinks back to the model's frame, the arriving key
    into the stored one) equal the torch composition: offset added back then rotated, or rotated
    back then shifted; partial rotary channels pass through; the round trip is the identity."""
    from kv_cache.compression.rope import rotate

    torch.manual_seed(rows)
    x = torch.randn(1, 3, 5, 64)
    pos = torch.tensor([0, 1, 2, 3, 4099])
    w = 1.0 / (10000 ** (torch.arange(0, 48, 2).float() / 48))  # 48 of 64 channels turned
    off = torch.randn(1, 3, rows, 64)
    if rows == 2:
        off[:, :, 1] = torch.rand(1, 3, 64) + 0.5
    got = arrival.turn_stored_keys(x, pos, w, scaling, layout, offset=off)
    base = x * off[:, :, 1:] + off[:, :, :1] if rows == 2 else x + off
    want = rotate(base, pos, w, scaling, layout)
    torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-5)
    back = arrival.turn_stored_keys(got, pos, w, scaling, layout, inverse=True, offset=off)
    torch.testing.assert_close(back, x, rtol=1e-4, atol=1e-4)
    monkeypatch.setattr(arrival, "_compiled", lambda *tensors: None)  # the torch path: the same keys
    torch.testing.assert_close(arrival.turn_stored_keys(x, pos, w, scaling, layout, offset=off), want, rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(arrival.turn_stored_keys(got, pos, w, scaling, layout, inverse=True, offset=off), back,
                               rtol=1e-5, atol=1e-5)


def test_turn_stored_keys_refuse_bad_input():
    w = torch.ones(32)
    with pytest.raises(ValueError, match="layout must be one of"):
        arrival.turn_stored_keys(torch.randn(1, 1, 2, 64), torch.arange(2), w, layout="spiral")
    with pytest.raises(ValueError, match=r"floating \[B, H, n, d\]"):
        arrival.turn_stored_keys(torch.randn(2, 64), torch.arange(2), w)


def test_trusted_blocks_are_the_checked_ones():
    """QBlock.trusted (views of held slots, rebuilt every decoding step) builds the same block as
    the checked constructor, defaults included, and refuses a field QBlock does not have."""
    x = torch.randn(3, 8, 64)
    blk = ops.quantize_block(x, 4, "token", 64, lut=torch.linspace(-2, 2, 16))
    same = QBlock.trusted(codes=blk.codes, bits=4, lut=blk.lut, grouping="token", scale=blk.scale, group_size=64)
    assert all(getattr(same, f.name) is getattr(blk, f.name) for f in dataclasses.fields(QBlock))
    with pytest.raises(TypeError, match="no fields"):
        QBlock.trusted(codes=blk.codes, colour="red")


@pytest.mark.parametrize("d", [128, 256])
def test_wide_heads_before_rope_match_the_reference(compiled, d):
    """Per-token keys before RoPE in a Hadamard space at head_dims 128 and 256 (Qwen-style and
    Gemma 3 heads: the register turn's 8- and 16-vector rows on AVX-512), with gaps and a step
    back in the positions: as the torch reference."""
    from kv_cache.cache.packed import _lloyd_max

    torch.manual_seed(d)
    R, N = 3, 150
    signs = (torch.randint(0, 2, (R, d)) * 2 - 1).to(torch.int8)
    k = arrival.code_tokens(torch.randn(R, N, d), 4, _lloyd_max(4, "cpu"), d, signs)
    v = arrival.code_tokens(torch.randn(R, N, d), 4, _lloyd_max(4, "cpu"), d)
    pos = torch.randint(1, 3, (R, N)).cumsum(1)
    pos[:, 40] -= 3
    w = 1.0 / (10000.0 ** (torch.arange(0, d, 2, dtype=torch.float32) / d))
    rope = KeyRope(pos.to(torch.int32).contiguous(), w, "half", 1.1, torch.randn(R, d), torch.rand(R, d) + 0.5,
                   signs.float())
    k = dataclasses.replace(k, rope=rope)
    q = torch.randn(R, 3, d)
    out, lse, logits = ops.attend_block(q, k, v, d ** -0.5, return_logits=True)
    want, want_lse, want_logits = reference.attend_block(q, k, v, d ** -0.5, return_logits=True)
    torch.testing.assert_close(logits, want_logits, rtol=0, atol=1e-4)
    torch.testing.assert_close(out, want, rtol=1e-4, atol=1e-5)
