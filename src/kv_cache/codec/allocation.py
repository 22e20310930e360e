"""Bit allocation of the storage codec: a step size per component, chosen to meet a byte target
with the least squared error (math dictionary §27.2).

Pure functions on float32 tensors. Each row is one component of one coded segment (its values
``x`` ``[T]`` over the segment's tokens, centred on their mean). Its candidates are "skip"
(decoded as the mean: no symbols) and uniform steps ``Delta_k = sigma * 2^((2 - k) / 2)``,
``k = 0 .. K-1`` (``sigma``: the row's standard deviation), each with

* its rate: the bits an adaptive-free entropy coder spends on ``q = round(x / Delta)`` under a
  quantized Laplace model of scale ``b = mean |x / Delta|`` (what :mod:`.ans` codes with), plus
  the 32 bits of its two float16 parameters (``Delta``, ``b``);
* its distortion: ``sum (x - q Delta)^2``.

:func:`allocate` picks per row the candidate minimising ``D + lambda R`` and bisects ``lambda``
so the total rate meets the target: the lower convex hull of every row's rate-distortion
curve, the classical solution of the allocation problem (reverse water-filling when the rows
are Gaussian). KVTC allocates by dynamic programming over the same tables; the Lagrangian
reaches the same points of the hull and is linear in the rows.
"""

from __future__ import annotations

import math

import torch

MAX_SYMBOL = 2047
"""Quantized values are clipped to ``[-MAX_SYMBOL, MAX_SYMBOL]`` (the support of the coder's model)."""
STEPS = 20
"""Candidate steps per component: ``sigma * 2^(1 - k/2)``, ``k < STEPS`` (2 sigma down to about 0.003 sigma)."""
PARAM_BITS = 32
"""Bits of a coded component's own parameters (its step and its Laplace scale, float16 each)."""
MIN_SCALE = 0.02
"""Smallest Laplace scale (in steps) the coder is given: a row of zeros still costs a few bits."""
_LOG2E = 1.0 / math.log(2.0)


def laplace_bits(q: torch.Tensor, b: torch.Tensor) -> torch.Tensor:
    """Bits ``-log2 P(q)`` of integers ``q`` ``[..., T]`` under a Laplace of scale ``b`` ``[..., 1]``
    (in steps, mean 0) quantized to unit bins: ``P(0) = 1 - exp(-1/(2b))``, ``P(q) = exp(-(|q| - 1/2)/b)
    (1 - exp(-1/b)) / 2``. Float32."""
    a = q.abs().float()
    zero = -torch.log2(-torch.expm1(-0.5 / b)).expand_as(a)
    other = 1.0 + (a - 0.5) / b * _LOG2E - torch.log2(-torch.expm1(-1.0 / b))
    return torch.where(a == 0, zero, other)


def round_half(t: torch.Tensor) -> torch.Tensor:
    """``t`` rounded to float16 and back (the stored parameters), float32."""
    return t.to(torch.float16).float()


def candidate_steps(sigma: torch.Tensor, steps: int = STEPS) -> torch.Tensor:
    """``[rows, steps]`` float32 step sizes ``sigma * 2^(1 - k/2)``, rounded to float16 as stored."""
    k = torch.arange(steps, dtype=torch.float32)
    return round_half(sigma[:, None] * torch.pow(2.0, 1.0 - k / 2))


def laplace_scale(x_steps: torch.Tensor) -> torch.Tensor:
    """The stored Laplace scale of values ``x_steps`` ``[..., T]`` in steps: ``mean |x|`` rounded
    to float16, at least :data:`MIN_SCALE`; ``[..., 1]`` float32."""
    return round_half(x_steps.abs().mean(-1, keepdim=True).clamp_min(MIN_SCALE))


def rd_table(x: torch.Tensor, steps: int = STEPS, param_bits: int = PARAM_BITS
             ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Rate-distortion table of rows ``x`` ``[rows, T]`` (centred). Returns ``(rate_bits, distortion,
    deltas)``: ``[rows, 1 + steps]`` float32 (column 0: skip) and the steps ``[rows, steps]``;
    ``param_bits``: what a coded row's parameters cost (0 where they are stored for every row)."""
    if x.dim() != 2:
        raise ValueError(f"rd_table: x must be [rows, T]; got shape {tuple(x.shape)}")
    x = x.float()
    sigma = x.pow(2).mean(-1).sqrt()
    deltas = candidate_steps(sigma, steps)
    rate = torch.zeros(x.shape[0], 1 + steps)
    dist = torch.empty(x.shape[0], 1 + steps)
    dist[:, 0] = x.pow(2).sum(-1)
    for k in range(steps):
        d = deltas[:, k:k + 1]
        ok = d > 0
        safe = torch.where(ok, d, torch.ones_like(d))
        xs = x / safe
        q = torch.round(xs).clamp(-MAX_SYMBOL, MAX_SYMBOL)
        b = laplace_scale(xs)
        rate[:, 1 + k] = torch.where(ok[:, 0], laplace_bits(q, b).sum(-1) + param_bits, torch.inf)
        dist[:, 1 + k] = torch.where(ok[:, 0], (x - q * safe).pow(2).sum(-1), torch.inf)
    return rate, dist, deltas


def choose(rate: torch.Tensor, dist: torch.Tensor, lam: float, weight: torch.Tensor | None = None) -> torch.Tensor:
    """Per row, the candidate index minimising ``weight * D + lam * R`` (``[rows]`` int64)."""
    w = 1.0 if weight is None else weight[:, None]
    return torch.argmin(w * dist + lam * rate, dim=1)


def allocate(rate: torch.Tensor, dist: torch.Tensor, budget_bits: float, weight: torch.Tensor | None = None,
             iters: int = 60) -> torch.Tensor:
    """The candidates (``[rows]`` indices into the tables) of least total (weighted) distortion
    whose total rate is at most ``budget_bits``: bisection of the Lagrange multiplier.

    Raises ``ValueError`` when even skipping every row does not fit (a negative budget)."""
    if not math.isfinite(budget_bits) or budget_bits < 0:
        raise ValueError(f"allocate: the budget must be a finite number of bits >= 0; got {budget_bits}")
    if rate.shape[0] == 0:
        return torch.zeros(0, dtype=torch.long)
    total = lambda c: float(rate.gather(1, c[:, None]).sum())  # noqa: E731
    lo, hi = 1e-12, 1e12  # lam small: finest steps; lam large: skip everything
    best = choose(rate, dist, hi, weight)
    if total(best) > budget_bits:
        return best
    for _ in range(iters):
        mid = math.sqrt(lo * hi)
        c = choose(rate, dist, mid, weight)
        if total(c) <= budget_bits:
            best, hi = c, mid
        else:
            lo = mid
        if hi / lo < 1.0005:
            break
    return best


__all__ = ["MAX_SYMBOL", "MIN_SCALE", "PARAM_BITS", "STEPS", "allocate", "candidate_steps", "choose",
           "laplace_bits", "laplace_scale", "rd_table", "round_half"]
