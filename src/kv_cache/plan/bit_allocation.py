"""Bits per layer for keys and values under an average budget (math dictionary §20).

Layers and the key/value halves of a layer differ by orders of magnitude in how much their
quantization error costs (on SmolLM2-135M a 2-bit key cache in layer 18 costs 30x the KL of
one in layer 3, and 2-bit values cost ~8x less than 2-bit keys). Given a measured cost
``D[i, c]`` for every item ``i`` (one layer's keys or values, the same number of elements each)
at every bit width ``choices[c]``, :func:`allocate_bits` picks one width per item minimizing
``sum_i D[i, b_i]`` subject to ``mean_i b_i <= average_bits`` exactly (a dynamic program over
the integer bit total, not a greedy that can stop short of the budget).

:func:`save_bit_profile` / :func:`load_bit_profile` write and read the allocation as a JSON
file (``kvcache allocate``) that ``QuantConfig(layer_bits=load_bit_profile(path))`` and the
method-spec letter ``p[<path>]`` consume. The file names the model it was measured on, the
costs and the budget, so the choice can be audited and re-derived.
"""

from __future__ import annotations

import json
import math
import os
from pathlib import Path
from typing import Any, Mapping, Sequence

import torch

from ..compression.packing import SUPPORTED_BITS

PROFILE_FORMAT = "kv_cache.bit_profile"
PROFILE_VERSION = 1


class BitProfileError(ValueError):
    """A bit-profile file that is unreadable, malformed, or of another format or version."""


def allocate_bits(costs: torch.Tensor, choices: Sequence[int], average_bits: float) -> torch.Tensor:
    """The bit width of each item minimizing the total cost at a mean of at most ``average_bits``.

    Parameters
    ----------
    costs : torch.Tensor, ``[items, len(choices)]``
        Finite, ``>= 0``: the cost (e.g. the KL of the next-token distribution) of storing item
        ``i`` at ``choices[c]`` bits. Read in float64.
    choices : sequence of int
        Allowed widths, strictly increasing, each in ``SUPPORTED_BITS``.
    average_bits : float
        Budget: ``sum_i b_i <= floor(average_bits * items)``; at least ``min(choices)``.

    Returns
    -------
    torch.Tensor, int64 ``[items]``
        The chosen widths. Exact optimum (dynamic program over the integer bit total, O(items x
        total x choices)); among optima, the one found first in item order.

    Raises
    ------
    TypeError, ValueError
        A non-tensor or wrong-rank ``costs``, NaN/Inf or negative costs, no items, bad
        ``choices``, a budget below ``min(choices)``.

    Examples
    --------
    >>> allocate_bits(torch.tensor([[1.0, 0.1], [0.2, 0.1]]), (2, 4), 3.0).tolist()
    [4, 2]
    """
    if not isinstance(costs, torch.Tensor):
        raise TypeError(f"costs must be a torch.Tensor [items, choices]; got {type(costs).__name__}")
    choices = tuple(choices)
    if (not choices or any(isinstance(c, bool) or c not in SUPPORTED_BITS for c in choices)
            or list(choices) != sorted(set(choices))):
        raise ValueError(f"choices must be strictly increasing widths from {list(SUPPORTED_BITS)}; got {list(choices)}")
    if costs.ndim != 2 or costs.shape[1] != len(choices):
        raise ValueError(f"costs must be [items, {len(choices)}] (one column per choice); got {tuple(costs.shape)}")
    n = costs.shape[0]
    if n == 0:
        raise ValueError("costs has no items (shape [0, ...]); measure at least one layer")
    c64 = costs.detach().to(torch.float64, copy=True).cpu()
    if not bool(torch.isfinite(c64).all()):
        raise ValueError("costs contains NaN or Inf; re-measure (a cost must be finite)")
    if bool((c64 < 0).any()):
        raise ValueError(f"costs must be >= 0; got a minimum of {float(c64.min()):.3g}")
    if isinstance(average_bits, bool) or not isinstance(average_bits, (int, float)) or not math.isfinite(average_bits):
        raise ValueError(f"average_bits must be a finite number; got {average_bits!r}")
    if average_bits < choices[0]:
        raise ValueError(f"average_bits ({average_bits}) is below the smallest choice ({choices[0]}): no allocation fits")
    base = choices[0]
    extra = [c - base for c in choices]  # bits above the floor
    total = min(int(math.floor(average_bits * n + 1e-9)) - base * n, extra[-1] * n)
    rows = c64.tolist()
    inf = float("inf")
    best = [0.0] + [inf] * total  # best[s]: least cost of the items so far using s extra bits
    picks: list[list[int]] = []
    for i in range(n):
        new = [inf] * (total + 1)
        pick = [-1] * (total + 1)
        for s in range(total + 1):
            if best[s] == inf:
                continue
            for c, e in enumerate(extra):
                t = s + e
                if t > total:
                    break
                v = best[s] + rows[i][c]
                if v < new[t]:
                    new[t], pick[t] = v, c
        best = new
        picks.append(pick)
    s = min(range(total + 1), key=lambda t: (best[t], t))
    out = [0] * n
    for i in range(n - 1, -1, -1):
        c = picks[i][s]
        out[i] = choices[c]
        s -= extra[c]
    return torch.tensor(out, dtype=torch.int64)


def layer_bits_from_allocation(bits: torch.Tensor, num_layers: int) -> dict[int, tuple[int, int]]:
    """``[2 * num_layers]`` widths (keys of layer 0, values of layer 0, keys of layer 1, ...) as
    ``{layer: (key_bits, value_bits)}`` for ``QuantConfig.layer_bits``."""
    if not isinstance(bits, torch.Tensor) or bits.shape != (2 * num_layers,):
        raise ValueError(f"bits must be a tensor [2 * num_layers = {2 * num_layers}]; got "
                         f"{getattr(bits, 'shape', type(bits).__name__)}")
    b = bits.tolist()
    return {i: (int(b[2 * i]), int(b[2 * i + 1])) for i in range(num_layers)}


def save_bit_profile(path: str | os.PathLike, layer_bits: Mapping[int, tuple[int, int]],
                     meta: Mapping[str, Any]) -> Path:
    """Write ``{layer: (key_bits, value_bits)}`` and ``meta`` (model, budget, costs, text) as JSON."""
    doc = {"format": PROFILE_FORMAT, "format_version": PROFILE_VERSION, **dict(meta),
           "layer_bits": {str(k): [int(v[0]), int(v[1])] for k, v in sorted(layer_bits.items())}}
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_name(path.name + ".tmp")
    tmp.write_text(json.dumps(doc, indent=1) + "\n", encoding="utf-8")
    os.replace(tmp, path)
    return path


def read_bit_profile(path: str | os.PathLike) -> dict[str, Any]:
    """The whole profile document (validated); see :func:`load_bit_profile` for the errors."""
    where = os.fspath(path)
    if not Path(where).is_file():
        raise FileNotFoundError(f"bit profile: no file at {where!r} (write one with `kvcache allocate`)")
    try:
        doc = json.loads(Path(where).read_text(encoding="utf-8"))
    except (UnicodeDecodeError, json.JSONDecodeError) as e:
        raise BitProfileError(f"bit profile {where!r} is not JSON ({e}); write one with `kvcache allocate`") from None
    if not isinstance(doc, dict) or doc.get("format") != PROFILE_FORMAT:
        got = doc.get("format") if isinstance(doc, dict) else type(doc).__name__
        raise BitProfileError(f"{where!r} is not a bit profile: format must be {PROFILE_FORMAT!r}; got {got!r}")
    if doc.get("format_version") != PROFILE_VERSION:
        raise BitProfileError(f"bit profile {where!r} has format_version {doc.get('format_version')!r}; "
                              f"this kv_cache reads version {PROFILE_VERSION}")
    lb = doc.get("layer_bits")
    if not isinstance(lb, dict) or not lb:
        raise BitProfileError(f"bit profile {where!r}: layer_bits must be a non-empty object "
                              f"{{\"layer\": [key_bits, value_bits]}}; got {lb!r}")
    for k, v in lb.items():
        ok = (isinstance(k, str) and k.isdigit() and isinstance(v, list) and len(v) == 2
              and all(not isinstance(x, bool) and x in SUPPORTED_BITS for x in v))
        if not ok:
            raise BitProfileError(f"bit profile {where!r}: layer_bits entries must be \"<layer>\": [key_bits, "
                                  f"value_bits] with bits in {list(SUPPORTED_BITS)}; got {k!r}: {v!r}")
    return doc


def load_bit_profile(path: str | os.PathLike) -> dict[int, tuple[int, int]]:
    """``{layer: (key_bits, value_bits)}`` of a profile written by :func:`save_bit_profile`.

    Raises
    ------
    FileNotFoundError
        No file at ``path``.
    BitProfileError
        Not JSON, another format or version, or malformed ``layer_bits``.
    """
    doc = read_bit_profile(path)
    return {int(k): (int(v[0]), int(v[1])) for k, v in doc["layer_bits"].items()}
