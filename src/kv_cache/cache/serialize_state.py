"""The object <-> state walk of :mod:`kv_cache.cache.serialize`: a cache as tensors plus JSON.

:mod:`~kv_cache.cache.serialize` owns the file (header, checksums, validation, the save / load
entry points); this module turns what a cache holds into named tensors and JSON records and back:

* the settings: a :class:`~kv_cache.cache.config.QuantConfig` and an eviction policy as JSON
  (:func:`_encode_quant` / :func:`_decode_quant`, :func:`_encode_policy` / :func:`_decode_policy`);
* the storages (:data:`STORAGE_CLASSES`: every registered layout, :data:`kv_cache.cache.storage.LAYOUTS`
  (full precision, quantized, ragged), and :class:`PackedKV`) and
  the rotations (:class:`Rotation` and its subclasses), written field by field (each class's
  declared ``FIELDS``: saved name -> the attribute that holds it) by
  :class:`_Writer` (tensors named by where they live, ``layer3.row2.packed.k_codes``) and rebuilt
  by :class:`_Reader`;
* the layers: their scalars, dtype, storage, state tensors and starts
  (:func:`_encode_layer` / :func:`_decode_layer`).
"""

from __future__ import annotations

import dataclasses
import os
from typing import Any

import torch

from ..policies import POLICIES, EvictionPolicy
from ..policies.base import LATER_FIELDS, at_hidden_default
from .config import LATER_FIELDS as QUANT_LATER_FIELDS, QuantConfig
from .layer import CompressedLayer
from .packed import PackedKV, Rotation
from ..compression.positions import unpack_mask
from . import packed_ragged as _packed_ragged  # noqa: F401  (registers the ragged layouts)
from . import ragged as _ragged  # noqa: F401
from .storage import LAYOUTS

STORAGE_CLASSES: dict[str, type] = {**LAYOUTS, PackedKV.__name__: PackedKV}
"""Classes whose instances are written by their declared ``FIELDS`` (rotations: :func:`_rotation_classes`)."""


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
    return {f.name: _encode_value(getattr(quant, f.name)) for f in dataclasses.fields(quant)
            if not at_hidden_default(f.name, getattr(quant, f.name), QUANT_LATER_FIELDS)}


def _decode_quant(d: dict[str, Any] | None) -> QuantConfig | None:
    if d is None:
        return None
    known = {f.name for f in dataclasses.fields(QuantConfig)}
    if set(d) - known:
        raise ValueError(f"kv_cache file: QuantConfig fields {sorted(set(d) - known)} are unknown to this version")
    # A field added later and left out means "as before" (LATER_FIELDS), not today's "auto".
    kw = {**QUANT_LATER_FIELDS, **{k: _decode_value(v) for k, v in d.items()}}
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
            "fields": {f.name: _encode_value(getattr(policy, f.name)) for f in dataclasses.fields(policy)
                       if f.init and not at_hidden_default(f.name, getattr(policy, f.name), LATER_FIELDS)}}


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
        # The class's declared fields, never whatever attributes the object happens to carry.
        attrs = {f: self.value(getattr(o, attr), prefix, f) for f, attr in sorted(cls.FIELDS.items())}
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
            if v == self.quant:
                return {"quant": True}
            if self.quant is not None and self.quant.evicted_bits is not None and v == self.quant.evicted_config():
                return {"quant": "evicted"}  # the evicted tier's layout, derived from the cache's
            if self.quant is not None and v == self.quant.sliding_config():
                return {"quant": "sliding"}  # a sliding-window layer's layout (no sinks, no tier)
            raise ValueError(f"cannot save: {name} holds a QuantConfig other than the cache's ({v!r})")
        if isinstance(v, list) and v and all(type(x).__name__ in LAYOUTS for x in v):  # rows: row r at "row{r}"
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
        optional = set(getattr(cls, "FIELD_DEFAULTS", {}))
        have, declared = set(d["attrs"]), set(cls.FIELDS)
        if not have <= declared or not declared - optional <= have:
            raise ValueError(f"kv_cache file is corrupted: a {name} has fields {sorted(d['attrs'])}; its layout "
                             f"declares {sorted(cls.FIELDS)}")
        out = cls.__new__(cls)
        for f, attr in cls.FIELDS.items():
            value = self.value(d["attrs"][f]) if f in have else cls.FIELD_DEFAULTS[f]
            setattr(out, attr, value)
        return out

    def value(self, v: Any) -> Any:
        if not isinstance(v, dict):
            return v
        if set(v) == {"tensor"}:
            return self.tensor(v["tensor"])
        if set(v) == {"dtype"}:
            return _dtype(v["dtype"])
        if set(v) == {"quant"}:
            if v["quant"] == "evicted":
                return self.quant.evicted_config()
            return self.quant.sliding_config() if v["quant"] == "sliding" else self.quant
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
    if layer.demoted is not None:
        out["demoted"] = w.obj(layer.demoted, f"layer{i}.demoted")
    out["state"] = {k: w.tensor(f"layer{i}.state.{k}", t)["tensor"] for k, t in sorted(layer.state.items())}
    out["_starts"] = None if layer._starts is None else w.tensor(f"layer{i}._starts", layer._starts)["tensor"]
    if layer.key_offset is not None:
        out["key_offset"] = w.tensor(f"layer{i}.key_offset", layer.key_offset)["tensor"]
    if layer.track_arrivals:  # positions kept after RoPE too (the transform codec's frame, §27.6)
        out["track_arrivals"] = True
    if layer.keeps_arrivals:  # keys stored before RoPE (or tracked): the arrivals and their bitmaps (§29.6)
        out["arrived"] = int(layer._arrived)
        for name in ("kept_arrivals", "demoted_arrivals"):
            t = getattr(layer, name)
            if t is not None:
                out[name] = w.tensor(f"layer{i}.{name}", t)["tensor"]
    err = layer.attention_error  # the fidelity check at prefill (§26): a figure of the stored context
    out["attention_error"] = None if err is None or err != err else float(err)
    if layer.evicted_attention is not None:  # the eviction check (§26.1)
        out["evicted_attention"] = float(layer.evicted_attention)
    return out


def _decode_layer(layer: CompressedLayer, d: dict[str, Any], r: _Reader) -> None:
    for k in _LAYER_SCALARS:
        setattr(layer, k, d[k])
    if not d["is_initialized"]:
        return
    layer.dtype, layer.device = _dtype(d["dtype"]), r.device
    layer.storage = None if d["storage"] is None else r.obj(d["storage"])
    layer.demoted = r.obj(d["demoted"]) if d.get("demoted") is not None else None
    layer.state = {k: r.tensor(name) for k, name in d["state"].items()}
    layer._starts = None if d["_starts"] is None else r.tensor(d["_starts"])
    layer.key_offset = r.tensor(d["key_offset"]) if d.get("key_offset") is not None else None
    _decode_positions(layer, d, r)
    err = d.get("attention_error")  # absent from files written before the check existed
    if err is not None and (isinstance(err, bool) or not isinstance(err, (int, float))):
        raise ValueError(f"kv_cache file is corrupted: layer attention_error must be a number; got {err!r}")
    layer.attention_error = None if err is None else float(err)
    x = d.get("evicted_attention")  # absent from files written before the eviction check existed
    if x is not None and (isinstance(x, bool) or not isinstance(x, (int, float)) or not 0 <= x <= 1):
        raise ValueError(f"kv_cache file is corrupted: layer evicted_attention must be a share in [0, 1]; got {x!r}")
    layer.evicted_attention = None if x is None else float(x)
    layer.is_initialized = True


def _decode_positions(layer: CompressedLayer, d: dict[str, Any], r: _Reader) -> None:
    """A layer storing keys before RoPE: its arrivals and bitmaps (§29.6), checked against what
    it holds, since a wrong position would rotate a key by the wrong angle without a sign."""
    layer._arrived = layer.seen  # files of layers without RoPE removed: their arrivals are their tokens
    tracked = d.get("track_arrivals", False)
    if tracked is not True and tracked is not False:
        raise ValueError(f"kv_cache file is corrupted: track_arrivals must be true or false; got {tracked!r}")
    layer.track_arrivals = tracked or layer.track_arrivals
    if layer.rope_frame is None and not tracked:
        if any(d.get(k) is not None for k in ("arrived", "kept_arrivals", "demoted_arrivals")):
            raise ValueError("kv_cache file is corrupted: positions saved for a layer that stores keys after RoPE")
        return
    arrived = d.get("arrived")
    n = 0 if layer.storage is None else layer.storage.length
    if isinstance(arrived, bool) or not isinstance(arrived, int) or arrived < n:
        raise ValueError(f"kv_cache file is corrupted: a layer storing keys before RoPE needs its arrivals "
                         f"(an int >= the {n} tokens it holds); got {arrived!r}")
    layer._arrived = arrived
    for name, part in (("kept_arrivals", layer.storage), ("demoted_arrivals", layer.demoted)):
        t = r.tensor(d[name]) if d.get(name) is not None else None
        setattr(layer, name, t)
        if t is None or part is None:
            continue
        bits = unpack_mask(t, 8 * t.shape[-1]) if t.dtype == torch.uint8 else None
        if bits is None or t.dim() != 3 or (name == "kept_arrivals" and t.shape[-1] != -(-arrived // 8)) \
                or not torch.equal(bits.sum(-1).cpu(), part.head_lengths()):
            raise ValueError(f"kv_cache file is corrupted: {name} does not match the tokens the layer holds")


# Public names of the settings codecs (the plan layer writes the same JSON for its layout and policy).
encode_quant, decode_quant = _encode_quant, _decode_quant
encode_policy, decode_policy = _encode_policy, _decode_policy
