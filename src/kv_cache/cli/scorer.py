"""``kvcache calibrate-scorer``: fit a KVzap scorer of a model on a text (math dictionary §24).

Runs KVzip's reconstruction scores on windows of the text and fits one small model per
full-attention layer that predicts them from the hidden states (``--kind linear`` or ``mlp``);
the last window is held out and its fit quality is printed and recorded in the file. The file
is a safetensors file with a checked header (model identity, format version, sha256 of the
header and of every tensor): ``KVzap(scorer=path)`` or the spec ``kvzap@0.25[path]`` use it,
and refuse it for another model. The default text is a Gutenberg novel from ``shared/data``,
never the wikitext-2 test split the evaluation scores on.
"""

from __future__ import annotations

import argparse
import time
from pathlib import Path

from .calibration_args import add_calibration_args, calibration_text, check_positive

DEFAULT_TEXT = "gutenberg/pg1342.txt"
DEFAULT_TOKENS = 16384
DEFAULT_WINDOW = 2048


def add_parser(sub) -> argparse.ArgumentParser:
    """Register the ``calibrate-scorer`` subcommand on ``sub`` (an argparse subparsers object)."""
    from ..compression.scorer import KINDS

    p = sub.add_parser("calibrate-scorer", help="fit a KVzap scorer (KVzip's scores predicted from hidden states)",
                       description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    add_calibration_args(p, default_text=DEFAULT_TEXT, out_help="the safetensors file to write", tokens=DEFAULT_TOKENS)
    p.add_argument("--kind", default="linear", choices=KINDS, help="scorer per layer [linear]")
    p.add_argument("--window", type=int, default=DEFAULT_WINDOW,
                   help=f"tokens per window (one prefill + KVzip pass each; the last is held out) [{DEFAULT_WINDOW}]")
    p.add_argument("--samples-per-window", type=int, default=1024,
                   help="tokens per window kept for the fit (drawn with --seed) [1024]")
    p.add_argument("--seed", type=int, default=0, help="seed of the token draw and of the mlp's initialisation [0]")
    p.add_argument("--mlp-width", type=int, default=64, help="the mlp's hidden width (--kind mlp) [64]")
    p.add_argument("--mlp-steps", type=int, default=400, help="the mlp's Adam steps (--kind mlp) [400]")
    p.add_argument("--ridge", type=float, default=None,
                   help="the ridge penalty per token on standardised inputs (--kind linear) [1e-3]")
    p.set_defaults(_run=run)
    return p


def run(args: argparse.Namespace) -> int:
    from ..compression.scorer import RIDGE, check_ridge
    from ..compression.scorer_file import save_scorer
    from ..models import load_model
    from ..plan.scorer_training import fit_scorer

    check_positive(args, "mlp_width", "mlp_steps")
    if args.ridge is not None and args.kind != "linear":
        raise ValueError(f"--ridge sets the linear scorer's penalty; got --kind {args.kind!r} (use --kind linear or drop --ridge)")
    ridge = RIDGE if args.ridge is None else check_ridge(args.ridge, "--ridge")
    text_path, text = calibration_text(args.text, DEFAULT_TEXT)
    out = Path(args.out)
    if not out.parent.is_dir():
        raise FileNotFoundError(f"--out: no directory {str(out.parent)!r}")
    model, tok = load_model(args.model)
    t0 = time.perf_counter()
    scorer = fit_scorer(model, tok, text, kind=args.kind, tokens=args.tokens, window=args.window,
                        max_tokens_per_window=args.samples_per_window, seed=args.seed, source=text_path.name,
                        mlp_width=args.mlp_width, mlp_steps=args.mlp_steps, ridge=ridge,
                        progress=lambda i, n: print(f"  window {i}/{n} scored", flush=True))
    save_scorer(out, scorer)
    info = scorer.info
    print(f"fitted {args.kind} scorers for {len(scorer.layers)} layers of {args.model} on {info['windows']} windows of "
          f"{args.window} tokens of {text_path.name} in {time.perf_counter() - t0:.0f} s: held-out R^2 "
          f"{info['mean_held_out_r2']:.3f}, top-25% overlap with KVzip {info['mean_held_out_top25_overlap']:.3f}: {out}")
    return 0
