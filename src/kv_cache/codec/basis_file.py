"""Per-model codec bases: a safetensors file with a checked header, referenced by fingerprint.

``kvcache calibrate-codec`` fits, per layer, KV head and K / V, the PCA of the cached vectors on
calibration text (:mod:`.transform`) and writes them here. A ``.kvc`` file coded with a basis
names it by its fingerprint (the sha256 of this file's header, which holds the sha256 of every
tensor): the basis is not embedded in each file.

Tensors (``l``: layer): ``layers.<l>.k_mean`` / ``v_mean`` ``[H, d]`` float32,
``layers.<l>.k_basis`` / ``v_basis`` ``[H, d, d]`` float16 (columns by decreasing variance;
orthonormalized on load), ``layers.<l>.k_var`` / ``v_var`` ``[H, d]`` float32, and where the
queries could be read ``layers.<l>.k_metric`` ``[H, d, d]`` float32 (the keys' query metric
``A``, :func:`~kv_cache.codec.transform.query_metric`; inverted on load).

Header (JSON): the format and its version, the identity of the model
(:func:`kv_cache.compression.scorer_file.model_identity`: shapes and a digest of its
embedding), how it was fitted (texts and their sha256, tokens) and the sha256 of every tensor.
Loading checks all of it; :meth:`CodecBasis.check_identity` checks the model.
"""

from __future__ import annotations

import os
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Mapping

import torch

from ..compression.checked_file import cached_loader, check_format, read_checked_header, read_tensors, tensor_digest, write_checked
from ..compression.scorer_file import IDENTITY_KEYS, model_identity
from .transform import orthonormalize

FORMAT = "kv_cache.codec_basis"
FORMAT_VERSION = 1
METADATA_KEY = "kv_cache.codec_basis"
SHA_KEY = "kv_cache.codec_basis_sha256"
KINDS = ("k", "v")
CODECS_DIR = Path(__file__).resolve().parent.parent / "assets" / "codec_bases"
"""Bases shipped with the package (``kv_cache/assets/codec_bases/*.safetensors``), found by fingerprint or model."""


class CodecBasisError(ValueError):
    """A codec basis file that is unreadable, malformed, tampered with, or fitted for another model."""


@dataclass(frozen=True)
class LayerBasis:
    """One layer's bases: ``mean`` ``[H, d]``, ``basis`` ``[H, d, d]`` (orthonormal), ``var`` ``[H, d]``
    for keys and for values (float32)."""

    k_mean: torch.Tensor
    k_basis: torch.Tensor
    k_var: torch.Tensor
    v_mean: torch.Tensor
    v_basis: torch.Tensor
    v_var: torch.Tensor
    k_metric: torch.Tensor | None = None  # [H, d, d]: the query metric A of the keys (None: identity)
    k_inverse: torch.Tensor | None = None  # [H, d, d]: A^-1

    def get(self, kind: str) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        return getattr(self, f"{kind}_mean"), getattr(self, f"{kind}_basis"), getattr(self, f"{kind}_var")

    def metric(self, kind: str) -> tuple[torch.Tensor | None, torch.Tensor | None]:
        """``(A [H, d, d], A^-1)`` for keys with a query metric; ``(None, None)`` otherwise."""
        return (self.k_metric, self.k_inverse) if kind == "k" else (None, None)

    def matrices(self, kind: str) -> tuple[torch.Tensor, torch.Tensor]:
        """``(A U, U^T A^-1)`` ``[H, d, d]`` float32: the forward and inverse transforms in one
        matrix each (``A = I`` without a metric), computed once per basis in float64."""
        key = f"_{kind}_matrices"
        if key not in self.__dict__:
            _, U, _ = self.get(kind)
            A, Ainv = self.metric(kind)
            fwd = U.double() if A is None else A.double() @ U.double()
            inv = U.double().transpose(-1, -2) if Ainv is None else U.double().transpose(-1, -2) @ Ainv.double()
            object.__setattr__(self, key, (fwd.float(), inv.float()))
        return self.__dict__[key]


@dataclass(frozen=True)
class CodecBasis:
    """A fitted per-model basis (:mod:`kv_cache.codec.basis_file`). ``fingerprint``: the sha256
    of its header, by which ``.kvc`` files refer to it."""

    layers: Mapping[int, LayerBasis]
    model: Mapping[str, Any]
    info: Mapping[str, Any] = field(default_factory=dict)
    fingerprint: str = ""
    path: str | None = None

    @property
    def keys_before_rope(self) -> bool:
        """Whether the key bases were fitted on keys before RoPE (``info["keys"] == "before_rope"``):
        the codec then turns each coded key back by its position first (math dictionary §27.6)."""
        return self.info.get("keys") == "before_rope"

    @property
    def heads(self) -> int:
        return next(iter(self.layers.values())).k_mean.shape[0]

    @property
    def head_dim(self) -> int:
        return next(iter(self.layers.values())).k_mean.shape[1]

    def check_identity(self, identity: Mapping[str, Any], what: str = "this model") -> None:
        """Raise :class:`CodecBasisError` unless ``identity`` is the model the basis was fitted on."""
        for key in IDENTITY_KEYS:
            if self.model.get(key) != identity.get(key):
                raise CodecBasisError(
                    f"the codec basis{f' {self.path!r}' if self.path else ''} was fitted on another model: {key} "
                    f"expected {self.model.get(key)!r} (in the file), received {identity.get(key)!r} ({what}); fit "
                    "one for this model with `kvcache calibrate-codec --model M -o basis.safetensors`")


_digest = tensor_digest  # the old private name


def save_basis(path: str | os.PathLike, layers: Mapping[int, Mapping[str, torch.Tensor]], model: Mapping[str, Any],
               info: Mapping[str, Any]) -> str:
    """Write bases (``layers[l]`` holds ``k_mean``, ``k_basis``, ``k_var``, ``v_...``) to ``path``
    (a temporary file, then renamed); returns the fingerprint."""
    tensors: dict[str, torch.Tensor] = {}
    for i, rec in sorted(layers.items()):
        for kind in KINDS:
            tensors[f"layers.{i}.{kind}_mean"] = rec[f"{kind}_mean"].float().contiguous()
            tensors[f"layers.{i}.{kind}_basis"] = rec[f"{kind}_basis"].to(torch.float16).contiguous()
            tensors[f"layers.{i}.{kind}_var"] = rec[f"{kind}_var"].float().contiguous()
        if rec.get("k_metric") is not None:
            tensors[f"layers.{i}.k_metric"] = rec["k_metric"].float().contiguous()
    missing = [k for k in IDENTITY_KEYS if k not in model]
    if missing:
        raise CodecBasisError(f"the basis' model identity lacks {missing}")
    header = {"format": FORMAT, "format_version": FORMAT_VERSION, "layers": sorted(int(i) for i in layers),
              "model": dict(model), "info": dict(info),
              "tensors": {k: _digest(v) for k, v in sorted(tensors.items())}}
    return write_checked(path, tensors, header, header_key=METADATA_KEY, sha_key=SHA_KEY)


def read_header(path: str | os.PathLike) -> dict[str, Any]:
    """The checked header of a basis file (format, version, header sha256), tensors unread; the
    fingerprint is added as ``"fingerprint"``."""
    header, found = read_checked_header(path, header_key=METADATA_KEY, sha_key=SHA_KEY, error=CodecBasisError,
                                        what="codec basis", written_by="`kvcache calibrate-codec`")
    check_format(header, path, FORMAT, FORMAT_VERSION, CodecBasisError)
    header["fingerprint"] = found
    return header


def _read_basis(path: str) -> CodecBasis:
    header = read_header(path)
    tensors = read_tensors(path, CodecBasisError, "codec basis", header["tensors"])
    layers, shape = {}, None
    for i in header["layers"]:
        rec = {}
        for kind in KINDS:
            mean, basis, var = (tensors.get(f"layers.{i}.{kind}_{n}") for n in ("mean", "basis", "var"))
            if mean is None or basis is None or var is None:
                raise CodecBasisError(f"{path}: layer {i} lacks its {kind} tensors")
            h, d = mean.shape
            if basis.shape != (h, d, d) or var.shape != (h, d) or (shape is not None and (h, d) != shape):
                raise CodecBasisError(f"{path}: layer {i} {kind} shapes {tuple(mean.shape)}, {tuple(basis.shape)}, "
                                      f"{tuple(var.shape)} are not [H, d], [H, d, d], [H, d] of one H, d")
            if not all(torch.isfinite(t).all() for t in (mean, basis, var)):
                raise CodecBasisError(f"{path}: layer {i} {kind} holds NaN or Inf")
            shape = (h, d)
            rec.update({f"{kind}_mean": mean.float(), f"{kind}_basis": orthonormalize(basis.float()),
                        f"{kind}_var": var.float()})
        metric = tensors.get(f"layers.{i}.k_metric")
        if metric is not None:
            h, d = shape
            if metric.shape != (h, d, d) or not torch.isfinite(metric).all():
                raise CodecBasisError(f"{path}: layer {i} k_metric must be finite [H, d, d]; got {tuple(metric.shape)}")
            try:
                inverse = torch.linalg.inv(metric.double())
            except RuntimeError:
                raise CodecBasisError(f"{path}: layer {i} k_metric is singular") from None
            if not torch.isfinite(inverse).all():
                raise CodecBasisError(f"{path}: layer {i} k_metric is singular")
            rec.update(k_metric=metric.float(), k_inverse=inverse.float())
        layers[int(i)] = LayerBasis(**rec)
    if not layers:
        raise CodecBasisError(f"{path}: holds no layer")
    return CodecBasis(layers, header["model"], header.get("info", {}), header["fingerprint"], path)


load_basis = cached_loader(_read_basis, 4, "codec basis")
load_basis.__doc__ = """Read and check a basis file (cached by path, size and modification time)."""


def find_basis(fingerprint: str, directories: list[Path] | None = None) -> CodecBasis | None:
    """The basis of ``fingerprint`` among the shipped ones and ``$KV_CACHE_HOME/codecs`` (None: none)."""
    for d in directories if directories is not None else search_dirs():
        if not d.is_dir():
            continue
        for p in sorted(d.glob("*.safetensors")):
            try:
                if read_header(p)["fingerprint"] == fingerprint:
                    return load_basis(p)
            except (CodecBasisError, OSError, ValueError):
                continue
    return None


def basis_for_model(model: torch.nn.Module, directories: list[Path] | None = None,
                    keys_before_rope: bool | None = None) -> CodecBasis | None:
    """The basis fitted on ``model`` among the shipped ones and ``$KV_CACHE_HOME/codecs`` (None:
    none). ``keys_before_rope``: only bases fitted before (True) or after (False) RoPE; None:
    either, one fitted before RoPE first (math dictionary §27.6)."""
    identity = model_identity(model)
    found = []
    for d in directories if directories is not None else search_dirs():
        if not d.is_dir():
            continue
        for p in sorted(d.glob("*.safetensors")):
            try:
                head = read_header(p)
            except (CodecBasisError, OSError, ValueError):
                continue
            if all(head["model"].get(k) == identity.get(k) for k in IDENTITY_KEYS):
                before = (head.get("info") or {}).get("keys") == "before_rope"
                if keys_before_rope is None or before == keys_before_rope:
                    found.append((not before, len(found), p))
    return load_basis(min(found)[2]) if found else None


def search_dirs() -> list[Path]:
    """Where bases are looked for: the package's ``assets/codec_bases/``, then ``$KV_CACHE_HOME/codecs``."""
    from ..models.paths import default_cache_dir

    return [CODECS_DIR, default_cache_dir() / "codecs"]


__all__ = ["CODECS_DIR", "CodecBasis", "CodecBasisError", "LayerBasis", "basis_for_model", "find_basis",
           "load_basis", "read_header", "save_basis", "search_dirs"]
