"""Calibrated KV rotation files: save, load, validate, and one layer's matrices for the cache
(math dictionary §17.7). Fitting them runs a model and lives in :mod:`kv_cache.plan.calibration`.

* :func:`save_calibration` / :func:`load_calibration`: a safetensors file, one float32 tensor
  ``layers.<i>`` ``[kv_heads, d, d]`` per layer, and a JSON header (key
  :data:`METADATA_KEY`) with :data:`FORMAT_VERSION`, the model's architecture and shapes,
  the sha256 of the text and the token count. Loading validates all of it.
* :func:`rotation_matrices`: one layer's matrices for the cache (``QuantConfig(rotation=
  "calibrated", rotation_path=...)``), loaded once per file and checked against the layer's
  shapes.
"""

from __future__ import annotations

import hashlib
import os
from pathlib import Path
from typing import Any, Mapping

import torch

from .checked_file import cached_loader, read_checked_header, read_tensors, write_checked

from .rotation import calibrated_rotation

FORMAT_VERSION = 1
METADATA_KEY = "kv_cache.calibration"
KIND = "query_covariance_eigh_hadamard"
ORTHONORMAL_ATOL = 1e-3
"""Largest ``|R R^T - I|`` entry accepted on load (float32 matrices are ~1e-6 off)."""

_REQUIRED_META = {"format_version": int, "kind": str, "model_type": str, "architecture": str,
                  "num_layers": int, "kv_heads": int, "q_heads": int, "head_dim": int,
                  "text_sha256": str, "tokens": int}

class CalibrationError(ValueError):
    """A calibration file that is unreadable, malformed, or fitted for another model."""


def model_shapes(config: Any) -> dict[str, Any]:
    """``model_type``, ``architecture``, ``num_layers``, ``kv_heads``, ``q_heads``, ``head_dim`` of a config."""
    q_heads = config.num_attention_heads
    head_dim = getattr(config, "head_dim", None) or config.hidden_size // q_heads
    archs = getattr(config, "architectures", None) or [type(config).__name__]
    return {"model_type": str(config.model_type), "architecture": str(archs[0]),
            "num_layers": int(config.num_hidden_layers),
            "kv_heads": int(getattr(config, "num_key_value_heads", None) or q_heads),
            "q_heads": int(q_heads), "head_dim": int(head_dim)}


def text_sha256(text: str) -> str:
    """The sha256 of ``text`` encoded as UTF-8 (hex)."""
    return hashlib.sha256(text.encode("utf-8")).hexdigest()


def _check_meta(meta: Any, where: str) -> dict[str, Any]:
    if not isinstance(meta, dict):
        raise CalibrationError(f"{where}: metadata must be a JSON object; got {type(meta).__name__}")
    for key, typ in _REQUIRED_META.items():
        if key not in meta:
            raise CalibrationError(f"{where}: metadata lacks {key!r} (required: {sorted(_REQUIRED_META)})")
        if not isinstance(meta[key], typ) or isinstance(meta[key], bool):
            raise CalibrationError(f"{where}: metadata {key!r} must be a {typ.__name__}; got {meta[key]!r}")
    if meta["format_version"] != FORMAT_VERSION:
        raise CalibrationError(f"{where}: format_version {meta['format_version']} is not supported "
                               f"(this library reads version {FORMAT_VERSION})")
    if meta["kind"] != KIND:
        raise CalibrationError(f"{where}: kind must be {KIND!r}; got {meta['kind']!r}")
    for key in ("num_layers", "kv_heads", "q_heads", "head_dim", "tokens"):
        if meta[key] < 1:
            raise CalibrationError(f"{where}: metadata {key!r} must be >= 1; got {meta[key]}")
    return meta


def _check_tensors(tensors: Mapping[str, torch.Tensor], meta: dict[str, Any], where: str) -> None:
    want = {f"layers.{i}" for i in range(meta["num_layers"])}
    if set(tensors) != want:
        extra, lost = sorted(set(tensors) - want), sorted(want - set(tensors), key=lambda k: int(k.split(".")[1]))
        raise CalibrationError(f"{where}: expected tensors layers.0 .. layers.{meta['num_layers'] - 1}; "
                               f"missing {lost[:5]}, unexpected {extra[:5]}")
    shape = (meta["kv_heads"], meta["head_dim"], meta["head_dim"])
    eye = torch.eye(meta["head_dim"], dtype=torch.float64)
    for name, t in tensors.items():
        if not isinstance(t, torch.Tensor) or t.dtype not in (torch.float32, torch.float16, torch.float64):
            raise CalibrationError(f"{where}: {name} must be a float16/float32/float64 tensor; "
                                   f"got {getattr(t, 'dtype', type(t).__name__)}")
        if tuple(t.shape) != shape:
            raise CalibrationError(f"{where}: {name} must have shape [kv_heads, head_dim, head_dim] = {list(shape)}; "
                                   f"got {list(t.shape)}")
        if not bool(torch.isfinite(t).all()):
            raise CalibrationError(f"{where}: {name} holds NaN or Inf")
        r = t.double()
        err = float((r @ r.transpose(-1, -2) - eye).abs().max())
        tol = ORTHONORMAL_ATOL if t.dtype != torch.float16 else 5e-3
        if err > tol:
            raise CalibrationError(f"{where}: {name} is not orthonormal (max |R R^T - I| = {err:.3g} > {tol})")


def save_calibration(path: str | os.PathLike, tensors: Mapping[str, torch.Tensor], meta: Mapping[str, Any]) -> Path:
    """Write ``tensors`` (``layers.<i>`` -> ``[kv_heads, d, d]``) and ``meta`` to a safetensors file.

    ``meta`` is validated (the keys of :func:`calibration_meta`) and stored as JSON under
    :data:`METADATA_KEY`; the tensors must match it (names, shapes, finite, orthonormal).

    Returns
    -------
    pathlib.Path
        The written path.

    Raises
    ------
    CalibrationError (a ValueError)
        Metadata or tensors that do not agree.
    """
    path = Path(path)
    meta = _check_meta(dict(meta), str(path))
    _check_tensors(tensors, meta, str(path))
    write_checked(path, tensors, meta, header_key=METADATA_KEY)
    return path


def load_calibration(path: str | os.PathLike) -> tuple[dict[str, torch.Tensor], dict[str, Any]]:
    """Read and validate a file written by :func:`save_calibration`.

    Returns
    -------
    (tensors, meta)
        ``layers.<i>`` -> float32 ``[kv_heads, d, d]`` on the CPU, and the metadata dict.

    Raises
    ------
    FileNotFoundError
        No file at ``path``.
    CalibrationError (a ValueError)
        The file is not readable safetensors (corrupted, truncated), lacks the metadata
        header, has another format version, or its tensors do not match its header.
    """
    where = str(path)
    meta, _ = read_checked_header(path, header_key=METADATA_KEY, sha_key=None, error=CalibrationError,
                                  what="calibration", written_by="save_calibration")
    tensors = read_tensors(path, CalibrationError, "calibration")
    meta = _check_meta(meta, where)
    _check_tensors(tensors, meta, where)
    return {k: v.float() for k, v in tensors.items()}, meta


def check_against_model(meta: Mapping[str, Any], config: Any, where: str = "calibration") -> None:
    """Raise :class:`CalibrationError` unless ``meta`` was fitted for a model shaped like ``config``."""
    have = model_shapes(config)
    for key in ("model_type", "num_layers", "kv_heads", "q_heads", "head_dim"):
        if meta.get(key) != have[key]:
            raise CalibrationError(f"{where} was fitted for {key}={meta.get(key)!r}; this model has "
                                   f"{key}={have[key]!r}")


_load_cached = cached_loader(load_calibration, 4, "calibration")


def rotation_matrices(path: str | os.PathLike, layer: int, kv_heads: int, head_dim: int,
                      device: Any = None) -> torch.Tensor:
    """Layer ``layer``'s calibrated rotations from ``path``: float32 ``[kv_heads, head_dim, head_dim]``.

    The file is read and validated once (cached by path, modification time and size); each
    call returns a fresh copy on ``device``, which the cache holds and counts.

    Raises
    ------
    FileNotFoundError
        No file at ``path``.
    CalibrationError (a ValueError)
        An invalid file, or one fitted for other shapes (the message names the file's and the
        model's values).
    """
    p = os.fspath(path)
    tensors, meta = _load_cached(p)
    if (meta["kv_heads"], meta["head_dim"]) != (kv_heads, head_dim):
        raise CalibrationError(
            f"{p} was fitted for kv_heads={meta['kv_heads']}, head_dim={meta['head_dim']} "
            f"({meta['architecture']}, {meta['num_layers']} layers); this model's layer {layer} has "
            f"kv_heads={kv_heads}, head_dim={head_dim}")
    if not 0 <= layer < meta["num_layers"]:
        raise CalibrationError(f"{p} holds layers 0..{meta['num_layers'] - 1} ({meta['architecture']}); "
                               f"this model asks for layer {layer}")
    return tensors[f"layers.{layer}"].to(device=device, dtype=torch.float32, copy=True)


__all__ = [
    "CalibrationError",
    "FORMAT_VERSION",
    "METADATA_KEY",
    "calibrate_rotations",
    "calibration_meta",
    "check_against_model",
    "load_calibration",
    "model_shapes",
    "query_covariances",
    "rotation_matrices",
    "save_calibration",
    "text_sha256",
]
