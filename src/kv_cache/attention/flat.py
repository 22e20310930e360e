"""Attention over the packed ragged layout: every row's tokens in one buffer per layer.

:class:`FlatRaggedBlock` is what :class:`~kv_cache.cache.packed_ragged.PackedRaggedStorage` hands
the attention function for the tokens its rows were cut to (the tail's tokens follow as ordinary
blocks). Seen from outside it is ``length = max(frozen)`` slots long, row ``r`` right-aligned
(its first ``length - frozen[r]`` slots virtual padding), like
:class:`~kv_cache.attention.blocks.RaggedBlock`. Inside, row ``r`` is

    [ sinks (rectangular, full precision) | fp_r (full precision) | q_r (packed codes) ]

with ``fp_r`` and ``q_r`` the row's tokens in one buffer each, at per-row offsets. A decoding step
reads it through :meth:`FlatRaggedBlock.segments`: three blocks of the one
:func:`~kv_cache.kernels.attend_mixed` call, the kernels reading each row at its offset
(math dictionary §15.7). Longer calls (a question after a compressed context, statistics for a
policy) take :meth:`FlatRaggedBlock.attend`, row by row.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass, field
from typing import Any

import torch

from .blocks import FullBlock, QuantBlock, RaggedBlock


@dataclass
class FlatFullBlock:
    """Full-precision tokens of every row in one buffer: ``keys``/``values`` ``[1, 1, N, d]``;
    row ``r`` holds ``lengths[r]`` tokens from token ``offsets[r]``. Read by the one-call path only
    (:func:`~kv_cache.attention.blocks.fused_decode`)."""

    keys: torch.Tensor
    values: torch.Tensor
    offsets: torch.Tensor  # int64 [R]
    lengths: torch.Tensor  # int32 [R]
    batch: int
    kv_heads: int

    def dense_entry(self, start: torch.Tensor | None) -> tuple:
        """``(keys, values, start, offsets, lengths)`` for :func:`~kv_cache.kernels.attend_mixed`
        (the buffer seen as ``[B, H, N, d]`` with row strides 0)."""
        B, H = self.batch, self.kv_heads
        k = self.keys.expand(B, H, -1, -1)
        v = self.values.expand(B, H, -1, -1)
        return k, v, start, self.offsets, self.lengths


def _expand(block, R: int, offsets: torch.Tensor, lengths: torch.Tensor):
    """A one-row :class:`~kv_cache.kernels.QBlock` over the whole buffer as a flat ragged block of ``R`` rows."""

    def e(t: torch.Tensor | None) -> torch.Tensor | None:
        return None if t is None else t.expand(R, *t.shape[1:])

    return dataclasses.replace(block, codes=e(block.codes), scale=e(block.scale), zero=e(block.zero),
                               gid=e(block.gid), offsets=offsets, lengths=lengths)


@dataclass
class FlatRaggedBlock:
    """The cut rows of one layer; see the module docstring.

    ``sinks``: ``(keys, values)`` ``[B, H, s, d]`` or None; ``fp``: ``(keys, values, offsets, lengths)``
    (buffers ``[1, 1, N_fp, d]``) or None; ``packed``: ``((kblock, vblock), offsets, lengths,
    rotation)`` with one-row blocks over the buffer (per-channel key groups indexed globally) or
    None; ``fp_len`` / ``q_len``: host copies of the per-row lengths.
    """

    batch: int
    kv_heads: int
    frozen: list
    sinks: tuple | None
    fp: tuple | None
    fp_len: list
    packed: tuple | None
    q_len: list
    key_rope: Any = None
    """A :class:`~kv_cache.kernels.KeyRope` for the packed buffer's keys (stored before RoPE,
    §29.8): positions ``[R, N_q]`` laid out like the codes (rows of stride 0), offset and scale
    per row; None: keys stored as attention reads them."""
    _segments: dict = field(default_factory=dict, repr=False)

    @property
    def length(self) -> int:
        return max(self.frozen, default=0)

    @property
    def n_sinks(self) -> int:
        return 0 if self.sinks is None else self.sinks[0].shape[2]

    def index_tensors(self) -> dict[str, torch.Tensor]:
        """The per-row offsets and lengths the kernels read, and the per-row starts of the
        segments made so far (held while the layer holds this view, and counted)."""
        out = {}
        if self.fp is not None:
            out.update(fp_row_offsets=self.fp[2], fp_row_lengths=self.fp[3])
        if self.packed is not None:
            out.update(packed_row_offsets=self.packed[1], packed_row_lengths=self.packed[2])
        for i, segments in enumerate(self._segments.values()):
            out.update({f"segment_starts{i}.{j}": st for j, (_, st) in enumerate(segments) if st is not None})
        return out

    # ------------------------------------------------------------------ the one-call path
    def _leads(self, start: torch.Tensor | None) -> list | torch.Tensor | None:
        """Per row: the leading slots of its held tokens to mask (the given virtual start past
        the row's virtual padding)."""
        if start is None:
            return None
        pad = [self.length - n for n in self.frozen]
        flat = start.reshape(-1)
        if flat.device.type == "cpu":
            return [max(int(s) - p, 0) for s, p in zip(flat.tolist(), pad)]
        return (flat - torch.tensor(pad, device=flat.device, dtype=flat.dtype)).clamp(min=0)

    def segments(self, start: torch.Tensor | None) -> list[tuple]:
        """``[(block, start [R] int32 or None), ...]``: the sinks (:class:`FullBlock`), the
        full-precision buffer (:class:`FlatFullBlock`) and the packed buffer (a
        :class:`QuantBlock` of flat ragged :class:`~kv_cache.kernels.QBlock` s), each with its
        rows' leading slots to mask, for one :func:`~kv_cache.kernels.attend_mixed` call."""
        leads = self._leads(start)
        key = None if not isinstance(leads, (list, type(None))) else (tuple(leads) if leads else None)
        if isinstance(leads, list) or leads is None:
            hit = self._segments.get(key)
            if hit is not None:
                return hit
        B, H = self.batch, self.kv_heads
        R = B * H
        s = self.n_sinks
        dev = (self.sinks or self.fp or (self.packed[1],))[0].device

        def starts(before: list, upto: list) -> torch.Tensor | None:
            if leads is None:
                return None
            if isinstance(leads, list):
                vals = [min(max(ld - b, 0), u) for ld, b, u in zip(leads, before, upto)]
                return torch.tensor(vals, dtype=torch.int32, device=dev) if any(vals) else None
            b = torch.tensor(before, device=leads.device, dtype=leads.dtype)
            u = torch.tensor(upto, device=leads.device, dtype=leads.dtype)
            return torch.minimum((leads - b).clamp(min=0), u).to(torch.int32)

        out = []
        if self.sinks is not None:
            out.append((FullBlock(*self.sinks), starts([0] * R, [s] * R)))
        if self.fp is not None:
            k, v, off, ln = self.fp
            out.append((FlatFullBlock(k, v, off, ln, B, H), starts([s] * R, self.fp_len)))
        if self.packed is not None:
            (kb, vb), off, ln, rot = self.packed
            kq = _expand(kb, R, off, ln)
            if self.key_rope is not None:
                kq = dataclasses.replace(kq, rope=self.key_rope)
            blk = QuantBlock(kq, _expand(vb, R, off, ln), B, H, rotation=rot)
            out.append((blk, starts([s + f for f in self.fp_len], self.q_len)))
        if isinstance(leads, list) or leads is None:
            if len(self._segments) >= 64:
                self._segments.clear()
            self._segments[key] = out
        return out

    # ------------------------------------------------------------------ the general path
    def as_rows(self) -> RaggedBlock:
        """The same tokens as a :class:`RaggedBlock` (each row's blocks views of the buffers; made
        per call, not held)."""
        B, H = self.batch, self.kv_heads
        rows = []
        fp_off = q_off = 0
        for r in range(B * H):
            b, h = divmod(r, H)
            blocks = []
            if self.sinks is not None:
                blocks.append(FullBlock(self.sinks[0][b:b + 1, h:h + 1], self.sinks[1][b:b + 1, h:h + 1]))
            f, q = self.fp_len[r], self.q_len[r]
            if f:
                k, v = self.fp[0], self.fp[1]
                blocks.append(FullBlock(k[:, :, fp_off:fp_off + f], v[:, :, fp_off:fp_off + f]))
            if q:
                (kb, vb), _, _, rot = self.packed
                kq = _row_block(kb, q_off, q)
                if self.key_rope is not None:
                    kq = dataclasses.replace(kq, rope=_row_rope(self.key_rope, r, H, q_off, q))
                blocks.append(QuantBlock(kq, _row_block(vb, q_off, q), 1, 1,
                                         rotation=None if rot is None else rot.head(h)))
            fp_off += f
            q_off += q
            rows.append(blocks)
        return RaggedBlock(rows, B, H, list(self.frozen))

    def attend(self, q: torch.Tensor, scaling: float, start: torch.Tensor | None, stat_rows: torch.Tensor | None):
        """As :meth:`RaggedBlock.attend` (row by row)."""
        return self.as_rows().attend(q, scaling, start, stat_rows)


def _row_rope(rope, r: int, H: int, first: int, n: int):
    """Row ``r``'s part of a flat block's :class:`~kv_cache.kernels.KeyRope`: its tokens
    ``[first, first + n)`` of the buffer, its offset and scale, its head's signs."""
    def row(t):
        return None if t is None else t[r:r + 1].contiguous()

    signs = None if rope.signs is None else rope.signs[(r % H) % rope.signs.shape[0]:][:1].contiguous()
    return dataclasses.replace(rope, positions=rope.positions[r:r + 1, first:first + n].contiguous(),
                               mean=row(rope.mean), scale=row(rope.scale), signs=signs)


def _row_block(block, first: int, n: int):
    """Tokens ``[first, first + n)`` of a one-row buffer block (views; the shared scale table whole)."""
    token = block.grouping == "token"

    def cut(t: torch.Tensor | None) -> torch.Tensor | None:
        return None if t is None else t[:, first:first + n]

    return dataclasses.replace(block, codes=cut(block.codes), scale=cut(block.scale) if token else block.scale,
                               zero=(cut(block.zero) if token else block.zero), gid=cut(block.gid))
