"""Bytes a cache holds: ours by its report, any other transformers ``Cache`` by a tensor walk."""

from __future__ import annotations

from typing import Any

import torch

from ..attention.flat import FlatRaggedBlock
from ..cache import CompressedCache
from ..cache.packed import PackedKV, Rotation
from ..cache.rope_frame import RopeFrame
from ..cache.storage import LayerStorage


def _inner_tensors(obj: Any, seen: set[int]) -> list[torch.Tensor]:
    """Plain tensors inside ``obj`` (tensor subclasses such as quanto's are flattened; a view
    stands for the tensor it views)."""
    if isinstance(obj, torch.Tensor):
        if obj._base is not None:  # a view keeps its whole base alive: count the base, once
            obj = obj._base
        if id(obj) in seen:
            return []
        seen.add(id(obj))
        if type(obj) is not torch.Tensor and hasattr(obj, "__tensor_flatten__"):
            names, _ = obj.__tensor_flatten__()
            out = []
            for n in names:
                out += _inner_tensors(getattr(obj, n), seen)
            return out
        return [obj]
    if isinstance(obj, dict):
        return [t for v in obj.values() for t in _inner_tensors(v, seen)]
    if isinstance(obj, (list, tuple)):
        return [t for v in obj for t in _inner_tensors(v, seen)]
    if isinstance(obj, (LayerStorage, PackedKV, Rotation, FlatRaggedBlock, RopeFrame)):  # ours: walked like a dict
        return _inner_tensors(vars(obj), seen)
    return []


def held_nbytes(cache: Any) -> int:
    """Bytes of every tensor held by ``cache``'s layers.

    Ours: :meth:`CompressedCache.memory_report`'s total (a test proves it equals this walk).
    Any other transformers ``Cache`` (the peers): the ``nbytes`` of every distinct tensor
    reachable from its layers' attributes, tensor subclasses flattened.
    """
    if isinstance(cache, CompressedCache):
        return cache.memory_report().total_bytes
    return walked_nbytes(cache)


def walked_nbytes(cache: Any) -> int:
    """The generic count of :func:`held_nbytes`: walk the layers' attributes for tensors."""
    seen: set[int] = set()
    total = 0
    for layer in getattr(cache, "layers", []):
        for value in vars(layer).values():
            total += sum(t.nbytes for t in _inner_tensors(value, seen))
    return total


__all__ = ["held_nbytes", "walked_nbytes"]
