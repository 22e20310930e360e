"""The decorrelating transform of the storage codec: PCA per layer, KV head and K/V (math
dictionary §27.1).

Pure functions. A calibration fits, for the vectors ``x`` ``[N, d]`` of one (layer, KV head,
K or V) on calibration text, the mean ``mu`` ``[d]``, an orthonormal basis ``U`` ``[d, d]``
(the eigenvectors of the covariance, columns by decreasing variance) and the variances
``lambda`` ``[d]``. A stored vector is coded as its components ``c = (x - mu) U`` and decoded as
``x = mu + c U^T`` (exact when nothing is quantized: ``U`` is orthonormal). Statistics in
float64; outputs float32.

Keys are taken as the cache holds them (after RoPE). The basis is fitted per KV head, not
across heads: KVzip keeps different tokens in each head, so the heads of one token are not all
stored.
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


def fit_basis(moments: tuple[torch.Tensor, torch.Tensor, int]) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """``(mu [d], U [d, d], lambda [d])`` float32 from running moments: the mean, the eigenvectors
    of the covariance as columns by decreasing eigenvalue (each column's sign fixed so its
    largest entry is positive: the fit is reproducible) and the eigenvalues (clamped at 0)."""
    s, ss, n = moments
    if n < 2:
        raise ValueError(f"fit_basis: needs at least 2 vectors; got {n}")
    mu = s / n
    cov = ss / n - torch.outer(mu, mu)
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


def to_components(x: torch.Tensor, mu: torch.Tensor, basis: torch.Tensor) -> torch.Tensor:
    """``(x - mu) U``: ``x`` ``[..., T, d]``, ``mu`` ``[d]``, ``basis`` ``[d, d]`` -> float32 ``[..., T, d]``."""
    return (x.float() - mu) @ basis


def from_components(c: torch.Tensor, mu: torch.Tensor, basis: torch.Tensor) -> torch.Tensor:
    """``mu + c U^T``: the inverse of :func:`to_components`, float32 ``[..., T, d]``."""
    return c.float() @ basis.T + mu


__all__ = ["accumulate_moments", "fit_basis", "from_components", "orthonormalize", "to_components"]
