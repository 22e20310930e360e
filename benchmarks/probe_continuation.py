"""KVzip with and without the continuation score (math dictionary §19.7; issue 27).

For each model, continuation perplexity over the full cache (``PREFIX`` tokens prefilled and
compressed, the next 256 scored, float32) on calibration windows of two novels that no held-out
check uses (*Pride and Prejudice*, pg1342, and *A Tale of Two Cities*, pg98: ``--windows`` evenly
spaced windows each) and on the golden test's held-out *Moby Dick* window
(``tests/test_golden_families.py``), for ``kvzip@0.25`` and the ``8x`` / ``16x`` presets, each with
the reconstruction score alone (``continuation_queries=0``) and with the continuation score of
the prompt's last 96 queries (what the presets use).

Run: ``python benchmarks/probe_continuation.py --models smollm2,qwen2.5-0.5b --windows 3``.
Writes ``benchmarks/results/probe_continuation.md``.
"""

from __future__ import annotations

import argparse
import dataclasses
import math
import sys
import time
from pathlib import Path

import torch

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT / "tests"))

import test_golden_families as golden  # noqa: E402

import kv_cache  # noqa: E402
from kv_cache import CompressedCache, KVzip  # noqa: E402
from kv_cache.context import forward_at  # noqa: E402
from kv_cache.models import load_model, shared_data_dir  # noqa: E402
from kv_cache.plan import preset_plan  # noqa: E402
from kv_cache.plan.planner import CONTINUATION_QUERIES  # noqa: E402

P, S = golden.PREFIX, golden.SCORED
NOVELS = ("pg1342.txt", "pg98.txt")


def calibration_windows(tok, per_novel: int) -> list[torch.Tensor]:
    out = []
    for name in NOVELS:
        text = (shared_data_dir() / "gutenberg" / name).read_text(encoding="utf-8").replace("\r\n", "\n")
        for j in range(per_novel):
            start = int(len(text) * (0.2 + 0.6 * j / max(1, per_novel - 1)))
            out.append(torch.tensor([tok(text[start:start + 12000]).input_ids[:P + S]]))
    return out


def ppl(model, tok, ids: torch.Tensor, cache) -> float:
    with torch.no_grad(), kv_cache.compress(model, cache):
        last, _ = kv_cache.prefill(model, cache, ids[:, :P], tokenizer=tok, last_only=True)
        cont = forward_at(model, cache, ids[:, P:-1], P)
    logits = torch.cat([last[:, -1:].float(), cont], 1)[0]
    return math.exp(float(torch.nn.functional.cross_entropy(logits, ids[0, P:])))


def caches(config, n: int) -> dict:
    def preset(target):
        plan = preset_plan(config, target, context_tokens=P)
        return dataclasses.replace(plan, policy=dataclasses.replace(plan.policy, continuation_queries=n))
    return {"kvzip@0.25": lambda: CompressedCache(config, eviction=KVzip(budget=0.25, continuation_queries=n)),
            "8x": lambda: CompressedCache(config, plan=preset("8x")),
            "16x": lambda: CompressedCache(config, plan=preset("16x"))}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--models", default="smollm2,qwen2.5-0.5b")
    ap.add_argument("--windows", type=int, default=3, help="calibration windows per novel")
    args = ap.parse_args()
    rows = []
    for alias in args.models.split(","):
        model, tok = load_model(alias)
        wins = calibration_windows(tok, args.windows)
        held = golden._window(tok)
        fulls = [ppl(model, tok, w, CompressedCache(model.config)) for w in wins]
        full_held = ppl(model, tok, held, CompressedCache(model.config))
        for n in (0, CONTINUATION_QUERIES):
            for name, make in caches(model.config, n).items():
                t = time.time()
                ds = [ppl(model, tok, w, make()) / f - 1 for w, f in zip(wins, fulls)]
                dh = ppl(model, tok, held, make()) / full_held - 1
                rows.append((alias, name, n, sum(ds) / len(ds), max(ds), dh))
                print(alias, name, n, f"{sum(ds) / len(ds):+.2%} {dh:+.2%} ({time.time() - t:.0f}s)", flush=True)
    lines = ["# KVzip's continuation score (math dictionary §19.7, issue 27)", "",
             f"`python benchmarks/probe_continuation.py --models {args.models} --windows {args.windows}`: "
             f"continuation perplexity over the full cache, {P} tokens compressed and {S} scored, float32; "
             f"calibration windows: {args.windows} each of *Pride and Prejudice* (pg1342) and *A Tale of Two "
             "Cities* (pg98); held out: the golden test's *Moby Dick* window. `n`: `continuation_queries` "
             "(0: the reconstruction score alone).", "",
             "| model | cache | n | Δppl, novels (mean) | Δppl, novels (worst) | Δppl, *Moby Dick* (held out) |",
             "|---|---|---|---|---|---|"]
    for alias, name, n, mean, worst, dh in rows:
        lines.append(f"| {alias} | `{name}` | {n} | {mean:+.2%} | {worst:+.2%} | {dh:+.2%} |")
    out = ROOT / "benchmarks" / "results" / "probe_continuation.md"
    out.write_text("\n".join(lines) + "\n")
    print(f"wrote {out}")


if __name__ == "__main__":
    main()
