"""The quantized block: packed codes plus the metadata the kernels need (math dictionary §15).

A block holds ``N`` tokens of ``R`` rows (``R = batch * kv_heads``), each token a ``d``-vector
stored as ``d`` codes of ``bits`` bits, packed token-major exactly as
:func:`kv_cache.compression.packing.pack_bits` packs a C-order ``[R, N, d]`` code tensor.
"""

from __future__ import annotations

import dataclasses
import math
from dataclasses import dataclass
from typing import Any

import torch

from ..compression.packing import SUPPORTED_BITS

GROUPINGS = ("channel", "token")
"""``"channel"``: one (scale, zero) per group of tokens and channel (KIVI keys);
``"token"``: one per token and group of channels (KIVI values)."""

SCALE_DTYPES = (torch.float16, torch.bfloat16, torch.float32)
ZERO_DTYPES = (torch.int16, torch.int8, torch.uint8, torch.float16, torch.bfloat16, torch.float32)


def _names(dtypes) -> str:
    return ", ".join(str(d).replace("torch.", "") for d in dtypes)


def check_bits(bits) -> int:
    """Return ``bits`` as int after checking it is one of 2, 3, 4, 8 (``ValueError`` otherwise)."""
    if isinstance(bits, bool) or not isinstance(bits, int) or bits not in SUPPORTED_BITS:
        raise ValueError(f"bits must be one of {list(SUPPORTED_BITS)}; got {bits!r}")
    return bits


def check_grouping(grouping) -> str:
    """Return ``grouping`` after checking it is one of :data:`GROUPINGS`."""
    if grouping not in GROUPINGS:
        raise ValueError(f"grouping must be one of {list(GROUPINGS)}; got {grouping!r}")
    return grouping


def _check_tensor(t, name: str) -> torch.Tensor:
    if not isinstance(t, torch.Tensor):
        raise TypeError(f"{name} must be a torch.Tensor; got {type(t).__name__}")
    return t


ROPE_LAYOUTS = ("half", "interleaved")
"""Channel pairs of a rotary frame (:mod:`kv_cache.compression.rope`)."""


@dataclass(frozen=True, eq=False)
class KeyRope:
    """Keys stored before RoPE, turned at read (math dictionary §29.8)::

        k[r, t] = scaling * R(positions[r, t]) (scale[r] * u[r, t] + mean[r])

    with ``u = k_hat`` the dequantized key, or, for keys stored in a randomized Hadamard space
    (``signs``), ``u = (k_hat H) * signs[r % H'] / sqrt(d)`` (``H`` the Sylvester matrix).

    ``R(p)`` turns channel pair ``i`` by ``p * inv_freq[i]`` (``layout`` ``"half"``: channels
    ``i`` and ``i + r/2``; ``"interleaved"``: ``2i`` and ``2i + 1``); channels past ``r =
    2 * len(inv_freq)`` pass through (partial rotary).

    Attributes
    ----------
    positions : torch.Tensor, int32, shape ``[R, N]``
        The arrival index (rotary position) of every token of the block.
    inv_freq : torch.Tensor, float32, shape ``[r/2]``
    layout : {"half", "interleaved"}
    scaling : float
        The rope type's attention scaling (1 for plain RoPE), > 0.
    mean, scale : torch.Tensor or None, float32, shape ``[R, d]``
        The per-row key offset added back (§25) and the per-channel scale multiplied back
        (§29.7) before the rotation; None reads as 0 and 1.
    signs : torch.Tensor or None, float32, shape ``[H', d]`` (``R`` a multiple of ``H'``, ``d`` a
        power of two)
        Keys stored as ``x diag(s) H / sqrt(d)`` (the cache's randomized Hadamard rotation):
        each key is mapped back before the offset, one fast Walsh-Hadamard transform per key.
    """

    positions: torch.Tensor
    inv_freq: torch.Tensor
    layout: str = "half"
    scaling: float = 1.0
    mean: torch.Tensor | None = None
    scale: torch.Tensor | None = None
    signs: torch.Tensor | None = None

    def check(self, R: int, N: int, d: int) -> None:
        """Raise ``TypeError``/``ValueError`` unless the fields fit a block of ``[R, N, d]``."""
        if self.layout not in ROPE_LAYOUTS:
            raise ValueError(f"KeyRope.layout must be one of {list(ROPE_LAYOUTS)}; got {self.layout!r}")
        pos = _check_tensor(self.positions, "KeyRope.positions")
        if pos.dtype != torch.int32 or tuple(pos.shape) != (R, N):
            raise ValueError(f"KeyRope.positions must be int32 [R, N] = [{R}, {N}]; got {pos.dtype} of shape "
                             f"{tuple(pos.shape)}")
        w = _check_tensor(self.inv_freq, "KeyRope.inv_freq")
        if w.dtype != torch.float32 or w.dim() != 1 or not 1 <= w.numel() <= d // 2:
            raise ValueError(f"KeyRope.inv_freq must be float32 [r/2] with 1 <= r/2 <= d/2 = {d // 2}; got "
                             f"{w.dtype} of shape {tuple(w.shape)}")
        sc = self.scaling
        if isinstance(sc, bool) or not isinstance(sc, (int, float)) or not math.isfinite(sc) or sc <= 0:
            raise ValueError(f"KeyRope.scaling must be a finite number > 0; got {sc!r}")
        for name in ("mean", "scale"):
            t = getattr(self, name)
            if t is None:
                continue
            t = _check_tensor(t, f"KeyRope.{name}")
            if t.dtype != torch.float32 or tuple(t.shape) != (R, d):
                raise ValueError(f"KeyRope.{name} must be float32 [R, d] = [{R}, {d}]; got {t.dtype} of shape "
                                 f"{tuple(t.shape)}")
        if self.signs is not None:
            t = _check_tensor(self.signs, "KeyRope.signs")
            if (t.dtype != torch.float32 or t.dim() != 2 or t.shape[1] != d or t.shape[0] < 1 or R % t.shape[0]
                    or d & (d - 1)):
                raise ValueError(f"KeyRope.signs must be float32 [H, d] with d = {d} a power of two and R = {R} a "
                                 f"multiple of H; got {t.dtype} of shape {tuple(t.shape)}")


@dataclass(frozen=True, eq=False)
class QBlock:
    """Packed ``bits``-bit codes of an ``[R, N, d]`` tensor and their dequantization table.

    Dequantized value (math dictionary §15.1)::

        x_hat[r, t, c] = scale[...] * (lut[code[r, t, c]] - zero[...])

    Attributes
    ----------
    codes : torch.Tensor, uint8, shape ``[R, N, P]``
        ``P = d * bits / 8`` bytes per token (so ``d * bits`` is a multiple of 8), packed as
        ``pack_bits`` packs a C-order ``[R, N, d]`` code tensor: 2-bit = 4 codes per byte,
        LSB first; 4-bit = low nibble first; 3-bit = 8 codes per 3 bytes (24-bit
        little-endian word, code ``j`` at bits ``3j..3j+2``); 8-bit = one per byte.
    bits : {2, 3, 4, 8}
    lut : torch.Tensor, float32, shape ``[2**bits]``
        Code -> level. Asymmetric uniform: ``arange(2**bits)`` (with ``zero`` the zero
        point); symmetric uniform: ``arange(2**bits) - 2**(bits-1)`` (``zero`` None); a
        codebook (e.g. Lloyd-Max levels): the sorted levels (``zero`` None).
    grouping : {"channel", "token"}
    scale : torch.Tensor, float16 / bfloat16 / float32
        ``"channel"``: ``[R, NG, d]``, token ``t`` of row ``r`` uses group ``gid[r, t]``
        (or ``t // group_size`` when ``gid`` is None, then ``NG >= ceil(N / group_size)``).
        ``"token"``: ``[R, N, d // group_size]``, channel ``c`` uses group
        ``c // group_size``.
    zero : torch.Tensor or None
        Same shape as ``scale``; int16, int8, uint8 or float. None reads as 0.
    group_size : int
        ``"channel"``: tokens per group (used when ``gid`` is None); ``"token"``: channels
        per group, a divisor of ``d``.
    scale_table : torch.Tensor or None, float32, shape ``[256]``
        With ``scale`` of dtype uint8 (required then, and only then): ``scale`` holds 8-bit
        codes and the scale is ``scale_table[code]`` (e.g. log-coded norms, math dictionary
        §18.8), decoded by the kernels where they read it.
    gid : torch.Tensor or None, int32, shape ``[R, N]``
        ``"channel"`` only: the scale-table row of each token (ragged groups after
        eviction). Values must lie in ``[0, NG)``; that is checked where the block is used.
    offsets, lengths : torch.Tensor or None, int64 ``[R]`` and int32 ``[R]``
        Both or neither: a *flat ragged* block (math dictionary §15.7), the tokens of all ``R``
        rows in one buffer. Every tensor's row axis then has stride 0 (an ``expand`` of a
        ``[1, N, ...]`` buffer, ``N`` the tokens of all rows) and row ``r`` holds the
        ``lengths[r]`` tokens that start at token ``offsets[r]`` of the buffer (codes, ``gid``
        and token-grouped metadata); a channel-grouped scale table is shared by every row and
        ``gid`` indexes it globally. The kernels read only each row's own tokens.
    rope : KeyRope or None
        Keys stored before RoPE: attention reads each key turned to its position, its offset and
        scale added back first (§29.8). In a flat ragged block, ``rope.positions`` is laid out
        like the codes (rows of stride 0 over the buffer's tokens).

    Raises
    ------
    TypeError
        A field has the wrong type or dtype.
    ValueError
        Unsupported bits or grouping, inconsistent shapes, devices or group size.
    """

    codes: torch.Tensor
    bits: int
    lut: torch.Tensor
    grouping: str
    scale: torch.Tensor
    zero: torch.Tensor | None = None
    group_size: int = 1
    gid: torch.Tensor | None = None
    scale_table: torch.Tensor | None = None
    offsets: torch.Tensor | None = None
    lengths: torch.Tensor | None = None
    rope: KeyRope | None = None

    def __post_init__(self) -> None:
        bits = check_bits(self.bits)
        grouping = check_grouping(self.grouping)
        codes = _check_tensor(self.codes, "codes")
        if codes.dtype != torch.uint8:
            raise TypeError(f"codes must be uint8; got {codes.dtype}")
        if codes.dim() != 3:
            raise ValueError(f"codes must be rank 3 [R, N, P]; got shape {tuple(codes.shape)}")
        R, N, P = codes.shape
        if (8 * P) % bits:
            raise ValueError(
                f"codes has P={P} bytes per token, which does not hold a whole number of "
                f"{bits}-bit codes (P * 8 must be a multiple of bits)")
        d = 8 * P // bits
        lut = _check_tensor(self.lut, "lut")
        if lut.dtype != torch.float32 or tuple(lut.shape) != (1 << bits,):
            raise ValueError(
                f"lut must be float32 of shape [{1 << bits}] for {bits}-bit codes; got "
                f"{lut.dtype} of shape {tuple(lut.shape)}")
        scale = _check_tensor(self.scale, "scale")
        if scale.dtype == torch.uint8:
            table = self.scale_table
            if not isinstance(table, torch.Tensor) or table.dtype != torch.float32 or tuple(table.shape) != (256,):
                raise ValueError("uint8 scale codes need scale_table, a float32 [256] tensor (code -> scale); got "
                                 f"{getattr(table, 'dtype', type(table).__name__)} of shape "
                                 f"{tuple(getattr(table, 'shape', ()))}")
        elif scale.dtype not in SCALE_DTYPES:
            raise TypeError(f"scale must be one of {_names(SCALE_DTYPES)} (or uint8 codes with scale_table); "
                            f"got {scale.dtype}")
        elif self.scale_table is not None:
            raise ValueError(f"scale_table applies to uint8 scale codes only; got scale of dtype {scale.dtype}")
        gs = self.group_size
        if isinstance(gs, bool) or not isinstance(gs, int) or gs < 1:
            raise ValueError(f"group_size must be an int >= 1; got {gs!r}")
        if scale.dim() != 3 or scale.shape[0] != R:
            raise ValueError(f"scale must be rank 3 with R={R} rows; got shape {tuple(scale.shape)}")
        if grouping == "channel":
            if scale.shape[2] != d:
                raise ValueError(f"channel-grouped scale must be [R, NG, d={d}]; got {tuple(scale.shape)}")
            if self.gid is None and scale.shape[1] * gs < N:
                raise ValueError(
                    f"scale has {scale.shape[1]} groups of group_size={gs} tokens, fewer than "
                    f"N={N} tokens (pass gid for ragged groups)")
        else:
            if d % gs:
                raise ValueError(f"token grouping needs group_size dividing d={d}; got group_size={gs}")
            if tuple(scale.shape) != (R, N, d // gs):
                raise ValueError(
                    f"token-grouped scale must be [R, N, d // group_size] = {[R, N, d // gs]}; got "
                    f"{list(scale.shape)}")
            if self.gid is not None:
                raise ValueError("gid is only meaningful for grouping='channel'; got a gid with 'token'")
        if self.zero is not None:
            zero = _check_tensor(self.zero, "zero")
            if zero.dtype not in ZERO_DTYPES:
                raise TypeError(f"zero must be None or one of {_names(ZERO_DTYPES)}; got {zero.dtype}")
            if zero.shape != scale.shape:
                raise ValueError(f"zero must have the shape of scale {tuple(scale.shape)}; got {tuple(zero.shape)}")
        if self.gid is not None:
            gid = _check_tensor(self.gid, "gid")
            if gid.dtype != torch.int32:
                raise TypeError(f"gid must be int32; got {gid.dtype}")
            if tuple(gid.shape) != (R, N):
                raise ValueError(f"gid must be [R, N] = {[R, N]}; got {list(gid.shape)}")
        if (self.offsets is None) != (self.lengths is None):
            raise ValueError("a flat ragged block needs both offsets and lengths; got one of them")
        if self.offsets is not None:
            for name, t, dt in (("offsets", self.offsets, torch.int64), ("lengths", self.lengths, torch.int32)):
                t = _check_tensor(t, name)
                if t.dtype != dt or tuple(t.shape) != (R,):
                    raise ValueError(f"{name} must be {dt} of shape [R] = [{R}]; got {t.dtype} of shape "
                                     f"{tuple(t.shape)}")
        ropes = ()
        if self.rope is not None:
            if not isinstance(self.rope, KeyRope):
                raise TypeError(f"rope must be a KeyRope or None; got {type(self.rope).__name__}")
            self.rope.check(R, N, d)
            ropes = (self.rope.positions, self.rope.inv_freq, self.rope.mean, self.rope.scale, self.rope.signs)
        devices = {t.device for t in (codes, lut, scale, self.zero, self.gid, self.scale_table, self.offsets,
                                      self.lengths, *ropes) if t is not None}
        if len(devices) > 1:
            raise ValueError(f"all tensors of a QBlock must be on one device; got {sorted(map(str, devices))}")

    @classmethod
    def trusted(cls, **fields: Any) -> "QBlock":
        """A block built from tensors the library already checked (a view of a packed slot, a block
        with its positions attached), made without :meth:`__post_init__`'s checks: a decoding step
        builds a few per layer, and the kernels check shapes and dtypes again where they read them.
        Fields left out take their defaults. Never for user input."""
        obj = object.__new__(cls)
        for name, default in _QBLOCK_FIELDS:
            object.__setattr__(obj, name, fields.pop(name, default))
        if fields:
            raise TypeError(f"QBlock has no fields {sorted(fields)}")
        return obj

    @property
    def rows(self) -> int:
        """``R``: rows (batch * kv_heads)."""
        return self.codes.shape[0]

    @property
    def num_tokens(self) -> int:
        """``N``: tokens per row."""
        return self.codes.shape[1]

    def scale_values(self) -> torch.Tensor:
        """``scale`` as float32 (uint8 codes decoded through ``scale_table``)."""
        if self.scale_table is not None:
            return self.scale_table[self.scale.long()]
        return self.scale.float()

    @property
    def head_dim(self) -> int:
        """``d``: channels per token (``P * 8 / bits``)."""
        return self.codes.shape[2] * 8 // self.bits

    @property
    def flat(self) -> bool:
        """True for a flat ragged block (``offsets`` / ``lengths`` given)."""
        return self.offsets is not None

    @property
    def nbytes(self) -> int:
        """Bytes held by codes and metadata (the lut and scale table excluded: shared and tiny)."""
        n = self.codes.nbytes + self.scale.nbytes
        for t in (self.zero, self.gid):
            if t is not None:
                n += t.nbytes
        return int(n)


def uniform_lut(bits: int, symmetric: bool, device=None) -> torch.Tensor:
    """The lut of uniform codes: ``arange(2**b)`` (asymmetric) or ``arange(2**b) - 2**(b-1)``."""
    bits = check_bits(bits)
    lut = torch.arange(1 << bits, dtype=torch.float32, device=device)
    return lut - (1 << (bits - 1)) if symmetric else lut


_QBLOCK_FIELDS = tuple((f.name, None if f.default is dataclasses.MISSING else f.default)
                       for f in dataclasses.fields(QBlock))
"""``(name, default)`` of every field, for :meth:`QBlock.trusted`."""

__all__ = ["GROUPINGS", "KeyRope", "QBlock", "ROPE_LAYOUTS", "SCALE_DTYPES", "ZERO_DTYPES", "check_bits", "check_grouping", "uniform_lut"]

