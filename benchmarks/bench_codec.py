"""Encode and decode time of transform-coded context files against a plain prefill of the same
tokens (issue 30's speed target: decoding a 4K-token file in <= 0.1x its prefill).

For each context length (default 1,792 and 4,096 tokens of wikitext-2) and file ratio, in one
process and in this order, ``--repeats`` times: a plain prefill (a full-precision
:class:`~kv_cache.CompressedCache`, no eviction), the KVzip prefill at the budget the file uses,
the save through the codec (encode), the load (decode: the file read, checked and decoded into
the cache). Each figure is the median over the repeats; the ratios are taken against the plain
prefill of the same run. The machine is shared and noisy: compare ratios, not seconds.

Run: ``python benchmarks/bench_codec.py [--model smollm2] [--contexts 1792,4096]
[--files kvzip@0.5+file10,kvzip@0.25+file20,kvzip@0.1+file40] [--repeats 3] [--out docs/results/]``
"""

from __future__ import annotations

import argparse
import json
import statistics
import tempfile
import time
from pathlib import Path

import torch


def main() -> int:
    from kv_cache import CompressedCache, KVzip
    from kv_cache.cache.report import fp16_kv_bytes
    from kv_cache.cache.serialize import load_cache, save_cache
    from kv_cache.codec import basis_for_model
    from kv_cache.context import prefill
    from kv_cache.models import load_model, shared_data_dir

    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--model", default="smollm2")
    ap.add_argument("--contexts", default="1792,4096")
    ap.add_argument("--files", default="kvzip@0.5+file10,kvzip@0.25+file20,kvzip@0.1+file40")
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--out", default="docs/results/")
    args = ap.parse_args()
    if args.repeats < 1:
        raise SystemExit(f"--repeats must be >= 1; got {args.repeats}")
    files = []
    for spec in args.files.split(","):
        ev, _, f = spec.partition("+file")
        if not ev.startswith("kvzip@") or not f:
            raise SystemExit(f"--files: each entry is kvzip@<budget>+file<R>; got {spec!r}")
        files.append((spec, float(ev.removeprefix("kvzip@")), float(f)))
    model, tok = load_model(args.model)
    basis = basis_for_model(model)
    if basis is None:
        raise SystemExit(f"no codec basis for {args.model}: kvcache calibrate-codec --model {args.model}")
    text = (shared_data_dir() / "wikitext-2-raw" / "wiki.test.raw").read_text(encoding="utf-8")
    ids_all = tok(text[:200000], add_special_tokens=False)["input_ids"]
    rows = []
    for T in (int(t) for t in args.contexts.split(",")):
        ids = torch.tensor([ids_all[:T]])
        for spec, budget, ratio in files:
            plain, kvzip, enc, dec, size = [], [], [], [], 0
            for _ in range(args.repeats):
                t0 = time.perf_counter()
                with torch.no_grad():
                    prefill(model, CompressedCache(model.config), ids, last_only=True)
                plain.append(time.perf_counter() - t0)
                cache = CompressedCache(model.config, eviction=KVzip(budget=budget))
                t0 = time.perf_counter()
                with torch.no_grad():
                    prefill(model, cache, ids, tokenizer=tok, last_only=True)
                kvzip.append(time.perf_counter() - t0)
                with tempfile.TemporaryDirectory() as d:
                    t0 = time.perf_counter()
                    size = save_cache(cache, Path(d) / "c.kvc", model_config=model.config, codec=basis,
                                      file_bytes=int(fp16_kv_bytes(model.config, T) / ratio))
                    enc.append(time.perf_counter() - t0)
                    t0 = time.perf_counter()
                    load_cache(Path(d) / "c.kvc", model_config=model.config, codec=basis)
                    dec.append(time.perf_counter() - t0)
            med = {k: statistics.median(v) for k, v in
                   (("plain_prefill_s", plain), ("kvzip_prefill_s", kvzip), ("encode_s", enc), ("decode_s", dec))}
            row = {"tokens": T, "file": spec, "file_bytes": size, "file_ratio": fp16_kv_bytes(model.config, T) / size,
                   **med, "encode_over_prefill": med["encode_s"] / med["plain_prefill_s"],
                   "decode_over_prefill": med["decode_s"] / med["plain_prefill_s"]}
            rows.append(row)
            print(json.dumps(row), flush=True)
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    stem = f"codec_speed_{args.model}"
    (out / f"{stem}.json").write_text(json.dumps({"model": args.model, "repeats": args.repeats, "rows": rows}, indent=1))
    lines = ["| tokens | file | file bytes | ratio vs fp16 | plain prefill s | KVzip prefill s | encode s | decode s "
             "| encode / prefill | decode / prefill |", "|---|---|---|---|---|---|---|---|---|---|"]
    for r in rows:
        lines.append(f"| {r['tokens']:,} | `{r['file']}` | {r['file_bytes']:,} | {r['file_ratio']:.1f}x | "
                     f"{r['plain_prefill_s']:.2f} | {r['kvzip_prefill_s']:.2f} | {r['encode_s']:.2f} | {r['decode_s']:.2f} | "
                     f"{r['encode_over_prefill']:.2f}x | {r['decode_over_prefill']:.3f}x |")
    (out / f"{stem}.md").write_text("\n".join(lines) + "\n")
    print("\n".join(lines))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
