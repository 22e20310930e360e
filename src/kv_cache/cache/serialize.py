"""Save and load a :class:`~kv_cache.CompressedCache`: safetensors tensors plus a checked JSON header.

A file written by :func:`save_cache` is a plain safetensors file (no pickle):

* the tensors, keyed by where they live: ``layer3.row2.packed.k_codes`` (layer 3, ragged row 2,
  its packed key codes), ``layer0.keys``, ``layer1.state.h2o``, ``layer2._starts``, ...;
* the safetensors metadata (strings only):

  - ``format`` = :data:`FORMAT` and ``format_version`` = :data:`FORMAT_VERSION`, checked first;
  - ``kv_cache``: the JSON header -- the quantization and eviction settings, the model's
    identity (architecture, layer / head shapes, the sha256 of its config and the config
    itself, to name what differs), the tokens seen, the structure of every layer (its scalars
    and, object by object, the attributes of its storage) and a sha256 of every tensor (name,
    dtype, shape and bytes);
  - ``kv_cache_sha256``: the sha256 of that header.

:func:`load_cache` checks all of it before building anything: a different model, a truncated or
corrupted file (a flipped byte in a tensor or in the header), another format version or a file
that is not a kv_cache file each raise ``ValueError`` naming what was expected and what was
found; a missing file raises ``FileNotFoundError``. A loaded cache holds the same tensors, so it
answers exactly as the saved one and its :meth:`~kv_cache.CompressedCache.memory_report` is equal.

The storages are written from their attributes (the object graph of a layer's storage, restricted
to the classes of :data:`~kv_cache.cache.serialize_state.STORAGE_CLASSES` and the rotation
classes): a new scalar or tensor attribute is saved without a change here; an attribute of an
unknown type is refused when saving. That walk (objects <-> tensors + JSON) lives in
:mod:`kv_cache.cache.serialize_state`; this module owns the file format and its checks.
"""

from __future__ import annotations

import hashlib
import json
import os
import struct
from pathlib import Path
from typing import Any

import torch

from .cache import CompressedCache
from .config import QuantConfig
from .report import fp16_kv_bytes, kv_geometry
from .serialize_state import (
    STORAGE_CLASSES,  # noqa: F401  (re-exported: kv_cache.cache.serialize.STORAGE_CLASSES)
    _decode_layer,
    _decode_policy,
    _decode_quant,
    _dtype_name,
    _encode_layer,
    _encode_policy,
    _encode_quant,
    _Reader,
    _Writer,
)

FORMAT = "kv_cache.compressed_cache"
"""The value of the ``format`` metadata key of every file written here."""

FORMAT_VERSION = 3
"""Bumped whenever the layout of the file changes. Version 2: objects are written by their
layout's declared fields (``FIELDS``), not by attribute. Version 3: the header may hold a
``codec`` record (the full-precision K/V transform-coded, :mod:`kv_cache.codec`) and
``fp16_bytes`` (the float16 K/V of every token the file covers: its ratio's numerator)."""
READ_VERSIONS = (2, 3)
"""Versions :func:`load_cache` reads (a version-2 file has no codec record)."""

_VOLATILE_CONFIG_KEYS = ("transformers_version", "torch_dtype", "dtype", "architectures")
"""Config keys that do not change the cache (keys starting with ``_`` are dropped too):
the model's identity is its shapes and the settings its attention depends on."""

_HEADER_KEYS = ("model", "quant", "eviction", "tokens_seen", "layers", "extra", "tensors")
_MAX_HEADER = 100 * 1024 * 1024  # safetensors' own limit on the JSON header


def _tensor_digest(t: torch.Tensor) -> str:
    """sha256 of a CPU tensor's dtype, shape and bytes."""
    h = hashlib.sha256(f"{_dtype_name(t.dtype)}{tuple(t.shape)}".encode())
    if t.numel():
        h.update(t.contiguous().reshape(-1).view(torch.uint8).numpy())
    return h.hexdigest()


def model_identity(config: Any) -> dict[str, Any]:
    """What a cache depends on in a model: its type, K/V shapes and the sha256 of its config.

    ``config_hash`` covers every config entry except those of :data:`_VOLATILE_CONFIG_KEYS` and
    private ones (``_name_or_path``, ...), so the same model loaded from another folder matches.
    """
    geo = kv_geometry(config)
    relevant = _relevant_config(config)
    blob = json.dumps(relevant, sort_keys=True, default=str).encode()
    return {
        "model_type": geo.model_type,
        "architectures": list(getattr(config, "architectures", None) or []),
        "num_layers": geo.layers,
        "kv_heads": geo.kv_heads,
        "head_dim": geo.head_dim,
        "config_hash": hashlib.sha256(blob).hexdigest(),
        "config": json.loads(json.dumps(relevant, sort_keys=True, default=str)),
    }


def _relevant_config(config: Any) -> dict[str, Any]:
    d = config.to_dict() if hasattr(config, "to_dict") else dict(vars(config))
    return {k: v for k, v in d.items() if not k.startswith("_") and k not in _VOLATILE_CONFIG_KEYS}


def _check_model(saved: dict[str, Any], config: Any, path: str) -> None:
    now = model_identity(config)
    for key in ("model_type", "num_layers", "kv_heads", "head_dim"):
        if saved.get(key) != now[key]:
            raise ValueError(
                f"{path}: the cache was saved from a different model: {key} expected {saved.get(key)!r} "
                f"(in the file), received {now[key]!r} (this model)"
            )
    if saved.get("config_hash") != now["config_hash"]:
        old, new = saved.get("config", {}), now["config"]
        diff = sorted(k for k in set(old) | set(new) if old.get(k) != new.get(k))
        shown = "; ".join(f"{k}: expected {old.get(k)!r}, received {new.get(k)!r}" for k in diff[:8])
        raise ValueError(
            f"{path}: the cache was saved from a different model config (sha256 expected "
            f"{saved.get('config_hash')}, received {now['config_hash']})" + (f": {shown}" if shown else "")
        )


# ---------------------------------------------------------------------------------------- the file
def save_cache(cache: CompressedCache, path: str | os.PathLike, *, model_config: Any = None,
               extra: dict[str, Any] | None = None, codec: Any = None, file_bytes: int | None = None,
               codec_settings: Any = None) -> int:
    """Write ``cache`` to ``path`` (safetensors + JSON header; see the module docstring).

    Parameters
    ----------
    cache : CompressedCache
        A prefilled (and compressed) cache, outside any ``session()`` or forward call.
    path : str or os.PathLike
    model_config : transformers.PretrainedConfig, optional
        The model's config, recorded as its identity; defaults to ``cache.config``.
    extra : dict, optional
        JSON-serializable values returned by :func:`load_cache` (e.g. ``{"context_tokens": n}``).
    codec : kv_cache.codec.CodecBasis, optional
        Transform-code the full-precision K/V with this model's basis (:mod:`kv_cache.codec`);
        the file names the basis by its fingerprint. None: the tensors as held.
    file_bytes : int, optional
        With ``codec``: the whole file's size target (least squared error within it); None:
        the codec's finest steps.
    codec_settings : kv_cache.codec.CodecSettings, optional
        What the codec keeps exact (default: 4 sinks and the last 8 tokens of every head).

    Returns
    -------
    int
        Bytes written.

    Raises
    ------
    TypeError
        ``cache`` is not a CompressedCache.
    ValueError
        The cache is mid-session or mid-forward, holds an object of an unknown type, or
        ``extra`` is not JSON-serializable.
    """
    from safetensors.torch import save

    if not isinstance(cache, CompressedCache):
        raise TypeError(f"save_cache needs a CompressedCache; got {type(cache).__name__}")
    if codec is not None and any(layer.rope_frame is not None for layer in cache.layers):
        raise ValueError("save_cache: the transform codec (codec=) does not read a cache storing keys before RoPE "
                         "(QuantConfig(pre_rope=True)) yet; save it without codec=, or prefill with pre_rope=False")
    config = cache.config if model_config is None else model_config
    w = _Writer(cache.quant, None)
    layers = [_encode_layer(layer, i, w) for i, layer in enumerate(cache.layers)]
    try:
        extra_json = json.loads(json.dumps(extra or {}))
    except TypeError as exc:
        raise ValueError(f"save_cache: extra must be JSON-serializable: {exc}") from None
    tokens_seen = cache.get_seq_length()
    base = {
        "quant": _encode_quant(cache.quant),
        "eviction": _encode_policy(cache.eviction),
        "model": model_identity(config),
        "tokens_seen": tokens_seen,
        "layers": layers,
        "extra": extra_json,
        "on_cpu": w.on_cpu,
        "fp16_bytes": fp16_kv_bytes(config, tokens_seen, batch=cache_batch(cache)),
    }

    def serialized(tensors: dict[str, torch.Tensor], codec_record: dict[str, Any] | None) -> bytes:
        header = {**base, "tensors": {name: _tensor_digest(t) for name, t in sorted(tensors.items())}}
        if codec_record is not None:
            header["codec"] = codec_record
        text = json.dumps(header, sort_keys=True, separators=(",", ":"))
        meta = {"format": FORMAT, "format_version": str(FORMAT_VERSION), "kv_cache": text,
                "kv_cache_sha256": hashlib.sha256(text.encode()).hexdigest()}
        return save(tensors, metadata=meta)

    if codec is None:
        if file_bytes is not None or codec_settings is not None:
            raise ValueError("save_cache: file_bytes and codec_settings need codec= (a kv_cache.codec.CodecBasis)")
        data = serialized(w.tensors, None)
    else:
        from ..codec import encode_state

        if file_bytes is not None and (isinstance(file_bytes, bool) or not isinstance(file_bytes, int) or file_bytes < 1):
            raise ValueError(f"save_cache: file_bytes must be a positive int; got {file_bytes!r}")
        frames = _frames(config, cache.geometry.head_dim) if getattr(codec, "keys_before_rope", False) else None
        tensors, record = encode_state(w.tensors, layers, codec, lambda t, r: len(serialized(t, r)), file_bytes,
                                       codec_settings, frames=frames)
        data = serialized(tensors, record)
    path = Path(path)
    tmp = path.with_name(path.name + ".tmp")
    tmp.write_bytes(data)
    os.replace(tmp, path)  # never a half-written file under the final name
    return len(data)


def _read_header(data: bytes, path: str) -> tuple[dict[str, Any], dict[str, str]]:
    """The safetensors JSON header of ``data`` and its metadata, checked for size and format."""
    not_ours = f"{path} is not a kv_cache file (expected a safetensors file written by kv_cache.save_cache)"
    if len(data) < 8:
        raise ValueError(f"{not_ours}: it holds {len(data)} bytes")
    (n,) = struct.unpack("<Q", data[:8])
    if n > _MAX_HEADER:
        raise ValueError(f"{not_ours}: its first 8 bytes give a header of {n} bytes")
    if 8 + n > len(data):
        raise ValueError(f"{path} is truncated: expected a header of {n} bytes after the first 8, "
                         f"found {len(data) - 8} bytes in the file")
    try:
        st_header = json.loads(data[8:8 + n].decode("utf-8"))
    except (UnicodeDecodeError, json.JSONDecodeError) as exc:
        raise ValueError(f"{not_ours}, or its header is corrupted: {exc}") from None
    if not isinstance(st_header, dict):
        raise ValueError(f"{not_ours}: its header is not a JSON object")
    meta = st_header.pop("__metadata__", None) or {}
    if meta.get("format") != FORMAT:
        raise ValueError(f"{not_ours}: format expected {FORMAT!r}, found {meta.get('format')!r}")
    if meta.get("format_version") not in [str(v) for v in READ_VERSIONS]:
        raise ValueError(f"{path}: kv_cache format version expected one of {list(READ_VERSIONS)}, found "
                         f"{meta.get('format_version')!r} (written by another version of kv_cache)")
    try:
        end = max((int(e["data_offsets"][1]) for e in st_header.values()), default=0)
    except (TypeError, KeyError, ValueError, IndexError):
        raise ValueError(f"{path} is corrupted: malformed tensor table in its header") from None
    if 8 + n + end != len(data):
        what = "truncated" if 8 + n + end > len(data) else "corrupted (trailing bytes)"
        raise ValueError(f"{path} is {what}: expected {8 + n + end} bytes, found {len(data)}")
    return st_header, meta


def _read_file(path: str | os.PathLike) -> tuple[bytes, dict[str, Any], str]:
    """The bytes of a kv_cache file and its checked JSON header (tensors not read yet)."""
    p = Path(path)
    if not p.is_file():
        raise FileNotFoundError(f"no kv_cache file at {str(p)!r}")
    data, name = p.read_bytes(), str(p)
    _, meta = _read_header(data, name)
    text = meta.get("kv_cache")
    if not isinstance(text, str):
        raise ValueError(f"{name} is not a kv_cache file: its metadata has no 'kv_cache' header")
    found = hashlib.sha256(text.encode()).hexdigest()
    if meta.get("kv_cache_sha256") != found:
        raise ValueError(f"{name} is corrupted: header sha256 expected {meta.get('kv_cache_sha256')}, found {found}")
    try:
        header = json.loads(text)
    except json.JSONDecodeError as exc:
        raise ValueError(f"{name} is corrupted: unreadable kv_cache header ({exc})") from None
    missing = [k for k in _HEADER_KEYS if not isinstance(header, dict) or k not in header]
    if missing:
        raise ValueError(f"{name} is corrupted: its kv_cache header lacks {missing}")
    return data, header, name


def read_info(path: str | os.PathLike) -> dict[str, Any]:
    """The header of a kv_cache file, checked (format, version, sizes, header sha256), without
    reading its tensors: ``model`` (identity), ``quant``, ``eviction``, ``tokens_seen``, ``extra``.

    Raises the errors of :func:`load_cache` for the file itself (not the model check)."""
    data, header, _ = _read_file(path)
    out = {k: header[k] for k in ("model", "quant", "eviction", "tokens_seen", "extra")}
    out["file_bytes"] = len(data)
    if isinstance(header.get("fp16_bytes"), int):  # version 3
        out["fp16_bytes"] = header["fp16_bytes"]
        out["file_ratio"] = header["fp16_bytes"] / len(data)
    if isinstance(header.get("codec"), dict):
        out["codec"] = {"basis": header["codec"].get("basis"), "settings": header["codec"].get("settings")}
    return out


def rewrite_extra(path: str | os.PathLike, extra: dict[str, Any]) -> int:
    """Replace the ``extra`` of the kv_cache file at ``path`` (its tensors unchanged), atomically:
    the new file is written next to it (``<name>.tmp``, fsynced), then renamed over it. Returns
    the bytes written; raises the errors of :func:`read_info` for a file that fails its checks."""
    from safetensors.torch import load, save

    data, header, _ = _read_file(path)
    version = _read_header(data, str(path))[1]["format_version"]  # a version-2 file stays one
    try:
        header = {**header, "extra": json.loads(json.dumps(extra))}
    except TypeError as exc:
        raise ValueError(f"rewrite_extra: extra must be JSON-serializable: {exc}") from None
    text = json.dumps(header, sort_keys=True, separators=(",", ":"))
    meta = {"format": FORMAT, "format_version": version, "kv_cache": text,
            "kv_cache_sha256": hashlib.sha256(text.encode()).hexdigest()}
    out = save(load(data), metadata=meta)
    p = Path(path)
    tmp = p.with_name(p.name + ".tmp")
    with open(tmp, "wb") as f:
        f.write(out)
        f.flush()
        os.fsync(f.fileno())
    os.replace(tmp, p)
    return len(out)


def cache_batch(cache: CompressedCache) -> int:
    """Rows of a prefilled cache (1 when nothing is stored yet)."""
    return next((layer.storage.batch for layer in cache.layers if layer.storage is not None), 1)


def _decode_codec(tensors: dict[str, torch.Tensor], header: dict[str, Any], cache: CompressedCache, codec: Any,
                  name: str) -> dict[str, torch.Tensor]:
    """The coded K/V of a version-3 file decoded (:func:`kv_cache.codec.decode_state`), after the
    tokens it claims are checked against the model's positions."""
    from ..codec import decode_state, find_basis

    record = header["codec"]
    fingerprint = record.get("basis") if isinstance(record, dict) else None
    basis = codec if codec is not None else (find_basis(fingerprint) if isinstance(fingerprint, str) else None)
    if basis is None:
        raise ValueError(f"{name} is transform-coded with the codec basis {fingerprint!r}, which is neither shipped "
                         "nor in $KV_CACHE_HOME/codecs: pass codec= (kv_cache.codec.load_basis(path)) or fit it with "
                         "`kvcache calibrate-codec --model M -o $KV_CACHE_HOME/codecs/M.safetensors`")
    tokens = header.get("tokens_seen")
    limit = getattr(cache.config, "max_position_embeddings", None) or 1 << 22
    if isinstance(tokens, bool) or not isinstance(tokens, int) or not 0 < tokens <= limit:
        raise ValueError(f"{name} is corrupted: tokens seen must be an int in [1, {limit}] (the model's positions); "
                         f"found {tokens!r}")
    geo = cache.geometry
    before = isinstance(record, dict) and record.get("keys_before_rope") is True
    return decode_state(tensors, record, basis, tokens_seen=tokens, layers=geo.layers, kv_heads=geo.kv_heads,
                        head_dim=geo.head_dim, where=name, layer_recs=header.get("layers") if before else None,
                        frames=_frames(cache.config, geo.head_dim) if before else None)


def _frames(config: Any, head_dim: int) -> list:
    """Each layer's rotary frame for the transform codec's keys before RoPE (§27.6)."""
    from .rope_frame import rope_frames

    return rope_frames(config, head_dim)


def load_cache(path: str | os.PathLike, *, model_config: Any, device: str | torch.device | None = None,
               codec: Any = None, quant: QuantConfig | None = None) -> tuple[CompressedCache, dict[str, Any]]:
    """Read a file written by :func:`save_cache` for the model of ``model_config``.

    Parameters
    ----------
    path : str or os.PathLike
    model_config : transformers.PretrainedConfig
        The config of the model that will read the cache; it must be the one the cache was
        saved from (type, K/V shapes, config hash).
    device : str or torch.device, optional
        Where the tensors go (default: CPU).
    codec : kv_cache.codec.CodecBasis, optional
        The basis a transform-coded file names (by fingerprint); None: found among the shipped
        bases and ``$KV_CACHE_HOME/codecs`` (:func:`kv_cache.codec.find_basis`).
    quant : QuantConfig, optional
        The layout to hold a full-precision file's tokens in (a codec file decodes to full
        precision): :func:`kv_cache.cache.relayout.quantize_cache` after the load. A quantized
        file with ``quant`` raises ``ValueError``.

    Returns
    -------
    (CompressedCache, dict)
        The cache, as saved, and the ``extra`` dict given to :func:`save_cache`.

    Raises
    ------
    FileNotFoundError
        No file at ``path``.
    ValueError
        Not a kv_cache file; another format version; a truncated or corrupted file (sizes,
        header checksum, a tensor's sha256); a different model (the message names the
        expected and received values).
    """
    from safetensors import SafetensorError
    from safetensors.torch import load

    if quant is not None and not isinstance(quant, QuantConfig):
        raise TypeError(f"quant must be a QuantConfig or None; got {type(quant).__name__}")
    layout = quant  # the name quant is the file's own below
    data, header, name = _read_file(path)
    saved_model, layer_recs, digests = header["model"], header["layers"], header["tensors"]
    _check_model(saved_model, model_config, name)
    try:
        tensors = load(data)
    except SafetensorError as exc:
        raise ValueError(f"{name} is corrupted: {exc}") from None
    del data
    if set(tensors) != set(digests):
        raise ValueError(f"{name} is corrupted: tensors expected {sorted(set(digests) - set(tensors))[:5]} "
                         f"(missing), found {sorted(set(tensors) - set(digests))[:5]} (unexpected)")
    for tname, t in tensors.items():
        got = _tensor_digest(t)
        if got != digests[tname]:
            raise ValueError(f"{name} is corrupted: tensor {tname!r} sha256 expected {digests[tname]}, found {got}")

    quant, policy = _decode_quant(header["quant"]), _decode_policy(header["eviction"])
    cache = CompressedCache(model_config, quant=quant, eviction=policy)
    if "codec" in header:
        tensors = _decode_codec(tensors, header, cache, codec, name)
    if len(layer_recs) != len(cache.layers):
        raise ValueError(f"{name} is corrupted: layers expected {len(cache.layers)}, found {len(layer_recs)}")
    dev = torch.device("cpu" if device is None else device)
    reader = _Reader(tensors, quant, dev, set(header.get("on_cpu", [])))
    try:
        for layer, rec in zip(cache.layers, layer_recs):
            _decode_layer(layer, rec, reader)
    except (KeyError, TypeError, AttributeError) as exc:
        raise ValueError(f"{name} is corrupted: unreadable layer record ({type(exc).__name__}: {exc})") from None
    if reader.used != set(tensors):
        raise ValueError(f"{name} is corrupted: tensors no layer refers to: {sorted(set(tensors) - reader.used)[:5]}")
    kv_heads = cache.geometry.kv_heads
    for i, layer in enumerate(cache.layers):
        if layer.storage is not None and layer.storage.heads != kv_heads:
            raise ValueError(f"{name}: layer {i} holds {layer.storage.heads} KV heads; expected {kv_heads}")
    if cache.get_seq_length() != header.get("tokens_seen"):
        raise ValueError(f"{name} is corrupted: tokens seen expected {header.get('tokens_seen')}, "
                         f"found {cache.get_seq_length()}")
    if layout is not None:
        if cache.quant is not None:
            raise ValueError(f"{name} holds a quantized cache ({cache.quant!r}); quant= re-stores a full-precision "
                             "file (a codec file, or one saved with quant=None) only: load it without quant=")
        from .relayout import quantize_cache

        quantize_cache(cache, layout)
    return cache, dict(header.get("extra", {}))


__all__ = ["FORMAT", "FORMAT_VERSION", "load_cache", "model_identity", "read_info", "rewrite_extra", "save_cache"]
