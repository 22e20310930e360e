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
to the classes of :data:`STORAGE_CLASSES` and the rotation classes): a new scalar or tensor
attribute is saved without a change here; an attribute of an unknown type is refused when saving.
"""

from __future__ import annotations

import dataclasses
import hashlib
import json
import os
import struct
from pathlib import Path
from typing import Any

import torch

from ..policies import POLICIES, EvictionPolicy
from .cache import CompressedCache
from .config import QuantConfig
from .layer import CompressedLayer
from .packed import PackedKV, Rotation
from .ragged import RaggedStorage
from .report import kv_geometry
from .storage import FullPrecisionStorage, QuantizedStorage

FORMAT = "kv_cache.compressed_cache"
"""The value of the ``format`` metadata key of every file written here."""

FORMAT_VERSION = 1
"""Bumped whenever the layout of the file changes; :func:`load_cache` reads this version only."""

STORAGE_CLASSES: dict[str, type] = {
    cls.__name__: cls for cls in (FullPrecisionStorage, QuantizedStorage, RaggedStorage, PackedKV)
}
"""Classes whose instances are written attribute by attribute (rotations: :func:`_rotation_classes`)."""

_VOLATILE_CONFIG_KEYS = ("transformers_version", "torch_dtype", "dtype", "architectures")
"""Config keys that do not change the cache (keys starting with ``_`` are dropped too):
the model's identity is its shapes and the settings its attention depends on."""

_HEADER_KEYS = ("model", "quant", "eviction", "tokens_seen", "layers", "extra", "tensors")
_MAX_HEADER = 100 * 1024 * 1024  # safetensors' own limit on the JSON header


# ---------------------------------------------------------------------------------------- helpers
def _rotation_classes() -> dict[str, type]:
    """:class:`Rotation` and its subclasses, by name (a calibrated rotation type included)."""
    out, todo = {}, [Rotation]
    while todo:
        cls = todo.pop()
        out[cls.__name__] = cls
        todo.extend(cls.__subclasses__())
    return out


def _dtype_name(dtype: torch.dtype) -> str:
    return str(dtype).removeprefix("torch.")


def _dtype(name: str) -> torch.dtype:
    dt = getattr(torch, str(name), None)
    if not isinstance(dt, torch.dtype):
        raise ValueError(f"kv_cache file names an unknown torch dtype {name!r}")
    return dt


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


# ---------------------------------------------------------------------------------------- settings
def _encode_value(v: Any) -> Any:
    if isinstance(v, torch.dtype):
        return {"dtype": _dtype_name(v)}
    if isinstance(v, tuple):
        return [_encode_value(x) for x in v]
    if isinstance(v, os.PathLike):
        return os.fspath(v)
    return v


def _decode_value(v: Any) -> Any:
    if isinstance(v, dict) and set(v) == {"dtype"}:
        return _dtype(v["dtype"])
    return v


def _encode_quant(quant: QuantConfig | None) -> dict[str, Any] | None:
    if quant is None:
        return None
    return {f.name: _encode_value(getattr(quant, f.name)) for f in dataclasses.fields(quant)}


def _decode_quant(d: dict[str, Any] | None) -> QuantConfig | None:
    if d is None:
        return None
    known = {f.name for f in dataclasses.fields(QuantConfig)}
    if set(d) - known:
        raise ValueError(f"kv_cache file: QuantConfig fields {sorted(set(d) - known)} are unknown to this version")
    kw = {k: _decode_value(v) for k, v in d.items()}
    try:
        return QuantConfig(**kw)
    except FileNotFoundError:
        # rotation="calibrated" whose calibration file is gone: the file holds the rotation
        # matrices themselves, so the path is a record only. Validate the rest, then restore it.
        quant = QuantConfig(**{**kw, "rotation": None, "rotation_path": None})
        object.__setattr__(quant, "rotation", kw["rotation"])
        object.__setattr__(quant, "rotation_path", kw["rotation_path"])
        return quant


def _encode_policy(policy: EvictionPolicy | None) -> dict[str, Any] | None:
    if policy is None:
        return None
    name = type(policy).__name__
    if type(policy) not in POLICIES.values():
        raise ValueError(f"cannot save eviction policy {name}: only {sorted(c.__name__ for c in POLICIES.values())}")
    return {"class": name,
            "fields": {f.name: _encode_value(getattr(policy, f.name)) for f in dataclasses.fields(policy) if f.init}}


def _decode_policy(d: dict[str, Any] | None) -> EvictionPolicy | None:
    if d is None:
        return None
    classes = {c.__name__: c for c in POLICIES.values()}
    cls = classes.get(d.get("class"))
    if cls is None:
        raise ValueError(f"kv_cache file: eviction policy expected one of {sorted(classes)}, found {d.get('class')!r}")
    return cls(**{k: _decode_value(v) for k, v in d["fields"].items()})


# ---------------------------------------------------------------------------------------- objects
class _Writer:
    """Collects tensors (CPU copies, keyed by name) while encoding the object graph."""

    def __init__(self, quant: QuantConfig | None, device: torch.device | None):
        self.quant, self.device = quant, device
        self.tensors: dict[str, torch.Tensor] = {}
        self.on_cpu: list[str] = []  # held on the CPU while the layer is on an accelerator

    def tensor(self, name: str, t: torch.Tensor) -> dict[str, str]:
        if name in self.tensors:
            raise ValueError(f"cannot save: two tensors named {name!r}")
        if t.device.type == "cpu" and self.device is not None and self.device.type != "cpu":
            self.on_cpu.append(name)
        self.tensors[name] = t.detach().to("cpu", copy=True).contiguous()
        return {"tensor": name}

    def obj(self, o: Any, prefix: str) -> dict[str, Any]:
        """``{"class": name, "attrs": {...}}`` of a storage, packed part or rotation."""
        cls = type(o)
        kind = STORAGE_CLASSES.get(cls.__name__)
        if kind is not cls and _rotation_classes().get(cls.__name__) is not cls:
            raise ValueError(
                f"cannot save a {cls.__module__}.{cls.__qualname__} at {prefix or 'storage'}: only "
                f"{sorted(STORAGE_CLASSES) + sorted(_rotation_classes())} are known to kv_cache.cache.serialize"
            )
        attrs = {k: self.value(v, prefix, k) for k, v in sorted(vars(o).items())}
        return {"class": cls.__name__, "attrs": attrs}

    def value(self, v: Any, prefix: str, attr: str) -> Any:
        """Attribute ``attr`` of the object at ``prefix``: its tensors are named ``prefix.attr``."""
        name = _join(prefix, attr)
        if isinstance(v, torch.Tensor):
            return self.tensor(name, v)
        if v is None or isinstance(v, (bool, int, float, str)):
            return v
        if isinstance(v, torch.dtype):
            return {"dtype": _dtype_name(v)}
        if isinstance(v, QuantConfig):
            if v != self.quant:
                raise ValueError(f"cannot save: {name} holds a QuantConfig other than the cache's ({v!r})")
            return {"quant": True}
        if attr == "rows" and isinstance(v, list):  # RaggedStorage.rows: row r at "row{r}"
            return {"rows": [self.obj(row, _join(prefix, f"row{r}")) for r, row in enumerate(v)]}
        if isinstance(v, (list, tuple)) and all(isinstance(x, (bool, int, float, str)) for x in v):
            return {"list": list(v)}
        if type(v).__name__ in STORAGE_CLASSES or type(v).__name__ in _rotation_classes():
            return self.obj(v, name)
        t = type(v)
        raise ValueError(f"cannot save attribute {name!r} of type {t.__module__}.{t.__qualname__}: "
                         "kv_cache.cache.serialize saves tensors, scalars, dtypes and the classes "
                         f"{sorted(STORAGE_CLASSES) + sorted(_rotation_classes())}")


def _join(prefix: str, name: str) -> str:
    return f"{prefix}.{name}" if prefix else name


class _Reader:
    """Rebuilds the object graph from the header and the loaded tensors."""

    def __init__(self, tensors: dict[str, torch.Tensor], quant: QuantConfig | None, device, on_cpu: set[str]):
        self.tensors, self.quant, self.device, self.on_cpu = tensors, quant, device, on_cpu
        self.used: set[str] = set()

    def tensor(self, name: str) -> torch.Tensor:
        if name not in self.tensors:
            raise ValueError(f"kv_cache file is corrupted: the header names tensor {name!r}, which the file lacks")
        self.used.add(name)
        t = self.tensors[name]
        return t if name in self.on_cpu else t.to(self.device)

    def obj(self, d: Any) -> Any:
        if not isinstance(d, dict) or "class" not in d or not isinstance(d.get("attrs"), dict):
            raise ValueError(f"kv_cache file is corrupted: expected an object record, found {str(d)[:80]!r}")
        name = d["class"]
        cls = STORAGE_CLASSES.get(name) or _rotation_classes().get(name)
        if cls is None:
            raise ValueError(f"kv_cache file holds an object of class {name!r}; expected one of "
                             f"{sorted(STORAGE_CLASSES) + sorted(_rotation_classes())}")
        out = cls.__new__(cls)
        for k, v in d["attrs"].items():
            if not isinstance(k, str) or not k.isidentifier() or k.startswith("__"):
                raise ValueError(f"kv_cache file is corrupted: attribute name {k!r} of a {name}")
            setattr(out, k, self.value(v))
        return out

    def value(self, v: Any) -> Any:
        if not isinstance(v, dict):
            return v
        if set(v) == {"tensor"}:
            return self.tensor(v["tensor"])
        if set(v) == {"dtype"}:
            return _dtype(v["dtype"])
        if set(v) == {"quant"}:
            return self.quant
        if set(v) == {"rows"}:
            return [self.obj(r) for r in v["rows"]]
        if set(v) == {"list"}:
            return list(v["list"])
        return self.obj(v)


_LAYER_SCALARS = ("seen", "prompt_len", "_prefill_done")


def _encode_layer(layer: CompressedLayer, i: int, w: _Writer) -> dict[str, Any]:
    why = None
    if layer._tail is not None:
        why = "it is inside cache.session() (a question is being asked)"
    elif layer._awaiting_reconstruction or layer._reconstruct is not None:
        why = "KVzip's reconstruction pass has not finished (prefill with kv_cache.prefill)"
    elif layer._pending is not None or layer._view is not None:
        why = "a forward call is in progress"
    if why:
        raise ValueError(f"cannot save the cache: layer {i}: {why}")
    out: dict[str, Any] = {"is_initialized": bool(layer.is_initialized)}
    out.update({k: getattr(layer, k) for k in _LAYER_SCALARS})
    if not layer.is_initialized:
        return out
    w.device = torch.device(layer.device)
    out["dtype"] = _dtype_name(layer.dtype)
    out["storage"] = None if layer.storage is None else w.obj(layer.storage, f"layer{i}")
    out["state"] = {k: w.tensor(f"layer{i}.state.{k}", t)["tensor"] for k, t in sorted(layer.state.items())}
    out["_starts"] = None if layer._starts is None else w.tensor(f"layer{i}._starts", layer._starts)["tensor"]
    return out


def _decode_layer(layer: CompressedLayer, d: dict[str, Any], r: _Reader) -> None:
    for k in _LAYER_SCALARS:
        setattr(layer, k, d[k])
    if not d["is_initialized"]:
        return
    layer.dtype, layer.device = _dtype(d["dtype"]), r.device
    layer.storage = None if d["storage"] is None else r.obj(d["storage"])
    layer.state = {k: r.tensor(name) for k, name in d["state"].items()}
    layer._starts = None if d["_starts"] is None else r.tensor(d["_starts"])
    layer.is_initialized = True


# ---------------------------------------------------------------------------------------- the file
def save_cache(cache: CompressedCache, path: str | os.PathLike, *, model_config: Any = None,
               extra: dict[str, Any] | None = None) -> int:
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
    config = cache.config if model_config is None else model_config
    w = _Writer(cache.quant, None)
    layers = [_encode_layer(layer, i, w) for i, layer in enumerate(cache.layers)]
    try:
        extra_json = json.loads(json.dumps(extra or {}))
    except TypeError as exc:
        raise ValueError(f"save_cache: extra must be JSON-serializable: {exc}") from None
    header = {
        "quant": _encode_quant(cache.quant),
        "eviction": _encode_policy(cache.eviction),
        "model": model_identity(config),
        "tokens_seen": cache.get_seq_length(),
        "layers": layers,
        "extra": extra_json,
        "on_cpu": w.on_cpu,
        "tensors": {name: _tensor_digest(t) for name, t in sorted(w.tensors.items())},
    }
    text = json.dumps(header, sort_keys=True, separators=(",", ":"))
    meta = {"format": FORMAT, "format_version": str(FORMAT_VERSION), "kv_cache": text,
            "kv_cache_sha256": hashlib.sha256(text.encode()).hexdigest()}
    data = save(w.tensors, metadata=meta)
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
    if meta.get("format_version") != str(FORMAT_VERSION):
        raise ValueError(f"{path}: kv_cache format version expected {FORMAT_VERSION}, found "
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
    _, header, _ = _read_file(path)
    return {k: header[k] for k in ("model", "quant", "eviction", "tokens_seen", "extra")}


def load_cache(path: str | os.PathLike, *, model_config: Any, device: str | torch.device | None = None
               ) -> tuple[CompressedCache, dict[str, Any]]:
    """Read a file written by :func:`save_cache` for the model of ``model_config``.

    Parameters
    ----------
    path : str or os.PathLike
    model_config : transformers.PretrainedConfig
        The config of the model that will read the cache; it must be the one the cache was
        saved from (type, K/V shapes, config hash).
    device : str or torch.device, optional
        Where the tensors go (default: CPU).

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
    return cache, dict(header.get("extra", {}))


__all__ = ["FORMAT", "FORMAT_VERSION", "load_cache", "model_identity", "read_info", "save_cache"]
