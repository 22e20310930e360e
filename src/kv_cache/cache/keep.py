"""Keeping a layer's slots: the storage step of an eviction, and its bytes before it happens
(math dictionary §19.6).

:func:`keep_slots` is what :meth:`CompressedLayer.apply_keep_masks` does to the storage: heads
keeping the same number of tokens gather them in place; heads keeping different numbers become
ragged rows that hold only theirs. :func:`bytes_if_kept` runs it on a copy of the storage, so a
model-wide budget can be sized to a byte target with the layout's real bytes (a 4-bit layout
with per-channel key groups frees a group's scales only when all its tokens go, so what a budget
holds depends on which tokens it keeps, not only on how many).
"""

from __future__ import annotations

import copy
from typing import Any

import torch

from ..compression.selection import starts_after


def keep_slots(storage: Any, masks: torch.Tensor, starts: torch.Tensor | None, in_place: bool = True
               ) -> tuple[Any, torch.Tensor | None]:
    """``storage`` keeping the slots ``masks`` (bool ``[batch, kv_heads, T]``, every protected slot
    set) and the leading padding slots ``starts`` ``[batch, kv_heads]`` (or None) after it.
    Returns ``(storage, starts)``; ``in_place=False`` leaves the old tensors untouched."""
    B, H, T = masks.shape
    counts = masks.sum(-1)
    pad = (T - storage.head_lengths()).flatten().tolist()  # virtual slots before a ragged row
    if not storage.ragged and bool((counts == counts.flatten()[0]).all()):
        keep = masks.nonzero()[:, 2].reshape(B, H, -1)
        starts = starts_after(starts, keep)
        storage.gather(keep, in_place=in_place)
        return storage, starts
    keeps = [masks[b, h].nonzero().squeeze(1) - pad[b * H + h] for b in range(B) for h in range(H)]
    lead = [0 if starts is None else int((k < int(starts[r // H, r % H])).sum()) for r, k in enumerate(keeps)]
    kept = storage.keep_rows(keeps, lead, in_place)
    return kept, kept.starts()


def bytes_if_kept(storage: Any, masks: torch.Tensor, starts: torch.Tensor | None) -> int:
    """The bytes ``storage`` and its ``starts`` would hold after keeping ``masks`` (:func:`keep_slots`
    on a deep copy; ``storage`` is unchanged): the sum of ``nbytes`` over their tensors."""
    kept, new_starts = keep_slots(copy.deepcopy(storage), masks, starts, in_place=True)
    return sum(kept.nbytes_by_category().values()) + (0 if new_starts is None else new_starts.nbytes)


__all__ = ["bytes_if_kept", "keep_slots"]
