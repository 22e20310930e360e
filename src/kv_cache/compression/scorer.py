"""KVzap's learned token scorer: one small model per layer, from hidden states to scores (§24).

KVzap (Jegou & Jeblick, arXiv 2601.07891) predicts, from the hidden state entering a layer's
attention (after its input norm), the log of the score KVzip's reconstruction pass would give
the token in each KV head, so that the cache can be compressed at the cost of a plain prefill
and token by token while decoding. Everything here is pure: no model is run.

Shape contract
--------------
* ``hidden``: ``[batch, T, hidden_size]``, any float dtype; computed in float32.
* :func:`score_hidden` returns ``[batch, kv_heads, T]`` float32: the predicted
  ``log(max(kvzip_score, SCORE_FLOOR))`` of every token in every KV head.

Per layer, the input is standardised with the calibration statistics, ``z = (h - mu) / sigma``:

* ``linear``: ``s = z W + b``, ``W`` ``[hidden_size, kv_heads]``;
* ``mlp``: ``s = gelu(z W1 + b1) W2 + b2``, ``W1`` ``[hidden_size, width]``, ``W2`` ``[width, kv_heads]``;
* ``static``: ``s = b``, one constant per KV head (a ``linear`` file with ``W = 0``): the per-head
  static score, every token of a head scored alike.

Fitting (:func:`fit_linear`, :func:`fit_mlp`, :func:`fit_static`) is least squares on
``(z, log score)`` pairs (closed-form ridge for ``linear``, Adam for ``mlp``, the mean for
``static``), with a seeded generator.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Any

import torch

KINDS = ("linear", "mlp", "static")
SCORE_FLOOR = 1e-7
"""KVzip scores below this are clipped before the log (a probability under 1e-7 is never kept)."""
RIDGE = 1e-3
"""The linear scorer's default ridge penalty: per training token, on standardised inputs (§24.3)."""


@dataclass(frozen=True)
class LayerScorer:
    """One layer's scorer. Tensors are float32 on the CPU (moved on first use).

    Attributes
    ----------
    mu, sigma : ``[hidden_size]`` — the standardisation (sigma > 0)
    w1 : ``[hidden_size, width]`` (``mlp``) or ``[hidden_size, kv_heads]`` (``linear``)
    b1 : ``[width]`` or ``[kv_heads]``
    w2, b2 : ``[width, kv_heads]``, ``[kv_heads]`` (``mlp`` only; None for ``linear``)
    """

    mu: torch.Tensor
    sigma: torch.Tensor
    w1: torch.Tensor
    b1: torch.Tensor
    w2: torch.Tensor | None = None
    b2: torch.Tensor | None = None

    @property
    def kind(self) -> str:
        return "linear" if self.w2 is None else "mlp"

    @property
    def hidden_size(self) -> int:
        return int(self.w1.shape[0])

    @property
    def kv_heads(self) -> int:
        return int((self.w1 if self.w2 is None else self.w2).shape[1])

    def tensors(self) -> dict[str, torch.Tensor]:
        """The named tensors (``mu``, ``sigma``, ``w1``, ``b1`` [, ``w2``, ``b2``])."""
        out = {"mu": self.mu, "sigma": self.sigma, "w1": self.w1, "b1": self.b1}
        if self.w2 is not None:
            out.update(w2=self.w2, b2=self.b2)
        return out

    def to(self, device: torch.device | str) -> "LayerScorer":
        return LayerScorer(**{k: v.to(device) for k, v in self.tensors().items()})


def check_layer_scorer(s: LayerScorer, where: str = "scorer") -> None:
    """Raise ValueError unless the tensors of ``s`` agree in shape and are finite, ``sigma > 0``."""
    d = s.w1.shape[0]
    want = {"mu": (d,), "sigma": (d,), "b1": (s.w1.shape[1],)}
    if s.w2 is not None:
        if s.b2 is None:
            raise ValueError(f"{where}: an mlp scorer needs b2")
        want.update(w2=(s.w1.shape[1], s.w2.shape[1]), b2=(s.w2.shape[1],))
    for name, t in s.tensors().items():
        if t.dim() not in (1, 2) or not t.is_floating_point():
            raise ValueError(f"{where}: {name} must be a float vector or matrix; got {t.dtype} {tuple(t.shape)}")
        if name in want and tuple(t.shape) != want[name]:
            raise ValueError(f"{where}: {name} must have shape {list(want[name])}; got {list(t.shape)}")
        if not bool(torch.isfinite(t).all()):
            raise ValueError(f"{where}: {name} holds NaN or Inf")
    if not bool((s.sigma > 0).all()):
        raise ValueError(f"{where}: sigma must be > 0 everywhere")


def score_hidden(scorer: LayerScorer, hidden: torch.Tensor) -> torch.Tensor:
    """Predicted log KVzip scores ``[batch, kv_heads, T]`` (float32) of ``hidden`` ``[batch, T, d]``."""
    if hidden.dim() != 3:
        raise ValueError(f"hidden must be [batch, tokens, hidden_size]; got shape {tuple(hidden.shape)}")
    if hidden.shape[-1] != scorer.hidden_size:
        raise ValueError(f"hidden_size {hidden.shape[-1]} does not match the scorer's {scorer.hidden_size}")
    if scorer.mu.device != hidden.device:
        scorer = scorer.to(hidden.device)
    z = (hidden.float() - scorer.mu) / scorer.sigma
    s = z @ scorer.w1 + scorer.b1
    if scorer.w2 is not None:
        s = torch.nn.functional.gelu(s) @ scorer.w2 + scorer.b2
    return s.transpose(1, 2).contiguous()


def log_targets(scores: torch.Tensor) -> torch.Tensor:
    """``log(max(scores, SCORE_FLOOR))`` in float32: what the scorer learns to predict."""
    return scores.float().clamp_min(SCORE_FLOOR).log()


def standardise(x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """``(mu, sigma)`` ``[d]`` of samples ``x`` ``[N, d]`` (float64 sums); constant channels get sigma 1."""
    if x.dim() != 2 or x.shape[0] < 2:
        raise ValueError(f"need at least 2 samples [N, d] to standardise; got shape {tuple(x.shape)}")
    x64 = x.double()
    mu = x64.mean(0)
    sigma = x64.std(0)
    sigma = torch.where(sigma > 1e-8, sigma, torch.ones_like(sigma))
    return mu.float(), sigma.float()


def _check_xy(x: torch.Tensor, y: torch.Tensor) -> None:
    if x.dim() != 2 or y.dim() != 2 or x.shape[0] != y.shape[0]:
        raise ValueError(f"x must be [N, hidden_size] and y [N, kv_heads] with the same N; got {tuple(x.shape)} "
                         f"and {tuple(y.shape)}")
    if x.shape[0] < 2:
        raise ValueError(f"fitting a scorer needs at least 2 samples; got {x.shape[0]}")
    for name, t in (("x", x), ("y", y)):
        if not bool(torch.isfinite(t).all()):
            raise ValueError(f"{name} holds NaN or Inf")


def check_ridge(ridge: Any, name: str = "ridge") -> float:
    """``ridge`` as a float if it is a finite number >= 0 (not a bool); else ValueError naming ``name``."""
    if isinstance(ridge, bool) or not isinstance(ridge, (int, float)) or not math.isfinite(ridge) or ridge < 0:
        raise ValueError(f"{name} must be a finite number >= 0; got {ridge!r}")
    return float(ridge)


def fit_linear(x: torch.Tensor, y: torch.Tensor, ridge: float = RIDGE) -> LayerScorer:
    """Ridge regression of ``y`` ``[N, kv_heads]`` on standardised ``x`` ``[N, d]`` (closed form,
    float64): ``W = (Z^T Z + ridge N I)^{-1} Z^T (y - mean y)``, ``b = mean y``."""
    _check_xy(x, y)
    ridge = check_ridge(ridge)
    mu, sigma = standardise(x)
    z = ((x.double() - mu.double()) / sigma.double())
    ym = y.double().mean(0)
    a = z.T @ z + ridge * z.shape[0] * torch.eye(z.shape[1], dtype=torch.float64)
    w = torch.linalg.solve(a, z.T @ (y.double() - ym))
    return LayerScorer(mu, sigma, w.float(), ym.float())


def fit_static(x: torch.Tensor, y: torch.Tensor) -> LayerScorer:
    """The per-head static score: ``W = 0``, ``b = mean y`` ``[kv_heads]`` (float32), a linear
    scorer that gives every token of a KV head the head's mean log KVzip score, so a model-wide
    budget keeps whole heads (the heads KVzip reads most) and the forced window of the others.
    ``x`` only sets the standardisation (the file's format)."""
    _check_xy(x, y)
    mu, sigma = standardise(x)
    return LayerScorer(mu, sigma, torch.zeros(x.shape[1], y.shape[1]), y.double().mean(0).float())


def fit_mlp(x: torch.Tensor, y: torch.Tensor, *, width: int = 64, steps: int = 400, lr: float = 3e-3,
            batch: int = 1024, weight_decay: float = 1e-4, seed: int = 0) -> LayerScorer:
    """A two-layer GELU MLP fitted with Adam on the mean squared error (seeded, float32)."""
    _check_xy(x, y)
    for name, v in (("width", width), ("steps", steps), ("batch", batch)):
        if isinstance(v, bool) or not isinstance(v, int) or v < 1:
            raise ValueError(f"{name} must be an int >= 1; got {v!r}")
    mu, sigma = standardise(x)
    z = (x.float() - mu) / sigma
    yf = y.float()
    g = torch.Generator().manual_seed(seed)
    d, h = z.shape[1], yf.shape[1]
    w1 = (torch.randn(d, width, generator=g) / math.sqrt(d)).requires_grad_()
    b1 = torch.zeros(width, requires_grad=True)
    w2 = (torch.randn(width, h, generator=g) / math.sqrt(width)).requires_grad_()
    b2 = yf.mean(0).clone().requires_grad_()
    opt = torch.optim.Adam([w1, b1, w2, b2], lr=lr, weight_decay=weight_decay)
    n = z.shape[0]
    with torch.enable_grad():
        for _ in range(steps):
            idx = torch.randint(0, n, (min(batch, n),), generator=g)
            pred = torch.nn.functional.gelu(z[idx] @ w1 + b1) @ w2 + b2
            loss = torch.mean((pred - yf[idx]) ** 2)
            opt.zero_grad()
            loss.backward()
            opt.step()
    return LayerScorer(mu, sigma, w1.detach(), b1.detach(), w2.detach(), b2.detach())


def r_squared(pred: torch.Tensor, y: torch.Tensor) -> float:
    """``1 - SS_res / SS_tot`` over every entry (float64); 0 when ``y`` is constant."""
    y64, p64 = y.double(), pred.double()
    tot = float(((y64 - y64.mean(0)) ** 2).sum())
    return 0.0 if tot == 0 else 1.0 - float(((y64 - p64) ** 2).sum()) / tot


__all__ = ["KINDS", "RIDGE", "SCORE_FLOOR", "LayerScorer", "check_layer_scorer", "check_ridge", "fit_linear", "fit_mlp", "fit_static",
           "log_targets", "r_squared", "score_hidden", "standardise"]
