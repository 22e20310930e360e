"""Seeded randomized Hadamard rotations of KV vectors (math dictionary §17).

A rotation ``R`` (orthonormal, ``R R^T = I``) applied to every key and value spreads an outlier
channel over all channels, so the rotated coordinates of a vector are close to Gaussian and a
per-vector norm plus Lloyd-Max levels (:mod:`kv_cache.compression.codebook`) quantize them well
at 2-3 bits (QuaRot, Ashkboos et al., 2024; QuIP#, Tseng et al., 2024). Attention needs no
inverse on the keys: ``q . k = (q R) . (k R)``, so the query is rotated once; the output of the
rotated values is rotated back once, ``out = (sum_t p_t v_t R) R^T``.

``R = diag(s) H`` with ``s`` random signs drawn from a seeded ``torch.Generator`` (no
calibration) and ``H`` the normalized Sylvester-Hadamard matrix, or a block-diagonal of them
when the dimension is not a power of two. Vectors are row vectors: ``forward(x) = x @ R``.

Dtype rule (:func:`fwht`, :meth:`RandomizedHadamard.forward`, :meth:`~RandomizedHadamard.inverse`):
the arithmetic runs in float32 (float64 for float64 input) and the result has the input's
dtype, so a float16 or bfloat16 round trip is exact only up to that dtype's rounding.
"""

from __future__ import annotations

import hashlib
import math
from dataclasses import dataclass, field
from typing import Any

import torch

from ._arrays import FLOAT_DTYPES, check_int, raise_non_finite

_FLOAT_NAMES = "float16, bfloat16, float32, float64"


def _check_input(x: Any, name: str = "x") -> torch.Tensor:
    """Check ``x`` is a finite floating tensor of rank >= 1 (empty leading dims are fine)."""
    if not isinstance(x, torch.Tensor):
        raise TypeError(f"{name} must be a torch.Tensor; got {type(x).__name__}")
    if x.dtype not in FLOAT_DTYPES:
        raise TypeError(f"{name} must have a floating dtype ({_FLOAT_NAMES}); got {x.dtype}")
    if x.ndim < 1:
        raise ValueError(f"{name} must be rank >= 1 [..., d]; got a 0-d tensor")
    # Same contract as the quantizer: NaN/Inf would be smeared over every channel of the
    # vector by the rotation, so they are rejected here rather than passed on silently.
    if x.numel() and not bool(torch.isfinite(x).all()):
        raise_non_finite(x, name)
    return x


def _work_dtype(dtype: torch.dtype) -> torch.dtype:
    return torch.float64 if dtype == torch.float64 else torch.float32


def _is_pow2(n: int) -> bool:
    return n >= 1 and n & (n - 1) == 0


def _butterflies(y: torch.Tensor) -> torch.Tensor:
    """Unnormalized Sylvester-ordered WHT of the last dim of a contiguous ``[n, d]`` tensor."""
    n, d = y.shape
    h = 1
    while h < d:
        # Pairs (j, j + h) inside each block of 2h: the Sylvester recursion H_2m = [[H, H], [H, -H]].
        y4 = y.view(n, d // (2 * h), 2, h)
        a, b = y4[:, :, 0, :], y4[:, :, 1, :]
        y = torch.stack((a + b, a - b), dim=2).view(n, d)
        h *= 2
    return y


def fwht(x: torch.Tensor, dim: int = -1) -> torch.Tensor:
    """Orthonormal fast Walsh-Hadamard transform along ``dim``: ``y = x @ H_d / sqrt(d)``.

    ``H_d`` is the Sylvester-Hadamard matrix (``H_1 = [1]``, ``H_2m = [[H_m, H_m], [H_m, -H_m]]``,
    entries ``(-1)^popcount(i & j)``), symmetric with ``H_d H_d = d I``, so the normalized
    transform is orthonormal and its own inverse: ``fwht(fwht(x)) == x``. Cost
    ``O(d log d)`` per vector (``log2 d`` butterfly passes), vectorized over every other dim.

    Parameters
    ----------
    x : torch.Tensor, ``[..., d]`` (``d`` along ``dim``)
        float16, bfloat16, float32 or float64, finite; leading dims may be empty.
    dim : int, default -1
        The transformed dimension; its length ``d`` must be a power of two.

    Returns
    -------
    torch.Tensor
        Same shape and dtype as ``x`` (computed in float32, float64 for float64 input).

    Raises
    ------
    TypeError
        ``x`` is not a tensor or has a non-floating dtype.
    ValueError
        ``d`` is not a power of two, ``dim`` is out of range, ``x`` holds NaN or Inf.

    Examples
    --------
    >>> fwht(torch.tensor([1.0, 0.0, 0.0, 0.0]))
    tensor([0.5000, 0.5000, 0.5000, 0.5000])
    """
    x = _check_input(x)
    dim = check_int(dim, "dim")
    if not -x.ndim <= dim < x.ndim:
        raise ValueError(f"dim must be in [{-x.ndim}, {x.ndim - 1}] for a rank-{x.ndim} tensor; got {dim}")
    d = x.shape[dim]
    if not _is_pow2(d):
        raise ValueError(f"fwht needs a power-of-two length (1, 2, 4, ..., 64, 128, ...) along dim; got {d}")
    xt = x.movedim(dim, -1)
    lead = xt.shape[:-1]
    y = _butterflies(xt.to(_work_dtype(x.dtype)).reshape(-1, d).contiguous())
    y = (y * (1.0 / math.sqrt(d))).view(*lead, d)  # not in place: for d = 1, y may be x itself
    return y.movedim(-1, dim).to(x.dtype)


def pow2_blocks(dim: int) -> tuple[int, ...]:
    """The largest powers of two that tile ``dim``, largest first (the binary digits of ``dim``).

    ``128 -> (128,)``, ``96 -> (64, 32)``, ``80 -> (64, 16)``, ``112 -> (64, 32, 16)``.

    Raises
    ------
    ValueError
        ``dim`` is odd or < 2: a 1-wide block would be a bare sign flip that mixes nothing, so
        the allowed values are the even integers >= 2.
    """
    dim = check_int(dim, "dim")
    if dim < 2 or dim % 2:
        raise ValueError(
            f"dim must be an even integer >= 2 (a power of two, or tiled by powers of two >= 2, "
            f"e.g. 64, 80, 96, 128); got {dim}")
    return tuple(1 << i for i in reversed(range(dim.bit_length())) if dim >> i & 1)


def seed_for(layer: int, kv_head: int, base_seed: int = 0) -> int:
    """A seed for the rotation of ``(layer, kv_head)``, distinct per triple and reproducible.

    ``blake2b(b"kv_cache.rotation:{base_seed}:{layer}:{kv_head}")`` truncated to 63 bits: stable
    across processes and platforms (unlike ``hash``), independent of the call order.

    Raises
    ------
    TypeError, ValueError
        An argument is not an int >= 0.
    """
    base_seed = check_int(base_seed, "base_seed", minimum=0)
    layer = check_int(layer, "layer", minimum=0)
    kv_head = check_int(kv_head, "kv_head", minimum=0)
    key = f"kv_cache.rotation:{base_seed}:{layer}:{kv_head}".encode()
    digest = hashlib.blake2b(key, digest_size=8).digest()
    return int.from_bytes(digest, "little") & ((1 << 63) - 1)


@dataclass(frozen=True)
class RandomizedHadamard:
    """The seeded rotation ``R = diag(s) · blockdiag(H_b1/sqrt(b1), H_b2/sqrt(b2), ...)`` (§17).

    ``s`` are ``dim`` random signs (``±1``) from ``torch.Generator().manual_seed(seed)``; ``H_b``
    is the Sylvester-Hadamard matrix of size ``b``. ``R`` is orthonormal (``R R^T = I``), so
    ``forward`` preserves norms and dot products and ``inverse`` is exact up to rounding.

    **Block-diagonal rule.** When ``dim`` is not a power of two, the channels are split into
    consecutive blocks of the largest powers of two that tile it (:func:`pow2_blocks`:
    ``96 = 64 + 32``, ``80 = 64 + 16``) and each block is transformed on its own: an outlier is
    then spread only over its block (amplitude ``M/sqrt(b)`` on each channel of that block).

    Parameters
    ----------
    dim : int
        Vector length (head dim); an even integer >= 2.
    seed : int
        Seed of the signs, ``0 <= seed < 2**64``; see :func:`seed_for` / :meth:`for_head` for one per head.
    blocks : tuple of int, optional
        Block sizes (powers of two summing to ``dim``), in channel order; default
        ``pow2_blocks(dim)``.

    Raises
    ------
    TypeError, ValueError
        A bad ``dim`` (odd, < 2), ``seed`` or ``blocks``.

    Examples
    --------
    >>> rot = RandomizedHadamard(96, seed=0)
    >>> rot.blocks
    (64, 32)
    >>> x = torch.randn(2, 5, 96)
    >>> torch.allclose(rot.inverse(rot.forward(x)), x, atol=1e-5)
    True
    """

    dim: int
    seed: int = 0
    blocks: tuple[int, ...] | None = None
    _signs: torch.Tensor = field(init=False, repr=False, compare=False)

    def __post_init__(self) -> None:
        dim = check_int(self.dim, "dim", minimum=2)
        seed = check_int(self.seed, "seed", minimum=0)
        if seed >= 1 << 64:
            raise ValueError(f"seed must be < 2**64 (torch.Generator.manual_seed); got {seed}")
        if self.blocks is None:
            blocks = pow2_blocks(dim)
        else:
            if not isinstance(self.blocks, (tuple, list)) or not self.blocks:
                raise TypeError(f"blocks must be None or a non-empty tuple of ints; got {self.blocks!r}")
            blocks = tuple(check_int(b, "blocks[i]", minimum=1) for b in self.blocks)
            if not all(_is_pow2(b) and b >= 2 for b in blocks) or sum(blocks) != dim:
                raise ValueError(f"blocks must be powers of two >= 2 summing to dim={dim}; got {blocks}")
        signs = torch.randint(0, 2, (dim,), generator=torch.Generator().manual_seed(seed), dtype=torch.int64,
                              device="cpu")  # the generator's device; signs() moves them
        object.__setattr__(self, "dim", dim)
        object.__setattr__(self, "seed", seed)
        object.__setattr__(self, "blocks", blocks)
        object.__setattr__(self, "_signs", (signs * 2 - 1).to(torch.float64))

    @classmethod
    def for_head(cls, dim: int, layer: int, kv_head: int, base_seed: int = 0) -> "RandomizedHadamard":
        """The rotation of ``(layer, kv_head)``: ``cls(dim, seed_for(layer, kv_head, base_seed))``."""
        return cls(dim, seed_for(layer, kv_head, base_seed))

    def signs(self, dtype: torch.dtype = torch.float32, device: Any = None) -> torch.Tensor:
        """The sign vector ``s``, ``[dim]`` of ``±1`` (a fresh tensor)."""
        return self._signs.to(dtype=dtype, device=device)

    def _check(self, x: Any, name: str) -> torch.Tensor:
        x = _check_input(x, name)
        if x.shape[-1] != self.dim:
            raise ValueError(
                f"{name} must have last dim {self.dim} [..., {self.dim}]; got shape {tuple(x.shape)}")
        return x

    def _blockwise(self, y: torch.Tensor) -> torch.Tensor:
        """Apply ``blockdiag(H_b / sqrt(b))`` to the last dim of ``[n, dim]`` (work dtype)."""
        if len(self.blocks) == 1:
            return _butterflies(y).mul_(1.0 / math.sqrt(self.dim))
        parts = torch.split(y, list(self.blocks), dim=-1)
        out = [_butterflies(p.contiguous()).mul_(1.0 / math.sqrt(p.shape[-1])) for p in parts]
        return torch.cat(out, dim=-1)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        """Rotate: ``y = x @ R = blockdiag(H/sqrt(b)) applied to (x * s)``.

        Parameters
        ----------
        x : torch.Tensor, ``[..., dim]``
            float16, bfloat16, float32 or float64, finite; leading dims may be empty.

        Returns
        -------
        torch.Tensor
            ``[..., dim]``, dtype of ``x`` (computed in float32, float64 for float64 input).

        Raises
        ------
        TypeError
            Non-tensor or non-floating ``x``.
        ValueError
            Last dim is not ``dim``; NaN or Inf in ``x``.
        """
        x = self._check(x, "x")
        work = _work_dtype(x.dtype)
        y = x.to(work).reshape(-1, self.dim) * self.signs(work, x.device)
        return self._blockwise(y.contiguous()).view(x.shape).to(x.dtype)

    def inverse(self, y: torch.Tensor) -> torch.Tensor:
        """Undo :meth:`forward`: ``x = y @ R^T = (blockdiag(H/sqrt(b)) applied to y) * s``.

        Each normalized Sylvester block is symmetric and its own inverse, and ``s * s = 1``.
        Same shapes, dtypes and errors as :meth:`forward`.
        """
        y = self._check(y, "y")
        work = _work_dtype(y.dtype)
        x = self._blockwise(y.to(work).reshape(-1, self.dim).contiguous()) * self.signs(work, y.device)
        return x.view(y.shape).to(y.dtype)

    def matrix(self, dtype: torch.dtype = torch.float32, device: Any = None) -> torch.Tensor:
        """The dense orthonormal ``R``, ``[dim, dim]``, with ``forward(x) == x @ R``.

        For tests and for rotating a query with one matmul (``q @ R``); ``R^T`` undoes it.

        Raises
        ------
        TypeError
            ``dtype`` is not a floating dtype.
        """
        if dtype not in FLOAT_DTYPES:
            raise TypeError(f"dtype must be one of {_FLOAT_NAMES}; got {dtype!r}")
        eye = torch.eye(self.dim, dtype=torch.float64, device="cpu")  # built on the host, moved below
        return self.forward(eye).to(dtype=dtype, device=device)


def hadamard_matrix(dim: int, block: int | None = None, dtype: torch.dtype = torch.float64) -> torch.Tensor:
    """The normalized block-diagonal Sylvester-Hadamard matrix ``blockdiag(H_b / sqrt(b))``, ``[dim, dim]``.

    Symmetric and orthonormal (each block is its own inverse). ``block`` None: the blocks of
    :func:`pow2_blocks` (one block when ``dim`` is a power of two); otherwise equal blocks of
    ``block`` channels (a power of two >= 2 dividing ``dim``), e.g. the channel group of a
    per-token quantizer, so every scale group mixes only its own channels (§17.7).

    Raises
    ------
    TypeError, ValueError
        A bad ``dim`` (odd, < 2) or ``block`` (not a power of two >= 2 dividing ``dim``), or a
        non-floating ``dtype``.
    """
    dim = check_int(dim, "dim", minimum=2)
    if block is None:
        blocks = pow2_blocks(dim)
    else:
        block = check_int(block, "block", minimum=2)
        if not _is_pow2(block) or dim % block:
            raise ValueError(f"block must be a power of two >= 2 dividing dim={dim}; got {block}")
        blocks = (block,) * (dim // block)
    if dtype not in FLOAT_DTYPES:
        raise TypeError(f"dtype must be one of {_FLOAT_NAMES}; got {dtype!r}")
    out = torch.zeros(dim, dim, dtype=torch.float64)
    at = 0
    for b in blocks:
        out[at:at + b, at:at + b] = fwht(torch.eye(b, dtype=torch.float64))
        at += b
    return out.to(dtype)


def covariance_eigenvectors(cov: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Eigen-decomposition ``C = V diag(lam) V^T`` of symmetric PSD matrices, largest first.

    The sign of each eigenvector is fixed (its largest-magnitude entry is positive) so the
    result is deterministic across LAPACK builds; computed in float64.

    Parameters
    ----------
    cov : torch.Tensor, ``[..., d, d]``
        Symmetric (up to rounding), finite.

    Returns
    -------
    lam : torch.Tensor, float64 ``[..., d]``
        Eigenvalues, descending.
    V : torch.Tensor, float64 ``[..., d, d]``
        Orthonormal; column ``j`` is the eigenvector of ``lam[..., j]``.

    Raises
    ------
    TypeError, ValueError
        Not a floating tensor; not square ``[..., d, d]``; NaN or Inf.
    """
    cov = _check_input(cov, "cov")
    if cov.ndim < 2 or cov.shape[-1] != cov.shape[-2]:
        raise ValueError(f"cov must be square matrices [..., d, d]; got shape {tuple(cov.shape)}")
    c = cov.to(torch.float64)
    lam, vec = torch.linalg.eigh((c + c.transpose(-1, -2)) / 2)  # ascending
    lam, vec = lam.flip(-1), vec.flip(-1)
    pivot = vec.abs().argmax(-2, keepdim=True)  # [..., 1, d]: the largest entry of each column
    sign = torch.sign(torch.gather(vec, -2, pivot))
    return lam, vec * torch.where(sign == 0, torch.ones_like(sign), sign)


def calibrated_rotation(query_cov: torch.Tensor, block: int | None = None) -> torch.Tensor:
    """OSCAR-style rotation ``R = V H`` from a query covariance ``C_Q = Q^T Q`` (§17.7).

    ``V`` holds the eigenvectors of ``C_Q``, largest eigenvalue first (:func:`covariance_eigenvectors`);
    ``H`` = :func:`hadamard_matrix` ``(d, block)`` mixes them inside each block, so each channel
    group of the rotated key sees directions of similar query energy and no single outlier
    direction sets a group's scale. ``R`` is orthonormal: ``q . k = (q R) . (k R)``.

    Parameters
    ----------
    query_cov : torch.Tensor, ``[..., d, d]``
        Symmetric PSD (e.g. the summed ``q^T q`` of the query heads sharing a KV head).
    block : int or None
        Hadamard block size (the quantizer's channel group); None: :func:`pow2_blocks`.

    Returns
    -------
    torch.Tensor, float64 ``[..., d, d]``
        Row-vector convention: ``forward(x) = x @ R``, ``inverse(y) = y @ R^T``.

    Examples
    --------
    >>> R = calibrated_rotation(torch.diag(torch.arange(1.0, 9.0)))
    >>> torch.allclose(R @ R.T, torch.eye(8, dtype=torch.float64))
    True
    """
    _, vec = covariance_eigenvectors(query_cov)
    return vec @ hadamard_matrix(vec.shape[-1], block)


__all__ = ["RandomizedHadamard", "calibrated_rotation", "covariance_eigenvectors", "fwht", "hadamard_matrix",
           "pow2_blocks", "seed_for"]
