"""Heads that hold different numbers of tokens: the storage of shared (per-layer / per-model) budgets.

A shared budget (:mod:`kv_cache.compression.global_budget`) keeps more tokens in some KV heads
than in others. Padding every head to the fullest one would hold the memory the eviction was
meant to free, so :class:`RaggedStorage` holds each ``(batch, head)`` row as a storage of its
own (:meth:`LayerStorage.row`: ``batch = heads = 1``, the same layout as before, full precision
or packed codes), and the bytes held are the tokens kept.

Seen from the layer and the attention function, the storage is ``length = max(row lengths)``
slots long and each row is right-aligned: its first ``length - len_r`` slots are virtual padding,
masked through the same per-row ``start`` as left padding. New tokens append to every row (the
row lengths differ by the eviction only), so the layout stays right-aligned.
"""

from __future__ import annotations

from typing import Callable

import torch

from ..attention.blocks import RaggedBlock
from .storage import CATEGORIES, LayerStorage, register_layout


class RaggedRows(LayerStorage):
    """What every layout whose heads hold different numbers of tokens shares: ``row_lengths``
    per ``(b, h)`` row (``r = b * heads + h``), right-aligned in ``length = max(row_lengths)``
    slots, ``lead[r]`` leading padding slots a row had to keep, and the per-row eviction
    (:meth:`gather_rows`). Subclasses define ``row_lengths``, ``gather_rows`` and ``_device``."""

    ragged = True

    @property
    def batch(self) -> int:
        return self._batch

    @property
    def heads(self) -> int:
        return self._heads

    @property
    def length(self) -> int:
        return max(self.row_lengths, default=0)

    def head_lengths(self) -> torch.Tensor:
        return torch.tensor(self.row_lengths, dtype=torch.int64).reshape(self._batch, self._heads)

    def keep_rows(self, keeps: list[torch.Tensor], lead: list[int], in_place: bool = True) -> "RaggedRows":
        """Row-local ``keeps`` (each row's own slots; its lead is tracked here, ``lead`` unused)."""
        self.gather_rows(keeps, in_place)
        return self

    def starts(self) -> torch.Tensor | None:
        """``[batch, heads]`` int32: the first valid slot of each right-aligned row (None: 0 everywhere)."""
        L = self.length
        s = [L - n + p for n, p in zip(self.row_lengths, self.lead)]
        if not any(s):  # decided on the host: no read back from the device
            return None
        return torch.tensor(s, dtype=torch.int32, device=self._device).reshape(self._batch, self._heads)

    def read(self, new_keys=None, new_values=None):
        raise RuntimeError(
            "this layer keeps a different number of tokens per head (a shared budget): only the native "
            "attention reads it; run the model inside kv_cache.compress(model, cache) with attention='native'"
        )

    def gather(self, keep: torch.Tensor, in_place: bool = True) -> None:
        """Keep the (virtual, right-aligned) slots ``keep`` ``[batch, heads, K]``; virtual padding
        slots in it are ignored."""
        self.gather_rows(row_local(keep, self.row_lengths, self._heads), in_place)


@register_layout
class RaggedStorage(RaggedRows):
    """``rows[b * heads + h]``: the tokens of row ``(b, h)``; ``lead[r]``: its leading padding
    slots that had to be kept (quantization sinks of a left-padded row)."""

    FIELDS = {"batch": "_batch", "heads": "_heads", "lead": "lead", "rows": "rows"}
    """Saved fields (:mod:`.serialize_state`) and the attributes that hold them."""

    def __init__(self, rows: list[LayerStorage], batch: int, heads: int, lead: list[int] | None = None):
        if len(rows) != batch * heads:
            raise ValueError(f"RaggedStorage needs batch * heads = {batch * heads} rows; got {len(rows)}")
        self.rows, self._batch, self._heads = rows, batch, heads
        self.lead = [0] * len(rows) if lead is None else list(lead)

    @classmethod
    def split(cls, storage: LayerStorage, keeps: list[torch.Tensor], lead: list[int] | None = None) -> "RaggedStorage":
        """Rows of ``storage`` keeping ``keeps[r]`` (sorted int64 slot indices of row ``r``,
        every protected slot included) each, in tensors of their own."""
        rows = []
        for r, keep in enumerate(keeps):
            b, h = divmod(r, storage.heads)
            row = storage.row(b, h)
            if keep.numel() != row.length or not bool((keep == torch.arange(row.length, device=keep.device)).all()):
                row.gather(keep.reshape(1, 1, -1), in_place=False)
            rows.append(row)
        return cls(rows, storage.batch, storage.heads, lead)

    @property
    def row_lengths(self) -> list[int]:
        return [row.length for row in self.rows]

    @property
    def _device(self) -> torch.device:
        return self.rows[0].keys.device

    # ------------------------------------------------------------------ the contract
    def append(self, keys: torch.Tensor, values: torch.Tensor) -> None:
        for r, row in enumerate(self.rows):
            b, h = divmod(r, self._heads)
            row.append(keys[b:b + 1, h:h + 1], values[b:b + 1, h:h + 1])

    def blocks(self) -> list:
        if not self.length:
            return []
        return [RaggedBlock([row.blocks() for row in self.rows], self._batch, self._heads, self.row_lengths)]

    def protected(self) -> tuple[int, int]:
        sides = {row.protected() for row in self.rows}
        if len(sides) != 1:  # appends and flushes are the same in every row
            raise RuntimeError(f"rows of a ragged layer disagree on their protected slots: {sorted(sides)}")
        return sides.pop()

    def gather_rows(self, keeps: list[torch.Tensor], in_place: bool = True) -> None:
        """Row ``r`` keeps its own slots ``keeps[r]`` (sorted int64, row-local indices)."""
        for r, (row, keep) in enumerate(zip(self.rows, keeps)):
            self.lead[r] = int((keep < self.lead[r]).sum())
            if keep.numel() != row.length:
                row.gather(keep.reshape(1, 1, -1), in_place)

    def row(self, b: int, h: int) -> LayerStorage:
        return self.rows[b * self._heads + h].row(0, 0)

    def named_tensors(self) -> dict[str, torch.Tensor]:
        out = {}
        for r, row in enumerate(self.rows):
            out.update({f"row{r}.{name}": t for name, t in row.named_tensors().items()})
        return out

    def map_tensors(self, fn: Callable[[torch.Tensor], torch.Tensor]) -> None:
        """Batch selection / repetition: ``fn`` acts on the batch axis, so it is applied to the
        row numbers and the rows are copied accordingly."""
        order = fn(torch.arange(self._batch).reshape(self._batch, 1)).reshape(-1).tolist()
        rows, lead = [], []
        for b in order:
            for h in range(self._heads):
                rows.append(self.rows[b * self._heads + h].row(0, 0))
                lead.append(self.lead[b * self._heads + h])
        self.rows, self.lead, self._batch = rows, lead, len(order)

    def nbytes_by_category(self) -> dict[str, int]:
        out = dict.fromkeys(CATEGORIES, 0)
        for row in self.rows:
            for k, v in row.nbytes_by_category().items():
                out[k] += v
        return out


def row_local(keep: torch.Tensor, lengths: list[int], heads: int) -> list[torch.Tensor]:
    """Virtual, right-aligned slots ``keep`` ``[batch, heads, K]`` of rows of ``lengths`` tokens
    as each row's own slot indices (its virtual padding slots dropped)."""
    L = max(lengths, default=0)
    rows = []
    for r, n in enumerate(lengths):
        b, h = divmod(r, heads)
        k = keep[b, h] - (L - n)
        rows.append(k[k >= 0])
    return rows


def dense_read(storage: LayerStorage) -> tuple[torch.Tensor, torch.Tensor]:
    """``storage``'s tokens in full precision ``[batch, heads, length, d]``: :meth:`LayerStorage.read`,
    or for heads holding different numbers of tokens the stored blocks dequantized, each row
    right-aligned after zeros in its virtual padding (what the layer's starts mask; float32). The
    reader of a layer storing keys before RoPE, which rotates every key back (math dictionary §29.6)."""
    if not storage.ragged:
        return storage.read()
    from ..attention.dense import materialize

    dense = materialize(storage.blocks())
    if dense is None:
        raise ValueError("a ragged storage holding no token has nothing to read")
    return dense[0], dense[1]


def ragged_state(t: torch.Tensor, masks: torch.Tensor) -> torch.Tensor:
    """A policy's per-slot state ``[B, H, T]`` after row ``(b, h)`` keeps the slots ``masks[b, h]``
    (bool ``[B, H, T]``): ``[B, H, K_max]``, each row's kept entries right-aligned, 0 before them."""
    B, H, T = t.shape
    counts = masks.sum(-1)
    K = int(counts.max()) if counts.numel() else 0
    out = t.new_zeros(B, H, K)
    for b in range(B):
        for h in range(H):
            vals = t[b, h][masks[b, h]]
            if vals.numel():
                out[b, h, K - vals.numel():] = vals
    return out
