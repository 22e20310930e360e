"""Quantize+pack and unpack+dequantize throughput against memcpy of the same buffer.

Buffer: ``--layers`` layers of keys ``[1, 8, 4096, 128]`` float16 (default 32 layers, 256 MiB,
one Llama-3-8B-sized K cache at 4K context). Per layer, keys are quantized per-channel
(statistics over tokens, group 128) as the cache does; the figure is the median over
``--repeats`` passes after one warm-up pass. The same run measures ``memcpy`` (``torch``
``copy_`` and ``numpy.copyto``) of the same buffer, and every throughput is also reported as a
fraction of it, so the ratios are comparable across noisy machines.

Run: ``python benchmarks/bench_quantizer.py [--layers 32] [--repeats 3] [--out FILE.json]``
"""

from __future__ import annotations

import argparse
import json
import platform
import statistics
import time

import numpy as np
import torch

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
    ap.add_argument("--out", default=None, help="write the results as JSON here")
    args = ap.parse_args()

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
    print(f"{'lib':6s} {'bits':>4s} {'quant GB/s':>10s} {'x memcpy':>9s} {'dequant GB/s':>12s} "
          f"{'x memcpy':>9s} {'bits/elem':>9s}")
    rows = []
    for lib, layers in (("torch", layers_t), ("numpy", layers_n)):
        for bits in [int(b) for b in args.bits.split(",")]:
            qts = []

            def q():
                qts.clear()
                for a in layers:
                    qts.append(quantize(a, bits, axis=-2, group_size=args.group_size, scale_dtype=torch.float16))

            def dq():
                for qt in qts:
                    dequantize(qt)

            tq = _median_seconds(q, args.repeats)
            tdq = _median_seconds(dq, args.repeats)
            held = sum(qt.nbytes for qt in qts)
            row = {
                "lib": lib, "bits": bits,
                "quantize_GBps": gb / tq, "quantize_vs_memcpy": gb / tq / memcpy[lib],
                "dequantize_GBps": gb / tdq, "dequantize_vs_memcpy": gb / tdq / memcpy[lib],
                "bits_per_element": 8 * held / (nbytes / 2),
            }
            rows.append(row)
            print(f"{lib:6s} {bits:4d} {row['quantize_GBps']:10.2f} {row['quantize_vs_memcpy']:9.1%} "
                  f"{row['dequantize_GBps']:12.2f} {row['dequantize_vs_memcpy']:9.1%} "
                  f"{row['bits_per_element']:9.3f}")
    if args.out:
        with open(args.out, "w") as f:
            json.dump({"shape": shape, "layers": args.layers, "memcpy_GBps": memcpy, "rows": rows}, f, indent=1)


if __name__ == "__main__":
    main()
