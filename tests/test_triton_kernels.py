"""The Triton kernels (``kv_cache.kernels.triton``) against the torch reference, without a GPU.

Triton decides when a kernel is *decorated* (``triton.jit``, i.e. when ``kv_cache.kernels.triton``
is imported) whether it compiles it for a GPU or runs it in its interpreter: it reads
``TRITON_INTERPRET`` (``triton.knobs.runtime.interpret``) then. So the interpreter cases run in a
child process started with ``TRITON_INTERPRET=1`` (:func:`test_kernels_under_the_interpreter`), on
CPU tensors; this process is left as it was (no variable set, no module imported twice). Run
them directly, with each case reported, by ``TRITON_INTERPRET=1 pytest tests/test_triton_kernels.py``.
On a CUDA machine the same cases run compiled on the GPU (marker ``cuda``: ``pytest -m cuda``),
with the CUDA-only checks at the end (a cache on the GPU against the CPU, device bytes, no host
read in a decoding step).

Cases (kept tiny: the interpreter runs each program in Python): fused quantize + pack of every
bit width in the default layout (Lloyd-Max norm-only per token, rotated, 8-bit log-coded norms)
and KIVI's (uniform per-channel keys, per-token values), bit for bit; dequantize, bit for bit;
attention from the codes (one block with padding, lengths and logits; a layer's mixed blocks,
dense in float32 / float16 / bfloat16, rotated, padded, a row with no valid token; ragged rows)
within the tolerance of ``test_kernels.py``; the decode logits of a tiny model against the
reference path. A missing Triton skips the module with the reason.
"""

from __future__ import annotations

import os
import re
import subprocess
import sys
from pathlib import Path

import pytest
import torch

triton = pytest.importorskip(
    "triton", reason="Triton is not installed (pip install -e '.[test]' installs it on Linux): "
                     "the Triton kernels cannot be tested")

from kv_cache import CompressedCache, QuantConfig, compress  # noqa: E402
from kv_cache.attention.blocks import FullBlock, QuantBlock, RaggedBlock, fused_decode  # noqa: E402
from kv_cache.cache.packed import PackedKV  # noqa: E402
from kv_cache.compression.codebook import lloyd_max_gaussian  # noqa: E402
from kv_cache.kernels import _select, ops, reference  # noqa: E402
from kv_cache.kernels._checks import check_attend_args, check_mixed_args, check_quantize_args  # noqa: E402

INTERPRET = os.environ.get("TRITON_INTERPRET", "0") == "1"
ATOL = RTOL = 1e-4  # as test_kernels.py: float32 sums of O(1) terms against a float64 oracle
DEVICE = "cpu" if INTERPRET else "cuda"


def on_device(fn):
    """A kernel case: run on CPU tensors in the interpreter child, compiled on a CUDA device (marker
    ``cuda``), skipped in a process that has neither."""
    if INTERPRET:
        return fn
    fn = pytest.mark.cuda(fn)
    return pytest.mark.skipif(not torch.cuda.is_available(),
                              reason="runs in the TRITON_INTERPRET=1 child process "
                                     "(test_kernels_under_the_interpreter), or on a CUDA device")(fn)


def _tk():
    """The Triton backend module (interpreted here when TRITON_INTERPRET=1)."""
    return _select.triton_module(required=True)


def _on(t, dev=DEVICE):
    return None if t is None else t.to(dev)


def _to_device(blk):
    """A QBlock (its KeyRope too) with every tensor on the case's device."""
    def move(x):
        if isinstance(x, torch.Tensor):
            return _on(x)
        if x is not None and hasattr(x, "__dataclass_fields__"):
            return _to_device(x)
        return x

    return type(blk)(**{f: move(getattr(blk, f)) for f in blk.__dataclass_fields__})


def cuda_only(fn):
    """A check of the compiled kernels on a CUDA device (marker ``cuda``); never in the interpreter child."""
    fn = pytest.mark.skipif(INTERPRET, reason="CUDA-only: runs compiled (pytest -m cuda), not in the interpreter")(fn)
    return pytest.mark.cuda(fn)


@pytest.fixture
def triton_backend(monkeypatch):
    """The public ops routed to Triton on every device (the child's CPU tensors included)."""
    monkeypatch.setenv("KV_CACHE_KERNELS", "triton")


# ----------------------------------------------------------------------------- the interpreter run
@pytest.mark.skipif(INTERPRET, reason="this is the interpreter run itself")
def test_kernels_under_the_interpreter():
    """Run this module's cases under Triton's interpreter in a child process; fail with its report."""
    env = {**os.environ, "TRITON_INTERPRET": "1"}
    cmd = [sys.executable, "-m", "pytest", str(Path(__file__)), "-q", "-p", "no:cacheprovider", "-o", "addopts=-ra",
           "-W", "ignore::RuntimeWarning"]  # numpy's warnings on masked lanes of the interpreter
    res = subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=900,
                         cwd=Path(__file__).resolve().parent.parent)
    report = res.stdout[-6000:] + res.stderr[-3000:]
    assert res.returncode == 0, f"interpreter run failed (exit {res.returncode}):\n{report}"
    passed = re.search(r"(\d+) passed", res.stdout)
    assert passed and int(passed.group(1)) >= 20, f"the interpreter run ran too few cases:\n{report}"


def test_backend_per_device(monkeypatch):
    """Compiled C++ on the CPU, Triton on CUDA, the reference elsewhere; the variable overrides."""
    monkeypatch.delenv("KV_CACHE_KERNELS", raising=False)
    assert _select.backend("cuda") == "triton"  # Triton imports here (the module would be skipped otherwise)
    assert _select.backend("meta") == "torch" and _select.backend("mps") == "torch"
    assert _select.backend("cpu") in ("compiled", "torch")
    monkeypatch.setenv("KV_CACHE_KERNELS", "torch")
    assert {_select.backend(d) for d in ("cpu", "cuda", "meta")} == {"torch"}
    monkeypatch.setenv("KV_CACHE_KERNELS", "triton")
    assert {_select.backend(d) for d in ("cpu", "cuda", "meta")} == {"triton"}
    assert ops._compiled(torch.zeros(1)) is None and ops._triton(torch.zeros(1)) is not None
    monkeypatch.setenv("KV_CACHE_KERNELS", "nonsense")
    with pytest.raises(ValueError, match="KV_CACHE_KERNELS must be one of"):
        _select.backend("cpu")


# ----------------------------------------------------------------------------- quantize + pack
QUANT_CASES = [(bits, layout) for bits in (2, 3, 4, 8) for layout in ("codebook", "kivi_keys", "kivi_values", "sym")]


@pytest.mark.parametrize("bits,layout", QUANT_CASES)
@pytest.mark.parametrize("x_dtype", [torch.float32, torch.float16, torch.bfloat16])
@on_device
def test_quantize_matches_reference_bit_for_bit(bits, layout, x_dtype):
    gen = torch.Generator().manual_seed(bits * 10 + len(layout))
    d = 32
    N = 24 if layout != "kivi_keys" else 16
    x = (torch.randn(3, N, d, generator=gen) * 2).to(x_dtype)
    x[0, 1] = 0  # an all-zero token (and group)
    x[1, :, 5] = 1.25  # a constant channel
    if layout == "codebook":  # the default layout's kernel: one RMS per token, float32 (log-coded afterwards)
        lut = lloyd_max_gaussian(bits) if bits < 8 else torch.sort(torch.randn(256, generator=gen))[0]
        spec = dict(grouping="token", group_size=d, symmetric=False, scale_dtype=torch.float32, lut=lut)
    elif layout == "kivi_keys":
        spec = dict(grouping="channel", group_size=8, symmetric=False, scale_dtype=torch.float16, lut=None)
    elif layout == "kivi_values":
        spec = dict(grouping="token", group_size=16, symmetric=False, scale_dtype=torch.float16, lut=None)
    else:
        spec = dict(grouping="token", group_size=8, symmetric=True, scale_dtype=torch.bfloat16, lut=None)
    a = check_quantize_args(x, bits, spec["grouping"], spec["group_size"], spec["symmetric"], spec["scale_dtype"],
                            spec["lut"])
    want = reference._quantize(a)
    got = _tk().quantize_block(check_quantize_args(_on(x), bits, spec["grouping"], spec["group_size"],
                                                   spec["symmetric"], spec["scale_dtype"], _on(spec["lut"]),
                                                   levels=False))
    assert torch.equal(got.codes.cpu(), want.codes)
    assert got.scale.dtype == want.scale.dtype and torch.equal(got.scale.cpu(), want.scale)
    assert (got.zero is None) == (want.zero is None)
    if want.zero is not None:
        assert torch.equal(got.zero.cpu(), want.zero)
    assert torch.equal(got.lut.cpu(), want.lut)


@pytest.mark.parametrize("config", ["default", "kivi"])
@pytest.mark.parametrize("bits", [2, 4])
@on_device
def test_packed_layouts_match_reference(monkeypatch, config, bits):
    """PackedKV.append (rotation, clipping, log-coded norms, zero points) through Triton equals the reference."""
    cfg = QuantConfig(bits=bits) if config == "default" else QuantConfig.kivi(bits=bits, group_size=8)
    gen = torch.Generator().manual_seed(bits)
    k, v = torch.randn(1, 2, 32, 32, generator=gen).half(), torch.randn(1, 2, 32, 32, generator=gen).half()
    held = {}
    for name, dev in (("torch", "cpu"), ("triton", DEVICE)):
        monkeypatch.setenv("KV_CACHE_KERNELS", name)
        packed = PackedKV(cfg, torch.float16, 32, track_groups=False)
        packed.append(k.to(dev), v.to(dev))
        held[name] = {n: t.cpu() for n, t in packed.named_tensors().items()}
    assert held["torch"].keys() == held["triton"].keys()
    for n, t in held["torch"].items():
        assert torch.equal(held["triton"][n], t), n


@on_device
def test_quantize_errors(triton_backend):
    x = torch.randn(2, 8, 32, device=DEVICE)
    bad = x.clone()
    bad[1, 3, 7] = float("nan")
    with pytest.raises(ValueError, match="NaN"):
        ops.quantize_block(bad, 4, "token", 32, lut=lloyd_max_gaussian(4).to(DEVICE))
    with pytest.raises(ValueError, match="cannot represent"):
        ops.quantize_block(x * 1e6, 4, "channel", 8, scale_dtype=torch.float16)
    with pytest.raises(ValueError, match="strictly increasing"):
        ops.quantize_block(x, 2, "token", 32, lut=torch.tensor([0.0, 1.0, 1.0, 2.0], device=DEVICE))


# ----------------------------------------------------------------------------- dequantize
@pytest.mark.parametrize("bits", [2, 3, 4, 8])
@pytest.mark.parametrize("grouping", ["channel", "token"])
@on_device
def test_dequantize_matches_reference_bit_for_bit(bits, grouping):
    from test_kernels import random_block

    out_dtype = (torch.float32, torch.float16, torch.bfloat16)[bits % 3]
    if grouping == "channel":  # ragged groups after eviction, bfloat16 scales, int8 zero points
        blk = random_block(2, 21, 32, bits, "channel", 5, scale_dtype=torch.bfloat16, zero_dtype=torch.int8,
                           gid=True, extra_groups=2, seed=bits)
    else:  # norm-only codebook with 8-bit log-coded norms (the default layout)
        from kv_cache.compression.codebook import log_scale_table
        from kv_cache.kernels import QBlock

        base = random_block(2, 21, 32, bits, "token", 32, mode="codebook", seed=bits)
        codes = torch.randint(0, 256, base.scale.shape, dtype=torch.uint8, generator=torch.Generator().manual_seed(1))
        blk = QBlock(base.codes, bits, base.lut, "token", codes, None, 32, scale_table=log_scale_table())
    want = reference.dequantize_block(blk, out_dtype)
    got = _tk().dequantize_block(_to_device(blk), out_dtype, None)
    assert got.dtype == out_dtype and torch.equal(got.cpu(), want)


# ----------------------------------------------------------------------------- attention
@pytest.mark.parametrize("spec", [0, 1, 2, 3])
@on_device
def test_attend_block_matches_oracle(spec):
    """Padding starts, ragged lengths (row 3 has none: out 0, lse -inf) and logits, over several chunks."""
    from test_kernels import KV_SPECS, oracle_attend, random_block

    R, N, G = 4, 70, 3
    kspec, vspec = KV_SPECS[spec]
    k, v = random_block(R, N, 64, seed=spec, **kspec), random_block(R, N, 64, seed=spec + 1, **vspec)
    q = torch.randn(R, G, 64, generator=torch.Generator().manual_seed(spec))
    start = torch.tensor([0, 3, 40, 10], dtype=torch.int32)
    length = torch.tensor([N, N - 5, 41, 10], dtype=torch.int32)
    want_out, want_lse, want_s = oracle_attend(q, k, v, 0.125, start, length)
    a = check_attend_args(_on(q), _to_device(k), _to_device(v), 0.125, _on(start), _on(length))
    out, lse, logits = _tk().attend.attend_block(a, True, splits=2)
    torch.testing.assert_close(out.cpu().double(), want_out, rtol=RTOL, atol=ATOL)
    torch.testing.assert_close(lse.cpu().double(), want_lse, rtol=0, atol=ATOL)
    torch.testing.assert_close(logits.cpu().double(), want_s, rtol=0, atol=ATOL)
    assert torch.equal(out[3].cpu(), torch.zeros(G, 64)) and bool(torch.isneginf(lse[3]).all())


@pytest.mark.parametrize("layout,half", [("half", 32), ("interleaved", 12)])
@pytest.mark.parametrize("keys", ["channel-gid", "token-hadamard", "token-zero"])
@on_device
def test_keys_before_rope_are_turned_at_read(layout, half, keys):
    """Keys stored before RoPE (§29.8), turned inside the kernel at their positions (gaps, a step
    back), offset and scale added back, per-token keys mapped out of their Hadamard space, full
    and partial rotary, both pair layouts: as the torch reference, alone and in a layer's call."""
    from test_kernels import _rope_case

    k, v, q = _rope_case(3, 70, half, layout, seed=half, keys=keys)
    start = torch.tensor([0, 5, 0], dtype=torch.int32)
    want_out, want_lse, want_s = reference.attend_block(q, k, v, 0.125, start=start, return_logits=True)
    a = check_attend_args(_on(q), _to_device(k), _to_device(v), 0.125, _on(start), None)
    out, lse, logits = _tk().attend.attend_block(a, True, splits=2)
    fin = torch.isfinite(want_s)
    torch.testing.assert_close(logits.cpu()[fin], want_s[fin], rtol=0, atol=1e-3)
    torch.testing.assert_close(out.cpu(), want_out, rtol=1e-3, atol=1e-3)
    torch.testing.assert_close(lse.cpu(), want_lse, rtol=0, atol=1e-3)
    dense = [(torch.randn(1, 3, 4, 64), torch.randn(1, 3, 4, 64), None)]
    want_out, want_lse = reference.attend_mixed(q, 0.125, packed=(k, v, start), dense=dense)
    m = check_mixed_args(_on(q), 0.125, (_to_device(k), _to_device(v), _on(start)),
                         [tuple(_on(t) for t in blk) for blk in dense], None, None)
    out, lse = _tk().attend.attend_mixed(m, splits=2)
    torch.testing.assert_close(out.cpu(), want_out, rtol=1e-3, atol=1e-3)
    torch.testing.assert_close(lse.cpu(), want_lse, rtol=0, atol=1e-3)


@pytest.mark.parametrize("name", ["q8", "q4d", "q3d", "q2d", "q4", "q4db", "q3db", "q2db"])
@on_device
def test_attend_paged_reads_the_block_table(name, triton_backend):
    """vLLM's paged slots read in place through a block table (a shared prefix block, an empty
    request, a partial block) against the torch reference; a bad block id is refused. The ``*b``
    codecs' keys are stored before RoPE and turned to their token index in the kernel (full,
    partial interleaved, and scaled frames)."""
    from test_paged_kernels import key_rope_for, paged_case

    from kv_cache.kernels.paged import attend_paged, reference_attend_paged

    cache, table, lengths, layout, q = paged_case(name, bs=32, lengths=(90, 0, 33, 32))
    rope = key_rope_for(name)
    want_out, want_lse = reference_attend_paged(q, cache, table, lengths, layout, 0.1, rope)
    out, lse = attend_paged(_on(q), _on(cache), _on(table), _on(lengths), layout, 0.1, rope)
    torch.testing.assert_close(out.cpu(), want_out, rtol=RTOL, atol=ATOL)
    torch.testing.assert_close(lse.cpu(), want_lse, rtol=0, atol=ATOL)
    assert torch.equal(out[1].cpu(), torch.zeros_like(out[1].cpu())) and bool(torch.isneginf(lse[1]).all())
    bad = table.clone()
    bad[0, 2] = 99
    with pytest.raises(ValueError, match="outside the cache"):
        attend_paged(_on(q), _on(cache), _on(bad), _on(lengths), layout, 0.1)


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16, torch.bfloat16])
@pytest.mark.parametrize("rotated", [False, True])
@on_device
def test_attend_mixed_matches_one_softmax(dtype, rotated):
    """A layer's blocks (sinks with padding, packed with padding and an all-padding row, a residual
    that is a view of a longer buffer, dense in ``dtype``) in one call, against float64."""
    from test_attend_mixed import _layer, _oracle

    q, kw = _layer(dtype, rotated)
    want, want_lse = _oracle(q, **kw)
    k, v, st = kw["packed"]
    dense = [tuple(_on(t) for t in blk) for blk in kw["dense"]]
    a = check_mixed_args(_on(q), 0.125, (_to_device(k), _to_device(v), _on(st)), dense, _on(kw.get("q_packed")),
                         _on(kw.get("value_inverse")))
    for splits in (None, 3):
        out, lse = _tk().attend.attend_mixed(a, splits=splits)
        valid = torch.isfinite(want_lse)
        torch.testing.assert_close(out.cpu().double(), want, rtol=RTOL, atol=ATOL)
        torch.testing.assert_close(lse.cpu().double()[valid], want_lse[valid], rtol=0, atol=ATOL)
        assert torch.equal(torch.isfinite(lse.cpu()), valid)


@on_device
def test_attend_mixed_takes_hadamard_signs_as_value_inverse():
    """``value_inverse`` as a Hadamard rotation's int8 signs (expanded to ``R^T`` on this path)
    against the same rotation's dense matrices, in one call."""
    from kv_cache.cache.packed import Rotation
    from test_attend_mixed import _layer, _oracle

    q, kw = _layer(torch.float32, True)
    rot = Rotation(2, kw["value_inverse"].shape[0], q.shape[-1], 0, "cpu")
    want, want_lse = _oracle(q, **{**kw, "value_inverse": rot.inverse_matrices()})
    k, v, st = kw["packed"]
    dense = [tuple(_on(t) for t in blk) for blk in kw["dense"]]
    a = check_mixed_args(_on(q), 0.125, (_to_device(k), _to_device(v), _on(st)), dense, _on(kw["q_packed"]),
                         _on(rot.signs))
    out, lse = _tk().attend.attend_mixed(a)
    valid = torch.isfinite(want_lse)
    torch.testing.assert_close(out.cpu().double(), want, rtol=RTOL, atol=ATOL)
    torch.testing.assert_close(lse.cpu().double()[valid], want_lse[valid], rtol=0, atol=ATOL)


@pytest.mark.parametrize("q_dtype", [torch.float32, torch.float16, torch.bfloat16])
@on_device
def test_fused_decode_ragged_rows(monkeypatch, q_dtype):
    """Heads of different lengths (a shared budget): one attend_mixed call per row, per-row padding."""
    gen = torch.Generator().manual_seed(5)
    B, H, G, d = 1, 2, 3, 32
    rows, lengths = [], []
    for r in range(B * H):
        pk = PackedKV(QuantConfig(bits=4, key_grouping="token"), torch.float32, d, track_groups=False)
        n = 8 + 4 * r
        pk.append(torch.randn(1, 1, n, d, generator=gen), torch.randn(1, 1, n, d, generator=gen))
        rows.append([QuantBlock(*pk.qblocks(), batch=1, kv_heads=1, rotation=pk.rotation),
                     FullBlock(torch.randn(1, 1, 2, d, generator=gen), torch.randn(1, 1, 2, d, generator=gen))])
        lengths.append(n + 2)
    new = FullBlock(torch.randn(B, H, 1, d, generator=gen), torch.randn(B, H, 1, d, generator=gen))
    q = torch.randn(B, H, G, d, generator=gen).to(q_dtype)
    starts = torch.tensor([[4, 3]])  # row 0: 2 virtual + 2 padding slots; row 1: 3 padding slots
    monkeypatch.setenv("KV_CACHE_KERNELS", "torch")
    want, want_lse = fused_decode([RaggedBlock(rows, B, H, lengths), new], q, 0.2, starts)

    def dev_block(blk):
        if isinstance(blk, FullBlock):
            return FullBlock(_on(blk.keys), _on(blk.values))
        rot = blk.rotation
        if rot is not None:
            rot = type(rot).from_signs(_on(rot.signs))
        return QuantBlock(_to_device(blk.keys), _to_device(blk.values), 1, 1, rot)

    view = [RaggedBlock([[dev_block(b) for b in row] for row in rows], B, H, lengths), dev_block(new)]
    monkeypatch.setenv("KV_CACHE_KERNELS", "triton")
    got, got_lse = fused_decode(view, _on(q), 0.2, _on(starts))
    torch.testing.assert_close(got.cpu(), want, rtol=RTOL, atol=ATOL)
    torch.testing.assert_close(got_lse.cpu(), want_lse, rtol=RTOL, atol=ATOL)


# ----------------------------------------------------------------------------- a model, end to end
def _tiny_llama():
    from transformers import AutoConfig, AutoModelForCausalLM

    cfg = AutoConfig.for_model("llama", vocab_size=128, hidden_size=64, intermediate_size=96, num_hidden_layers=2,
                               num_attention_heads=4, num_key_value_heads=2, head_dim=32, max_position_embeddings=256,
                               pad_token_id=0, bos_token_id=1, eos_token_id=2)
    torch.manual_seed(0)
    model = AutoModelForCausalLM.from_config(cfg, attn_implementation="sdpa").eval()
    with torch.no_grad():  # widen the logits so attention is not uniform
        for p in model.parameters():
            if p.dim() == 2:
                p.mul_(2.5)
    return model


def _decode_logits(model, quant, dev, steps=5, padded=False):
    g = torch.Generator().manual_seed(3)
    ids = torch.randint(3, 128, (2 if padded else 1, 21), generator=g)
    mask = torch.ones_like(ids)
    if padded:
        ids[1, :4], mask[1, :4] = 0, 0
    model = model.to(dev)
    cache = CompressedCache(model.config, quant=quant)
    outs = []
    with torch.no_grad(), compress(model, cache):
        out = model(input_ids=ids.to(dev), attention_mask=mask.to(dev), past_key_values=cache, use_cache=True)
        outs.append(out.logits[:, -1].float().cpu())
        for _ in range(steps):
            nxt = torch.randint(3, 128, (ids.shape[0], 1), generator=g)
            mask = torch.cat([mask, torch.ones_like(nxt)], 1)
            out = model(input_ids=nxt.to(dev), attention_mask=mask.to(dev), past_key_values=cache, use_cache=True)
            outs.append(out.logits[:, -1].float().cpu())
    return torch.stack(outs), cache


@pytest.mark.parametrize("quant", ["q4d", "kivi4", "q4db", "q4dtb"])
@on_device
def test_decode_logits_match_the_reference_path(monkeypatch, quant):
    """Prefill + 5 decoding steps (flushes included) of a tiny llama, batch 2 left-padded: the Triton
    backend gives the reference kernels' logits (the compiled kernels' CPU tolerance); keys stored
    before RoPE (``q4db``, ``q4dtb``) are turned inside the kernel."""
    from kv_cache.cache.config import PRE_ROPE_LAYOUT

    q = {"q4d": QuantConfig(bits=4), "kivi4": QuantConfig.kivi(bits=4, group_size=8, residual_length=8),
         "q4db": QuantConfig(bits=4, pre_rope=True),
         "q4dtb": QuantConfig(**{**PRE_ROPE_LAYOUT, "bits": 4, "pre_rope": True})}[quant]
    model = _tiny_llama()
    monkeypatch.setenv("KV_CACHE_KERNELS", "torch")
    want, _ = _decode_logits(model, q, "cpu", padded=True)
    monkeypatch.setenv("KV_CACHE_KERNELS", "triton")
    got, _ = _decode_logits(model, q, DEVICE, padded=True)
    torch.testing.assert_close(got, want, rtol=1e-4, atol=1e-4)


# ----------------------------------------------------------------------------- CUDA only
@cuda_only
def test_cache_on_cuda_counts_device_bytes_like_the_cpu():
    """The same cache on CUDA (default selection: Triton) and on the CPU (compiled): close logits,
    and the memory report counts the same bytes (device tensors' nbytes, nothing copied to the host)."""
    model = _tiny_llama()
    cpu_logits, cpu_cache = _decode_logits(model, QuantConfig(bits=4), "cpu")
    gpu_logits, gpu_cache = _decode_logits(model, QuantConfig(bits=4), "cuda")
    torch.testing.assert_close(gpu_logits, cpu_logits, rtol=1e-4, atol=1e-4)
    assert gpu_cache.memory_report().total_bytes == cpu_cache.memory_report().total_bytes
    assert all(t.device.type == "cuda" for layer in gpu_cache.layers for t in layer.storage.named_tensors().values()
               if t is not None)


@cuda_only
def test_decoding_step_reads_nothing_back_from_the_gpu():
    """A decoding step that flushes nothing (the default layout's residual not yet full) runs its
    storage update and its one-call attention without a single host synchronisation."""
    model = _tiny_llama().cuda()
    cache = CompressedCache(model.config, quant=QuantConfig(bits=4, key_grouping="token"))  # 4 sinks, flushes of 4
    with torch.no_grad(), compress(model, cache):
        model(input_ids=torch.randint(3, 128, (1, 21), device="cuda"), past_key_values=cache, use_cache=True)
    st = cache.layers[0].storage
    assert st.keys.shape[2] == 1  # 21 = 4 sinks + 16 packed + 1 in the residual

    def step():
        k, v = torch.randn(1, 2, 1, 32, device="cuda"), torch.randn(1, 2, 1, 32, device="cuda")
        view = st.attention_update(k, v)  # the residual grows to 2, then 3: no flush
        return fused_decode(view, torch.randn(1, 2, 2, 32, device="cuda"), 0.2, None)

    step()  # compiles the kernels for this view
    torch.cuda.synchronize()
    torch.cuda.set_sync_debug_mode("error")
    try:
        out, lse = step()
    finally:
        torch.cuda.set_sync_debug_mode("default")
    assert out.shape == (1, 2, 2, 32) and bool(torch.isfinite(lse).all())
