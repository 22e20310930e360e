"""KVzap scorer files: a safetensors file with a checked header (math dictionary §24).

Like a ``.kvc`` file, the header (JSON under :data:`METADATA_KEY`) carries the format, its
version, the identity of the model the scorer was fitted on (shapes and a digest of its
weights, :func:`model_identity`), how it was fitted (text
sha256, tokens, fit quality) and the sha256 of every tensor; :data:`SHA_KEY` holds the sha256
of the header text itself. Loading checks all of it; the caller checks the identity against
the model it runs (:meth:`Scorer.check_identity`).

Tensors: ``layers.<i>.<name>`` for each scored layer ``i`` and each tensor of its
:class:`~kv_cache.compression.scorer.LayerScorer` (``mu``, ``sigma``, ``w1``, ``b1`` [, ``w2``,
``b2``]), float32.
"""

from __future__ import annotations

import hashlib
import os
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Mapping

import torch

from .checked_file import cached_loader, check_format, read_checked_header, read_tensors, tensor_digest, write_checked

from .scorer import KINDS, LayerScorer, check_layer_scorer, score_hidden

FORMAT = "kv_cache.scorer"
FORMAT_VERSION = 1
METADATA_KEY = "kv_cache.scorer"
SHA_KEY = "kv_cache.scorer_sha256"
IDENTITY_KEYS = ("model_type", "architecture", "num_layers", "kv_heads", "q_heads", "head_dim", "hidden_size",
                 "weights_sha256")
"""What a scorer file records of its model; every one must match the model it is used with."""


class ScorerFileError(ValueError):
    """A scorer file that is unreadable, malformed, tampered with, or fitted for another model."""


@dataclass(frozen=True)
class Scorer:
    """A fitted KVzap scorer: one :class:`LayerScorer` per scored (full-attention) layer.

    Attributes
    ----------
    layers : dict int -> LayerScorer
    model : dict — the model identity (:data:`IDENTITY_KEYS`)
    info : dict — how it was fitted (text sha256, tokens, per-layer R^2, ...)
    path : str or None — the file it was read from
    """

    layers: Mapping[int, LayerScorer]
    model: Mapping[str, Any]
    info: Mapping[str, Any] = field(default_factory=dict)
    path: str | None = None

    @property
    def kind(self) -> str:
        return next(iter(self.layers.values())).kind

    def score(self, layer: int, hidden: torch.Tensor) -> torch.Tensor:
        """Predicted log scores ``[batch, kv_heads, T]`` float32 of layer ``layer``'s input ``hidden``
        ``[batch, T, hidden_size]``."""
        if layer not in self.layers:
            raise ValueError(f"the scorer{self._where()} has no model for layer {layer}; it scores layers "
                             f"{sorted(self.layers)}")
        return score_hidden(self.layers[layer], hidden)

    def check_identity(self, identity: Mapping[str, Any], what: str = "this model") -> None:
        """Raise :class:`ScorerFileError` unless ``identity`` is the model the scorer was fitted on."""
        for key in IDENTITY_KEYS:
            if self.model.get(key) != identity.get(key):
                raise ScorerFileError(
                    f"the KVzap scorer{self._where()} was fitted on another model: {key} expected "
                    f"{self.model.get(key)!r} (in the file), received {identity.get(key)!r} ({what}); fit one for "
                    "this model with `kvcache calibrate-scorer --model M --text T -o scorer.safetensors`"
                )

    def _where(self) -> str:
        return f" {self.path!r}" if self.path else ""


def model_identity(model: Any) -> dict[str, Any]:
    """What a scorer depends on in a model (:data:`IDENTITY_KEYS`): its shapes, and the sha256 of
    the first and last 256 rows of its input embedding rounded to bfloat16, so the same weights
    loaded in float32, bfloat16 or float16 (from the same checkpoint) match and another
    checkpoint of the same shapes does not."""
    cfg = model.config
    cfg = cfg.get_text_config() if hasattr(cfg, "get_text_config") else cfg
    q_heads = int(cfg.num_attention_heads)
    head_dim = getattr(cfg, "head_dim", None) or cfg.hidden_size // q_heads
    archs = getattr(cfg, "architectures", None) or getattr(model.config, "architectures", None) or [type(model).__name__]
    emb = model.get_input_embeddings().weight.detach()
    rows = torch.cat([emb[:256], emb[-256:]]).float().cpu().to(torch.bfloat16)
    return {"model_type": str(cfg.model_type), "architecture": str(archs[0]),
            "num_layers": int(cfg.num_hidden_layers),
            "kv_heads": int(getattr(cfg, "num_key_value_heads", None) or q_heads), "q_heads": q_heads,
            "head_dim": int(head_dim), "hidden_size": int(cfg.hidden_size),
            "weights_sha256": hashlib.sha256(rows.view(torch.int16).numpy().tobytes()).hexdigest()}


_digest = tensor_digest  # the old private name


def save_scorer(path: str | os.PathLike, scorer: Scorer) -> Path:
    """Write ``scorer`` to ``path`` (written to a temporary file, then renamed)."""
    path = Path(path)
    tensors: dict[str, torch.Tensor] = {}
    for i, ls in sorted(scorer.layers.items()):
        check_layer_scorer(ls, f"layer {i}")
        for name, t in ls.tensors().items():
            tensors[f"layers.{i}.{name}"] = t.detach().float().cpu().contiguous()
    missing = [k for k in IDENTITY_KEYS if k not in scorer.model]
    if missing:
        raise ScorerFileError(f"the scorer's model identity lacks {missing}")
    header = {"format": FORMAT, "format_version": FORMAT_VERSION, "kind": scorer.kind,
              "layers": sorted(int(i) for i in scorer.layers), "model": dict(scorer.model),
              "info": dict(scorer.info), "tensors": {k: _digest(v) for k, v in sorted(tensors.items())}}
    write_checked(path, tensors, header, header_key=METADATA_KEY, sha_key=SHA_KEY)
    return path


def read_header(path: str | os.PathLike) -> dict[str, Any]:
    """The checked header of a scorer file (format, version, header sha256), tensors unread."""
    header, _ = read_checked_header(path, header_key=METADATA_KEY, sha_key=SHA_KEY, error=ScorerFileError,
                                    what="KVzap scorer", written_by="`kvcache calibrate-scorer`")
    check_format(header, path, FORMAT, FORMAT_VERSION, ScorerFileError)
    if header.get("kind") not in KINDS:
        raise ScorerFileError(f"{path}: kind must be one of {list(KINDS)}; got {header.get('kind')!r}")
    return header


def _read_scorer(path: str) -> Scorer:
    header = read_header(path)
    tensors = read_tensors(path, ScorerFileError, "KVzap scorer", header["tensors"])
    layers = {}
    for i in header["layers"]:
        get = {n: tensors.get(f"layers.{i}.{n}") for n in ("mu", "sigma", "w1", "b1", "w2", "b2")}
        if any(get[n] is None for n in ("mu", "sigma", "w1", "b1")):
            raise ScorerFileError(f"{path}: layer {i} lacks tensors")
        ls = LayerScorer(**get)
        try:
            check_layer_scorer(ls, f"{path}: layer {i}")
        except ValueError as exc:
            raise ScorerFileError(str(exc)) from None
        layers[int(i)] = ls
    return Scorer(layers, header["model"], header.get("info", {}), path)


load_scorer = cached_loader(_read_scorer, 8, "KVzap scorer")
load_scorer.__doc__ = """Read and check a scorer file (cached by path, size and modification time)."""


__all__ = ["FORMAT", "FORMAT_VERSION", "IDENTITY_KEYS", "Scorer", "ScorerFileError", "load_scorer",
           "model_identity", "read_header", "save_scorer"]
