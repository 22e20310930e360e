"""Probe: calibrated (query-covariance eigenvectors x Hadamard) vs random Hadamard rotations.

A feasibility probe in the style of ``shared/notes/lowbit-probe.md``, not an evaluation: the
prefix of each window is prefilled with the full cache, every stored key and value of the
prefix is replaced by its rotate -> quantize -> dequantize -> rotate-back round trip (fake
quantization, norm-only Lloyd-Max levels, fp16 norms), and the next-token NLL of a full-
precision continuation is scored. Calibration text: a Gutenberg novel (Moby Dick), never the
wikitext-2 test split scored here.

Usage (single thread, a few minutes on one CPU core)::

    python benchmarks/probe_calibrated_rotation.py [--windows 3] [--prefix 1792] [--cont 256]
"""

from __future__ import annotations

import argparse
import copy
import json
import math
import time

import torch

from kv_cache.plan.calibration import query_covariances
from kv_cache.compression.codebook import dequantize_norm_codebook, quantize_norm_codebook
from kv_cache.compression.rotation import RandomizedHadamard, calibrated_rotation
from kv_cache.models import load_model, shared_data_dir


def lm_roundtrip(x: torch.Tensor, bits: int, group: int) -> torch.Tensor:
    codes, scale = quantize_norm_codebook(x, bits, group_size=group)
    return dequantize_norm_codebook(codes, scale.half().float(), bits)


def fake_quant(cache, rots: tuple[dict, dict], kb: int, vb: int, group: int) -> None:
    """Replace each layer's keys/values [1, h, n, d] by their rotated LM round trip (in place);
    ``rots``: (key rotations, value rotations), layer -> [h, d, d]."""
    for i, layer in enumerate(cache.layers):
        for name, bits, R in (("keys", kb, rots[0][i]), ("values", vb, rots[1][i])):
            x = getattr(layer, name).float()
            y = lm_roundtrip(x @ R.unsqueeze(0), bits, group) @ R.transpose(-1, -2).unsqueeze(0)
            getattr(layer, name).copy_(y.to(getattr(layer, name).dtype))


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--windows", type=int, default=3)
    ap.add_argument("--prefix", type=int, default=1792)
    ap.add_argument("--cont", type=int, default=256)
    ap.add_argument("--calib-tokens", type=int, default=4096)
    ap.add_argument("--out", default=None, help="write the numbers as JSON here")
    args = ap.parse_args()
    torch.set_num_threads(1)
    model, tok = load_model("smollm2")
    cfg = model.config
    L, H, d = cfg.num_hidden_layers, cfg.num_key_value_heads, cfg.hidden_size // cfg.num_attention_heads
    data = shared_data_dir()
    t0 = time.time()
    calib = (data / "gutenberg/pg2701.txt").read_text().replace("\r\n", "\n")
    cids = tok(calib, return_tensors="pt").input_ids[:, : args.calib_tokens]
    covs, ntok = query_covariances(model, cids, window=1024)
    t_cal = time.time() - t0
    had = {i: torch.stack([RandomizedHadamard.for_head(d, i, h).matrix() for h in range(H)]) for i in range(L)}
    cal = {i: calibrated_rotation(covs[i]).float() for i in range(L)}
    cal16 = {i: calibrated_rotation(covs[i], 16).float() for i in range(L)}
    schemes = {  # name: ((key rotations, value rotations), key bits, value bits, channels per norm)
        "hadamard LM2 c64": ((had, had), 2, 2, 64),
        "calibrated LM2 c64": ((cal, cal), 2, 2, 64),
        "calibrated K, hadamard V, LM2 c64": ((cal, had), 2, 2, 64),
        "hadamard K3V2 c64": ((had, had), 3, 2, 64),
        "calibrated K3V2 c64": ((cal, cal), 3, 2, 64),
        "hadamard LM2 c16": ((had, had), 2, 2, 16),
        "calibrated(b16) LM2 c16": ((cal16, cal16), 2, 2, 16),
        "calibrated(b16) K, hadamard V, LM2 c16": ((cal16, had), 2, 2, 16),
    }
    text = (data / "wikitext-2-raw/wiki.test.raw").read_text().replace("\r\n", "\n")
    ids = tok(text, return_tensors="pt").input_ids
    span = args.prefix + args.cont
    nll: dict[str, list[float]] = {"full": [], **{k: [] for k in schemes}}
    for w in range(args.windows):
        s = 5000 + w * 3 * span  # spread over the split, away from its first article
        win = ids[:, s:s + span]
        with torch.no_grad():
            out = model(win[:, : args.prefix - 1], use_cache=True)
            base = out.past_key_values
            feed, target = win[:, args.prefix - 1: -1], win[:, args.prefix:]
            for name in nll:
                cache = copy.deepcopy(base)
                if name != "full":
                    fake_quant(cache, *schemes[name])
                logits = model(feed, past_key_values=cache, use_cache=True).logits.float()
                nll[name].append(float(torch.nn.functional.cross_entropy(logits[0], target[0])))
        print(f"window {w}: " + ", ".join(f"{k} {v[-1]:.4f}" for k, v in nll.items()), flush=True)
    mean = {k: sum(v) / len(v) for k, v in nll.items()}
    print(f"\ncalibration: {ntok} tokens of pg2701 in {t_cal:.0f}s; {args.windows} wikitext-2 test windows, "
          f"prefix {args.prefix}, continuation {args.cont}")
    print("| scheme | mean NLL | ppl | Δppl vs full |\n|---|---|---|---|")
    for k, v in mean.items():
        print(f"| {k} | {v:.4f} | {math.exp(v):.3f} | {100 * (math.exp(v - mean['full']) - 1):+.1f}% |")
    if args.out:
        with open(args.out, "w") as f:
            json.dump({"nll": nll, "mean": mean, "calib_tokens": ntok}, f, indent=1)


if __name__ == "__main__":
    main()
