"""The decorrelating transform of the storage codec: PCA per layer, KV head and K/V (math
dictionary §27.1).

Pure functions. A calibration fits, for the vectors ``x`` ``[N, d]`` of one (layer, KV head,
K or V) on calibration text, the mean ``mu`` ``[d]``, an orthonormal basis ``U`` ``[d, d]``
(the eigenvectors of the covariance, columns by decreasing variance) and the variances
``lambda`` ``[d]``. A stored vector is coded as its components ``c = (x - mu) U`` and decoded as
``x = mu + c U^T`` (exact when nothing is quantized: ``U`` is orthonormal). Statistics in
float64; outputs float32.

Keys are taken as the cache holds them (after RoPE). For keys the PCA is taken after a metric
``A = E[q q^T]^(1/2)`` of the queries that read them (:func:`query_metric`): squared error
after ``A`` is the mean squared error of the logits ``q . k``, which is what the allocation then
spends bits against. The basis is fitted per KV head, not across heads: KVzip keeps different
tokens in each head, so the heads of one token are not all stored.
"""

from __future__ import annotations

import torch


def accumulate_moments(x: torch.Tensor, moments: tuple[torch.Tensor, torch.Tensor, int] | None = None
                       ) -> tuple[torch.Tensor, torch.Tensor, int]:
    """Add the vectors ``x`` ``[N, d]`` to running float64 moments ``(sum [d], sum of outer
    products [d, d], count)`` (None: start)."""
    if x.dim() != 2:
        raise ValueError(f"accumulate_moments: x must be [N, d]; got shape {tuple(x.shape)}")
    if not torch.isfinite(x).all():
        raise ValueError("accumulate_moments: x holds NaN or Inf")
    x64 = x.detach().to(torch.float64)
    s, ss, n = moments if moments is not None else (torch.zeros(x.shape[1], dtype=torch.float64),
                                                    torch.zeros(x.shape[1], x.shape[1], dtype=torch.float64), 0)
    return s + x64.sum(0), ss + x64.T @ x64, n + x.shape[0]


def fit_basis(moments: tuple[torch.Tensor, torch.Tensor, int], metric: torch.Tensor | None = None
              ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """``(mu [d], U [d, d], lambda [d])`` float32 from running moments: the mean, the eigenvectors
    of the covariance (of ``(x - mu) A`` with a ``metric`` ``A``) as columns by decreasing eigenvalue (each column's sign fixed so its
    largest entry is positive: the fit is reproducible) and the eigenvalues (clamped at 0)."""
    s, ss, n = moments
    if n < 2:
        raise ValueError(f"fit_basis: needs at least 2 vectors; got {n}")
    mu = s / n
    cov = ss / n - torch.outer(mu, mu)
    if metric is not None:  # the covariance of (x - mu) A
        a = metric.double()
        cov = a.T @ cov @ a
    cov = (cov + cov.T) / 2
    lam, vec = torch.linalg.eigh(cov)
    order = torch.argsort(lam, descending=True)
    lam, vec = lam[order].clamp_min(0), vec[:, order]
    signs = torch.sign(vec[vec.abs().argmax(0), torch.arange(vec.shape[1])])
    vec = vec * torch.where(signs == 0, torch.ones_like(signs), signs)
    return mu.float(), vec.float(), lam.float()


def orthonormalize(basis: torch.Tensor) -> torch.Tensor:
    """The nearest orthonormal matrix to ``basis`` ``[..., d, d]`` (polar factor, float64 SVD),
    float32: a basis read from a file is used as an exact inverse pair."""
    u, _, vh = torch.linalg.svd(basis.double())
    return (u @ vh).float()


def query_metric(second_moment: torch.Tensor, count: int, floor: float = 1e-3) -> torch.Tensor:
    """``A = (E[q q^T])^(1/2)`` ``[d, d]`` float32 from a float64 sum of query outer products over
    ``count`` queries: a key error ``delta`` changes a logit by ``q . delta``, and ``E[(q . delta)^2]
    = |delta A|^2``, so squared error after ``A`` is the mean squared logit error. Eigenvalues
    are floored at ``floor`` times their mean (``A`` stays invertible)."""
    if count < 1:
        raise ValueError(f"query_metric: needs at least one query; got {count}")
    c = second_moment.double() / count
    lam, vec = torch.linalg.eigh((c + c.T) / 2)
    lam = lam.clamp_min(float(lam.clamp_min(0).mean()) * floor + 1e-30)
    return (vec * lam.sqrt()) @ vec.T


def to_components(x: torch.Tensor, mu: torch.Tensor, basis: torch.Tensor, metric: torch.Tensor | None = None
                  ) -> torch.Tensor:
    """``(x - mu) A U``: ``x`` ``[..., T, d]``, ``mu`` ``[d]``, ``basis`` ``[d, d]``, the metric ``A``
    ``[d, d]`` (None: the identity) -> float32 ``[..., T, d]``."""
    y = x.float() - mu
    if metric is not None:
        y = y @ metric
    return y @ basis


def from_components(c: torch.Tensor, mu: torch.Tensor, basis: torch.Tensor, inverse_metric: torch.Tensor | None = None
                    ) -> torch.Tensor:
    """``mu + c U^T A^-1``: the inverse of :func:`to_components`, float32 ``[..., T, d]``."""
    y = c.float() @ basis.T
    if inverse_metric is not None:
        y = y @ inverse_metric
    return y + mu


__all__ = ["accumulate_moments", "fit_basis", "from_components", "orthonormalize", "query_metric", "to_components"]
