"""Heads that hold different numbers of tokens, in one buffer per layer: the packed ragged layout.

A shared budget (KVzip's model-wide budget, tiers chosen by a policy) keeps a different number of
tokens in each ``(batch, head)`` row. :class:`PackedRaggedStorage` holds the kept tokens of every
row *in one buffer* (one for the full-precision ones, one :class:`~kv_cache.cache.packed.PackedKV`
for the packed codes), row after row, with per-row lengths; the offsets of the rows are their
running sums. Nothing is padded: the bytes held are the tokens kept (plus one int64 and one int32
per row). Tokens appended afterwards (decoding) go to a rectangular *tail*, the layer's ordinary
layout (every row gains the same tokens), whose full-precision sinks stand for the rows' sinks.

A row ``r`` reads, in token order::

    [ sinks | fp_r (its full-precision tokens) | q_r (its packed tokens) | tail packed | tail residual ]

Seen from the layer it is ``length = max(row lengths)`` slots long and right-aligned, as
:class:`~kv_cache.cache.ragged.RaggedStorage` (the one-storage-per-row layout, kept for the cases
this one does not cover and for files saved with it). A decoding step attends all of it in one
:func:`~kv_cache.kernels.attend_mixed` call (:class:`~kv_cache.attention.flat.FlatRaggedBlock`):
the kernels read each row's tokens at its offset in the buffers (math dictionary §15.7).
"""

from __future__ import annotations

from typing import Callable

import torch

from ..attention.flat import FlatRaggedBlock
from .packed import PackedKV, gather_tokens
from .ragged import RaggedRows, RaggedStorage
from .storage import CATEGORIES, FullPrecisionStorage, LayerStorage, QuantizedStorage, register_layout


def _concat_packed(parts: list[PackedKV]) -> PackedKV:
    """Row storages' packed parts (each ``[1, 1, n_r, ...]``) in one ``[1, 1, sum n_r, ...]``
    :class:`PackedKV`: tokens concatenated, per-channel key scale tables concatenated and each
    token's group index made global (``k_group``)."""
    out = PackedKV.__new__(PackedKV)
    out.__dict__.update({k: v for k, v in parts[0].__dict__.items() if k != PackedKV._BLOCKS})
    out.rotation = None  # every row's own head: the storage holds the layer's rotation
    first = 0
    groups = []
    for p in parts:
        if p.per_channel_keys:
            n, ng = p.length, p.k_scale.shape[2]
            local = (p.k_group.reshape(-1) if p.k_group is not None
                     else torch.arange(n, device=p.k_codes.device, dtype=torch.int32) // p.quant.group_size)
            groups.append((local + first).to(torch.int32).reshape(1, 1, -1))
            first += ng
    for name in PackedKV._SLOTS:
        if name == "k_group":
            continue
        ts = [getattr(p, name) for p in parts]
        setattr(out, name, None if ts[0] is None else torch.cat(ts, dim=2))
    out.k_group = torch.cat(groups, dim=2) if groups else None
    out.track_groups = out.per_channel_keys
    return out


@register_layout
class PackedRaggedStorage(RaggedRows):
    """Every row's kept tokens in one buffer per layer; see the module docstring.

    Attributes
    ----------
    tail : FullPrecisionStorage or QuantizedStorage, ``[batch, heads, ...]``
        Tokens appended after the rows were cut (and the sinks of a quantized layout).
    fp_keys, fp_values : ``[1, 1, sum fp_len, d]`` or None
        The rows' full-precision tokens (a full-precision layout, or a residual that was cut).
    fp_len : list[int], per row
    packed : PackedKV ``[1, 1, sum q_len, ...]`` or None
        The rows' packed tokens; per-channel key groups indexed globally (``k_group``).
    q_len : list[int], per row
    rotation : the layer's per-head rotation of the packed codes (row ``r`` is head ``r % heads``)
    lead : list[int], per row: leading padding slots it had to keep (sinks of a left-padded row)
    """

    FIELDS = {"batch": "_batch", "heads": "_heads", "lead": "lead", "tail": "tail", "fp_keys": "fp_keys",
              "fp_values": "fp_values", "fp_lengths": "fp_len", "packed": "packed", "packed_lengths": "q_len",
              "rotation": "rotation"}
    """Saved fields (:mod:`.serialize_state`) and the attributes that hold them (the offsets are
    the running sums of the lengths, rebuilt on demand)."""
    _VIEW = "_flat_view"

    # ------------------------------------------------------------------ construction
    @classmethod
    def split(cls, storage: LayerStorage, keeps: list[torch.Tensor], lead: list[int] | None = None) -> LayerStorage:
        """Row ``r`` of ``storage`` keeps its sorted row-local slots ``keeps[r]``: the rows in one buffer."""
        return cls.from_rows(RaggedStorage.split(storage, keeps, lead).rows, storage.batch, storage.heads, lead)

    @classmethod
    def from_rows(cls, rows: list[LayerStorage], batch: int, heads: int, lead: list[int] | None = None
                  ) -> LayerStorage:
        """The rows (``batch = heads = 1`` storages of one layout) in one buffer; the per-row
        :class:`RaggedStorage` when they cannot be (a quantized row whose sinks are not full yet)."""
        lead = [0] * len(rows) if lead is None else list(lead)
        out = cls.__new__(cls)
        out._batch, out._heads, out.lead = batch, heads, lead
        out.fp_keys = out.fp_values = out.packed = out.rotation = None
        out.fp_len = [0] * len(rows)
        out.q_len = [0] * len(rows)
        first = rows[0]
        if isinstance(first, FullPrecisionStorage) and all(isinstance(r, FullPrecisionStorage) for r in rows):
            out._set_fp([r.keys for r in rows], [r.values for r in rows])
            out.tail = FullPrecisionStorage(first.keys.new_empty(batch, heads, 0, first.keys.shape[-1]),
                                            first.values.new_empty(batch, heads, 0, first.values.shape[-1]))
            return out
        quantized = all(type(r) is QuantizedStorage for r in rows)
        sinks = {r.n_sinks for r in rows} if quantized else set()
        if not quantized or len(sinks) != 1 or (first.quant.sink_tokens and sinks != {first.quant.sink_tokens}):
            return RaggedStorage(rows, batch, heads, lead)
        residuals = {r.keys.shape[2] for r in rows}
        keep_residual = len(residuals) == 1 and all(r.packed.length for r in rows)  # rectangular: the tail's
        if not keep_residual:  # cut residuals stay full precision, in the buffer
            out._set_fp([r.keys for r in rows], [r.values for r in rows])
        with_codes = [r.packed for r in rows if r.packed.length]
        if with_codes:
            out.packed = _concat_packed(with_codes)
            out.q_len = [r.packed.length for r in rows]
            if first.quant.rotation is not None:  # the space each head's codes were made in
                out.rotation = _layer_rotation(rows, heads)
                if out.rotation is None:
                    return RaggedStorage(rows, batch, heads, lead)
        tail = QuantizedStorage.__new__(QuantizedStorage)
        tail.quant, tail.dtype = first.quant, first.dtype

        def stack(ts: list[torch.Tensor | None]) -> torch.Tensor | None:
            return None if ts[0] is None else torch.cat(ts, dim=0).reshape(batch, heads, *ts[0].shape[2:])

        tail.sink_keys, tail.sink_values = stack([r.sink_keys for r in rows]), stack([r.sink_values for r in rows])
        if keep_residual:
            tail.keys, tail.values = stack([r.keys for r in rows]), stack([r.values for r in rows])
        else:
            tail.keys = first.keys.new_empty(batch, heads, 0, first.keys.shape[-1])
            tail.values = first.values.new_empty(batch, heads, 0, first.values.shape[-1])
        tail.packed = PackedKV(first.quant, first.dtype, first.packed.head_dim, True, first.packed.layer)
        tail.packed.key_bits, tail.packed.value_bits = first.packed.key_bits, first.packed.value_bits
        out.tail = tail
        return out

    def _set_fp(self, keys: list[torch.Tensor], values: list[torch.Tensor]) -> None:
        self.fp_len = [k.shape[2] for k in keys]
        self.fp_keys = torch.cat([k.reshape(1, 1, -1, k.shape[-1]) for k in keys], dim=2)
        self.fp_values = torch.cat([v.reshape(1, 1, -1, v.shape[-1]) for v in values], dim=2)

    def __setattr__(self, name: str, value) -> None:
        self.__dict__.pop(self._VIEW, None)  # the block view is rebuilt after any change
        object.__setattr__(self, name, value)

    # ------------------------------------------------------------------ shape
    @property
    def _device(self) -> torch.device:
        return self.tail.keys.device

    @property
    def n_sinks(self) -> int:
        return getattr(self.tail, "n_sinks", 0)

    @property
    def frozen_lengths(self) -> list[int]:
        """Per row: the slots before the tail's own tokens (sinks, full-precision, packed)."""
        s = self.n_sinks
        return [s + f + q for f, q in zip(self.fp_len, self.q_len)]

    @property
    def row_lengths(self) -> list[int]:
        rest = self.tail.length - self.n_sinks
        return [n + rest for n in self.frozen_lengths]

    def protected(self) -> tuple[int, int]:
        """The sinks, and a quantized tail's residual (it stays rectangular)."""
        trail = self.tail.keys.shape[2] if isinstance(self.tail, QuantizedStorage) else 0
        return self.n_sinks, trail

    # ------------------------------------------------------------------ reading
    def _frozen_block(self) -> FlatRaggedBlock | None:
        view = self.__dict__.get(self._VIEW)
        if view is None:
            view = self._make_frozen_block()
            object.__setattr__(self, self._VIEW, view)
        return view

    def _make_frozen_block(self) -> FlatRaggedBlock | None:
        frozen = self.frozen_lengths
        if not max(frozen, default=0):
            return None
        dev = self.tail.keys.device
        sinks = None
        if self.n_sinks:
            sinks = (self.tail.sink_keys, self.tail.sink_values)
        fp = None
        if self.fp_keys is not None and any(self.fp_len):
            fp = (self.fp_keys, self.fp_values, _offsets(self.fp_len, dev), torch.tensor(self.fp_len, dtype=torch.int32,
                                                                                        device=dev))
        packed = None
        if self.packed is not None and any(self.q_len):
            packed = (self.packed.qblocks(), _offsets(self.q_len, dev),
                      torch.tensor(self.q_len, dtype=torch.int32, device=dev), self.rotation)
        return FlatRaggedBlock(self._batch, self._heads, frozen, sinks, fp, self.fp_len, packed, self.q_len)

    def _tail_blocks(self, blocks: list) -> list:
        """The tail's blocks without its sinks (the frozen block reads them)."""
        return blocks[1:] if self.n_sinks else blocks

    def blocks(self) -> list:
        frozen = self._frozen_block()
        return ([] if frozen is None else [frozen]) + self._tail_blocks(self.tail.blocks())

    def attention_update(self, keys: torch.Tensor, values: torch.Tensor) -> list:
        frozen = self._frozen_block()
        had_sinks = self.n_sinks
        rest = self.tail.attention_update(keys, values)
        rest = rest[1:] if had_sinks else rest
        return ([] if frozen is None else [frozen]) + rest

    # ------------------------------------------------------------------ writing
    def append(self, keys: torch.Tensor, values: torch.Tensor) -> None:
        self.tail.append(keys, values)

    def gather_rows(self, keeps: list[torch.Tensor], in_place: bool = True) -> None:
        """Row ``r`` keeps its own sorted slots ``keeps[r]`` (every protected slot included).

        The kept full-precision and packed tokens of each row (its buffer part, then the tail's
        packed tokens it keeps) are gathered into new buffers in one ``index_select`` each; the
        tail keeps its sinks and residual. Always into new tensors: views handed out for an
        attention call that has not run yet stay valid."""
        s, frozen = self.n_sinks, self.frozen_lengths
        tail_q = self.tail.packed.length if isinstance(self.tail, QuantizedStorage) else 0
        tail_fp = self.tail.length if isinstance(self.tail, FullPrecisionStorage) else 0
        fp_off, q_off = _offsets(self.fp_len), _offsets(self.q_len)
        fp_idx, q_idx, new_fp, new_q = [], [], [], []
        total_fp = sum(self.fp_len)
        total_q = sum(self.q_len)
        for r, keep in enumerate(keeps):
            keep = keep.to("cpu")
            if s and int((keep < s).sum()) != s:
                raise RuntimeError(f"row {r} of a ragged layer must keep its {s} sinks")
            self.lead[r] = int((keep < self.lead[r]).sum())
            f, q = self.fp_len[r], self.q_len[r]
            k = keep[keep >= s] - s
            in_fp = k[k < f]
            in_q = k[(k >= f) & (k < f + q)] - f
            in_tail = k[k >= f + q] - (f + q)  # the tail's own tokens: packed, then residual / fp
            fp_idx.append(in_fp + int(fp_off[r]))
            q_idx.append(in_q + int(q_off[r]))
            t_fp = in_tail[in_tail < tail_fp]
            t_q = in_tail[in_tail < tail_q]
            fp_idx.append(t_fp + total_fp + r * tail_fp)  # a full-precision tail's tokens join the buffer
            q_idx.append(t_q + total_q + r * tail_q)
            new_fp.append(in_fp.numel() + t_fp.numel())
            new_q.append(in_q.numel() + t_q.numel())
            if tail_q and (in_tail >= tail_q).sum() != self.tail.keys.shape[2]:
                raise RuntimeError(f"row {r} of a ragged layer must keep the residual of its quantized tail")
        if tail_fp:
            B, H = self._batch, self._heads
            fk = self.tail.keys.reshape(1, 1, B * H * tail_fp, -1)
            fv = self.tail.values.reshape(1, 1, B * H * tail_fp, -1)
            src_k = fk if self.fp_keys is None else torch.cat([self.fp_keys, fk], dim=2)
            src_v = fv if self.fp_values is None else torch.cat([self.fp_values, fv], dim=2)
            self.tail.gather(self.tail.keys.new_zeros(B, H, 0, dtype=torch.int64), in_place=False)
        else:
            src_k, src_v = self.fp_keys, self.fp_values
        if src_k is not None:
            idx = torch.cat(fp_idx).to(src_k.device).reshape(1, 1, -1)
            self.fp_keys, self.fp_values = gather_tokens(src_k, idx), gather_tokens(src_v, idx)
        self.fp_len = new_fp
        if tail_q:
            parts = ([] if self.packed is None else [self.packed]) + [
                p for p in _rows_of_packed(self.tail.packed)]
            merged = _concat_packed(parts)
            if self.rotation is None:
                self.rotation = self.tail.packed.rotation
            self.tail.packed = PackedKV(self.tail.quant, self.tail.dtype, self.tail.packed.head_dim, True,
                                        self.tail.packed.layer)
        else:
            merged = self.packed
        if merged is not None:
            idx = torch.cat(q_idx).to(merged.k_codes.device).reshape(1, 1, -1)
            if idx.numel() != merged.length or not bool((idx.reshape(-1) == torch.arange(
                    merged.length, device=idx.device)).all()):
                merged.gather(idx)
            self.packed = merged if merged.length else None
        self.q_len = new_q
        self.__dict__.pop(self._VIEW, None)

    def row(self, b: int, h: int) -> LayerStorage:
        raise RuntimeError("a packed ragged layer's rows share one buffer: use gather_rows or map_tensors")

    def map_tensors(self, fn: Callable[[torch.Tensor], torch.Tensor]) -> None:
        """Batch selection / repetition: ``fn`` acts on the batch axis, so it is applied to the
        row numbers and each row's tokens are gathered in the new order."""
        order = fn(torch.arange(self._batch).reshape(self._batch, 1)).reshape(-1).tolist()
        H = self._heads
        rows = [b * H + h for b in order for h in range(H)]
        fp_off, q_off = _offsets(self.fp_len), _offsets(self.q_len)
        if self.fp_keys is not None:
            idx = torch.cat([torch.arange(int(fp_off[r]), int(fp_off[r]) + self.fp_len[r]) for r in rows])
            idx = idx.to(self.fp_keys.device).reshape(1, 1, -1)
            self.fp_keys, self.fp_values = gather_tokens(self.fp_keys, idx), gather_tokens(self.fp_values, idx)
        if self.packed is not None:
            idx = torch.cat([torch.arange(int(q_off[r]), int(q_off[r]) + self.q_len[r]) for r in rows])
            self.packed.gather(idx.to(self.packed.k_codes.device).reshape(1, 1, -1))
        self.fp_len = [self.fp_len[r] for r in rows]
        self.q_len = [self.q_len[r] for r in rows]
        self.lead = [self.lead[r] for r in rows]
        self.tail.map_tensors(fn)
        self._batch = len(order)

    # ------------------------------------------------------------------ accounting
    def named_tensors(self) -> dict[str, torch.Tensor]:
        out = {f"tail.{k}": v for k, v in self.tail.named_tensors().items()}
        if self.fp_keys is not None:
            out.update(fp_keys=self.fp_keys, fp_values=self.fp_values)
        if self.packed is not None:
            out.update({f"packed.{k}": v for k, v in self.packed.named_tensors().items()})
        if self.rotation is not None:
            out.update(self.rotation.named_tensors())
        view = self._frozen_block()  # the per-row offsets and lengths the kernels read
        if view is not None:
            out.update(view.index_tensors())
        return out

    def nbytes_by_category(self) -> dict[str, int]:
        out = dict.fromkeys(CATEGORIES, 0)
        for k, v in self.tail.nbytes_by_category().items():
            out[k] += v
        if self.fp_keys is not None:
            out["residual"] += self.fp_keys.nbytes + self.fp_values.nbytes
        if self.packed is not None:
            self.packed.add_nbytes(out)
        if self.rotation is not None:
            out["tables"] += sum(t.nbytes for t in self.rotation.named_tensors().values())
        view = self._frozen_block()
        if view is not None:
            out["indices"] += sum(t.nbytes for t in view.index_tensors().values())
        return out


def _offsets(lengths: list[int], device=None) -> torch.Tensor:
    """int64 ``[R]``: where each row starts in a buffer of rows of ``lengths`` tokens."""
    out = torch.zeros(len(lengths), dtype=torch.int64)
    if len(lengths) > 1:
        out[1:] = torch.tensor(lengths[:-1], dtype=torch.int64).cumsum(0)
    return out if device is None else out.to(device)


def _rows_of_packed(packed: PackedKV) -> list[PackedKV]:
    b, h = packed.k_codes.shape[:2]
    return [packed.row(i, j) for i in range(b) for j in range(h)]


def _layer_rotation(rows: list[LayerStorage], heads: int):
    """The rotation the rows' packed codes were made in, per head (row ``r`` is head ``r % heads``):
    head ``h`` takes a row of that head's own rotation (a cut row keeps its head's; the evicted
    tier's rows were all made in one). None when two rows of one head disagree (the per-row
    layout then holds them)."""
    from .packed import Rotation

    per_head: list = [None] * heads
    for r, row in enumerate(rows):
        rot = row.packed.rotation if row.packed.length else None
        if rot is None:
            continue
        have = per_head[r % heads]
        if have is None:
            per_head[r % heads] = rot
        elif not _same_rotation(have, rot):
            return None
    known = next(x for x in per_head if x is not None)
    per_head = [known if x is None else x for x in per_head]  # a head without codes: any space serves
    if known.matrices is not None:
        return Rotation.from_matrices(torch.cat([x.matrices for x in per_head], dim=0)).with_keys(known.keys)
    return Rotation.from_signs(torch.cat([x.signs for x in per_head], dim=0)).with_keys(known.keys)


def _same_rotation(a, b) -> bool:
    if (a.matrices is None) != (b.matrices is None) or a.keys != b.keys:
        return False
    return torch.equal(a.matrices, b.matrices) if a.matrices is not None else torch.equal(a.signs, b.signs)
