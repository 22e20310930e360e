"""How one cache layer holds its tokens: the storage layouts of :class:`CompressedLayer`.

A layer only knows the transformers contract and the order of operations (append, attend,
observe, evict); a storage knows its layout. Every storage holds the kept tokens of one layer
in token order, every tensor ``[batch, kv_heads, n, ...]``, and offers the same small API:

* :meth:`LayerStorage.read` -- the stored tokens in full precision (the reference attention
  path), optionally followed by this call's new tokens;
* :meth:`LayerStorage.append` -- add new tokens (:meth:`LayerStorage.update`: read, then append);
* :meth:`LayerStorage.gather` -- keep the slots ``keep`` (``[batch, kv_heads, K]``, sorted): the
  physical eviction, which frees memory;
* :meth:`LayerStorage.blocks` -- the stored tokens as attention blocks in token order, read
  in place by :func:`kv_cache.attention.compressed_attention` (codes are never dequantized
  into a key matrix);
* :meth:`LayerStorage.protected` -- how many leading / trailing slots eviction must keep;
* :meth:`LayerStorage.named_tensors` / :meth:`LayerStorage.nbytes_by_category` -- honest
  accounting (every tensor held, by category);
* :meth:`LayerStorage.head_lengths` / :meth:`LayerStorage.starts` -- the tokens each
  ``(batch, head)`` row holds and the first valid slot of each row (a layout whose heads hold
  different numbers declares ``ragged = True``);
* :meth:`LayerStorage.keep_rows` -- row ``r`` keeps its own slots: a rectangular layout returns
  the ragged layout that holds only those (:mod:`~kv_cache.cache.packed_ragged`), a ragged one
  gathers in place;
* ``FIELDS`` -- the saved fields (name -> attribute) a ``.kvc`` file writes and reads back.

Every layout registers itself in :data:`LAYOUTS` (:func:`register_layout`); the serializer
saves and loads exactly the registered ones.

Layouts: :class:`FullPrecisionStorage` (no quantization, exactly ``DynamicCache``) and
:class:`QuantizedStorage` (KIVI: full-precision sinks | packed codes | full-precision
residual), whose packed middle is a :class:`~kv_cache.cache.packed.PackedKV` (per-channel or
per-token keys, uniform or Lloyd-Max levels, optionally rotated);
:class:`~kv_cache.cache.packed_ragged.PackedRaggedStorage` (heads holding different numbers of
tokens, every row's tokens in one buffer per layer, read at per-row offsets) and
:class:`~kv_cache.cache.ragged.RaggedStorage` (the same, one storage per row: rows whose sinks
are not full yet, and files saved with it). New layouts implement :class:`LayerStorage`,
register, and plug into the layer unchanged.
"""

from __future__ import annotations

from abc import ABC, abstractmethod
from typing import Callable, ClassVar

import torch

from ..attention.blocks import FullBlock, QuantBlock
from .config import QuantConfig
from ..kernels import compact_rows_
from .packed import PackedKV, _cat, gather_tokens

CATEGORIES = ("codes", "scales", "zero_points", "residual", "indices", "tables")

COMPACT_SLACK = 8
"""An eviction leaving at most ``max(1, kept // COMPACT_SLACK)`` slots unused compacts in place;
more unused slots are given back (exact-size buffers)."""
"""Byte categories of a storage (the layer adds ``scores`` for policy state)."""


LAYOUTS: dict[str, type] = {}
"""Every registered storage layout, by class name (the serializer's list of known layouts)."""


def register_layout(cls: type) -> type:
    """Class decorator: add a :class:`LayerStorage` subclass (with its ``FIELDS``) to :data:`LAYOUTS`."""
    if not isinstance(getattr(cls, "FIELDS", None), dict):
        raise TypeError(f"a storage layout declares FIELDS (saved name -> attribute); {cls.__name__} does not")
    LAYOUTS[cls.__name__] = cls
    return cls


class LayerStorage(ABC):
    """The tokens one layer holds; see the module docstring for the contract."""

    FIELDS: ClassVar[dict[str, str]] = {}
    ragged: ClassVar[bool] = False
    """True for a layout whose heads hold different numbers of tokens."""

    def head_lengths(self) -> torch.Tensor:
        """``[batch, heads]`` int64: the tokens each row holds (all :attr:`length` unless ragged)."""
        return torch.full((self.batch, self.heads), self.length, dtype=torch.int64)

    def starts(self) -> torch.Tensor | None:
        """``[batch, heads]`` int32: each row's first valid slot of the ``length`` slots the layout
        shows (None: 0 everywhere; left padding is tracked by the layer)."""
        return None

    def keep_rows(self, keeps: list[torch.Tensor], lead: list[int], in_place: bool = True) -> "LayerStorage":
        """Row ``r = b * heads + h`` keeps its sorted row-local slots ``keeps[r]`` (``lead[r]`` of
        them leading padding); returns the storage that holds the result: the ragged layout for a
        rectangular one (every row's tokens in one buffer, :mod:`~kv_cache.cache.packed_ragged`)."""
        return LAYOUTS["PackedRaggedStorage"].split(self, keeps, lead)

    @property
    @abstractmethod
    def length(self) -> int:
        """Tokens held (every ``[batch, kv_heads]`` row holds the same number)."""

    @property
    def batch(self) -> int:
        """Rows of the batch."""
        return self.keys.shape[0]  # every layout keeps its full-precision part as ``keys``

    @property
    def heads(self) -> int:
        """KV heads."""
        return self.keys.shape[1]

    @abstractmethod
    def append(self, keys: torch.Tensor, values: torch.Tensor) -> None:
        """Add ``[batch, kv_heads, q_len, head_dim]`` tokens after the stored ones."""

    @abstractmethod
    def read(
        self, new_keys: torch.Tensor | None = None, new_values: torch.Tensor | None = None
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """Stored tokens in full precision, in order, then ``new_*`` (one concatenation)."""

    def update(self, keys: torch.Tensor, values: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """Append this call's tokens and return what its attention reads: the stored tokens in
        full precision, then ``keys``/``values`` exactly as given (``[batch, kv_heads, n + q_len, d]``)."""
        out = self.read(keys, values)
        self.append(keys, values)
        return out

    @abstractmethod
    def blocks(self) -> list:
        """The stored tokens as :mod:`kv_cache.attention.blocks` blocks, in token order."""

    def attention_update(self, keys: torch.Tensor, values: torch.Tensor) -> list:
        """Append this call's tokens; return the blocks its attention reads (native path).

        The blocks stored before the call, in token order; when the call has one token
        (decoding, no causal structure inside the call) that token is included too, as a
        full-precision block of its own, exactly as given (the one-call decoding step reads it
        there; the per-block path joins it to a short full-precision block,
        :func:`kv_cache.attention.blocks.join_new_token`); longer calls get their own causal block
        in the attention function.
        """
        view = self.blocks()
        self.append(keys, values)
        if keys.shape[2] == 1:
            view.append(FullBlock(keys, values))
        return view

    @abstractmethod
    def protected(self) -> tuple[int, int]:
        """``(leading, trailing)``: slots eviction must keep (full-precision sinks, residual)."""

    @abstractmethod
    def gather(self, keep: torch.Tensor, in_place: bool = True) -> None:
        """Keep the slots ``keep`` (``[batch, kv_heads, K]`` int64, sorted, every protected slot in).

        ``in_place=False``: tensors handed out by :meth:`update` for an attention call that has
        not run yet must not change."""

    @abstractmethod
    def row(self, b: int, h: int) -> "LayerStorage":
        """Row ``(b, h)`` alone (``batch = heads = 1``) in tensors of its own: the unit of a
        :class:`~kv_cache.cache.ragged.RaggedStorage`, whose heads hold different numbers of tokens."""

    @abstractmethod
    def named_tensors(self) -> dict[str, torch.Tensor]:
        """Every tensor held, by slot name."""

    @abstractmethod
    def map_tensors(self, fn: Callable[[torch.Tensor], torch.Tensor]) -> None:
        """Replace every held tensor ``t`` by ``fn(t)`` (batch selection, beam reordering)."""

    @abstractmethod
    def nbytes_by_category(self) -> dict[str, int]:
        """Bytes held by category (keys of :data:`CATEGORIES`): sums of ``tensor.nbytes``."""


@register_layout
class FullPrecisionStorage(LayerStorage):
    """Tokens in the model dtype: exactly ``DynamicCache`` when nothing is evicted.

    Held in buffers ``[b, h, cap, d]``; ``keys``/``values`` are views of the first ``n`` slots.
    Appending beyond ``cap`` concatenates to exactly ``n + q_len`` (``DynamicCache``'s growth);
    an eviction that frees few slots compacts the buffers in place
    (:func:`kv_cache.kernels.compact_rows_`), so H2O's steady state (append one, evict one)
    neither allocates nor copies more than half a row; one that frees many (SnapKV after the
    prefill) gathers into exact-size buffers, so the memory is really returned. The report
    counts the whole buffers.
    """

    FIELDS = {"key_buffer": "_kbuf", "value_buffer": "_vbuf", "length": "n"}
    """Saved fields (:mod:`.serialize_state`): the whole buffers, as held and counted, and the
    number of valid slots."""

    def __init__(self, keys: torch.Tensor, values: torch.Tensor):
        self._kbuf, self._vbuf, self.n = keys, values, keys.shape[2]  # [b, h, cap, d]

    @property
    def keys(self) -> torch.Tensor:
        return self._kbuf[:, :, :self.n]

    @property
    def values(self) -> torch.Tensor:
        return self._vbuf[:, :, :self.n]

    @property
    def length(self) -> int:
        return self.n

    def append(self, keys: torch.Tensor, values: torch.Tensor) -> None:
        q = keys.shape[2]
        if self.n + q > self._kbuf.shape[2]:
            self._kbuf = torch.cat([self.keys, keys], dim=2)
            self._vbuf = torch.cat([self.values, values], dim=2)
        else:  # a slot freed by the last eviction
            self._kbuf[:, :, self.n:self.n + q] = keys
            self._vbuf[:, :, self.n:self.n + q] = values
        self.n += q

    def read(self, new_keys=None, new_values=None):
        if new_keys is None:
            return self.keys, self.values
        return torch.cat([self.keys, new_keys], dim=2), torch.cat([self.values, new_values], dim=2)

    def update(self, keys, values):
        self.append(keys, values)  # one concatenation (or none), and attention reads the stored tensors
        return self.keys, self.values

    def blocks(self) -> list:
        return [FullBlock(self.keys, self.values)] if self.length else []

    def attention_update(self, keys, values):
        if keys.shape[2] == 1:  # decoding: the stored buffers already hold the new token
            self.append(keys, values)
            return self.blocks()
        return super().attention_update(keys, values)

    def protected(self) -> tuple[int, int]:
        return 0, 0

    def gather(self, keep: torch.Tensor, in_place: bool = True) -> None:
        b, h, cap = self._kbuf.shape[:3]
        K = keep.shape[-1]
        if not in_place or cap - K > max(1, K // COMPACT_SLACK):  # exact-size buffers give the memory back
            self._kbuf, self._vbuf = gather_tokens(self.keys, keep), gather_tokens(self.values, keep)
        else:
            rows = keep.reshape(b * h, K)
            compact_rows_(self._kbuf.view(b * h, cap, -1), rows)
            compact_rows_(self._vbuf.view(b * h, cap, -1), rows)
        self.n = K

    def row(self, b: int, h: int) -> "FullPrecisionStorage":
        return FullPrecisionStorage(self.keys[b:b + 1, h:h + 1].clone(), self.values[b:b + 1, h:h + 1].clone())

    def named_tensors(self) -> dict[str, torch.Tensor]:
        return {"keys": self._kbuf, "values": self._vbuf}

    def map_tensors(self, fn) -> None:
        self._kbuf, self._vbuf = fn(self.keys), fn(self.values)
        self.n = self._kbuf.shape[2]

    def nbytes_by_category(self) -> dict[str, int]:
        out = dict.fromkeys(CATEGORIES, 0)
        out["residual"] = self._kbuf.nbytes + self._vbuf.nbytes
        return out


@register_layout
class QuantizedStorage(LayerStorage):
    """KIVI storage: ``[ full-precision sinks | packed quantized tokens | full-precision residual ]``.

    * New tokens enter the residual. Once it holds ``max(residual_length, group_size)`` tokens,
      all its whole blocks of ``group_size`` tokens are quantized once and appended to the
      :class:`PackedKV` (KIVI); stored codes are never re-quantized.
    * The first ``sink_tokens`` tokens of the sequence stay full precision and are filled
      before anything is quantized.
    * Eviction keeps the sinks and, once something is packed, the residual (so every head's
      packed part stays rectangular and the residual append-only).
    """

    FIELDS = {"quant": "quant", "dtype": "dtype", "sink_keys": "sink_keys", "sink_values": "sink_values",
              "packed": "packed", "residual_keys": "keys", "residual_values": "values"}
    """Saved fields (:mod:`.serialize_state`) and the attributes that hold them."""

    def __init__(self, quant: QuantConfig, keys: torch.Tensor, values: torch.Tensor, track_groups: bool,
                 layer: int = 0):
        self.quant = quant
        self.dtype = keys.dtype  # the model's: read() returns it, PackedKV quantizes in it
        rd = quant.residual_dtype or keys.dtype  # full-precision residual and sinks (e.g. fp16 on a fp32 model)
        self.keys, self.values = keys.to(rd), values.to(rd)  # the residual, [b, h, r, d]
        self.sink_keys: torch.Tensor | None = None
        self.sink_values: torch.Tensor | None = None
        self.packed = PackedKV(quant, keys.dtype, keys.shape[-1], track_groups, layer)

    @property
    def n_sinks(self) -> int:
        return 0 if self.sink_keys is None else self.sink_keys.shape[2]

    @property
    def length(self) -> int:
        return self.n_sinks + self.packed.length + self.keys.shape[2]

    def append(self, keys: torch.Tensor, values: torch.Tensor) -> None:
        q = self.quant
        if (self.keys.shape[2] == 0 and q.residual_length == 0 and q.group_size == 1 and self.packed.length
                and self.n_sinks >= q.sink_tokens):  # coded on arrival (§29.5): straight to the packed part
            self.packed.append(keys.to(self.keys.dtype), values.to(self.values.dtype))
            return
        self.keys = torch.cat([self.keys, keys.to(self.keys.dtype)], dim=2)
        self.values = torch.cat([self.values, values.to(self.values.dtype)], dim=2)
        self._flush()

    def _flush(self) -> None:
        if self._fill_and_pack():  # the residual is now a slice of what append concatenated
            self.keys, self.values = _owned(self.keys), _owned(self.values)  # never a view of a prefill

    def _fill_and_pack(self) -> bool:
        """Move the residual's leading tokens to the sinks, then whole groups to the packed part;
        returns whether the residual was sliced (else it is the tensor ``append`` made)."""
        q = self.quant
        sliced = False
        if q.sink_tokens:
            take = min(q.sink_tokens - self.n_sinks, self.keys.shape[2]) if self.packed.length == 0 else 0
            if take > 0:
                self.sink_keys = _owned(_cat(self.sink_keys, self.keys[:, :, :take]))
                self.sink_values = _owned(_cat(self.sink_values, self.values[:, :, :take]))
                self.keys, self.values = self.keys[:, :, take:], self.values[:, :, take:]
                sliced = True
            if self.n_sinks < q.sink_tokens:
                return sliced  # sinks fill first; nothing is quantized before them
        g = q.group_size
        # KIVI: once the residual reaches max(R, g) tokens, all its whole groups are quantized.
        if self.keys.shape[2] < max(q.residual_length, g):
            return sliced
        n = (self.keys.shape[2] // g) * g
        k_blk, v_blk = self.keys[:, :, :n], self.values[:, :, :n]
        self.keys, self.values = self.keys[:, :, n:], self.values[:, :, n:]
        self.packed.append(k_blk, v_blk)
        return True

    def read(self, new_keys=None, new_values=None):
        ks, vs = [], []
        if self.sink_keys is not None:
            ks.append(self.sink_keys)
            vs.append(self.sink_values)
        if self.packed.length:
            k, v = self.packed.dequantize()
            ks.append(k)
            vs.append(v)
        ks.append(self.keys)
        vs.append(self.values)
        if new_keys is not None:
            ks.append(new_keys)
            vs.append(new_values)
        if len(ks) == 1:
            return ks[0].to(self.dtype), vs[0].to(self.dtype)
        return torch.cat([k.to(self.dtype) for k in ks], dim=2), torch.cat([v.to(self.dtype) for v in vs], dim=2)

    def blocks(self) -> list:
        out = []
        if self.sink_keys is not None:
            out.append(FullBlock(self.sink_keys, self.sink_values))
        if self.packed.length:
            out.append(QuantBlock(*self.packed.qblocks(), batch=self.keys.shape[0], kv_heads=self.keys.shape[1],
                                  rotation=self.packed.rotation))
        if self.keys.shape[2]:
            out.append(FullBlock(self.keys, self.values))
        return out

    def protected(self) -> tuple[int, int]:
        return self.n_sinks, self.keys.shape[2] if self.packed.length else 0

    def gather(self, keep: torch.Tensor, in_place: bool = True) -> None:
        lead, trail = self.protected()
        idx = keep[..., lead: keep.shape[-1] - trail] - lead  # same count in every row: protected slots are shared
        if self.packed.length:
            self.packed.gather(idx)
        else:
            self.keys, self.values = gather_tokens(self.keys, idx), gather_tokens(self.values, idx)

    def row(self, b: int, h: int) -> "QuantizedStorage":
        out = QuantizedStorage.__new__(QuantizedStorage)
        out.quant, out.dtype = self.quant, self.dtype

        def one(t: torch.Tensor | None) -> torch.Tensor | None:
            return None if t is None else t[b:b + 1, h:h + 1].clone()

        out.keys, out.values = one(self.keys), one(self.values)
        out.sink_keys, out.sink_values = one(self.sink_keys), one(self.sink_values)
        out.packed = self.packed.row(b, h)
        return out

    def named_tensors(self) -> dict[str, torch.Tensor]:
        out = {"keys": self.keys, "values": self.values}
        if self.sink_keys is not None:
            out.update(sink_keys=self.sink_keys, sink_values=self.sink_values)
        out.update({f"packed.{k}": v for k, v in self.packed.named_tensors().items()})
        return out

    def map_tensors(self, fn) -> None:
        self.keys, self.values = fn(self.keys), fn(self.values)
        if self.sink_keys is not None:
            self.sink_keys, self.sink_values = fn(self.sink_keys), fn(self.sink_values)
        self.packed.map_tensors(fn)

    def nbytes_by_category(self) -> dict[str, int]:
        out = dict.fromkeys(CATEGORIES, 0)
        out["residual"] = self.keys.nbytes + self.values.nbytes
        if self.sink_keys is not None:
            out["residual"] += self.sink_keys.nbytes + self.sink_values.nbytes
        self.packed.add_nbytes(out)
        return out


def _owned(t: torch.Tensor) -> torch.Tensor:
    """``t`` in memory of its own: a slice (the sinks, an empty or short residual) of a prefill's
    ``[b, h, T, d]`` states would otherwise keep all ``T`` tokens alive while its ``nbytes``
    counts only its own slots (an empty slice is "contiguous" and ``.contiguous()`` keeps it)."""
    if t.is_contiguous() and t.untyped_storage().nbytes() == t.nbytes:
        return t
    return t.clone(memory_format=torch.contiguous_format)


def make_storage(
    quant: QuantConfig | None, keys: torch.Tensor, values: torch.Tensor, track_groups: bool, layer: int = 0
) -> LayerStorage:
    """The storage of layer ``layer`` for ``quant`` (None: full precision), starting empty like
    ``keys``/``values`` (``[batch, kv_heads, 0, head_dim]``). ``track_groups``: tokens may be evicted."""
    if quant is None:
        return FullPrecisionStorage(keys, values)
    return QuantizedStorage(quant, keys, values, track_groups, layer)
