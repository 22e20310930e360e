"""Decode speed and peak device memory on a CUDA GPU: compressed caches against the fp16 full cache
and transformers' ``QuantizedCache``, at long contexts.

For every context (default 8K, 32K, 128K tokens of the Gutenberg novels in ``shared/data``) and
method spec (the ``kvcache eval`` grammar; default ``full``, ``q4d``, ``q2d``, ``q4+kvzip@0.3``,
``hf-quanto-int4``, ``hf-hqq-int4``), a fresh subprocess loads the model on the GPU (float16 by
default), warms up (Triton compiles its kernels, the allocator fills), prefills the context
(logits of the last position only, as ``generate`` does) and decodes ``--decode`` tokens greedily.
It reports the KV bytes held (sum of tensor ``nbytes`` on the device), the peak device memory of
the prefill and of the decode above the model's weights (``torch.cuda.max_memory_allocated``,
reset between the phases), that decode peak over the full cache's KV bytes, and decode tokens/s
(median of per-step times, each step synchronized) against the full cache and against quanto.

Contexts beyond the model's positions (SmolLM2-135M has 8192): ``--long-context rope`` (the
default) runs them with linear RoPE scaling, a config override (``rope_parameters`` =
``{"rope_type": "linear", "factor": ceil(needed / positions)}``, the rotary modules rebuilt): the
speed and memory measured do not depend on it, the quality of the continuation is not measured
here. ``--long-context skip`` leaves those rows out, saying so in the table; pass ``--model`` a
model with that many positions instead (any model ``kv_cache`` supports: alias, HF folder, hub id).

The table (with the GPU's name, torch / Triton / CUDA versions) goes to ``benchmarks/results/``.
Without a CUDA device the script stops at once with the reason (exit status 2).

Run: ``python benchmarks/bench_gpu.py [--contexts 8192,32768,131072] [--decode 32]
[--methods full,q4d,...] [--dtype float16] [--model smollm2] [--long-context rope|skip]``, or the
whole GPU check, tests first: ``benchmarks/gpu_check.sh``.
"""

from __future__ import annotations

import argparse
import json
import math
import re
import statistics
import subprocess
import sys
import time
from pathlib import Path

DEFAULT_METHODS = "full,q4d,q2d,q4+kvzip@0.3,hf-quanto-int4,hf-hqq-int4"
DEFAULT_CONTEXTS = "8192,32768,131072"
WARMUP_TOKENS = 256
MIB = 2**20
DEVICE = "cuda"


def _fail(message: str) -> None:
    print(message, file=sys.stderr)
    sys.exit(2)


def require_cuda() -> None:
    """Exit (status 2) with the reason unless torch sees a CUDA device and the Triton kernels serve it."""
    try:
        import torch
    except ImportError:
        _fail("bench_gpu.py: torch is not installed; install a CUDA build of torch first")
    if not torch.cuda.is_available():
        build = torch.version.cuda or "none (a CPU-only build of torch)"
        _fail(f"bench_gpu.py needs a CUDA device and torch sees none: torch.cuda.is_available() is False "
                 f"(torch {torch.__version__}, CUDA build: {build})")
    from kv_cache.kernels import backend

    if backend("cuda") != "triton":
        _fail("bench_gpu.py: CUDA tensors would run on the torch reference kernels, not Triton "
                 "(pip install triton, and unset KV_CACHE_KERNELS): the numbers would not be the GPU path's")


def _text_ids(tok, n: int):
    """``[1, n]`` token ids of the Gutenberg novels (concatenated as needed); random ids if the texts are absent."""
    import torch

    from kv_cache.models import shared_data_dir

    try:
        files = sorted((shared_data_dir() / "gutenberg").glob("pg*.txt"))
    except FileNotFoundError:
        files = []
    ids: list[int] = []
    for f in files:
        ids += tok(f.read_text().replace("\r\n", "\n")).input_ids
        if len(ids) >= n:
            return torch.tensor([ids[:n]]), "gutenberg"
    g = torch.Generator().manual_seed(0)
    return torch.randint(100, tok.vocab_size, (1, n), generator=g), "random ids (shared/data/gutenberg not found)"


def extend_positions(model, needed: int) -> str | None:
    """Linear RoPE scaling so ``needed`` positions fit (a config override, rotary modules rebuilt).

    Returns the note for the table, or None when the model has the positions already.

    Raises
    ------
    ValueError
        The model already scales its RoPE, or has no rotary module to rebuild.
    """
    cfg = model.config.get_text_config() if hasattr(model.config, "get_text_config") else model.config
    positions = int(cfg.max_position_embeddings)
    if needed <= positions:
        return None
    params = dict(getattr(cfg, "rope_parameters", None) or {})
    if params.get("rope_type", "default") != "default":
        raise ValueError(f"the model already scales RoPE ({params}); pass --model with {needed} positions")
    factor = math.ceil(needed / positions)
    params.update(rope_type="linear", factor=float(factor))
    cfg.rope_parameters = params
    cfg.max_position_embeddings = positions * factor
    rebuilt = 0
    for name, mod in list(model.named_modules()):
        if type(mod).__name__.endswith("RotaryEmbedding"):
            parent = model.get_submodule(name.rsplit(".", 1)[0]) if "." in name else model
            setattr(parent, name.rsplit(".", 1)[-1], type(mod)(config=cfg).to(model.device))
            rebuilt += 1
    if not rebuilt:
        raise ValueError("no rotary embedding module to rebuild; pass --model with enough positions")
    return f"linear RoPE x{factor} ({positions} positions)"


def _decode(model, cache, nxt, start: int, steps: int) -> list[float]:
    """Greedy decode ``steps`` tokens from ``nxt`` at position ``start``; per-step seconds (synchronized)."""
    import torch

    from kv_cache.context import forward_at

    times = []
    for i in range(steps):
        torch.cuda.synchronize()
        t0 = time.perf_counter()
        logits = forward_at(model, cache, nxt, start + i)
        nxt = logits[:, -1:].argmax(-1)
        torch.cuda.synchronize()
        times.append(time.perf_counter() - t0)
    return times


def one(spec: str, context: int, decode: int, dtype: str, model_name: str, long_context: str) -> dict:
    """Measure one (method, context) in this process (the parent runs each in a fresh one)."""
    import gc

    import torch

    from kv_cache.cache.report import fp16_kv_bytes
    from kv_cache.eval.accounting import held_nbytes
    from kv_cache.spec.grammar import MethodUnavailable, parse_method
    from kv_cache.eval.runner import _prefill
    from kv_cache.models import load_model

    row = {"method": spec, "context": context}
    try:
        method = parse_method(spec)
    except MethodUnavailable as exc:
        return {**row, "skipped": str(exc)}
    model, tok = load_model(model_name, dtype=getattr(torch, dtype))
    model.to(DEVICE)
    positions = int(model.config.get_text_config().max_position_embeddings)
    if context + decode > positions and long_context == "skip":
        return {**row, "skipped": f"needs a model with >= {context + decode} positions ({model_name} has "
                                  f"{positions}): pass --model, or --long-context rope"}
    note = extend_positions(model, context + decode) if long_context == "rope" else None
    ids, source = _text_ids(tok, context)
    ids = ids.to(DEVICE)
    with torch.no_grad():  # warm-up: compiles the kernels, fills the allocator; not measured
        warm = _prefill(model, method, ids[:, :WARMUP_TOKENS], tokenizer=tok, last_only=True)
        _decode(model, warm.cache, warm.logits[:, -1:].argmax(-1), WARMUP_TOKENS, 8)
        warm.scope.close()
        del warm
    gc.collect()
    torch.cuda.synchronize()
    torch.cuda.empty_cache()
    base = torch.cuda.memory_allocated()  # the weights (and anything else held before the cache)
    torch.cuda.reset_peak_memory_stats()
    with torch.no_grad():
        t0 = time.perf_counter()
        pre = _prefill(model, method, ids, tokenizer=tok, last_only=True)
        torch.cuda.synchronize()
        prefill_s = time.perf_counter() - t0
        peak_prefill = torch.cuda.max_memory_allocated() - base
        kv_prefill = held_nbytes(pre.cache)
        torch.cuda.reset_peak_memory_stats()
        try:
            steps = _decode(model, pre.cache, pre.logits[:, -1:].argmax(-1), context, decode)
        finally:
            pre.scope.close()
        peak_decode = torch.cuda.max_memory_allocated() - base
    timed = steps[2:] if len(steps) > 6 else steps
    return {**row, "decode": decode, "dtype": dtype, "model": model_name, "text": source, "note": note,
            "kv_bytes_prefill": kv_prefill, "kv_bytes_end": held_nbytes(pre.cache),
            "fp16_kv_bytes": fp16_kv_bytes(model.config, context), "weights_bytes": base,
            "prefill_s": prefill_s, "peak_prefill_bytes": peak_prefill, "peak_decode_bytes": peak_decode,
            "decode_tokens_per_s": 1.0 / statistics.median(timed)}


def _environment() -> dict:
    import torch

    try:
        import triton

        triton_version = triton.__version__
    except ImportError:
        triton_version = "not installed"
    return {"device": torch.cuda.get_device_name(0), "torch": torch.__version__, "cuda": torch.version.cuda,
            "triton": triton_version}


def _speedup(row: dict, ref: dict | None) -> str:
    return f"{row['decode_tokens_per_s'] / ref['decode_tokens_per_s']:.2f}x" if ref else "-"


def table(rows: list[dict], env: dict, args) -> str:
    """The markdown report: the environment, then one row per (context, method)."""
    lines = [f"# GPU decode: {env['device']}", "",
             f"torch {env['torch']} (CUDA {env['cuda']}), Triton {env['triton']}; model `{args.model}` in "
             f"{args.dtype}; {args.decode} decoded tokens; long contexts: `--long-context {args.long_context}`. "
             "Peaks are `torch.cuda.max_memory_allocated` above the weights; `/ full KV` divides the decode "
             "peak by the full cache's KV bytes at the same context.", "",
             "| context | method | KV MiB | KV / fp16 KV | prefill s | peak prefill MiB | peak decode MiB "
             "| peak decode / full KV | decode tok/s | vs full | vs quanto | note |", "|" + "---|" * 12]
    for ctx in sorted({r["context"] for r in rows}):
        at = [r for r in rows if r["context"] == ctx]
        full = next((r for r in at if r["method"] == "full" and "kv_bytes_end" in r), None)
        quanto = next((r for r in at if r["method"].startswith("hf-quanto") and "kv_bytes_end" in r), None)
        for r in at:
            if "kv_bytes_end" not in r:
                lines.append(f"| {ctx} | `{r['method']}` |" + " |" * 9 + f" {r.get('skipped') or r.get('error')} |")
                continue
            full_kv = full["kv_bytes_end"] if full else r["fp16_kv_bytes"]
            lines.append(
                f"| {ctx} | `{r['method']}` | {r['kv_bytes_prefill'] / MIB:.1f} "
                f"| {r['kv_bytes_prefill'] / r['fp16_kv_bytes']:.3f} | {r['prefill_s']:.2f} "
                f"| {r['peak_prefill_bytes'] / MIB:.0f} | {r['peak_decode_bytes'] / MIB:.0f} "
                f"| {r['peak_decode_bytes'] / full_kv:.3f} | {r['decode_tokens_per_s']:.1f} | {_speedup(r, full)} "
                f"| {_speedup(r, quanto)} "
                f"| {r.get('note') or ''} |")
    return "\n".join(lines) + "\n"


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--contexts", default=DEFAULT_CONTEXTS)
    ap.add_argument("--decode", type=int, default=32)
    ap.add_argument("--methods", default=DEFAULT_METHODS)
    ap.add_argument("--dtype", default="float16", choices=["float16", "bfloat16", "float32"])
    ap.add_argument("--model", default="smollm2", help="alias, HF folder, hub id or .gguf (default smollm2)")
    ap.add_argument("--long-context", default="rope", choices=["rope", "skip"],
                    help="contexts beyond the model's positions: linear RoPE scaling (default) or skip them")
    ap.add_argument("--out", default=str(Path(__file__).parent / "results"))
    ap.add_argument("--one", help=argparse.SUPPRESS)
    ap.add_argument("--context", type=int, help=argparse.SUPPRESS)
    args = ap.parse_args()
    require_cuda()
    if args.one:
        print(json.dumps(one(args.one, args.context, args.decode, args.dtype, args.model, args.long_context)))
        return
    env = _environment()
    rows = []
    for ctx in [int(c) for c in args.contexts.split(",")]:
        for spec in args.methods.split(","):
            proc = subprocess.run([sys.executable, __file__, "--one", spec, "--context", str(ctx), "--decode",
                                   str(args.decode), "--dtype", args.dtype, "--model", args.model, "--long-context",
                                   args.long_context], capture_output=True, text=True)
            if proc.returncode != 0:
                row = {"method": spec, "context": ctx, "error": " ".join(proc.stderr.strip().splitlines()[-1:])}
            else:
                row = json.loads(proc.stdout.strip().splitlines()[-1])
            rows.append(row)
            print(json.dumps(row), file=sys.stderr, flush=True)
    text = table(rows, env, args)
    print(text)
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    device = re.sub(r"[^A-Za-z0-9]+", "-", env["device"]).strip("-").lower()
    stem = f"bench_gpu_{device}_{Path(args.model).stem}_{args.dtype}_ctx{args.contexts.replace(',', '-')}_dec{args.decode}"
    (out / f"{stem}.json").write_text(json.dumps({"environment": env, "rows": rows}, indent=1))
    (out / f"{stem}.md").write_text(text)
    print(f"wrote {out / stem}.md", file=sys.stderr)


if __name__ == "__main__":
    main()
