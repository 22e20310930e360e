"""Decode speed and memory of compressed caches on SmolLM2-135M, against the full cache and
transformers' ``QuantizedCache`` in the same run.

For every context length (default 1K, 2K, 4K, 8K tokens of Moby Dick) and method spec (the
``kvcache eval`` grammar; ours run with :func:`kv_cache.compress`, i.e. the native attention
over the compressed cache), a fresh subprocess loads the model, prefills the context and
decodes ``--decode`` tokens greedily. It reports the cache bytes held after prefill and after
decoding (sum of tensor ``nbytes``), the ratio against an fp16 full cache of the same tokens,
the prefill time and its ratio to the full cache's (KVzip: with its reconstruction pass; KVzap:
scored in the prefill's own pass), decode tokens/s (median of per-step times
after 4 warm-up steps) and its ratio to the full cache measured in the same run, and the peak
resident memory during prefill and during decode (Linux ``VmHWM``, reset between the two
phases through ``/proc/self/clear_refs``). For KVzap rows, ``decode scoring / step`` is the
median time its scorers take to score one decoded token in every scored layer over the median
decoding step (the evictions every ``evict_every`` steps are inside the step times). One subprocess per measurement keeps the peaks per
configuration honest, and each runs with the same fixed glibc mmap threshold
(:data:`MMAP_THRESHOLD`) so that peaks reflect live memory, not allocation history. The prefill forms the last position's logits only (``logits_to_keep=1``,
as ``model.generate`` does), so its peak is the model's activations and the cache, not a
``context x vocabulary`` logits matrix that is the same for every method (1.6 GB at 8K here).

Run: ``python benchmarks/bench_generate.py [--contexts 1024,2048,4096,8192] [--decode 64]
[--methods full,q4,...] [--dtype bfloat16] [--model M] [--out benchmarks/results/]``
"""

from __future__ import annotations

import argparse
import hashlib
import json
import os
import resource
import statistics
import subprocess
import sys
import time
from pathlib import Path

DEFAULT_METHODS = "full,q8,q4,q2,hf-quanto-int4,snapkv@0.5,h2o@0.5,q4+h2o@0.5"


def _peak_rss_mib() -> float:
    """Peak resident memory of this process since start or the last :func:`_reset_peak` (MiB)."""
    for line in Path("/proc/self/status").read_text().splitlines():
        if line.startswith("VmHWM:"):
            return int(line.split()[1]) / 1024
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024


def _reset_peak() -> None:
    """Reset the peak-RSS counter (Linux: writing 5 to /proc/self/clear_refs)."""
    Path("/proc/self/clear_refs").write_text("5")


MMAP_THRESHOLD = 1 << 20
"""glibc's ``MALLOC_MMAP_THRESHOLD_`` for every measured subprocess (unless already set): blocks
of 1 MiB and more are mapped and unmapped on free. glibc's default threshold adapts to the
allocation history (up to 32 MiB), so large transient buffers can stay in the heap after they
are freed, and the peak resident memory of the same configuration varied by up to 500 MiB
between runs (8K prefill: 1676-1934 MiB for the full cache, 1256-1753 MiB for ``q4``); with a
fixed threshold, repeated runs agree within a few MiB. Every configuration, ours and the
peers, runs with the same setting; it applies to the prefill, decoding runs with
:data:`DECODE_MMAP_THRESHOLD`."""


DECODE_MMAP_THRESHOLD = 32 << 20
"""The threshold while decoding: glibc's own upper bound. A full cache reallocates its
``[b, h, n, d]`` tensors at every step (``torch.cat``, 1.5-6 MiB per layer at 2K-8K tokens);
mapped fresh each time they would page-fault at every step, which the default (adaptive)
threshold avoids by reusing heap memory."""


def _decode_allocator() -> None:
    """Raise glibc's mmap threshold to :data:`DECODE_MMAP_THRESHOLD` for the decode phase (Linux/glibc
    only; elsewhere nothing changes)."""
    try:
        import ctypes

        ctypes.CDLL("libc.so.6").mallopt(-3, DECODE_MMAP_THRESHOLD)  # M_MMAP_THRESHOLD
    except (OSError, AttributeError):
        pass


def _env() -> dict:
    env = dict(os.environ)
    env.setdefault("MALLOC_MMAP_THRESHOLD_", str(MMAP_THRESHOLD))
    return env


def _one(method_spec: str, context: int, decode: int, dtype: str = "float32", model_name: str = "smollm2") -> dict:
    import torch

    from kv_cache.spec.grammar import MethodUnavailable, parse_method
    from kv_cache.cache.report import fp16_kv_bytes
    from kv_cache.context import forward_at
    from kv_cache.eval.runner import _prefill, held_nbytes
    from kv_cache.models import load_model, shared_data_dir

    try:
        method = parse_method(method_spec)
    except MethodUnavailable as exc:
        return {"method": method_spec, "context": context, "skipped": str(exc)}
    torch.set_num_threads(2)
    model, tok = load_model(model_name, dtype=dtype)
    text = (shared_data_dir() / "gutenberg" / "pg2701.txt").read_text().replace("\r\n", "\n")
    ids = tok(text[: context * 8], return_tensors="pt").input_ids[:, :context]
    # Warm-up outside the measurement: kernels load once per process, as in a server.
    with torch.no_grad():
        warm = _prefill(model, method, ids[:, :64], tokenizer=tok, last_only=True)
        forward_at(model, warm.cache, warm.logits[:, -1:].argmax(-1), 64)
        warm.scope.close()
        del warm
    _reset_peak()
    with torch.no_grad():
        t0 = time.perf_counter()
        pre = _prefill(model, method, ids, tokenizer=tok, last_only=True)  # KVzip's reconstruction pass needs it
        prefill_s = time.perf_counter() - t0
        peak_prefill = _peak_rss_mib()
        _decode_allocator()
        _reset_peak()
        bytes_prefill = held_nbytes(pre.cache)
        nxt = pre.logits[:, -1:].argmax(-1)
        steps = []
        try:
            for i in range(decode):
                t0 = time.perf_counter()
                logits = forward_at(model, pre.cache, nxt, context + i)
                steps.append(time.perf_counter() - t0)
                nxt = logits[:, -1:].argmax(-1)
        finally:
            pre.scope.close()
    timed = steps[4:] if len(steps) > 8 else steps
    scoring = _scoring_share(model, pre.cache, statistics.median(timed))
    return {**scoring,
        "method": method_spec, "context": context, "decode": decode, "dtype": dtype, "model": model_name,
        "kv_bytes_prefill": bytes_prefill, "kv_bytes_end": held_nbytes(pre.cache),
        "fp16_bytes_prefill": fp16_kv_bytes(model.config, context),
        "fp16_bytes_end": fp16_kv_bytes(model.config, context + decode),
        "prefill_s": prefill_s, "decode_tokens_per_s": 1.0 / statistics.median(timed),
        "peak_rss_prefill_mib": peak_prefill, "peak_rss_decode_mib": _peak_rss_mib(),
    }


def _scoring_share(model, cache, step_s: float) -> dict:
    """For a KVzap cache: the median time its scorers take to score one decoded token in every
    scored layer (the work KVzap adds to a decoding step, on the layers' hidden size and dtype),
    and its share of the median decoding step measured above. Empty for other methods."""
    import torch

    pol = getattr(cache, "eviction", None)
    if pol is None or not getattr(pol, "needs_hidden", False):
        return {}
    scorer = pol._bound
    layers = [i for i, layer in enumerate(cache.layers) if layer.policy is not None]
    h = torch.randn(1, 1, model.config.hidden_size, dtype=model.dtype)
    runs = []
    with torch.no_grad():
        for _ in range(25):
            t0 = time.perf_counter()
            for i in layers:
                scorer.score(i, h)
            runs.append(time.perf_counter() - t0)
    score_s = statistics.median(runs[5:])
    return {"decode_scoring_s": score_s, "decode_scoring_share": score_s / step_s}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--contexts", default="1024,2048,4096,8192")
    ap.add_argument("--decode", type=int, default=64)
    ap.add_argument("--methods", default=DEFAULT_METHODS)
    ap.add_argument("--out", default=str(Path(__file__).parent / "results"))
    ap.add_argument("--dtype", default="float32", choices=["float32", "bfloat16", "float16"],
                    help="model dtype (the full cache then holds it too)")
    ap.add_argument("--model", default="smollm2", help="alias, HF folder or .gguf (default smollm2)")
    ap.add_argument("--one", help=argparse.SUPPRESS)
    ap.add_argument("--context", type=int, help=argparse.SUPPRESS)
    args = ap.parse_args()
    if args.one:
        print(json.dumps(_one(args.one, args.context, args.decode, args.dtype, args.model)))
        return
    rows = []
    for ctx in [int(c) for c in args.contexts.split(",")]:
        for spec in args.methods.split(","):
            proc = subprocess.run([sys.executable, __file__, "--one", spec, "--context", str(ctx),
                                   "--decode", str(args.decode), "--dtype", args.dtype, "--model", args.model],
                                  capture_output=True, text=True, env=_env())
            if proc.returncode != 0:
                row = {"method": spec, "context": ctx, "error": proc.stderr.strip().splitlines()[-1:]}
            else:
                row = json.loads(proc.stdout.strip().splitlines()[-1])
            rows.append(row)
            print(json.dumps(row), file=sys.stderr, flush=True)
    lines = ["| context | method | KV bytes after prefill | ratio vs fp16 | KV bytes after decode | prefill s "
             "| vs full | decode tok/s | vs full | peak RSS prefill MiB | peak RSS decode MiB | decode scoring / step |",
             "|" + "---|" * 12]
    for ctx in sorted({r["context"] for r in rows}):
        full = next((r for r in rows if r["context"] == ctx and r["method"] == "full" and "kv_bytes_end" in r), None)
        for r in (r for r in rows if r["context"] == ctx):
            if "kv_bytes_end" not in r:
                lines.append(f"| {ctx} | `{r['method']}` | {r.get('skipped') or r.get('error')} |" + " |" * 9)
                continue
            rel = r["decode_tokens_per_s"] / full["decode_tokens_per_s"] if full else float("nan")
            rel_pre = r["prefill_s"] / full["prefill_s"] if full else float("nan")
            lines.append(
                f"| {ctx} | `{r['method']}` | {r['kv_bytes_prefill'] / 2**20:.2f} MiB "
                f"| {r['fp16_bytes_prefill'] / r['kv_bytes_prefill']:.2f}x | {r['kv_bytes_end'] / 2**20:.2f} MiB "
                f"| {r['prefill_s']:.1f} | {rel_pre:.2f}x | {r['decode_tokens_per_s']:.1f} | {rel:.2f}x "
                f"| {r['peak_rss_prefill_mib']:.0f} | {r['peak_rss_decode_mib']:.0f} "
                f"| {'-' if 'decode_scoring_share' not in r else format(r['decode_scoring_share'], '.1%')} |")
    table = "\n".join(lines)
    print(table)
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    methods_id = hashlib.sha256(args.methods.encode()).hexdigest()[:8]  # runs never overwrite each other
    tag = "" if args.dtype == "float32" else f"_{args.dtype}"
    name = Path(args.model).stem if args.model != "smollm2" else "smollm2"
    stem = f"bench_generate_{name}{tag}_ctx{args.contexts.replace(',', '-')}_dec{args.decode}_methods-{methods_id}"
    (out / f"{stem}.json").write_text(json.dumps(rows, indent=1))
    (out / f"{stem}.md").write_text(table + "\n")


if __name__ == "__main__":
    main()
