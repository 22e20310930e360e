"""Attention read from packed codes vs SDPA on a full-precision cache, in one run.

For each context length ``N`` and bit width, one decode step of ``G`` query rows per KV row
(``R = batch * kv_heads`` rows, head dim ``d``) attends over ``N`` cached tokens stored as:

* ``kernels``: :func:`kv_cache.kernels.attend_block` on the compiled code path (keys
  per-channel in groups of 128 tokens, values per-token, asymmetric, float16 scales: KIVI);
* ``reference``: the same call on the pure-torch reference (dequantize, matmul, softmax);
* ``sdpa-fp32`` / ``sdpa-fp16``: ``torch.nn.functional.scaled_dot_product_attention`` with
  ``q [1, R, G, d]`` over a full cache ``k, v [1, R, N, d]`` of that dtype;
* ``layer-blocks`` / ``layer-one-call``: a whole layer's decoding step as the cache holds it
  (4 float32 sinks | the ``N`` packed tokens | a 64-token float32 residual): block by block
  with a log-sum-exp merge in torch (``FullBlock``/``QuantBlock.attend`` + ``merge``), or in one
  kernel call (:func:`kv_cache.attention.blocks.fused_decode` -> ``attend_mixed``), what
  ``compressed_attention`` runs when decoding.

``--pre-rope`` adds keys stored before RoPE (math dictionary §29.8), read by the same kernel with
their positions: ``kernels-prerope`` (the per-channel keys above, turned at read) and
``token`` / ``token-prerope`` (per-token Lloyd-Max keys with one norm per vector, as stored, or
in a randomized Hadamard space mapped back by one fast Walsh-Hadamard transform per key and
turned), every variant timed in the same run.

``--cold`` writes a 64 MiB buffer before every timed call (outside the timing), so the KV is
read from memory as in a model, where a layer's weights pass through the caches between two
attention calls; without it the KV stays in the caches from call to call.

Each figure is the median of ``--repeats`` timed calls after ``--warmup`` untimed ones (µs per
call, wall clock); ``x sdpa-fp32`` is the ratio to SDPA on the float32 cache measured in the
same run, and ``KV MiB`` the bytes each variant reads.

Run: ``python benchmarks/bench_attention.py [--tokens 1024,2048,4096,8192] [--bits 2,4]
[--threads N] [--repeats 50]``; results go to ``benchmarks/results/`` as JSON and Markdown
named after the configuration.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import platform
import statistics
import time
from pathlib import Path

import torch
import torch.nn.functional as F

from kv_cache import kernels
from kv_cache.attention.blocks import FullBlock, QuantBlock, fused_decode, merge
from kv_cache.kernels import reference

RESULTS = Path(__file__).resolve().parent / "results"


_FLUSH: list = []


def _median_us(fn, warmup: int, repeats: int) -> float:
    for _ in range(warmup):
        fn()
    times = []
    for _ in range(repeats):
        for buf in _FLUSH:  # --cold: evict the caches, untimed
            buf.add_(1.0)
        t0 = time.perf_counter()
        fn()
        times.append(time.perf_counter() - t0)
    return statistics.median(times) * 1e6


def _pre_rope_variants(q, k, kb, vb, bits: int, scaling: float, args, gen) -> list:
    """``--pre-rope``: the same keys read before RoPE (positions ``0..N-1``, an offset, SmolLM2's
    frequencies), per-channel and per-token in a Hadamard space (§29.8)."""
    R, N, d = k.shape
    positions = torch.arange(N, dtype=torch.int32).expand(R, N).contiguous()
    inv_freq = 1.0 / (100000.0 ** (torch.arange(0, d, 2, dtype=torch.float32) / d))
    mean = torch.randn(R, d, generator=gen)
    roped = dataclasses.replace(kb, rope=kernels.KeyRope(positions, inv_freq, "half", 1.0, mean))
    from kv_cache.compression.codebook import lloyd_max_gaussian

    kt = kernels.quantize_block(k, bits, "token", d, lut=lloyd_max_gaussian(bits))
    signs = (torch.randint(0, 2, (R, d), generator=gen) * 2 - 1).float()
    kt_roped = dataclasses.replace(kt, rope=kernels.KeyRope(positions, inv_freq, "half", 1.0, mean, None, signs))
    out = []
    for name, blk in (("kernels-prerope", roped), ("token", kt), ("token-prerope", kt_roped)):
        t = _median_us(lambda: kernels.attend_block(q, blk, vb, scaling), args.warmup, args.repeats)
        out.append((name, bits, t, blk.nbytes + vb.nbytes))
    return out


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--tokens", default="1024,2048,4096,8192")
    ap.add_argument("--bits", default="2,4")
    ap.add_argument("--rows", type=int, default=3, help="R = batch * kv_heads (3: SmolLM2 at batch 1)")
    ap.add_argument("--queries", type=int, default=3, help="G query rows per KV row (GQA group x positions)")
    ap.add_argument("--head-dim", type=int, default=64)
    ap.add_argument("--group-size", type=int, default=128, help="tokens per key scale group")
    ap.add_argument("--threads", type=int, default=None, help="torch threads (default: torch's)")
    ap.add_argument("--warmup", type=int, default=5)
    ap.add_argument("--repeats", type=int, default=50)
    ap.add_argument("--ref-repeats", type=int, default=10, help="repeats of the (slow) torch reference")
    ap.add_argument("--cold", action="store_true", help="evict the caches before every timed call")
    ap.add_argument("--pre-rope", action="store_true", help="also keys stored before RoPE, turned at read")
    args = ap.parse_args()
    if args.cold:
        _FLUSH.append(torch.zeros(16 * 2**20))
    if args.threads:
        torch.set_num_threads(args.threads)
    R, G, d = args.rows, args.queries, args.head_dim
    tokens = [int(n) for n in args.tokens.split(",")]
    bit_widths = [int(b) for b in args.bits.split(",")]
    isa = kernels.isa()  # builds the compiled kernels if needed (outside the timings)
    threads = torch.get_num_threads()
    print(f"R={R} G={G} d={d}; threads={threads}; kernels code path: {isa}; "
          f"{platform.processor() or platform.machine()}")
    print(f"{'N':>5s} {'variant':12s} {'us/call':>9s} {'x sdpa-fp32':>11s} {'KV MiB':>7s}")
    gen = torch.Generator().manual_seed(0)
    scaling = d ** -0.5
    rows = []
    for N in tokens:
        k = torch.randn(R, N, d, generator=gen)
        v = torch.randn(R, N, d, generator=gen)
        q = torch.randn(R, G, d, generator=gen)
        k4, v4, q4 = k[None], v[None], q[None]
        k16, v16, q16 = k4.half(), v4.half(), q4.half()
        t_fp32 = _median_us(lambda: F.scaled_dot_product_attention(q4, k4, v4, scale=scaling),
                            args.warmup, args.repeats)
        t_fp16 = _median_us(lambda: F.scaled_dot_product_attention(q16, k16, v16, scale=scaling),
                            args.warmup, args.repeats)
        measured = [("sdpa-fp32", None, t_fp32, (k.nbytes + v.nbytes)),
                    ("sdpa-fp16", None, t_fp16, (k16.nbytes + v16.nbytes))]
        for bits in bit_widths:
            kb = kernels.quantize_block(k, bits, "channel", args.group_size, scale_dtype=torch.float16)
            vb = kernels.quantize_block(v, bits, "token", d, scale_dtype=torch.float16)
            nbytes = kb.nbytes + vb.nbytes
            t_k = _median_us(lambda: kernels.attend_block(q, kb, vb, scaling), args.warmup, args.repeats)
            t_r = _median_us(lambda: reference.attend_block(q, kb, vb, scaling), 2, args.ref_repeats)
            measured += [("kernels", bits, t_k, nbytes), ("reference", bits, t_r, nbytes)]
            if args.pre_rope:
                measured += _pre_rope_variants(q, k, kb, vb, bits, scaling, args, gen)
            sinks = [torch.randn(1, R, 4, d, generator=gen) for _ in range(2)]
            resid = [torch.randn(1, R, 64, d, generator=gen) for _ in range(2)]
            view = [FullBlock(*sinks), QuantBlock(kb, vb, batch=1, kv_heads=R), FullBlock(*resid)]
            layer_bytes = nbytes + sum(t.nbytes for t in sinks + resid)

            def per_block():
                return merge([blk.attend(q4, scaling, None, None)[:2] for blk in view])

            t_b = _median_us(per_block, args.warmup, args.repeats)
            t_o = _median_us(lambda: fused_decode(view, q4, scaling, None), args.warmup, args.repeats)
            measured += [("layer-blocks", bits, t_b, layer_bytes), ("layer-one-call", bits, t_o, layer_bytes)]
        for variant, bits, us, nbytes in measured:
            name = variant if bits is None else f"{variant}-{bits}b"
            row = {"N": N, "variant": variant, "bits": bits, "us_per_call": us, "vs_sdpa_fp32": us / t_fp32,
                   "kv_MiB": nbytes / 2**20}
            rows.append(row)
            print(f"{N:5d} {name:12s} {us:9.1f} {us / t_fp32:11.2f} {nbytes / 2**20:7.2f}")
    config = (f"R{R}_G{G}_d{d}_N{'-'.join(map(str, tokens))}_b{'-'.join(map(str, bit_widths))}"
              f"_g{args.group_size}_{isa}_t{threads}" + ("_cold" if args.cold else "")
              + ("_prerope" if args.pre_rope else ""))
    result = {"rows_R": R, "queries_G": G, "head_dim": d, "group_size": args.group_size, "threads": threads,
              "kernels_isa": isa, "cpu": platform.processor() or platform.machine(),
              "warmup": args.warmup, "repeats": args.repeats, "cold": bool(args.cold), "results": rows}
    RESULTS.mkdir(exist_ok=True)
    stem = RESULTS / f"bench_attention_{config}"
    stem.with_suffix(".json").write_text(json.dumps(result, indent=1) + "\n")
    stem.with_suffix(".md").write_text(_markdown(result))
    print(f"wrote {stem}.json and .md")


def _markdown(result: dict) -> str:
    lines = [
        f"# bench_attention: R={result['rows_R']}, G={result['queries_G']}, d={result['head_dim']}",
        "",
        f"One decode step over N cached tokens; threads={result['threads']}; kernels code path: "
        f"{result['kernels_isa']}; median of {result['repeats']} calls after {result['warmup']} warm-up "
        "calls (the torch reference: fewer). Keys per-channel (group "
        f"{result['group_size']} tokens), values per-token, float16 scales. `x sdpa-fp32` is the "
        "ratio to SDPA over the float32 cache in the same run (lower is faster). `layer-*`: the "
        "packed block plus 4 float32 sinks and a 64-token float32 residual, block by block with a "
        "torch merge or in one kernel call. `kernels-prerope`, `token`, `token-prerope` (`--pre-rope`): "
        "keys stored before RoPE, turned at read (per-channel; per-token Lloyd-Max keys as stored or "
        "in a Hadamard space mapped back per key), math dictionary §29.8. "
        + ("Caches evicted before every timed call (`--cold`)." if result.get("cold") else
           "KV warm in the caches from call to call."),
        "",
        "| N | variant | bits | µs / call | x sdpa-fp32 | KV MiB read |",
        "|---:|---|---:|---:|---:|---:|",
    ]
    for r in result["results"]:
        bits = "-" if r["bits"] is None else str(r["bits"])
        lines.append(f"| {r['N']} | {r['variant']} | {bits} | {r['us_per_call']:.1f} | "
                     f"{r['vs_sdpa_fp32']:.2f} | {r['kv_MiB']:.2f} |")
    return "\n".join(lines) + "\n"


if __name__ == "__main__":
    main()
