"""``kvcache preset-scorers``: measure KVzip against KVzap in a model's presets and record the choice.

Each preset that evicts (``--targets``, default 4x, 8x and 16x) is built twice, evicting with KVzip
(a second pass over the context) and with KVzap's learned scores (the prefill's own pass), and
both run over the same calibration windows (the compressed context, then a teacher-forced
continuation). KVzap is chosen where its perplexity over the full cache's is within 0.3 points of
KVzip's and the checks stay quiet (``kv_cache.plan.preset_scorers.choose``). A preset that evicts
heavily (4-bit codes would keep under a quarter of the tokens) is also measured evicting from each
of the planner's ``HEAVY_LAYOUTS`` (K4V3, K3V2) with the chosen scorer, and the layout of lower
perplexity is recorded (``choose_layout``). The entry is written
to the record shipped with the package (``--out``), which ``kvcache eval``'s ``<r>x``, the server's
presets and ``kvcache compress --ratio`` read. The default text is *A Tale of Two Cities*: neither
the scorers' fitting text (*Pride and Prejudice*) nor an evaluation text.
"""

from __future__ import annotations

import argparse
import time

from .calibration_args import add_model, calibration_text, check_positive

DEFAULT_TEXT = "gutenberg/pg98.txt"


def add_parser(sub) -> argparse.ArgumentParser:
    """Register the ``preset-scorers`` subcommand on ``sub`` (an argparse subparsers object)."""
    from ..plan.preset_scorers import MEASURED_TARGETS

    p = sub.add_parser("preset-scorers", help="measure KVzip against KVzap in a model's presets; record the choice",
                       description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    add_model(p)
    p.add_argument("--text", default=None, help=f"calibration text file [shared/data/{DEFAULT_TEXT}]")
    p.add_argument("--targets", default=",".join(MEASURED_TARGETS), help="presets to measure [4x,8x,16x]")
    p.add_argument("--context", type=int, default=4096, help="context tokens per window [4096]")
    p.add_argument("--continuation", type=int, default=256, help="scored continuation tokens per window [256]")
    p.add_argument("--windows", type=int, default=2, help="calibration windows [2]")
    p.add_argument("--scorer", default=None,
                   help="a KVzap scorer file (`kvcache calibrate-scorer`) [the one shipped for the model]")
    p.add_argument("--reuse-kvzip", action="store_true",
                   help="take KVzip's half of each preset from the model's earlier entry (in --out's record, else the "
                        "shipped one) where it was measured on the same text, windows and plan; only KVzap runs")
    p.add_argument("--merge", action="store_true",
                   help="merge the measured presets into the model's entry (each preset row names the scorer file it "
                        "was measured with) instead of replacing the entry: a preset may use the scorer that measured "
                        "best for it")
    p.add_argument("-o", "--out", default=None,
                   help="the record to add the entry to; it must sit beside the scorer file or in a folder above it "
                        "[the shipped record, or presets.json beside --scorer]")
    p.set_defaults(_run=run)
    return p


def run(args: argparse.Namespace) -> int:
    from ..models import load_model
    from pathlib import Path

    from ..compression.scorer_file import model_identity
    from ..plan.preset_scorers import RECORD, measure, read_record, write_entry

    check_positive(args, "context", "continuation", "windows")
    if args.scorer is not None and not Path(args.scorer).is_file():
        raise FileNotFoundError(f"--scorer: no file at {args.scorer!r}")
    out = Path(args.out) if args.out else (RECORD if args.scorer is None else Path(args.scorer).parent / "presets.json")
    scorer = RECORD if args.scorer is None else Path(args.scorer).resolve()
    root = out.parent.resolve()
    if (root != RECORD.parent.resolve()) if args.scorer is None else (root not in scorer.parents):
        raise ValueError(f"--out must sit beside the scorer file or in a folder above it "
                         f"({RECORD.parent if args.scorer is None else scorer.parent}); "
                         f"got {str(out)!r}")
    path, text = calibration_text(args.text, DEFAULT_TEXT)
    model, tok = load_model(args.model)
    t0 = time.perf_counter()
    prior = None
    if args.reuse_kvzip:
        identity = model_identity(model)
        prior = next((e for rec in (out, RECORD) for e in read_record(rec) if e.get("model") == identity), None)
        if prior is None:
            print("--reuse-kvzip: no earlier entry for this model; KVzip is measured", flush=True)

    def progress(target, scorer, cost):
        print(f"  {target} {scorer:5s}: KL {cost['kl']:.4f}  ppl {100 * cost['delta_ppl']:+.2f}%"
              f"{'  (the checks warn)' if cost['warned'] else ''}", flush=True)

    entry = measure(model, tok, text, source=path.name, targets=[t.strip() for t in args.targets.split(",") if t.strip()],
                    context_tokens=args.context, continuation=args.continuation, windows=args.windows,
                    scorer_path=args.scorer, prior=prior, progress=progress)
    if args.scorer is not None:  # the record names its scorer files relative to its own folder
        entry["scorer_file"] = scorer.relative_to(root).as_posix()
    out = write_entry(entry, out, merge=args.merge)
    for target, row in entry["targets"].items():
        secs = row["seconds"]
        kvzip_s = "reused" if row.get("kvzip_reused") else f"{secs['kvzip']:.0f} s"
        layout = f", evicting from {row['layout']}" if "layout" in row else ""
        print(f"{target}: {row['scorer']}{layout} (time over the windows: KVzip {kvzip_s}, KVzap {secs['kvzap']:.0f} s)")
    print(f"measured on {entry['calibration']['windows']} windows of {path.name} in {time.perf_counter() - t0:.0f} s: {out}")
    return 0
