"""Attention over vLLM-style paged codes, read in place, against the alternatives, in one run.

Two shapes of one layer's attention step over a paged cache ``[blocks, H, block_size, S]``
(blocks of each request scattered over the pool, as vLLM hands them out):

* ``decode``: ``R`` requests, one new token each (``M = G`` query rows per kv head), ``N``
  cached tokens each;
* ``prefill``: one request, a chunk of ``C`` tokens (``M = G * C`` rows per kv head) over ``N``
  cached tokens (a later chunk of a chunked prefill).

Variants, each the cached part's ``(out, lse)``:

* ``paged-kernel``: :func:`kv_cache.kernels.paged.attend_paged`, the compiled kernel walking the
  block table and reading the slots in place (what the vLLM backend runs on the CPU);
* ``gather+decode``: the torch path of the backend (``blocks_per_step`` blocks gathered,
  decoded, attended with torch's CPU flash kernel, merged);
* ``sdpa-bf16`` / ``sdpa-fp32``: torch's flash attention over contiguous full-precision ``[R,
  H, N, D]`` keys and values (no paging, no decoding): the floor a full-precision cache sets.

And one layer's whole serving step (``step`` rows, what the backend's ``forward`` runs): the
cached part, the step's own tokens (causal), the merge and the value rotation, for the same
decode and prefill shapes:

* ``one-call``: :func:`kv_cache.integrations.vllm.attention.attend_batch` on the compiled
  kernels, one call for the batch (:func:`kv_cache.kernels.paged_batch.attend_paged_batch`);
* ``per-request``: the path before it: the compiled paged kernel for the cached part of the
  decoding requests together and of each prefill chunk, torch's flash kernel for the chunk's own
  tokens, the merges and rotations in torch;
* ``sdpa-bf16``: torch's flash attention over the same tokens in contiguous bf16 (causal
  for the chunk), the full-precision floor.

And the slot writes of one layer's step (``write`` rows): one decoded token, one token for each of
``R`` requests (each re-encodes its 32-slot key group), and a prefill chunk of ``C`` tokens, with
the compiled writer (:func:`kv_cache.kernels.paged.write_paged`) against the torch encoder
(``write_slots(..., kernels=False)``), both storing the same bytes.

Each figure is the median of ``--repeats`` timed calls (ms, wall clock) after ``--warmup``;
``x sdpa-bf16`` is the ratio to the bf16 floor measured in the same run. Results go to
``benchmarks/results/bench_paged_*.{json,md}``.

Run: ``python benchmarks/bench_paged.py [--codecs q4d,q3d,q2d,q4,q8] [--threads N]``.
"""

from __future__ import annotations

import argparse
import json
import platform
import statistics
import time
from pathlib import Path

import torch

from kv_cache.integrations.vllm.attention import _cached_by_torch, attend_batch
from kv_cache.integrations.vllm.blocks import paged_rope, slot_layout
from kv_cache.integrations.vllm.codecs import PagedCodec, value_rotations, write_slots
from kv_cache.kernels import backend
from kv_cache.kernels.paged import attend_paged

RESULTS = Path(__file__).resolve().parent / "results"


def _median_ms(fn, warmup: int, repeats: int) -> float:
    for _ in range(warmup):
        fn()
    times = []
    for _ in range(repeats):
        t0 = time.perf_counter()
        fn()
        times.append(time.perf_counter() - t0)
    return 1e3 * statistics.median(times)


def _cache(codec: PagedCodec, r: int, n: int, h: int, bs: int, seed: int = 0):
    """A pool with ``r`` requests of ``n`` tokens on shuffled blocks; returns cache, table, keys, values."""
    g = torch.Generator().manual_seed(seed)
    per = -(-n // bs)
    pool = r * per + 8
    cache = torch.zeros(pool, h, bs, codec.slot_bytes, dtype=torch.uint8)
    table = torch.randperm(pool, generator=g)[: r * per].view(r, per).to(torch.int32)
    k = torch.randn(r, n, h, codec.head_dim, generator=g) + torch.linspace(-3, 3, codec.head_dim)
    v = torch.randn(r, n, h, codec.head_dim, generator=g)
    rot = value_rotations(codec, 0, h)
    t = torch.arange(n)
    extra = {"rope": _frame(codec.head_dim), "positions": t} if codec.pre_rope else {}
    for i in range(r):
        write_slots(cache, k[i], v[i], table[i, t // bs].long() * bs + t % bs, codec, rot, **extra)
    return cache, table, k, v


def _frame(d: int):
    """A plain RoPE frame (base 10,000, every channel turned) for the codecs storing keys before RoPE."""
    from kv_cache.cache.rope_frame import RopeFrame

    return RopeFrame(1.0 / (10000.0 ** (torch.arange(0, d, 2).float() / d)), 1.0, "half")


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--codecs", default="q4d,q3d,q2d,q4,q8")
    ap.add_argument("--heads", type=int, default=3, help="kv heads (SmolLM2: 3)")
    ap.add_argument("--group", type=int, default=3, help="query heads per kv head (SmolLM2: 3)")
    ap.add_argument("--head-dim", type=int, default=64)
    ap.add_argument("--block-size", type=int, default=32)
    ap.add_argument("--decode", default="32x2048", help="requests x cached tokens")
    ap.add_argument("--prefill", default="256x4096", help="chunk tokens x cached tokens")
    ap.add_argument("--threads", type=int, default=0, help="torch threads (0: leave as is)")
    ap.add_argument("--warmup", type=int, default=2)
    ap.add_argument("--repeats", type=int, default=7)
    args = ap.parse_args()
    if args.threads:
        torch.set_num_threads(args.threads)
    if backend("cpu") != "compiled":
        raise SystemExit("the compiled kernels are not available here (KV_CACHE_KERNELS=torch or no compiler): "
                         "nothing to measure")
    h, g, d, bs = args.heads, args.group, args.head_dim, args.block_size
    dr, dn = (int(x) for x in args.decode.split("x"))
    pc, pn = (int(x) for x in args.prefill.split("x"))
    shapes = {"decode": (dr, dn, g), "prefill": (1, pn, g * pc)}
    rows = []
    for shape, (r, n, m) in shapes.items():
        q = torch.randn(r, h, m, d)
        lengths = torch.full((r,), n, dtype=torch.int64)
        dense = {}
        for name in args.codecs.split(","):
            codec = PagedCodec(name, d)
            cache, table, k, v = _cache(codec, r, n, h, bs)
            if not dense:
                for dt in (torch.bfloat16, torch.float32):
                    kd = k.permute(0, 2, 1, 3).contiguous().to(dt)
                    vd = v.permute(0, 2, 1, 3).contiguous().to(dt)
                    dense[dt] = (kd, vd)
            layout = slot_layout(codec)
            rope = paged_rope(_frame(d)) if codec.pre_rope else None
            times = {
                "paged-kernel": _median_ms(lambda: attend_paged(q, cache, table, lengths, layout, d ** -0.5, rope),
                                           args.warmup, args.repeats),
                "gather+decode": _median_ms(lambda: _cached_by_torch(q, cache, table.long(), lengths, codec,
                                                                     d ** -0.5, 8, rope), args.warmup, args.repeats),
            }
            for dt, label in ((torch.bfloat16, "sdpa-bf16"), (torch.float32, "sdpa-fp32")):
                kd, vd = dense[dt]
                qd = q.to(dt)
                times[label] = _median_ms(
                    lambda: torch.ops.aten._scaled_dot_product_flash_attention_for_cpu(qd, kd, vd, 0.0, False,
                                                                                       scale=d ** -0.5),
                    args.warmup, args.repeats)
            kv_bytes = r * n * h * codec.slot_bytes
            rows.append({"shape": shape, "requests": r, "cached_tokens": n, "query_rows": m, "codec": name,
                         "slot_bytes": codec.slot_bytes, "kv_mib_codes": kv_bytes / 2**20,
                         "kv_mib_bf16": r * n * h * 4 * d / 2**20, "ms": times})
            print(shape, name, {k_: round(v_, 3) for k_, v_ in times.items()}, flush=True)
    steps = _steps(args, h, g, d, bs, {"decode": (dr, dn, 1), "prefill": (1, pn, pc)})
    writes = []
    for name in args.codecs.split(","):
        codec = PagedCodec(name, d)
        g_ = torch.Generator().manual_seed(5)
        cache = torch.zeros(dr * 4 + pc // bs + 8, h, bs, codec.slot_bytes, dtype=torch.uint8)
        rot = value_rotations(codec, 0, h)
        kx = torch.randn(max(pc, dr), h, d, generator=g_).bfloat16()
        vx = torch.randn(max(pc, dr), h, d, generator=g_).bfloat16()
        cases = {"1 token": torch.tensor([5]), f"{dr} requests x 1 token": torch.arange(dr) * 4 * bs + 7,
                 f"chunk of {pc}": dr * 4 * bs + torch.arange(pc)}
        for label, slots in cases.items():
            n_ = slots.numel()
            extra = {"rope": _frame(d), "positions": torch.arange(n_)} if codec.pre_rope else {}
            t_ = {kind: _median_ms(lambda: write_slots(cache, kx[:n_], vx[:n_], slots, codec, rot, kernels=flag,
                                                       **extra),
                                   args.warmup, args.repeats * 3)
                  for kind, flag in (("compiled", None), ("torch", False))}
            writes.append({"codec": name, "case": label, "ms": t_})
            print("write", name, label, {k_: round(v_, 3) for k_, v_ in t_.items()}, flush=True)
    result = {"args": vars(args), "torch": torch.__version__, "threads": torch.get_num_threads(),
              "machine": f"{platform.machine()}, {platform.processor() or '?'}", "rows": rows,
              "steps": steps, "writes": writes}
    RESULTS.mkdir(exist_ok=True)
    pre_rope = any(PagedCodec(n, d).pre_rope for n in args.codecs.split(","))
    stem = RESULTS / f"bench_paged_h{h}g{g}d{d}_bs{bs}_dec{args.decode}_pre{args.prefill}{'_prerope' if pre_rope else ''}"
    stem.with_suffix(".json").write_text(json.dumps(result, indent=1) + "\n")
    stem.with_suffix(".md").write_text(_markdown(result))
    print(f"wrote {stem}.json / .md")


def _steps(args, h: int, g: int, d: int, bs: int, shapes: dict) -> list:
    """One layer's serving step (module docstring, ``step`` rows) per shape and codec: ms of the
    one compiled call, of the per-request path, and of bf16 sdpa over the same tokens."""
    rows = []
    for shape, (r, n, c) in shapes.items():
        gen = torch.Generator().manual_seed(11)
        q = torch.randn(r * c, h * g, d, generator=gen)
        k_new = torch.randn(r * c, h, d, generator=gen)
        v_new = torch.randn(r * c, h, d, generator=gen)
        query_start = torch.arange(r + 1, dtype=torch.int64) * c
        seq_lens = torch.full((r,), n + c, dtype=torch.int64)
        for name in args.codecs.split(","):
            codec = PagedCodec(name, d)
            cache, table, k, v = _cache(codec, r, n, h, bs)
            rot = value_rotations(codec, 0, h)
            rope = paged_rope(_frame(d)) if codec.pre_rope else None
            times = {label: _median_ms(lambda: attend_batch(q, cache, table, query_start, seq_lens, k_new, v_new,
                                                            codec, rot, d ** -0.5, kernels=flag, key_rope=rope),
                                       args.warmup, args.repeats)
                     for label, flag in (("one-call", True), ("per-request", False))}
            qd = q.view(r, c, h * g, d).transpose(1, 2).bfloat16()
            kd = torch.cat((k.permute(0, 2, 1, 3), k_new.view(r, c, h, d).transpose(1, 2)), 2).bfloat16()
            vd = torch.cat((v.permute(0, 2, 1, 3), v_new.view(r, c, h, d).transpose(1, 2)), 2).bfloat16()
            mask = None if c == 1 else torch.ones(c, n + c, dtype=torch.bool).tril(n)
            times["sdpa-bf16"] = _median_ms(lambda: torch.nn.functional.scaled_dot_product_attention(
                qd, kd, vd, attn_mask=mask, scale=d ** -0.5, enable_gqa=True), args.warmup, args.repeats)
            rows.append({"shape": shape, "requests": r, "cached_tokens": n, "step_tokens": c, "codec": name,
                         "ms": times})
            print("step", shape, name, {k_: round(v_, 3) for k_, v_ in times.items()}, flush=True)
    return rows


def _markdown(result: dict) -> str:
    a = result["args"]
    lines = [
        "# Paged attention over vLLM-style slots: read in place vs gathered and decoded",
        "",
        f"`python benchmarks/bench_paged.py --codecs {a['codecs']}`; torch {result['torch']}, "
        f"{result['threads']} threads, {result['machine']}. {a['heads']} kv heads x {a['group']} query heads, "
        f"head dim {a['head_dim']}, block size {a['block_size']}, blocks shuffled over the pool. Median of "
        f"{a['repeats']} calls (ms); `x bf16` = time / `sdpa-bf16` time in the same run.",
        "",
        "| shape | codec | slot B | KV MiB (codes / bf16) | paged kernel ms | gather+decode ms | sdpa bf16 ms | "
        "sdpa fp32 ms | kernel x bf16 | kernel / gather |",
        "|---|---|---|---|---|---|---|---|---|---|",
    ]
    for r in result["rows"]:
        t = r["ms"]
        shape = (f"decode {r['requests']} req x {r['cached_tokens']}" if r["shape"] == "decode"
                 else f"prefill chunk {r['query_rows'] // a['group']} over {r['cached_tokens']}")
        lines.append(f"| {shape} | `{r['codec']}` | {r['slot_bytes']} | {r['kv_mib_codes']:.1f} / "
                     f"{r['kv_mib_bf16']:.1f} | {t['paged-kernel']:.2f} | {t['gather+decode']:.2f} | "
                     f"{t['sdpa-bf16']:.2f} | {t['sdpa-fp32']:.2f} | {t['paged-kernel'] / t['sdpa-bf16']:.2f}x | "
                     f"{t['paged-kernel'] / t['gather+decode']:.2f}x |")
    if result.get("steps"):
        lines += ["", "One layer's serving step: cached codes, the step's own tokens, merge, rotation (ms):", "",
                  "| shape | codec | one call | per request | sdpa bf16 | one call / per request | one call x bf16 |",
                  "|---|---|---|---|---|---|---|"]
        for r in result["steps"]:
            t = r["ms"]
            shape = (f"decode {r['requests']} req x {r['cached_tokens']} + 1" if r["shape"] == "decode"
                     else f"prefill chunk {r['step_tokens']} over {r['cached_tokens']}")
            lines.append(f"| {shape} | `{r['codec']}` | {t['one-call']:.2f} | {t['per-request']:.2f} | "
                         f"{t['sdpa-bf16']:.2f} | {t['one-call'] / t['per-request']:.2f}x | "
                         f"{t['one-call'] / t['sdpa-bf16']:.2f}x |")
    if result.get("writes"):
        lines += ["", "Slot writes of one layer's step (ms; both store the same bytes):", "",
                  "| codec | case | compiled writer | torch encoder | compiled / torch |", "|---|---|---|---|---|"]
        for w in result["writes"]:
            t = w["ms"]
            lines.append(f"| `{w['codec']}` | {w['case']} | {t['compiled']:.3f} | {t['torch']:.3f} | "
                         f"{t['compiled'] / t['torch']:.2f}x |")
    return "\n".join(lines) + "\n"


if __name__ == "__main__":
    main()
