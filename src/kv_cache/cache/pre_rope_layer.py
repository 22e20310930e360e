"""Keys stored before RoPE: the methods of a :class:`~kv_cache.cache.layer.CompressedLayer` that
hold and read them (math dictionary §29.4-§29.6).

A layer with a :class:`~kv_cache.cache.rope_frame.RopeFrame` stores each key with its rotation
removed at the arrival index it came in with, and its readers (the reference path, the native
view, the fidelity check, KVzip's repeat pass, sessions) take the keys rotated back at those
positions, the offset added first. Until the first eviction a head's ``n`` slots are the last
``n`` arrivals; after it the layer holds a bitmap of the arrivals each head keeps
(:mod:`kv_cache.compression.positions`), gathered by every eviction and grown by every append.
"""

from __future__ import annotations


import torch

from ..attention.blocks import FullBlock, QuantBlock
from ..attention.flat import FlatRaggedBlock
from ..attention.key_offset import unshift_keys
from ..kernels import KeyRope, QBlock
from .packed import Rotation, _cat, _held
from ..compression.positions import arange_i32, kept_mask, pack_mask, slot_positions, unpack_mask
from .ragged import dense_read


class PreRopeLayer:
    """The pre-RoPE methods of :class:`~kv_cache.cache.layer.CompressedLayer` (a mixin over its
    ``rope_frame``, ``storage``, ``key_offset``, ``kept_arrivals``, ``demoted_arrivals``,
    ``_arrived`` and ``device``). A layer without a frame reads its storage as before."""

    @property
    def view_offset(self) -> torch.Tensor | None:
        """The key offset the attention readers add back (§25): None when the stored blocks
        they read already hold the model's keys (a layer storing keys before RoPE adds the
        offset back before rotating, since a rotated offset is no longer a constant logit)."""
        return None if self.rope_frame is not None else self.key_offset

    def _new_positions(self, q_len: int) -> torch.Tensor:
        """``[q_len]`` int64: the arrival indices of this call's tokens (the positions the stored
        keys are rotated by; any fixed frame is exact, the model's keeps the channels still)."""
        return torch.arange(self._arrived, self._arrived + q_len, device=self.device)

    def stored_positions(self) -> torch.Tensor:
        """``[n]`` (no eviction yet: the last ``n`` arrivals) or ``[batch, kv_heads, n]`` int64
        (each head's kept arrivals, right-aligned in a ragged layout's slots): the arrival index
        of every stored slot (:mod:`kv_cache.compression.positions`)."""
        n = 0 if self.storage is None else self.storage.length
        if self.kept_arrivals is None:
            return torch.arange(self._arrived - n, self._arrived, device=self.device)
        return slot_positions(unpack_mask(self.kept_arrivals, self._arrived), n)

    def _append(self, keys: torch.Tensor, values: torch.Tensor) -> None:
        """Store this call's keys (before RoPE) and values; the kept arrivals grow with them."""
        self.storage.append(keys, values)
        self._grow_arrivals(keys.shape[2])

    def _grow_arrivals(self, q_len: int) -> None:
        """``q_len`` tokens arrived and were stored by every head: the kept arrivals grow with them."""
        if self.kept_arrivals is not None:
            self.kept_arrivals = grow_mask(self.kept_arrivals, self._arrived, q_len)
        self._arrived += q_len

    def stored_states(self) -> tuple[torch.Tensor, torch.Tensor]:
        """The stored keys and values in full precision ``[batch, kv_heads, n, d]``, keys as the
        attention readers take them: rotated back at their positions (the offset added first)
        in a layer storing keys before RoPE, else as stored. Heads holding different numbers of
        tokens are read right-aligned, zeros in their virtual padding (masked by the starts)."""
        keys, values = dense_read(self.storage)
        if self.rope_frame is not None and keys.shape[2]:
            keys = self.rope_frame.apply(unshift_keys(keys, self.key_offset), self.stored_positions())
        return keys, values

    def _arrival_bitmaps(self) -> dict[str, torch.Tensor]:
        """The held bitmaps (a bitmap with room to grow: its whole buffer)."""
        return {name: _held(t) for name, t in (("kept_arrivals", self.kept_arrivals),
                                               ("demoted_arrivals", self.demoted_arrivals)) if t is not None}

    def arrival_bitmap_bytes(self, after_eviction: bool = False) -> int:
        """Bytes of the kept arrivals' bitmap (§29.6): held now, or (``after_eviction``) once an
        eviction about to run has made one: ``batch * kv_heads * ceil(arrivals / 8)``."""
        if self.kept_arrivals is not None:
            return _held(self.kept_arrivals).nbytes
        if not after_eviction or not self.keeps_arrivals or self.storage is None:
            return 0
        return self.storage.batch * self.storage.heads * -(-self._arrived // 8)

    def stored_blocks(self) -> list:
        """The stored tokens as attention blocks in token order: the storage's own blocks; in a
        layer storing keys before RoPE, the same blocks read at their positions (packed keys
        with a :class:`~kv_cache.kernels.KeyRope` the kernels turn at read time, full-precision
        sinks and residual turned here, §29.8) when every packed block holds per-channel keys,
        else one full-precision block of the keys rotated back (:meth:`stored_states`)."""
        if self.rope_frame is None:
            return self.storage.blocks()
        if self.storage.length == 0:
            return []
        blocks = self.storage.blocks()
        if not all(isinstance(b, FullBlock) or (isinstance(b, QuantBlock) and _kernel_reads(b.rotation, b.keys))
                   or (isinstance(b, FlatRaggedBlock) and _flat_reads(b)) for b in blocks):
            if getattr(self, "on_dense_read", None) is not None:
                d = next((b.keys.head_dim for b in blocks if isinstance(b, QuantBlock)), None)
                self.on_dense_read(self, "a calibrated dense rotation" if self.quant.rotation == "calibrated"
                                   else f"head_dim {d}, not a power of two")
            return [FullBlock(*self.stored_states())]
        return self._blocks_at_positions(blocks)

    def _blocks_at_positions(self, blocks: list) -> list:
        """``blocks`` (the storage's, in slot order) with their keys read at their positions."""
        frame, offset = self.rope_frame, self.key_offset
        n_all = self.storage.length
        first = self._arrived - n_all  # no eviction yet: slot s holds arrival first + s (no tensor built)
        pos = self.stored_positions() if self.kept_arrivals is not None else None
        out, start = [], 0
        for blk in blocks:
            n = blk.length
            p = pos[..., start:start + n] if pos is not None else None
            start += n
            if isinstance(blk, FullBlock):
                p = p if p is not None else torch.arange(first + start - n, first + start, device=self.device)
                out.append(FullBlock(frame.apply(blk.keys, p, offset), blk.values))  # offset added back, then turned
            elif isinstance(blk, FlatRaggedBlock):
                p = p if p is not None else torch.arange(first + start - n, first + start, device=self.device)
                out.append(self._flat_at_positions(blk, p))
            else:
                B, H = blk.batch, blk.kv_heads
                if p is None:  # one row of positions read by every row (stride 0): a view, O(1) per step
                    rows = arange_i32(first + start, self.device)[first + start - n:].view(1, n).expand(B * H, n)
                else:
                    rows = p.reshape(B * H, n).to(torch.int32).contiguous()
                rope, rot = self._key_rope(rows, blk.rotation, B * H, blk.keys.head_dim)
                keys = QBlock.trusted(**{**blk.keys.__dict__, "rope": rope})  # the held view, its positions attached
                out.append(QuantBlock(keys, blk.values, blk.batch, blk.kv_heads, rot))
        return out

    def _key_rope(self, positions: torch.Tensor, rot, R: int, d: int) -> tuple[KeyRope, object]:
        """The :class:`~kv_cache.kernels.KeyRope` of a packed key block of ``R`` rows at ``positions``
        (int32 ``[R, n]``, or a flat block's ``[R, N]`` of row stride 0), and the block's rotation
        as the view hands it: keys in a Hadamard space are mapped back in the kernel, so the
        query stays as it is (a value-only rotation)."""
        offset, frame = self.key_offset, self.rope_frame
        mean = scale = None
        if offset is not None:  # views of the held offset when it is float32 (the kernels read rows a pitch apart)
            mean = offset[:, :, 0].reshape(R, d).float()
            scale = offset[:, :, 1].reshape(R, d).float() if offset.shape[2] == 2 else None
        signs = None
        if rot is not None and rot.keys:
            signs = rot.signs.float()
            rot = Rotation.from_signs(rot.signs).with_keys(False)
        rope = KeyRope(positions, frame.inv_freq.to(device=positions.device, dtype=torch.float32), frame.layout,
                       float(frame.scaling), mean, scale, signs)
        return rope, rot

    def _flat_at_positions(self, blk: FlatRaggedBlock, pos: torch.Tensor) -> FlatRaggedBlock:
        """A flat ragged block (§15.7) read at its positions: ``pos`` ``[B, H, L]`` (each row's
        frozen tokens right-aligned: sinks, full-precision part, packed part); the sinks and the
        full-precision buffer turned here, the packed buffer given its positions laid out like
        its codes (a :class:`~kv_cache.kernels.KeyRope`, turned in the kernel)."""
        B, H, R, L = blk.batch, blk.kv_heads, blk.batch * blk.kv_heads, blk.length
        frame, offset = self.rope_frame, self.key_offset
        rows = pos.reshape(R, L)
        first = [L - f for f in blk.frozen]  # each row's first held slot
        s = blk.n_sinks
        sinks = fp = packed = key_rope = None
        if blk.sinks is not None:
            idx = torch.tensor(first, device=rows.device).unsqueeze(1) + torch.arange(s, device=rows.device)
            sp = rows.gather(1, idx).reshape(B, H, s)
            sinks = (frame.apply(unshift_keys(blk.sinks[0], offset), sp), blk.sinks[1])

        def buffer_positions(lengths: list, skip: list) -> torch.Tensor:  # rows' tokens one after another
            return torch.cat([rows[r, first[r] + skip[r]:first[r] + skip[r] + n] for r, n in enumerate(lengths)])

        if blk.fp is not None:
            k, v, off, ln = blk.fp
            fpos = buffer_positions(blk.fp_len, [s] * R)
            kf = k.float()
            if offset is not None:  # each token its row's offset (and scale)
                per_tok = offset.reshape(R, offset.shape[2], -1).repeat_interleave(
                    torch.tensor(blk.fp_len, device=k.device), dim=0)  # [N_fp, 1 or 2, d]
                kf = kf * per_tok[:, 1] if offset.shape[2] == 2 else kf
                kf = kf + per_tok[:, 0]
            fp = (frame.apply(kf.to(k.dtype), fpos.view(1, 1, -1)), v, off, ln)
        if blk.packed is not None:
            (kb, vb), off, ln, rot = blk.packed
            qpos = buffer_positions(blk.q_len, [s + f for f in blk.fp_len]).to(torch.int32)
            key_rope, rot = self._key_rope(qpos.view(1, -1).expand(R, -1), rot, R, kb.head_dim)
            packed = ((kb, vb), off, ln, rot)
        return FlatRaggedBlock(B, H, list(blk.frozen), sinks, fp, list(blk.fp_len), packed, list(blk.q_len),
                               key_rope=key_rope)

    def arrivals_of(self, slots: torch.Tensor) -> torch.Tensor:
        """The packed bitmap of the arrivals held in ``slots`` of the storage (int64 ``[batch,
        kv_heads, K]`` indices or bool ``[batch, kv_heads, T]`` masks; §29.6)."""
        pos = self.stored_positions()
        if pos.dim() == 1:
            pos = pos.expand(*slots.shape[:2], pos.shape[0])
        return pack_mask(kept_mask(pos, slots, self._arrived))

    def _keep_positions(self, keep: torch.Tensor) -> None:
        """Eviction keeps slots ``keep`` (int64 ``[batch, kv_heads, K]`` or bool masks ``[batch,
        kv_heads, T]``): the kept arrivals' bitmap follows (§29.6)."""
        if self.keeps_arrivals:
            self.kept_arrivals = self.arrivals_of(keep)

    @property
    def keeps_arrivals(self) -> bool:
        """Whether an eviction records the arrivals each head keeps: keys stored before RoPE, or
        a cache asked to (``track_positions``, for the transform codec's frame)."""
        return self.rope_frame is not None or self.track_arrivals


BITMAP_SLACK = 8
"""Bytes (64 arrivals, like a packed slot's :data:`~.packed.GROW_TOKENS`) a kept-arrivals bitmap
gains when a decoding append outgrows it: the next appends set their bits in place (held and
counted, like a packed slot's slack)."""


def grow_mask(packed: torch.Tensor, arrivals: int, add: int) -> torch.Tensor:
    """The packed bitmap ``packed`` (uint8 ``[B, H, >= ceil(arrivals / 8)]``, :func:`pack_mask`'s
    bit order) of ``arrivals`` arrivals, followed by ``add`` arrivals every row keeps: their bits
    set in place, in the room of the buffer ``packed`` leads (grown by :data:`BITMAP_SLACK` bytes
    when it runs out). Work O(add) per call, amortized; bits of earlier views never change."""
    total = arrivals + add
    need = -(-total // 8)
    if need > packed.shape[2]:
        packed = _cat(packed, packed.new_zeros(*packed.shape[:2], need - packed.shape[2]),
                      BITMAP_SLACK if add < 8 * BITMAP_SLACK else 0)
    lo, hi = arrivals, total
    if lo // 8 == (hi - 1) // 8:  # one byte (a decoding step)
        bits = ((1 << (hi - lo)) - 1) << (lo % 8)
        packed[:, :, lo // 8] |= bits
        return packed
    first, last = lo // 8, (hi - 1) // 8
    packed[:, :, first] |= (0xFF << (lo % 8)) & 0xFF
    if last > first + 1:
        packed[:, :, first + 1:last] = 0xFF
    packed[:, :, last] |= (1 << (hi - 8 * last)) - 1 if hi % 8 else 0xFF
    return packed


def _kernel_reads(rot, keys) -> bool:
    """Whether the kernels read packed ``keys`` (a :class:`~kv_cache.kernels.QBlock`) stored before
    RoPE under the block's rotation ``rot`` from their codes (§29.8): keys stored as computed, or
    in a randomized Hadamard space of a power-of-two head_dim; a calibrated (dense) rotation is
    read through a dequantized copy."""
    if rot is None or not rot.keys:
        return True
    d = keys.head_dim
    return rot.matrices is None and d & (d - 1) == 0


def _flat_reads(blk: FlatRaggedBlock) -> bool:
    """:func:`_kernel_reads` of a flat ragged block's packed buffer (none: nothing to read)."""
    return blk.packed is None or _kernel_reads(blk.packed[3], blk.packed[0][0])
