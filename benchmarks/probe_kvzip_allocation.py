"""Who gets KVzip's tokens inside a preset: one model-wide top-k, or every head its floor first.

The ``8x`` / ``16x`` presets are 4-bit codes plus ``KVzip(budget=b, target_ratio=r)``: one top-k
over the reconstruction scores of every head of every layer (``scope="model"``, the paper's
choice, math dictionary §19.1), grown from the planner's floor ``b`` to the measured bytes of
the ratio (§19.6). This probe holds the bytes fixed (the same ratio) and changes only who gets
the tokens:

* ``model``: the preset as shipped (``head_floor=0``);
* ``floor``: every KV head first keeps its own best ``b`` tokens (``head_floor=1.0``), then
  the tokens the ratio still allows go to the best scores model-wide;
* ``--floors 0,0.25,0.5,1`` adds the steps between: every head first keeps ``f * b`` tokens.

Each row is a window: ``--prefix`` tokens prefilled and compressed, the next 256 scored, against
the full cache of the same window. Windows: the golden tests' Moby Dick window (pg2701, held
out; 768 tokens) and wikitext windows (``--wikitext-offsets``, characters into the test set).

Run: ``python benchmarks/probe_kvzip_allocation.py --models smollm2,qwen2.5-0.5b
[--prefix 768] [--text moby|wikitext] [--presets 8x,16x] [--floors 0,1]``; results go to
``benchmarks/results/probe_kvzip_allocation_<text>_ctx<prefix>.{json,md}``.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import math
import time
import warnings
from pathlib import Path

import torch

import kv_cache
from kv_cache import CompressedCache
from kv_cache.context import forward_at
from kv_cache.models import load_model, shared_data_dir
from kv_cache.plan import preset_plan

SCORED = 256


def variant_name(floor: float) -> str:
    """``model`` (the preset as shipped), ``floor`` (every head its floor first) or ``floor<f>``."""
    return "model" if floor == 0 else "floor" if floor == 1 else f"floor{floor:g}"


def column(floor: float) -> str:
    return {0: "model-wide", 1: "every head its floor first"}.get(floor, f"every head {floor:g} of its floor first")


def windows(tok, text: str, prefix: int, offsets: list[int]) -> list[torch.Tensor]:
    """``[1, prefix + SCORED]`` token windows of the chosen text."""
    if text == "moby":
        raw = (shared_data_dir() / "gutenberg" / "pg2701.txt").read_text(encoding="utf-8").replace("\r\n", "\n")
        starts = [raw.index("CHAPTER 1. Loomings.")]
    else:
        raw = (shared_data_dir() / "wikitext-2-raw" / "wiki.test.raw").read_text(encoding="utf-8")
        starts = offsets
    out = []
    for s in starts:
        ids = tok(raw[s:s + 12 * (prefix + SCORED)]).input_ids[:prefix + SCORED]
        if len(ids) < prefix + SCORED:
            raise ValueError(f"the text at offset {s} holds fewer than {prefix + SCORED} tokens")
        out.append(torch.tensor([ids]))
    return out


def perplexity(model, tok, ids: torch.Tensor, prefix: int, cache) -> tuple[float, float]:
    """(perplexity of the scored tokens, the cache's ratio vs fp16 after the prefill)."""
    with torch.no_grad(), kv_cache.compress(model, cache):
        last, _ = kv_cache.prefill(model, cache, ids[:, :prefix], tokenizer=tok, last_only=True)
        ratio = cache.memory_report().ratio
        cont = forward_at(model, cache, ids[:, prefix:-1], prefix)
    logits = torch.cat([last[:, -1:].float(), cont], 1)[0]
    return math.exp(float(torch.nn.functional.cross_entropy(logits, ids[0, prefix:]))), ratio


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--models", default="smollm2,qwen2.5-0.5b")
    ap.add_argument("--prefix", type=int, default=768)
    ap.add_argument("--text", choices=("moby", "wikitext"), default="moby")
    ap.add_argument("--wikitext-offsets", default="0")
    ap.add_argument("--presets", default="8x,16x")
    ap.add_argument("--floors", default="0,1", help="head_floor values (fractions of the floor b) [0,1]")
    ap.add_argument("--out", default=str(Path(__file__).resolve().parent / "results"))
    args = ap.parse_args()
    floors = [float(f) for f in args.floors.split(",")]
    if not floors or any(not 0 <= f <= 1 for f in floors):
        raise ValueError(f"--floors must be fractions in [0, 1]; got {args.floors!r}")
    warnings.simplefilter("ignore")  # the fidelity check's warnings are not what is measured here
    rows = []
    for alias in args.models.split(","):
        model, tok = load_model(alias)
        for w, ids in enumerate(windows(tok, args.text, args.prefix, [int(x) for x in args.wikitext_offsets.split(",")])):
            full, _ = perplexity(model, tok, ids, args.prefix, CompressedCache(model.config))
            for preset in args.presets.split(","):
                plan = preset_plan(model.config, preset, context_tokens=args.prefix)
                for floor in floors:
                    name = variant_name(floor)
                    policy = dataclasses.replace(plan.policy, head_floor=floor)
                    t0 = time.perf_counter()
                    ppl, ratio = perplexity(model, tok, ids, args.prefix,
                                            CompressedCache(model.config, quant=plan.quant_config(), eviction=policy))
                    quant = plan.quant_config()
                    row = {"model": alias, "window": w, "preset": preset, "allocation": name,
                           "layout": f"K{quant.key_bits or quant.bits}V{quant.value_bits or quant.bits}",
                           "floor_budget": plan.policy.budget, "ratio": ratio, "ppl": ppl, "full_ppl": full,
                           "delta": ppl / full - 1, "seconds": time.perf_counter() - t0}
                    print(json.dumps(row), flush=True)
                    rows.append(row)
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    stem = out / (f"probe_kvzip_allocation_{args.text}_ctx{args.prefix}"
                  + ("" if floors == [0.0, 1.0] else "_floors" + "_".join(f"{f:g}".replace(".", "p") for f in floors)))
    stem.with_suffix(".json").write_text(json.dumps({"args": vars(args), "rows": rows}, indent=1) + "\n")
    lines = [f"# KVzip's allocation inside the presets ({args.text}, {args.prefix} tokens compressed, "
             f"{SCORED} scored)", "",
             "| model | window | preset | codes | floor b | "
             + " | ".join(f"{column(f)}: ratio, Δppl" for f in floors) + " |",
             "|---|---|---|---|---|" + "---|" * len(floors)]
    for i in range(0, len(rows), len(floors)):
        a = rows[i]
        lines.append(f"| {a['model']} | {a['window']} | `{a['preset']}` | {a['layout']} | {a['floor_budget']} | "
                     + " | ".join(f"{b['ratio']:.2f}x, {b['delta']:+.2%}" for b in rows[i:i + len(floors)]) + " |")
    lines += ["", "Produced by `benchmarks/probe_kvzip_allocation.py` "
              f"`--models {args.models} --prefix {args.prefix} --text {args.text} --presets {args.presets}`"
              + ("" if floors == [0.0, 1.0] else f" `--floors {args.floors}`")
              + (f" `--wikitext-offsets {args.wikitext_offsets}`" if args.text == "wikitext" else "")
              + ". Ratio: the cache's bytes after the prefill against fp16; Δppl against the full cache of the "
              "same window.", ""]
    stem.with_suffix(".md").write_text("\n".join(lines))
    print(f"wrote {stem}.{{json,md}}")


if __name__ == "__main__":
    main()
