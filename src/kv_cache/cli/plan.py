"""``kvcache plan``: a cache plan from a byte target, measured on calibration text (math dictionary §23).

Every candidate layout (4, 3 and 2 bits, K4V3, K3V2: ``QuantConfig(bits=b)``'s defaults) is
sized to the target (with KVzip keeping the largest fraction of tokens that meets it, its bytes
predicted before any model run; ``--scorers kvzip,kvzap`` sizes KVzap's eviction too), then
scored on the calibration text by the mean next-token KL divergence from the full cache
(``--metric kl``) or by the perplexity over the full cache's (``--metric delta_ppl``); the least
costly one on which the fidelity and eviction checks stayed quiet is written as a plan file for
``CompressedCache(config, plan=CachePlan.load(path))``, ``kvcache compress --plan`` and the
method spec ``plan[<path>]``. ``--preset`` writes the documented default instead (no model run
beyond the config).

The default text is a Gutenberg novel (Pride and Prejudice) from ``shared/data``, never the
wikitext-2 test split the evaluation scores on.
"""

from __future__ import annotations

import argparse

from .calibration_args import add_model, calibration_text

DEFAULT_TEXT = "gutenberg/pg1342.txt"


def add_parser(sub) -> argparse.ArgumentParser:
    """Register the ``plan`` subcommand on ``sub`` (an argparse subparsers object)."""
    p = sub.add_parser("plan", help="a cache plan from a byte target (writes a plan file)", description=__doc__,
                       formatter_class=argparse.RawDescriptionHelpFormatter)
    add_model(p)
    target = p.add_mutually_exclusive_group(required=True)
    target.add_argument("--ratio", help="bytes target as a ratio vs an fp16 cache, e.g. 8 or 8x")
    target.add_argument("--bytes-per-token", type=float, help="bytes held per context token")
    target.add_argument("--max-bytes", type=int, help="bytes held for --context tokens")
    p.add_argument("--text", default=None, help=f"calibration text file [shared/data/{DEFAULT_TEXT}]")
    p.add_argument("--context", type=int, default=None, help="context length planned for [4096, at most half the "
                                                            "model's positions]")
    p.add_argument("--windows", type=int, default=2, help="calibration windows [2]")
    p.add_argument("--metric", default="kl", choices=["kl", "delta_ppl"],
                   help="what the choice minimizes on the calibration windows: next-token KL from the full cache, "
                        "or the perplexity over the full cache's [kl]")
    p.add_argument("--scorers", default=None,
                   help="evictions tried with each layout, comma-separated among kvzip,kvzap [kvzip]")
    p.add_argument("--kvzap-scorer", default=None, help="a KVzap scorer file (kvcache calibrate-scorer) [the one "
                                                         "shipped for the model]")
    p.add_argument("--preset", action="store_true", help="the documented default for --ratio, no measurement")
    p.add_argument("-o", "--out", required=True, help="the plan file (JSON) to write")
    p.set_defaults(_run=run)
    return p


def run(args: argparse.Namespace) -> int:
    from ..models import load_model
    from ..plan import model_preset_plan, plan_for

    if args.context is not None and args.context < 1:
        raise ValueError(f"--context must be >= 1; got {args.context}")
    if args.windows < 1:
        raise ValueError(f"--windows must be >= 1; got {args.windows}")
    if args.preset and args.ratio is None:
        raise ValueError("--preset needs --ratio (presets are ratios, e.g. --ratio 8)")
    target = None if args.ratio is None else (args.ratio if str(args.ratio).lower().endswith("x") else f"{args.ratio}x")
    text = None if args.preset else calibration_text(args.text, DEFAULT_TEXT)[1]  # before the model loads
    model, tok = load_model(args.model)
    if args.preset:
        plan = model_preset_plan(model, target, context_tokens=args.context)
    else:
        plan = plan_for(model, tok, target=target, bytes_per_token=args.bytes_per_token, max_bytes=args.max_bytes,
                        calibration_text=text, context_tokens=args.context, windows=args.windows,
                        scorers=None if args.scorers is None else [x.strip() for x in args.scorers.split(",")],
                        kvzap_scorer=args.kvzap_scorer, metric=args.metric)
        for c in plan.predicted.get("candidates", []):
            err, ev = c.get("attention_error"), c.get("evicted_attention")
            checks = "".join([f"  attn err {err:.3f}" if err is not None else "", f"  evicted attn {ev:.3f}" if ev is not None
                              else "", "  (the checks warn)" if c.get("warned") else ""])
            print(f"  {c['layout']:12s} budget {c['budget']}  {c['ratio']:.2f}x  KL {c['kl']:.4f}  "
                  f"ppl {100 * c['delta_ppl']:+.2f}%{checks}")
    plan.save(args.out)
    print(plan.describe())
    print(f"wrote {args.out}")
    return 0
