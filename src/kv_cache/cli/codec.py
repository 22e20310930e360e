"""``kvcache calibrate-codec``: fit a model's storage-codec basis on calibration text (math
dictionary §27.1).

The model reads windows of the calibration texts in full precision; per layer, KV head and
K / V, the PCA of the cached vectors (keys after RoPE, as cached; with ``--keys-before-rope``
turned back by their positions first) is written to a safetensors
file with a checked header (model identity, texts and their sha256, sha256 of every tensor).
``.kvc`` files coded with it name it by its fingerprint; a basis in ``$KV_CACHE_HOME/codecs``
(the default output) or shipped in the package is found by it. The default texts are the
Gutenberg novels of ``shared/data`` other than *Moby Dick* (pg2701): held-out checks score on it.
"""

from __future__ import annotations

import argparse
import time
from pathlib import Path

from .calibration_args import add_model, read_text_file


def add_parser(sub) -> argparse.ArgumentParser:
    """Register ``calibrate-codec`` on ``sub`` (an argparse subparsers object)."""
    p = sub.add_parser("calibrate-codec", help="fit the storage codec's per-model basis (PCA of cached K/V)",
                       description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    add_model(p)
    p.add_argument("--text", action="append", default=None,
                   help="calibration text file (repeat for several) [the Gutenberg novels but Moby Dick]")
    p.add_argument("-o", "--out", default=None,
                   help="the safetensors file to write [$KV_CACHE_HOME/codecs/<model>.safetensors]")
    p.add_argument("--tokens", type=int, default=16384, help="tokens of text in all [16384]")
    p.add_argument("--window", type=int, default=2048, help="tokens per prefill window [2048]")
    p.add_argument("--keys-before-rope", action="store_true",
                   help="fit the key bases on keys turned back by their positions (math dictionary §27.6)")
    p.set_defaults(_run=run)
    return p


def run(args: argparse.Namespace) -> int:
    from ..codec.basis_file import save_basis
    from ..plan.codec_calibration import default_texts, fit_codec_basis
    from ..compression.scorer_file import model_identity
    from ..models import load_model
    from ..models.paths import default_cache_dir

    if args.text:
        texts = []
        for t in args.text:
            texts.append((Path(t).name, read_text_file(t)))
    else:
        texts = default_texts()
    out = Path(args.out) if args.out else default_cache_dir() / "codecs" / f"{Path(str(args.model)).name}.safetensors"
    out.parent.mkdir(parents=True, exist_ok=True)
    model, tok = load_model(args.model)
    t0 = time.perf_counter()
    layers, info = fit_codec_basis(model, tok, texts, tokens=args.tokens, window=args.window,
                                   progress=lambda i, n: print(f"  window {i}/{n}", flush=True),
                                   keys_before_rope=args.keys_before_rope)
    fingerprint = save_basis(out, layers, model_identity(model), info)
    print(f"fitted the codec basis of {len(layers)} layers of {args.model} on {info['tokens']:,} tokens "
          f"({', '.join(t['text'] for t in info['texts'])}) in {time.perf_counter() - t0:.0f} s: {out} "
          f"(fingerprint {fingerprint[:16]})")
    return 0
