"""Where the transform codec's tensors sit in a saved cache state (math dictionary §27, §27.6):
the full-precision token tensors of each layer's storage (the coding targets), each KV head's
tokens in them (the segments), and the arrival index of every token (its RoPE position, for a
basis fitted on keys before RoPE). Read by :mod:`.payload` when it encodes and decodes.

A target is a layer's :class:`FullPrecisionStorage` (``key_buffer`` / ``value_buffer`` ``[1, H,
cap, d]``, its first ``length`` slots: layout ``"heads"``) or a :class:`PackedRaggedStorage`'s
``fp_keys`` / ``fp_values`` ``[1, 1, sum T_h, d]`` (KVzip's ragged heads one after another:
layout ``"flat"``), as :mod:`kv_cache.cache.serialize_state` records them.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import numpy as np
import torch

from ..compression.positions import unpack_mask


@dataclass
class Target:
    """One coded pair of tensors (keys and values) of one layer, and its segments (one per KV head)."""

    layer: int
    names: tuple[str, str]  # the key tensor and the value tensor
    layout: str  # "heads" or "flat"
    shape: tuple[int, ...]  # the decoded shape [1, H, n, d] or [1, 1, sum, d]
    dtype: str
    heads: list[int]  # per segment: its KV head
    lengths: list[int]  # per segment: its tokens
    role: str = "storage"  # "storage" (the layer's own), "rows" (a ragged layout's rows), "tail" (after them)
    tail: int = 0  # "rows": the tokens of the ragged layout's tail, which follow every row
    mixed: bool = False  # "rows": the layout also holds sinks or packed tokens (a quantized layout)


ROLES = ("storage", "rows", "tail")


def find_targets(layer_recs: list[dict[str, Any]], tensors: dict[str, torch.Tensor]) -> list[Target]:
    """The coding targets of a saved state: every floating-point, non-empty full-precision token
    storage of every layer (``layer_recs``: the layers' records; ``tensors``: the state's tensors),
    in the layers' order; a ragged layout's rows (role ``"rows"``) before its tail (``"tail"``)."""
    out = []

    def walk(rec: Any, layer: int, role: str) -> None:
        if not isinstance(rec, dict):
            return
        cls, attrs = rec.get("class"), rec.get("attrs", {})
        if cls == "FullPrecisionStorage":
            kname, vname = attrs["key_buffer"]["tensor"], attrs["value_buffer"]["tensor"]
            k, n = tensors[kname], int(attrs["length"])
            if k.dim() == 4 and k.shape[0] == 1 and n > 0 and k.is_floating_point():
                out.append(Target(layer, (kname, vname), "heads", (1, k.shape[1], n, k.shape[3]),
                                   str(k.dtype).removeprefix("torch."), list(range(k.shape[1])), [n] * k.shape[1],
                                   role))
        elif cls == "PackedRaggedStorage" and isinstance(attrs.get("fp_keys"), dict):
            kname, vname = attrs["fp_keys"]["tensor"], attrs["fp_values"]["tensor"]
            k, heads = tensors[kname], int(attrs["heads"])
            lengths = list(attrs["fp_lengths"]["list"])
            tail = attrs.get("tail")
            tail_n = int(tail["attrs"]["length"]) if isinstance(tail, dict) and tail.get("class") == \
                "FullPrecisionStorage" else 0
            packed = attrs.get("packed_lengths")
            mixed = (isinstance(tail, dict) and tail.get("class") != "FullPrecisionStorage") or \
                (isinstance(packed, dict) and any(packed.get("list") or []))
            if (k.dim() == 4 and k.shape[:2] == (1, 1) and int(attrs["batch"]) == 1 and len(lengths) == heads
                    and sum(lengths) == k.shape[2] and k.shape[2] > 0 and k.is_floating_point()):
                out.append(Target(layer, (kname, vname), "flat", tuple(k.shape), str(k.dtype).removeprefix("torch."),
                                   list(range(heads)), lengths, "rows", tail_n, mixed))
        for v in attrs.values():
            walk(v, layer, "tail" if cls == "PackedRaggedStorage" else role)

    for i, rec in enumerate(layer_recs):
        walk(rec.get("storage"), i, "storage")
    return out


def segment_positions(layer_rec: dict[str, Any], tensors: dict[str, torch.Tensor], target: Target,
                      where: str = "the cache") -> list[torch.Tensor]:
    """The arrival index (the RoPE position) of every token of each segment of ``target``, int64
    ``[T_s]``, from its layer's record (math dictionary §27.6): ``arrived`` (or ``seen``) and the
    kept arrivals' bitmap when an eviction made one (its row ``h`` lists head ``h``'s tokens in
    order: a ragged layout's row first, then its tail).

    Raises ``ValueError`` when the positions are unknown (an evicting cache built without
    ``track_positions``) or do not match the segments."""
    if target.mixed:
        raise ValueError(f"{where}: layer {target.layer} holds a quantized ragged layout (sinks or packed tokens "
                         "beside its full-precision rows): keys before RoPE are coded for full-precision caches only; "
                         "code it with a basis fitted after RoPE (basis_for_model(model, keys_before_rope=False))")
    arrived = layer_rec.get("arrived", layer_rec.get("seen"))
    if isinstance(arrived, bool) or not isinstance(arrived, int) or arrived < 0:
        raise ValueError(f"{where}: layer {target.layer} records no arrivals")
    name = layer_rec.get("kept_arrivals")
    bits = None
    if isinstance(name, str) and name in tensors:
        t = tensors[name]
        if t.dtype != torch.uint8 or t.dim() != 3 or t.shape[0] != 1 or t.shape[-1] * 8 < arrived:
            raise ValueError(f"{where}: layer {target.layer}'s kept arrivals must be uint8 [1, heads, >= "
                             f"{-(-arrived // 8)}]; got {t.dtype} {tuple(t.shape)}")
        bits = unpack_mask(t, arrived)[0]  # [H, A]
    out = []
    for h, n in zip(target.heads, target.lengths):
        if target.role == "tail" or bits is None:
            if target.role == "rows":
                raise ValueError(f"{where}: layer {target.layer} evicted tokens and kept no positions: coding keys "
                                 "before RoPE needs them (build the cache with CompressedCache(track_positions=True),"
                                 " or code with a basis fitted after RoPE)")
            if n > arrived:
                raise ValueError(f"{where}: layer {target.layer} holds {n} tokens of {arrived} arrivals")
            out.append(torch.arange(arrived - n, arrived))
            continue
        if h >= bits.shape[0]:
            raise ValueError(f"{where}: layer {target.layer}'s kept arrivals have {bits.shape[0]} heads; head {h} asked")
        held = torch.nonzero(bits[h]).flatten()
        want = n + (target.tail if target.role == "rows" else 0)
        if held.numel() != want:
            raise ValueError(f"{where}: layer {target.layer} head {h} keeps {held.numel()} arrivals; its tokens "
                             f"need {want}")
        out.append(held[:n])
    return out


def turn(x: torch.Tensor, frame, positions: torch.Tensor, inverse: bool) -> torch.Tensor:
    """Rows ``x`` ``[T, d]`` turned back (``inverse``: the keys before RoPE) or forth by their positions."""
    y = frame.remove(x[None, None], positions) if inverse else frame.apply(x[None, None], positions)
    return y[0, 0]


def segments(t: torch.Tensor, target: Target) -> list[torch.Tensor]:
    """The segments ``[T_s, d]`` of a tensor, in the target's order."""
    if target.layout == "heads":
        n = target.shape[2]
        return [t[0, h, :n] for h in target.heads]
    offs = np.cumsum([0] + target.lengths)
    return [t[0, 0, offs[s]:offs[s + 1]] for s in range(len(target.lengths))]


__all__ = ["ROLES", "Target", "find_targets", "segment_positions", "segments", "turn"]
