"""Quantize+pack and unpack+dequantize throughput against memcpy of the same buffer.

Buffer: ``--layers`` layers of keys ``[1, 8, 4096, 128]`` float16 (default 32 layers, 256 MiB,
one Llama-3-8B-sized K cache at 4K context). Per layer, keys are quantized per-channel
(statistics over tokens, group 128) as the cache does; the figure is the median over
``--repeats`` passes after one warm-up pass. The same run measures ``memcpy`` (``torch``
``copy_`` and ``numpy.copyto``) of the same buffer, and every throughput is also reported as a
fraction of it, so the ratios are comparable across noisy machines.

Rows: ``torch`` and ``numpy`` are :func:`kv_cache.compression.quantize` / ``dequantize``;
``kernels`` are the compiled :func:`kv_cache.kernels.quantize_block` /
``dequantize_block`` (each layer as ``R = 8`` rows, per-channel groups of 128 tokens, float16
scales, float16 output) on the code path named in the header. Their ``out=`` columns
dequantize into preallocated buffers, as memcpy copies into a preallocated buffer (the other
columns allocate their output, page faults included).

Run: ``python benchmarks/bench_quantizer.py [--layers 32] [--repeats 3] [--threads N] [--out FILE.json]``
(``--out`` also writes ``FILE.md``; the results are named
``benchmarks/results/bench_quantizer_<layers>x<shape>_fp16_g<group>[_t<threads>].json``).
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import statistics
import time

import numpy as np
import torch

from kv_cache import kernels
from kv_cache.compression import dequantize, quantize


def _median_seconds(fn, repeats: int) -> float:
    fn()  # warm-up
    times = []
    for _ in range(repeats):
        t0 = time.perf_counter()
        fn()
        times.append(time.perf_counter() - t0)
    return statistics.median(times)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--layers", type=int, default=32)
    ap.add_argument("--tokens", type=int, default=4096)
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--group-size", type=int, default=128)
    ap.add_argument("--bits", default="2,3,4,8")
    ap.add_argument("--threads", type=int, default=None, help="torch threads (default: torch's)")
    ap.add_argument("--out", default=None, help="write the results as JSON here (and Markdown next to it)")
    args = ap.parse_args()
    if args.threads:
        torch.set_num_threads(args.threads)

    shape = (1, 8, args.tokens, 128)
    gen = torch.Generator().manual_seed(0)
    layers_t = [torch.randn(shape, generator=gen).to(torch.float16) for _ in range(args.layers)]
    layers_n = [t.numpy() for t in layers_t]
    nbytes = sum(t.nbytes for t in layers_t)
    gb = nbytes / 1e9

    dst_t = [torch.empty_like(t) for t in layers_t]
    dst_n = [np.empty_like(a) for a in layers_n]

    def copy_torch():
        for s, d in zip(layers_t, dst_t):
            d.copy_(s)

    def copy_numpy():
        for s, d in zip(layers_n, dst_n):
            np.copyto(d, s)

    memcpy = {"torch": gb / _median_seconds(copy_torch, args.repeats),
              "numpy": gb / _median_seconds(copy_numpy, args.repeats)}
    print(f"buffer: {args.layers} x {list(shape)} float16 = {nbytes / 2**20:.0f} MiB; "
          f"threads={torch.get_num_threads()}; {platform.processor() or platform.machine()}")
    print(f"memcpy  torch {memcpy['torch']:.2f} GB/s   numpy {memcpy['numpy']:.2f} GB/s")
    isa = kernels.isa()  # builds the compiled kernels if needed (outside the timings)
    print(f"kernels: code path {isa} (vs torch memcpy)")
    print(f"{'lib':7s} {'bits':>4s} {'quant GB/s':>10s} {'x memcpy':>9s} {'dequant GB/s':>12s} "
          f"{'x memcpy':>9s} {'out= GB/s':>9s} {'x memcpy':>9s} {'bits/elem':>9s}")
    rows = []
    libs = (("torch", layers_t), ("numpy", layers_n), ("kernels", layers_t))
    for lib, layers in libs:
        base = memcpy["numpy" if lib == "numpy" else "torch"]
        for bits in [int(b) for b in args.bits.split(",")]:
            qts = []
            tdq_out = None
            if lib == "kernels":
                rows3 = [a.reshape(-1, *a.shape[2:]) for a in layers]  # [R = batch * heads, N, d]

                def q():
                    qts.clear()
                    for a in rows3:
                        qts.append(kernels.quantize_block(a, bits, "channel", args.group_size,
                                                          scale_dtype=torch.float16))

                def dq():
                    for b in qts:
                        kernels.dequantize_block(b, torch.float16)

                def dq_out():
                    for b, d in zip(qts, dst_t):
                        kernels.dequantize_block(b, torch.float16, out=d.view(b.codes.shape[0], -1, d.shape[-1]))
            else:
                def q():
                    qts.clear()
                    for a in layers:
                        qts.append(quantize(a, bits, axis=-2, group_size=args.group_size, scale_dtype=torch.float16))

                def dq():
                    for qt in qts:
                        dequantize(qt)

            tq = _median_seconds(q, args.repeats)
            tdq = _median_seconds(dq, args.repeats)
            if lib == "kernels":
                tdq_out = _median_seconds(dq_out, args.repeats)
            held = sum(qt.nbytes for qt in qts)
            row = {
                "lib": lib, "bits": bits,
                "quantize_GBps": gb / tq, "quantize_vs_memcpy": gb / tq / base,
                "dequantize_GBps": gb / tdq, "dequantize_vs_memcpy": gb / tdq / base,
                "bits_per_element": 8 * held / (nbytes / 2),
            }
            if tdq_out is not None:
                row.update(dequantize_out_GBps=gb / tdq_out, dequantize_out_vs_memcpy=gb / tdq_out / base, isa=isa)
            rows.append(row)
            out_cols = (f"{row['dequantize_out_GBps']:9.2f} {row['dequantize_out_vs_memcpy']:9.1%}"
                        if tdq_out is not None else f"{'-':>9s} {'-':>9s}")
            print(f"{lib:7s} {bits:4d} {row['quantize_GBps']:10.2f} {row['quantize_vs_memcpy']:9.1%} "
                  f"{row['dequantize_GBps']:12.2f} {row['dequantize_vs_memcpy']:9.1%} {out_cols} "
                  f"{row['bits_per_element']:9.3f}")
    if args.out:
        result = {"shape": shape, "layers": args.layers, "threads": torch.get_num_threads(),
                  "cpu": platform.processor() or platform.machine(), "kernels_isa": isa,
                  "memcpy_GBps": memcpy, "rows": rows}
        with open(args.out, "w") as f:
            json.dump(result, f, indent=1)
        with open(os.path.splitext(args.out)[0] + ".md", "w") as f:
            f.write(_markdown(result, nbytes))


def _markdown(result: dict, nbytes: int) -> str:
    shape = "x".join(str(s) for s in result["shape"])
    lines = [
        f"# bench_quantizer: {result['layers']} x [{shape}] float16 ({nbytes / 2**20:.0f} MiB)",
        "",
        f"threads={result['threads']}; kernels code path: {result['kernels_isa']}; memcpy torch "
        f"{result['memcpy_GBps']['torch']:.2f} GB/s, numpy {result['memcpy_GBps']['numpy']:.2f} GB/s "
        "(the `x memcpy` columns divide by the memcpy of the same library in the same run).",
        "",
        "| lib | bits | quantize GB/s | x memcpy | dequantize GB/s | x memcpy | dequantize out= GB/s | x memcpy | bits/elem |",
        "|---|---:|---:|---:|---:|---:|---:|---:|---:|",
    ]
    for r in result["rows"]:
        out = (f"{r['dequantize_out_GBps']:.2f} | {r['dequantize_out_vs_memcpy']:.1%}"
               if "dequantize_out_GBps" in r else "- | -")
        lines.append(
            f"| {r['lib']} | {r['bits']} | {r['quantize_GBps']:.2f} | {r['quantize_vs_memcpy']:.1%} | "
            f"{r['dequantize_GBps']:.2f} | {r['dequantize_vs_memcpy']:.1%} | {out} | {r['bits_per_element']:.3f} |")
    return "\n".join(lines) + "\n"


if __name__ == "__main__":
    main()
