"""Which KVzap scorer predicts KVzip's scores best on a model? (issue 46, math dictionary §24)

The presets evict with KVzap (one pass, about 1.0x a plain prefill) only where it measures as
well as KVzip (two passes, 2.4-3x); on Qwen2.5 the shipped linear scorer (5 windows of 1,024
tokens, held-out R^2 0.42) loses 1.0-1.7 points at `8x` / `16x`. KVzap's paper also fits a
two-layer MLP. This probe runs KVzip's passes once over the calibration text
(:func:`kv_cache.plan.scorer_training.collect_windows`, cached in ``--pairs``), then fits every
scorer of ``--kinds`` on the same pairs (``linear``, ``static``: one constant per KV head, the
per-head static score, or ``mlp:<width>:<steps>``) and reports each
one's held-out R^2 and top-25% overlap with KVzip, the fit's seconds, and writes each scorer file
(``<out-dir>/<model>_<kind>.safetensors``), ready for ``kvcache preset-scorers --scorer``.

Run: ``python benchmarks/probe_scorer_kinds.py --model qwen2.5-0.5b --kinds linear,mlp:64:400,mlp:256:2000``;
the table goes to ``benchmarks/results/probe_scorer_kinds_<model>.md``.
"""

from __future__ import annotations

import argparse
import json
import math
import time
from pathlib import Path

import torch

from kv_cache.cli.calibration_args import calibration_text
from kv_cache.compression.scorer_file import save_scorer
from kv_cache.models import load_model
from kv_cache.plan.scorer_training import collect_windows, fit_collected

ROOT = Path(__file__).resolve().parents[1]


def parse_kind(spec: str) -> tuple[str, dict, str]:
    """``(kind, fit options, name)``: ``("mlp", {"mlp_width": 256, "mlp_steps": 2000}, "mlp256x2000")``
    from ``"mlp:256:2000"``, ``("linear", {"ridge": 0.1}, "linear_ridge0.1")`` from ``"linear:0.1"``,
    ``("linear", {}, "linear")`` from ``"linear"``."""
    parts = spec.split(":")
    if parts in (["linear"], ["static"]):
        return parts[0], {}, parts[0]
    if parts[0] == "linear" and len(parts) == 2:
        try:
            ridge = float(parts[1])
        except ValueError:
            ridge = -1.0
        if math.isfinite(ridge) and ridge >= 0:
            return "linear", {"ridge": ridge}, f"linear_ridge{parts[1]}"
    if parts[0] == "mlp" and len(parts) == 3 and all(x.isdigit() and int(x) > 0 for x in parts[1:]):
        return "mlp", {"mlp_width": int(parts[1]), "mlp_steps": int(parts[2])}, f"mlp{parts[1]}x{parts[2]}"
    raise ValueError(f"a kind is 'linear', 'linear:<ridge >= 0>', 'static' or 'mlp:<width>:<steps>' (positive ints); "
                     f"got {spec!r}")


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--model", default="qwen2.5-0.5b")
    ap.add_argument("--text", default=None, help="calibration text [shared/data/gutenberg/pg1342.txt]")
    ap.add_argument("--tokens", type=int, default=16384)
    ap.add_argument("--window", type=int, default=2048)
    ap.add_argument("--samples-per-window", type=int, default=1024)
    ap.add_argument("--kinds", default="linear,mlp:64:400,mlp:256:2000")
    ap.add_argument("--pairs", default=None, help="cache of the KVzip passes' pairs (.pt) [runs/scorer_pairs_<model>.pt]")
    ap.add_argument("--out-dir", default=str(ROOT / "runs" / "scorer_kinds"))
    ap.add_argument("--results", default=str(ROOT / "benchmarks" / "results"))
    args = ap.parse_args()
    kinds = [parse_kind(k.strip()) for k in args.kinds.split(",") if k.strip()]
    text_path, text = calibration_text(args.text, "gutenberg/pg1342.txt")
    model, tok = load_model(args.model)
    pairs_path = Path(args.pairs or ROOT / "runs" / f"scorer_pairs_{args.model}_{args.tokens}_{args.window}.pt")
    if pairs_path.is_file():
        pairs = torch.load(pairs_path)
        collect_s = pairs.pop("collect_seconds", float("nan"))
    else:
        t0 = time.perf_counter()
        pairs = collect_windows(model, tok, text, tokens=args.tokens, window=args.window,
                                max_tokens_per_window=args.samples_per_window,
                                progress=lambda i, n: print(f"  window {i}/{n} scored", flush=True))
        collect_s = time.perf_counter() - t0
        pairs_path.parent.mkdir(parents=True, exist_ok=True)
        torch.save({**pairs, "collect_seconds": collect_s}, pairs_path)
    out_dir = Path(args.out_dir)
    out_dir.mkdir(parents=True, exist_ok=True)
    rows = []
    for kind, options, name in kinds:
        t0 = time.perf_counter()
        scorer = fit_collected(model, text, pairs, kind=kind, source=text_path.name, **options)
        path = out_dir / f"{args.model}_{name}.safetensors"
        save_scorer(path, scorer)
        row = {"kind": name, "r2": scorer.info["mean_held_out_r2"],
               "top25": scorer.info["mean_held_out_top25_overlap"], "fit_s": time.perf_counter() - t0,
               "file": str(path)}
        print(json.dumps(row), flush=True)
        rows.append(row)
    lines = [f"# KVzap scorer kinds on {args.model}", "",
             f"KVzip's scores on {pairs['windows']} windows of {pairs['window']} tokens of {text_path.name} "
             f"({pairs['samples_per_window']} tokens drawn per window; the last window held out; the passes took "
             f"{collect_s:.0f} s), every kind fitted on the same pairs. Produced by "
             "`benchmarks/probe_scorer_kinds.py`.", "",
             "| scorer | held-out R^2 (mean over layers) | top-25% overlap with KVzip | fit (s) |", "|---|---|---|---|"]
    lines += [f"| `{r['kind']}` | {r['r2']:.3f} | {r['top25']:.3f} | {r['fit_s']:.1f} |" for r in rows]
    results = Path(args.results)
    results.mkdir(parents=True, exist_ok=True)
    defaults = (ap.get_default("tokens"), ap.get_default("samples_per_window"))
    size = "" if (args.tokens, args.samples_per_window) == defaults else f"_{pairs['tokens']}x{args.samples_per_window}"
    (results / f"probe_scorer_kinds_{args.model}{size}.md").write_text("\n".join(lines) + "\n")
    print("\n".join(lines))


if __name__ == "__main__":
    main()
