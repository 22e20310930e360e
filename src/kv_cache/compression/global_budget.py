"""One token budget shared by many rows (KV heads of a layer, or of every layer): Ada-KV / KVzip.

Per-head selection (:func:`kv_cache.compression.select_tokens`) keeps the same ``K`` tokens in
every head. A shared budget keeps the ``B`` highest scores over all rows together, so a head
whose attention is spread keeps more tokens than one that attends to a few (Ada-KV, Feng et al.
2024; KVzip, Kim et al. 2025, across heads *and* layers). Each row keeps a floor of its best
tokens first (Ada-KV's safeguard), forced tokens (sinks, recent window, the cache's
full-precision slots) are always kept and count in the budget. Formula: math dictionary §19.

Tie-breaking: among equal scores, rows listed first and then earlier tokens win (a stable sort
of the concatenated rows), so the result does not depend on the hardware.
"""

from __future__ import annotations

from typing import Sequence

import torch

from ._arrays import check_int


def select_global(
    scores: Sequence[torch.Tensor],
    budget: int,
    *,
    floor: int = 0,
    valid: Sequence[torch.Tensor | None] | None = None,
    forced: Sequence[torch.Tensor | None] | None = None,
) -> list[torch.Tensor]:
    """Keep the ``budget`` best tokens over all rows of ``scores`` together.

    Parameters
    ----------
    scores : sequence of torch.Tensor, each ``[R_i, T_i]`` float
        Importance per token (higher is kept first), one matrix per group of rows (e.g. the
        KV heads of one layer); rows and groups may have different lengths.
    budget : int
        Tokens kept over every row of every matrix, forced ones included (``>= 0``).
    floor : int, default 0
        Each row first keeps its ``min(floor, valid tokens)`` best tokens.
    valid : sequence of bool tensors ``[R_i, T_i]`` (or None entries), optional
        False for slots that hold no token (padding, ragged rows); never kept.
    forced : sequence of bool tensors ``[R_i, T_i]`` (or None entries), optional
        Always kept (counted in the budget).

    Returns
    -------
    list of bool torch.Tensor, each ``[R_i, T_i]``: the kept slots.

    Raises
    ------
    ValueError
        Empty input, shapes that disagree, NaN scores, a negative budget or floor, or forced
        tokens plus floors that exceed the budget (the message gives both numbers).
    TypeError
        Scores not floating point, masks not bool.
    """
    if len(scores) == 0:
        raise ValueError("scores must hold at least one [rows, tokens] matrix; got none")
    budget = check_int(budget, "budget", minimum=0)
    floor = check_int(floor, "floor", minimum=0)
    n = len(scores)
    valid = [None] * n if valid is None else list(valid)
    forced = [None] * n if forced is None else list(forced)
    if len(valid) != n or len(forced) != n:
        raise ValueError(f"valid and forced must have one entry per score matrix ({n}); "
                         f"got {len(valid)} and {len(forced)}")
    prio, vals, sizes = [], [], []
    for i, s in enumerate(scores):
        if not isinstance(s, torch.Tensor) or s.dim() != 2:
            raise ValueError(f"scores[{i}] must be a [rows, tokens] tensor; got "
                             f"{tuple(s.shape) if isinstance(s, torch.Tensor) else type(s).__name__}")
        if not s.is_floating_point():
            raise TypeError(f"scores[{i}] must be floating point; got {s.dtype}")
        if bool(torch.isnan(s).any()):
            raise ValueError(f"scores[{i}] contains NaN")
        v = torch.ones_like(s, dtype=torch.bool) if valid[i] is None else valid[i]
        f = torch.zeros_like(s, dtype=torch.bool) if forced[i] is None else forced[i]
        for name, m in (("valid", v), ("forced", f)):
            if m.dtype != torch.bool or m.shape != s.shape:
                raise TypeError(f"{name}[{i}] must be a bool tensor of shape {tuple(s.shape)}; "
                                f"got {m.dtype} {tuple(m.shape)}")
        p = torch.where(v, s.float(), float("-inf"))
        p = torch.where(f & v, float("inf"), p)
        prio.append(p)
        vals.append(v)
        sizes.append(s.shape)
    keep = []
    taken = 0
    for p, v in zip(prio, vals):
        k = torch.zeros_like(v)
        if floor:
            T = p.shape[1]
            order = torch.sort(p, dim=1, descending=True, stable=True).indices[:, :min(floor, T)]
            k.scatter_(1, order, True)
            k &= v
        k |= torch.isposinf(p)
        taken += int(k.sum())
        keep.append(k)
    if taken > budget:
        n_forced = sum(int(torch.isposinf(p).sum()) for p in prio)
        raise ValueError(
            f"forced tokens ({n_forced}) plus per-row floors ({floor} per row) keep {taken} tokens, more than "
            f"the shared budget of {budget}: raise the budget or lower the floor / forced tokens"
        )
    rest = budget - taken
    if rest:
        flat = torch.cat([torch.where(k, float("-inf"), p).reshape(-1) for p, k in zip(prio, keep)])
        cand = int(torch.isfinite(flat).sum())  # -inf: padding or already kept
        m = min(rest, cand)
        if m:
            order = torch.sort(flat, descending=True, stable=True).indices[:m]
            chosen = torch.zeros_like(flat, dtype=torch.bool)
            chosen[order] = True
            at = 0
            for i, k in enumerate(keep):
                size = k.numel()
                keep[i] = k | chosen[at:at + size].reshape(k.shape)
                at += size
    return keep


__all__ = ["select_global"]
