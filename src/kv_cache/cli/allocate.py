"""``kvcache allocate``: bits per layer for keys and values under an average budget (math dictionary §20).

Measures, on a calibration text, what quantizing each layer's keys or values at each width
costs (the next-token KL against the full cache, one layer half at a time), then picks the
widths that minimize the summed cost at the requested mean width (an exact dynamic program).
Writes a JSON profile for ``QuantConfig(layer_bits=load_bit_profile(path))`` or the method-spec
letter ``p[<path>]``, e.g. ``kvcache eval --methods "q3g4r4s4htc64lfp[alloc.json]"``.

The default text is a Gutenberg novel (Moby Dick) from ``shared/data``, never the wikitext-2
test split the evaluation scores on.
"""

from __future__ import annotations

import argparse

from .calibration_args import add_calibration_args, calibration_text, check_positive

DEFAULT_TEXT = "gutenberg/pg2701.txt"


def add_parser(sub) -> argparse.ArgumentParser:
    """Register the ``allocate`` subcommand on ``sub`` (an argparse subparsers object)."""
    p = sub.add_parser("allocate", help="choose key/value bits per layer under an average budget (writes a profile)",
                       description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    add_calibration_args(p, default_text=DEFAULT_TEXT, out_help="the JSON profile to write")
    p.add_argument("--layout", default="q3g4r4s4htc64lf",
                   help="our quantization spec whose layout is measured (its bits are replaced by each "
                        "choice) [q3g4r4s4htc64lf]")
    p.add_argument("--average-bits", type=float, required=True,
                   help="mean code width over every layer's keys and values (metadata comes on top)")
    p.add_argument("--choices", default="2,3,4", help="widths to choose from [2,3,4]")
    p.add_argument("--windows", type=int, default=2, help="calibration windows [2]")
    p.add_argument("--prefix", type=int, default=1792, help="cached tokens per window [1792]")
    p.add_argument("--continuation", type=int, default=256, help="scored tokens per window [256]")
    p.add_argument("--costs-from", default=None,
                   help="reuse the measured costs of an earlier profile (same model, layout and choices) "
                        "instead of measuring again: another budget costs no model run")
    p.set_defaults(_run=run)
    return p


def run(args: argparse.Namespace) -> int:
    import torch

    from ..plan.bit_allocation import allocate_bits, layer_bits_from_allocation, save_bit_profile
    from ..compression.rotation_file import model_shapes, text_sha256
    from ..plan.sensitivity import measure_bit_costs
    from ..spec import parse_quant
    from ..models import load_model

    check_positive(args, "windows", "prefix", "continuation")
    try:
        choices = tuple(int(c) for c in args.choices.split(","))
    except ValueError:
        raise ValueError(f"--choices must be comma-separated integers, e.g. 2,3,4; got {args.choices!r}") from None
    quant = parse_quant(args.layout)
    if quant.layer_bits:
        raise ValueError(f"--layout is the layout to measure; it must not carry a profile (p[...]); got {args.layout!r}")
    if args.costs_from:
        costs, meta = _reuse_costs(args.costs_from, args.layout, choices, args.model)
    else:
        text_path, text = calibration_text(args.text, DEFAULT_TEXT)
        model, tok = load_model(args.model)
        span = args.prefix + args.continuation
        ids = tok(text, return_tensors="pt").input_ids[0]
        if ids.numel() < span * args.windows:
            raise ValueError(f"--text has {ids.numel()} tokens; {args.windows} windows of {span} need "
                             f"{span * args.windows}")
        windows = [ids[i * span:(i + 1) * span] for i in range(args.windows)]
        costs = measure_bit_costs(model, windows, quant, choices, args.prefix)
        meta = {"model": {**model_shapes(model.config), "name": args.model}, "layout": args.layout,
                "quant": repr(quant), "choices": list(choices),
                "costs_kl": {str(i): {"keys": costs[2 * i].tolist(), "values": costs[2 * i + 1].tolist()}
                             for i in range(costs.shape[0] // 2)},
                "text": text_path.name, "text_sha256": text_sha256(text), "windows": args.windows,
                "prefix": args.prefix, "continuation": args.continuation}
    bits = allocate_bits(costs, choices, args.average_bits)
    num_layers = costs.shape[0] // 2
    layer_bits = layer_bits_from_allocation(bits, num_layers)
    predicted = float(costs.gather(1, torch.tensor([choices.index(int(b)) for b in bits])[:, None]).sum())
    meta.update(average_bits=args.average_bits, mean_bits=float(bits.double().mean()), predicted_kl=predicted)
    out = save_bit_profile(args.out, layer_bits, meta)
    keys = "".join(str(layer_bits[i][0]) for i in range(num_layers))
    values = "".join(str(layer_bits[i][1]) for i in range(num_layers))
    print(f"{args.model}: mean {meta['mean_bits']:.3f} bits (budget {args.average_bits}), predicted KL "
          f"{predicted:.4f}\n  keys   by layer: {keys}\n  values by layer: {values}\n{out}")
    return 0


_REUSED = ("model", "layout", "quant", "choices", "costs_kl", "text", "text_sha256", "windows", "prefix",
           "continuation")


def _reuse_costs(path: str, layout: str, choices: tuple[int, ...], model: str):
    """The costs and measurement metadata of an earlier profile, checked against this run."""
    import torch

    from ..plan.bit_allocation import read_bit_profile

    doc = read_bit_profile(path)
    missing = [k for k in _REUSED if k not in doc]
    if missing:
        raise ValueError(f"--costs-from {path!r} has no measured costs (missing {missing})")
    for name, want, got in (("--layout", layout, doc["layout"]), ("--choices", list(choices), doc["choices"]),
                            ("--model", model, doc["model"].get("name"))):
        if want != got:
            raise ValueError(f"--costs-from {path!r} was measured with {name} {got!r}; this run asks for {want!r}")
    n = len(doc["costs_kl"])
    try:
        costs = torch.tensor([doc["costs_kl"][str(i)][half] for i in range(n) for half in ("keys", "values")],
                             dtype=torch.float64)
    except (KeyError, TypeError, ValueError):
        raise ValueError(f"--costs-from {path!r}: costs_kl must hold keys/values costs for layers 0..{n - 1}") from None
    return costs, {k: doc[k] for k in _REUSED}
