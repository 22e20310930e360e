"""Which implementation of the kernels serves tensors on a given device.

* CPU: the compiled C++ kernels (:mod:`._build`), or the torch reference when they are not built;
* CUDA: the Triton kernels (:mod:`kv_cache.kernels.triton`) when ``triton`` imports, else the
  torch reference (one logged warning);
* any other device (MPS, XPU, ...): the torch reference (:mod:`.reference`), which is plain
  vectorized torch and runs wherever torch does.

``KV_CACHE_KERNELS`` (:func:`._build.backend`) overrides this: ``torch`` takes the reference
everywhere, ``triton`` takes Triton everywhere (CPU tensors then need Triton's interpreter,
``TRITON_INTERPRET=1``, set before ``triton`` is imported: for tests). Tensors on several devices
go to the reference, whose torch ops raise the usual device-mismatch error.
"""

from __future__ import annotations

import importlib
import logging
import threading
from types import ModuleType

import torch

from . import _build

logger = logging.getLogger(__name__)

TRITON_DEVICES = ("cuda",)
"""Device types the Triton kernels serve under the default selection (ROCm builds of torch also
report ``"cuda"``)."""

KINDS = ("compiled", "triton", "torch")

_lock = threading.Lock()
_triton: ModuleType | None = None
_triton_error: str | None = None
_triton_tried = False


def triton_module(required: bool = False) -> ModuleType | None:
    """:mod:`kv_cache.kernels.triton`, imported on first use; None when ``triton`` does not import.

    Parameters
    ----------
    required : bool, default False
        Raise instead of returning None (``KV_CACHE_KERNELS=triton``).

    Raises
    ------
    RuntimeError
        ``required`` and Triton cannot be imported (the message names the cause).
    """
    global _triton, _triton_error, _triton_tried
    if not _triton_tried:
        with _lock:
            if not _triton_tried:
                try:
                    _triton = importlib.import_module("kv_cache.kernels.triton")
                except Exception as exc:  # noqa: BLE001 - any import failure means "no Triton"
                    _triton_error = f"{type(exc).__name__}: {exc}"
                    logger.warning("kv_cache.kernels: Triton is not usable (%s); CUDA tensors use the torch "
                                   "reference kernels (slower). Install it with: pip install 'kv_cache[triton]'",
                                   _triton_error)
                _triton_tried = True
    if _triton is None and required:
        raise RuntimeError(f"{_build.ENV_BACKEND}=triton but Triton cannot be imported ({_triton_error}); "
                           "install it (pip install 'kv_cache[triton]') or unset the variable")
    return _triton


def backend(device: torch.device | str = "cpu") -> str:
    """The implementation that serves tensors on ``device``: ``"compiled"``, ``"triton"`` or ``"torch"``.

    Builds the compiled kernels (CPU) or imports Triton (CUDA) on first call.

    Raises
    ------
    ValueError
        ``$KV_CACHE_KERNELS`` holds an unknown value.
    RuntimeError
        ``KV_CACHE_KERNELS=triton`` without an importable Triton.

    Examples
    --------
    >>> backend("meta")
    'torch'
    """
    env = _build.backend()
    kind = torch.device(device).type
    if env == "torch":
        return "torch"
    if env == "triton":
        triton_module(required=True)
        return "triton"
    if kind == "cpu":
        return "compiled" if _build.load() is not None else "torch"
    if kind in TRITON_DEVICES and triton_module() is not None:
        return "triton"
    return "torch"


def _device_type(tensors) -> str | None:
    """The one device type of ``tensors`` (None entries ignored), or None when they span several
    (or there are none). Called on every kernel call (a decoding step makes one per layer): CPU
    tensors are recognised by ``is_cpu``, which builds no ``torch.device``."""
    kind = None
    for t in tensors:
        if t is None:
            continue
        k = "cpu" if t.is_cpu else t.device.type
        if kind is None:
            kind = k
        elif k != kind:
            return None
    return kind


def triton_for(tensors) -> ModuleType | None:
    """The Triton backend when it serves ``tensors`` (all on one device), else None."""
    env = _build.backend()
    if env == "torch":
        return None
    kind = _device_type(tensors)
    if kind is None:
        return None
    if env == "triton":
        return triton_module(required=True)
    return triton_module() if kind in TRITON_DEVICES else None


def compiled_for(tensors) -> ModuleType | None:
    """The compiled extension when it serves ``tensors`` (all on the CPU), else None."""
    if _build.backend() == "triton":
        return None
    for t in tensors:
        if t is not None and not t.is_cpu:
            return None
    return _build.load()


__all__ = ["KINDS", "TRITON_DEVICES", "backend", "compiled_for", "triton_for", "triton_module"]
