"""Array plumbing shared by the compression functions: numpy <-> torch and input checks.

Every formula in :mod:`kv_cache.compression` is written once, in torch. numpy inputs are
viewed as torch tensors without a copy (``torch.from_numpy``) and results are converted back,
so the numpy and torch paths produce identical codes by construction.
"""

from __future__ import annotations

from typing import Any

import numpy as np
import torch

FLOAT_DTYPES = (torch.float16, torch.bfloat16, torch.float32, torch.float64)
_FLOAT_NAMES = "float16, bfloat16 (torch only), float32, float64"


def to_torch(x: Any, name: str = "x") -> tuple[torch.Tensor, bool]:
    """Return ``(tensor, was_numpy)``; numpy arrays are wrapped without copying.

    Raises
    ------
    TypeError
        If ``x`` is neither a ``numpy.ndarray`` nor a ``torch.Tensor``.
    """
    if isinstance(x, torch.Tensor):
        return x, False
    if isinstance(x, np.ndarray):
        if not x.flags.writeable or not x.flags.c_contiguous or x.dtype.byteorder == ">":
            x = np.ascontiguousarray(x).astype(x.dtype.newbyteorder("="), copy=False)
        try:
            return torch.from_numpy(x), True
        except TypeError as exc:  # e.g. object or string arrays
            raise TypeError(
                f"{name} must have a numeric dtype; got numpy dtype {x.dtype}"
            ) from exc
    raise TypeError(
        f"{name} must be a numpy.ndarray or a torch.Tensor; got {type(x).__name__}"
    )


def to_numpy(t: torch.Tensor) -> np.ndarray:
    """Convert a CPU-or-device tensor to numpy (bfloat16 is widened to float32)."""
    t = t.detach()
    if t.device.type != "cpu":
        t = t.cpu()
    if t.dtype == torch.bfloat16:
        t = t.float()
    return t.numpy()


def check_float(
    x: torch.Tensor, name: str = "x", *, allow_empty: bool = False, finite: bool = True
) -> None:
    """Reject integer/bool/complex dtypes, empty tensors and NaN/Inf values.

    Raises
    ------
    TypeError
        If the dtype is not one of float16, bfloat16, float32, float64.
    ValueError
        If ``x`` is empty (unless ``allow_empty``) or holds NaN or Inf.
    """
    if x.dtype not in FLOAT_DTYPES:
        raise TypeError(f"{name} must have a floating dtype ({_FLOAT_NAMES}); got {x.dtype}")
    if x.numel() == 0:
        if allow_empty:
            return
        raise ValueError(f"{name} is empty (shape {tuple(x.shape)}); nothing to compress")
    if finite and not bool(torch.isfinite(x).all()):
        raise_non_finite(x, name)


def raise_non_finite(x: torch.Tensor, name: str) -> None:
    """Raise the ``ValueError`` for a tensor known to hold NaN or Inf (counts them)."""
    n_nan = int(torch.isnan(x).sum())
    n_inf = int(torch.isinf(x).sum())
    raise ValueError(
            f"{name} holds non-finite values ({n_nan} NaN, {n_inf} Inf); "
            "quantization and selection need finite inputs"
        )


def check_rank(x: torch.Tensor, ranks: tuple[int, ...], name: str, layout: str) -> None:
    """Raise ``ValueError`` unless ``x.ndim`` is in ``ranks``."""
    if x.ndim not in ranks:
        allowed = " or ".join(str(r) for r in ranks)
        raise ValueError(
            f"{name} must be rank {allowed} {layout}; got rank {x.ndim} with shape {tuple(x.shape)}"
        )


def check_min_rank(x: torch.Tensor, minimum: int, name: str, layout: str) -> None:
    """Raise ``ValueError`` unless ``x.ndim >= minimum`` (for layouts like ``[..., C]``)."""
    if x.ndim < minimum:
        raise ValueError(
            f"{name} must be rank >= {minimum} {layout}; got rank {x.ndim} with shape {tuple(x.shape)}"
        )


def check_int(value: Any, name: str, *, minimum: int | None = None) -> int:
    """Return ``value`` as ``int`` after checking it is an integer (not bool) >= minimum."""
    if isinstance(value, bool) or not isinstance(value, (int, np.integer)):
        raise TypeError(f"{name} must be an int; got {type(value).__name__} {value!r}")
    value = int(value)
    if minimum is not None and value < minimum:
        raise ValueError(f"{name} must be >= {minimum}; got {value}")
    return value
