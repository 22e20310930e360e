"""``kvcache calibrate``: fit the calibrated KV rotations of a model on a text (math dictionary §17.7).

Writes a safetensors file for ``QuantConfig(rotation="calibrated", rotation_path=...)``. The
default text is a Gutenberg novel (Moby Dick) from ``shared/data``: never the wikitext-2 test
split the evaluation scores on, so a calibration cannot leak the test text.
"""

from __future__ import annotations

import argparse

from .calibration_args import add_calibration_args, calibration_text, check_positive

DEFAULT_TEXT = "gutenberg/pg2701.txt"
DEFAULT_TOKENS = 4096
DEFAULT_WINDOW = 1024


def add_parser(sub) -> argparse.ArgumentParser:
    """Register the ``calibrate`` subcommand on ``sub`` (an argparse subparsers object)."""
    p = sub.add_parser("calibrate", help="fit calibrated KV rotations (query-covariance eigenvectors x Hadamard)",
                       description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    add_calibration_args(p, default_text=DEFAULT_TEXT, out_help="the safetensors file to write", tokens=DEFAULT_TOKENS)
    p.add_argument("--window", type=int, default=DEFAULT_WINDOW,
                   help=f"tokens per forward pass (independent windows) [{DEFAULT_WINDOW}]")
    p.add_argument("--block", type=int, default=None,
                   help="Hadamard block size: the quantizer's channel group (e.g. 16, 32); default: the whole head")
    p.set_defaults(_run=run)
    return p


def run(args: argparse.Namespace) -> int:
    import torch

    from ..compression.rotation_file import save_calibration
    from ..plan.calibration import calibrate_rotations, calibration_meta
    from ..models import load_model

    check_positive(args, "tokens", "window")
    text_path, text = calibration_text(args.text, DEFAULT_TEXT)
    model, tok = load_model(args.model)
    ids = tok(text, return_tensors="pt").input_ids[:, : args.tokens]
    with torch.no_grad():
        tensors = calibrate_rotations(model, ids, block=args.block, window=args.window)
    meta = calibration_meta(model, text, ids.shape[1], args.block, source=text_path.name)
    out = save_calibration(args.out, tensors, meta)
    print(f"calibrated {meta['num_layers']} layers x {meta['kv_heads']} KV heads (head_dim {meta['head_dim']}) "
          f"of {args.model} on {ids.shape[1]} tokens of {text_path.name}: {out}")
    return 0
