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
  accounting (every tensor held, by category).

Layouts: :class:`FullPrecisionStorage` (no quantization, exactly ``DynamicCache``) and
:class:`QuantizedStorage` (KIVI: full-precision sinks | packed codes | full-precision
residual), whose packed middle is a :class:`PackedKV`. New layouts (rotated, codebook, ragged
per head) implement :class:`LayerStorage` and plug into the layer unchanged.
"""

from __future__ import annotations

from abc import ABC, abstractmethod
from typing import Callable

import torch

from ..attention.blocks import FullBlock, QuantBlock
from ..kernels import QBlock, dequantize_block, quantize_block, uniform_lut
from .config import QuantConfig

CATEGORIES = ("codes", "scales", "zero_points", "residual", "indices")
"""Byte categories of a storage (the layer adds ``scores`` for policy state)."""


def gather_tokens(t: torch.Tensor, idx: torch.Tensor) -> torch.Tensor:
    """``t[b, h, idx[b, h, j], ...]`` for ``t`` ``[B, H, n, ...]`` and ``idx`` ``[B, H, k]``.

    One ``index_select`` over flattened rows: much cheaper than ``gather`` with an index
    expanded to the trailing dims.
    """
    b, h, n = t.shape[:3]
    k = idx.shape[2]
    rows = (idx.reshape(b * h, k) + torch.arange(b * h, device=t.device).unsqueeze(1) * n).reshape(-1)
    return t.reshape(b * h * n, *t.shape[3:]).index_select(0, rows).reshape(b, h, k, *t.shape[3:])


def _cat(old: torch.Tensor | None, new: torch.Tensor) -> torch.Tensor:
    return new if old is None else torch.cat([old, new], dim=2)


class LayerStorage(ABC):
    """The tokens one layer holds; see the module docstring for the contract."""

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

    @abstractmethod
    def protected(self) -> tuple[int, int]:
        """``(leading, trailing)``: slots eviction must keep (full-precision sinks, residual)."""

    @abstractmethod
    def gather(self, keep: torch.Tensor) -> None:
        """Keep the slots ``keep`` (``[batch, kv_heads, K]`` int64, sorted, every protected slot in)."""

    @abstractmethod
    def named_tensors(self) -> dict[str, torch.Tensor]:
        """Every tensor held, by slot name."""

    @abstractmethod
    def map_tensors(self, fn: Callable[[torch.Tensor], torch.Tensor]) -> None:
        """Replace every held tensor ``t`` by ``fn(t)`` (batch selection, beam reordering)."""

    @abstractmethod
    def nbytes_by_category(self) -> dict[str, int]:
        """Bytes held by category (keys of :data:`CATEGORIES`): sums of ``tensor.nbytes``."""


class FullPrecisionStorage(LayerStorage):
    """Tokens in the model dtype, appended by concatenation: exactly ``DynamicCache``."""

    def __init__(self, keys: torch.Tensor, values: torch.Tensor):
        self.keys, self.values = keys, values  # [b, h, n, d]

    @property
    def length(self) -> int:
        return self.keys.shape[2]

    def append(self, keys: torch.Tensor, values: torch.Tensor) -> None:
        self.keys = torch.cat([self.keys, keys], dim=2)
        self.values = torch.cat([self.values, values], dim=2)

    def read(self, new_keys=None, new_values=None):
        if new_keys is None:
            return self.keys, self.values
        return torch.cat([self.keys, new_keys], dim=2), torch.cat([self.values, new_values], dim=2)

    def update(self, keys, values):
        self.append(keys, values)  # one concatenation, and attention reads the stored tensors
        return self.keys, self.values

    def blocks(self) -> list:
        return [FullBlock(self.keys, self.values)] if self.length else []

    def protected(self) -> tuple[int, int]:
        return 0, 0

    def gather(self, keep: torch.Tensor) -> None:
        self.keys, self.values = gather_tokens(self.keys, keep), gather_tokens(self.values, keep)

    def named_tensors(self) -> dict[str, torch.Tensor]:
        return {"keys": self.keys, "values": self.values}

    def map_tensors(self, fn) -> None:
        self.keys, self.values = fn(self.keys), fn(self.values)

    def nbytes_by_category(self) -> dict[str, int]:
        out = dict.fromkeys(CATEGORIES, 0)
        out["residual"] = self.keys.nbytes + self.values.nbytes
        return out


class PackedKV:
    """Quantized keys and values of one layer, packed token-major (KIVI layout).

    Keys are per-channel (one scale per ``group_size`` tokens and channel), values per-token
    (one scale per token and ``min(group_size, head_dim)`` channels). Codes are packed
    token-major (``head_dim * bits / 8`` bytes per token and head), so keeping a subset of
    tokens is a gather of whole bytes: no unpacking, no re-quantization.

    Attributes (``n`` tokens, ``G`` key scale groups, ``d`` head_dim)
    ----------------------------------------------------------------
    k_codes, v_codes : uint8 ``[b, h, n, d * bits / 8]``
    k_scale, k_zero : ``[b, h, G, d]`` (``k_zero`` int16, None when symmetric)
    v_scale, v_zero : ``[b, h, n, d / group]``
    k_group : int32 ``[b, h, n]`` or None
        Each key's scale group, kept when tokens may be evicted (groups become ragged then);
        None while groups are whole (token ``t`` uses group ``t // group_size``).
    """

    def __init__(self, quant: QuantConfig, dtype: torch.dtype, head_dim: int, track_groups: bool):
        self.quant, self.dtype, self.head_dim, self.track_groups = quant, dtype, head_dim, track_groups
        self.k_codes = self.k_scale = self.k_zero = None
        self.v_codes = self.v_scale = self.v_zero = None
        self.k_group: torch.Tensor | None = None

    _SLOTS = ("k_codes", "k_scale", "k_zero", "v_codes", "v_scale", "v_zero", "k_group")
    _CATEGORY = {"k_codes": "codes", "v_codes": "codes", "k_scale": "scales", "v_scale": "scales",
                 "k_zero": "zero_points", "v_zero": "zero_points", "k_group": "indices"}

    @property
    def length(self) -> int:
        return 0 if self.k_codes is None else self.k_codes.shape[2]

    def append(self, keys: torch.Tensor, values: torch.Tensor) -> None:
        """Quantize ``[b, h, n, d]`` tokens (``n`` a multiple of ``group_size``) and append them.

        One fused quantize + pack per tensor (:func:`kv_cache.kernels.quantize_block`), bit for
        bit :func:`kv_cache.compression.quantize` with keys per channel and values per token.
        """
        q = self.quant
        g = q.group_size
        b, h, n, d = keys.shape
        R = b * h
        kq = quantize_block(keys.reshape(R, n, d), q.bits, "channel", g, q.symmetric, q.scale_dtype)
        vq = quantize_block(values.reshape(R, n, d), q.bits, "token", min(g, d), q.symmetric, q.scale_dtype)
        if self.track_groups:
            first = 0 if self.k_scale is None else self.k_scale.shape[2]  # index into the scale table
            gid = torch.arange(first, first + n // g, device=keys.device, dtype=torch.int32)
            self.k_group = _cat(self.k_group, gid.repeat_interleave(g).expand(b, h, n).contiguous())
        self.k_codes = _cat(self.k_codes, kq.codes.view(b, h, n, -1))
        self.k_scale = _cat(self.k_scale, kq.scale.view(b, h, n // g, d))  # [b, h, blocks, d]
        self.v_codes = _cat(self.v_codes, vq.codes.view(b, h, n, -1))
        self.v_scale = _cat(self.v_scale, vq.scale.view(b, h, n, -1))  # [b, h, n, d / gv]
        if not q.symmetric:  # symmetric codes have no zero point (None)
            self.k_zero = _cat(self.k_zero, kq.zero.view(b, h, n // g, d))
            self.v_zero = _cat(self.v_zero, vq.zero.view(b, h, n, -1))

    def dequantize(self) -> tuple[torch.Tensor, torch.Tensor]:
        """Keys and values ``[b, h, n, d]`` in ``dtype`` (math dictionary section 3), one fused
        unpack + dequantize pass each (:func:`kv_cache.kernels.dequantize_block`)."""
        b, h, n, _ = self.k_codes.shape
        kq, vq = self.qblocks()
        return (dequantize_block(kq, self.dtype).view(b, h, n, -1),
                dequantize_block(vq, self.dtype).view(b, h, n, -1))

    def qblocks(self) -> tuple[QBlock, QBlock]:
        """Keys and values as kernel blocks over rows ``R = batch * kv_heads`` (views, no copy)."""
        q = self.quant
        b, h, n, p = self.k_codes.shape
        R, d = b * h, self.head_dim
        lut = uniform_lut(q.bits, q.symmetric, self.k_codes.device)
        k_zero = None if self.k_zero is None else self.k_zero.reshape(R, -1, d)
        keys = QBlock(self.k_codes.reshape(R, n, p), q.bits, lut, "channel", self.k_scale.reshape(R, -1, d), k_zero,
                      q.group_size, None if self.k_group is None else self.k_group.reshape(R, n))
        gv = min(q.group_size, d)
        v_zero = None if self.v_zero is None else self.v_zero.reshape(R, n, d // gv)
        values = QBlock(self.v_codes.reshape(R, n, p), q.bits, lut, "token", self.v_scale.reshape(R, n, d // gv),
                        v_zero, gv)
        return keys, values

    def gather(self, idx: torch.Tensor) -> None:
        """Keep tokens ``idx`` (``[b, h, k]``) and drop key scale groups no head uses any more."""
        for name in ("k_codes", "v_codes", "v_scale", "v_zero", "k_group"):
            t = getattr(self, name)
            if t is not None:
                setattr(self, name, gather_tokens(t, idx))
        used = torch.unique(self.k_group)
        if used.numel() < self.k_scale.shape[2]:
            remap = torch.full((self.k_scale.shape[2],), -1, dtype=torch.int32, device=used.device)
            remap[used.long()] = torch.arange(used.numel(), dtype=torch.int32, device=used.device)
            self.k_scale = self.k_scale.index_select(2, used.long())
            if self.k_zero is not None:
                self.k_zero = self.k_zero.index_select(2, used.long())
            self.k_group = remap[self.k_group.long()]

    def named_tensors(self) -> dict[str, torch.Tensor]:
        return {name: t for name in self._SLOTS if (t := getattr(self, name)) is not None}

    def map_tensors(self, fn) -> None:
        for name, t in self.named_tensors().items():
            setattr(self, name, fn(t))

    def add_nbytes(self, out: dict[str, int]) -> None:
        for name, t in self.named_tensors().items():
            out[self._CATEGORY[name]] += t.nbytes


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

    def __init__(self, quant: QuantConfig, keys: torch.Tensor, values: torch.Tensor, track_groups: bool):
        self.quant = quant
        self.keys, self.values = keys, values  # the residual, [b, h, r, d]
        self.sink_keys: torch.Tensor | None = None
        self.sink_values: torch.Tensor | None = None
        self.packed = PackedKV(quant, keys.dtype, keys.shape[-1], track_groups)

    @property
    def n_sinks(self) -> int:
        return 0 if self.sink_keys is None else self.sink_keys.shape[2]

    @property
    def length(self) -> int:
        return self.n_sinks + self.packed.length + self.keys.shape[2]

    def append(self, keys: torch.Tensor, values: torch.Tensor) -> None:
        self.keys = torch.cat([self.keys, keys], dim=2)
        self.values = torch.cat([self.values, values], dim=2)
        self._flush()

    def _flush(self) -> None:
        q = self.quant
        if q.sink_tokens:
            take = min(q.sink_tokens - self.n_sinks, self.keys.shape[2]) if self.packed.length == 0 else 0
            if take > 0:
                self.sink_keys = _cat(self.sink_keys, self.keys[:, :, :take])
                self.sink_values = _cat(self.sink_values, self.values[:, :, :take])
                self.keys, self.values = self.keys[:, :, take:], self.values[:, :, take:]
            if self.n_sinks < q.sink_tokens:
                return  # sinks fill first; nothing is quantized before them
        g = q.group_size
        # KIVI: once the residual reaches max(R, g) tokens, all its whole groups are quantized.
        if self.keys.shape[2] < max(q.residual_length, g):
            return
        n = (self.keys.shape[2] // g) * g
        k_blk, v_blk = self.keys[:, :, :n], self.values[:, :, :n]
        self.keys, self.values = self.keys[:, :, n:].contiguous(), self.values[:, :, n:].contiguous()
        self.packed.append(k_blk, v_blk)

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
            return ks[0], vs[0]
        return torch.cat(ks, dim=2), torch.cat(vs, dim=2)

    def blocks(self) -> list:
        out = []
        if self.sink_keys is not None:
            out.append(FullBlock(self.sink_keys, self.sink_values))
        if self.packed.length:
            out.append(QuantBlock(*self.packed.qblocks(), batch=self.keys.shape[0], kv_heads=self.keys.shape[1]))
        if self.keys.shape[2]:
            out.append(FullBlock(self.keys, self.values))
        return out

    def protected(self) -> tuple[int, int]:
        return self.n_sinks, self.keys.shape[2] if self.packed.length else 0

    def gather(self, keep: torch.Tensor) -> None:
        lead, trail = self.protected()
        idx = keep[..., lead: keep.shape[-1] - trail] - lead  # same count in every row: protected slots are shared
        if self.packed.length:
            self.packed.gather(idx)
        else:
            self.keys, self.values = gather_tokens(self.keys, idx), gather_tokens(self.values, idx)

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


def make_storage(
    quant: QuantConfig | None, keys: torch.Tensor, values: torch.Tensor, track_groups: bool
) -> LayerStorage:
    """The storage for ``quant`` (None: full precision), starting empty like ``keys``/``values``
    (``[batch, kv_heads, 0, head_dim]``). ``track_groups``: tokens may be evicted."""
    if quant is None:
        return FullPrecisionStorage(keys, values)
    return QuantizedStorage(quant, keys, values, track_groups)
