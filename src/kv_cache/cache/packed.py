"""The packed quantized part of one layer: codes, scales, zero points, and how they were made.

Keys and values are each one :class:`~kv_cache.kernels.QBlock` layout, chosen by
:class:`~kv_cache.cache.config.QuantConfig`:

* keys per channel (KIVI: one scale per ``group_size`` tokens and channel) or per token (one
  scale per ``channel_group`` channels of a token); values per token;
* uniform levels (scale + zero point, or symmetric) or Lloyd-Max levels of N(0, 1) with one
  RMS scale per group and no zero point (norm-only);
* optionally rotated first: a randomized Hadamard transform per KV head, ``x R`` with
  ``R = diag(s_h) H`` (``H`` the normalized Sylvester matrix, block-diagonal when ``head_dim``
  is not a power of two), or a calibrated ``R_h = V_h H`` (math dictionary §17.7); attention
  undoes it by rotating the query and the output once.

Codes are packed token-major (``head_dim * bits / 8`` bytes per token and head), so keeping a
subset of tokens is a gather of whole bytes: no unpacking, no re-quantization.
"""

from __future__ import annotations

import dataclasses
import functools
import math

import torch

from ..compression.codebook import encode_log_scale, lloyd_max_gaussian, log_scale_table
from ..compression.packing import pack_bits
from ..compression.rotation import RandomizedHadamard
from ..kernels import QBlock, dequantize_block, quantize_block, uniform_lut
from ..kernels.arrival import code_tokens_raw
from .config import QuantConfig


def clip_groups(x: torch.Tensor, ratio: float, axis: int, group: int) -> torch.Tensor:
    """Shrink each group's range ``[lo, hi]`` about its midpoint to ``ratio`` and clamp ``x``.

    ``x`` ``[R, N, d]``; groups of ``group`` elements along ``axis`` (1: tokens, the per-channel
    layout; 2: channels, the per-token layout). The quantizer then spans ``ratio (hi - lo)``
    (math dictionary §18.6). ``ratio == 1`` returns ``x`` unchanged.
    """
    if ratio >= 1.0:
        return x
    R, N, d = x.shape
    g = x.reshape(R, N // group, group, d) if axis == 1 else x.reshape(R, N, d // group, group)
    red = 2 if axis == 1 else 3
    lo, hi = g.amin(red, keepdim=True), g.amax(red, keepdim=True)
    mid, half = (hi + lo) / 2, (hi - lo) * (ratio / 2)
    return torch.maximum(torch.minimum(g, mid + half), mid - half).reshape(R, N, d)


GROW_TOKENS = 64
"""Slack a packed slot gains when a decoding append outgrows it, in tokens (at most 1/8 of the
tokens held): appends of a few tokens (a short residual flushing every few steps) then copy
the slot once per this many tokens, not at every flush. The slack is held and counted
(:meth:`PackedKV.named_tensors`)."""


def _capacity(t: torch.Tensor) -> int:
    """Entries along dim 2 of the buffer ``t`` is the leading part of (``t.shape[2]`` if none)."""
    base = t._base
    if base is None or t.storage_offset() != 0 or t.dim() < 3 or t.numel() == 0:
        return t.shape[2]
    inner = math.prod(t.shape[3:]) if t.shape[2] else 0  # entries per token, no tensor made
    if not inner or t.stride(2) != inner or t.stride(1) % inner:
        return t.shape[2]
    cap = t.stride(1) // inner
    if t.stride(0) != t.shape[1] * cap * inner or base.numel() != t.shape[0] * t.shape[1] * cap * inner:
        return t.shape[2]
    return cap


def _cat(old: torch.Tensor | None, new: torch.Tensor, slack: int = 0) -> torch.Tensor:
    """``old`` ``[b, h, n, ...]`` followed by ``new`` along dim 2.

    The result is the leading part of a buffer with room to spare: appends write into the room
    in place (``old`` and earlier views stay valid: nothing they cover moves); when it runs out,
    a new buffer of ``n + new + slack`` entries is made (``slack`` 0: exact, as every first
    append is).
    """
    if old is None:
        return new
    n, add = old.shape[2], new.shape[2]
    cap = _capacity(old)
    if cap >= n + add:
        buf = old._base.view(*old.shape[:2], cap, *old.shape[3:])
    else:
        buf = old.new_empty((*old.shape[:2], n + add + slack, *old.shape[3:]))
        buf[:, :, :n] = old
    buf[:, :, n:n + add] = new
    return buf[:, :, :n + add]


def _held(t: torch.Tensor) -> torch.Tensor:
    """The tensor whose memory ``t`` keeps alive: its buffer when it is the leading part of one."""
    return t._base if _capacity(t) != t.shape[2] else t


def gather_tokens(t: torch.Tensor, idx: torch.Tensor) -> torch.Tensor:
    """``t[b, h, idx[b, h, j], ...]`` for ``t`` ``[B, H, n, ...]`` and ``idx`` ``[B, H, k]``.

    One ``index_select`` over flattened rows: much cheaper than ``gather`` with an index
    expanded to the trailing dims.
    """
    b, h, n = t.shape[:3]
    k = idx.shape[2]
    rows = (idx.reshape(b * h, k) + torch.arange(b * h, device=t.device).unsqueeze(1) * n).reshape(-1)
    return t.reshape(b * h * n, *t.shape[3:]).index_select(0, rows).reshape(b, h, k, *t.shape[3:])


@functools.lru_cache(maxsize=16)
def _hadamard(dim: int, device: str) -> torch.Tensor:
    """The normalized (block-)Sylvester matrix ``H`` ``[dim, dim]`` (symmetric, orthonormal).

    A constant of the code like a codebook's levels: the data-dependent part of a rotation is
    the per-head signs, which the cache holds (and counts)."""
    rh = RandomizedHadamard(dim)
    return (rh.signs()[:, None] * rh.matrix()).to(device)  # R = diag(s) H, so H = diag(s) R


@functools.lru_cache(maxsize=16)
def _lloyd_max(bits: int, device: str) -> torch.Tensor:
    """Lloyd-Max levels on ``device``, made once (a copy to a GPU per flush would wait for it)."""
    return lloyd_max_gaussian(bits).to(device)


class Rotation:
    """Per-KV-head rotations of one layer, ``x R_h`` for head ``h``.

    Randomized Hadamard (``rotation="hadamard"``): ``R_h = diag(s_h) H``, held as ``signs``
    ``[kv_heads, d]`` (int8; ``H`` is a constant of the code). Calibrated
    (``rotation="calibrated"``, :meth:`from_matrices`): dense orthonormal ``R_h = V_h H``, held
    as ``matrices`` ``[kv_heads, d, d]`` (float32) and ``signs`` None. Either is held by the
    cache and counted (category ``tables``, :meth:`named_tensors`).
    """

    matrices: torch.Tensor | None = None
    keys: bool = True
    """Whether keys are stored in the rotated space too (values always are). False for per-channel
    keys (math dictionary §25): the query is then not rotated, only the output is rotated back."""
    FIELDS = {"signs": "signs", "matrices": "matrices", "keys": "keys"}
    """Saved fields (:mod:`kv_cache.cache.serialize_state`)."""
    FIELD_DEFAULTS = {"keys": True}
    """Fields a file written before they existed may lack (format 2 files rotated keys always)."""

    def __init__(self, layer: int, kv_heads: int, head_dim: int, seed: int, device) -> None:
        self.signs = torch.stack([RandomizedHadamard.for_head(head_dim, layer, h, seed).signs()
                                  for h in range(kv_heads)]).to(device=device, dtype=torch.int8)

    @classmethod
    def from_signs(cls, signs: torch.Tensor) -> "Rotation":
        """A rotation with the given per-head ``signs`` ``[kv_heads, d]`` (int8)."""
        out = cls.__new__(cls)
        out.signs = signs
        return out

    @classmethod
    def from_matrices(cls, matrices: torch.Tensor) -> "Rotation":
        """A rotation with dense per-head orthonormal ``matrices`` ``[kv_heads, d, d]`` (float32)."""
        out = cls.__new__(cls)
        out.signs = None
        out.matrices = matrices
        return out

    def head(self, h: int) -> "Rotation":
        """The rotation of KV head ``h`` alone (its own copy of the signs, ``[1, d]``)."""
        if self.matrices is not None:
            return Rotation.from_matrices(self.matrices[h:h + 1].clone()).with_keys(self.keys)
        return Rotation.from_signs(self.signs[h:h + 1].clone()).with_keys(self.keys)

    def with_keys(self, keys: bool) -> "Rotation":
        """This rotation, with keys rotated (``keys``) or stored as computed; returns ``self``."""
        self.keys = bool(keys)
        return self

    def forward_keys(self, x: torch.Tensor) -> torch.Tensor:
        """Keys (or queries, which must live in the keys' space) into the stored space: ``x R`` when
        keys are rotated, else ``x`` unchanged."""
        return self.forward(x) if self.keys else x

    def inverse_keys(self, y: torch.Tensor) -> torch.Tensor:
        """Stored keys back to the model's space (``y R^T`` when keys are rotated, else ``y``)."""
        return self.inverse(y) if self.keys else y

    def named_tensors(self) -> dict[str, torch.Tensor]:
        """The held tensors: ``rotation_signs`` or ``rotation_matrices`` (``keys`` is a flag, no bytes)."""
        if self.matrices is not None:
            return {"rotation_matrices": self.matrices}
        return {"rotation_signs": self.signs}

    def inverse_matrices(self) -> torch.Tensor:
        """``R_h^T`` per head, float32 ``[kv_heads, d, d]`` (``inverse(y) = y @ R_h^T``); computed per
        call, not held (the attention kernel maps a rotated block's output back with it)."""
        if self.matrices is not None:
            return self.matrices.float().transpose(-1, -2).contiguous()
        d = self.signs.shape[-1]
        return (_hadamard(d, str(self.signs.device)) * self.signs.float()[:, None, :]).contiguous()

    def value_inverse(self) -> torch.Tensor:
        """What :func:`kv_cache.kernels.attend_mixed` takes as ``value_inverse`` to map rotated
        values back: the held ``signs`` (int8 ``[kv_heads, d]``, no copy) of a Hadamard rotation,
        else :meth:`inverse_matrices`."""
        return self.inverse_matrices() if self.matrices is not None else self.signs

    def _parts(self, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        return self.signs.to(x.dtype)[None, :, None, :], _hadamard(x.shape[-1], str(x.device)).to(x.dtype)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        """``x R`` for ``x`` ``[b, kv_heads, n, d]`` (each head its own rotation)."""
        if self.matrices is not None:
            return x @ self.matrices.to(x.dtype).unsqueeze(0)  # [b, h, n, d] @ [1, h, d, d]
        s, h = self._parts(x)
        return (x * s) @ h

    def inverse(self, y: torch.Tensor) -> torch.Tensor:
        """``y R^T`` (Hadamard: ``(y H) * s``, ``H`` symmetric)."""
        if self.matrices is not None:
            return y @ self.matrices.to(y.dtype).transpose(-1, -2).unsqueeze(0)
        s, h = self._parts(y)
        return (y @ h) * s


def _make_rotation(quant: QuantConfig, layer: int, kv_heads: int, head_dim: int, device) -> Rotation:
    if quant.rotation == "calibrated":
        from ..compression.rotation_file import rotation_matrices

        return Rotation.from_matrices(rotation_matrices(quant.rotation_path, layer, kv_heads, head_dim, device))
    return Rotation(layer, kv_heads, head_dim, quant.rotation_seed, device)


def _zero_range(dtype: torch.dtype) -> tuple[int, int]:
    info = torch.iinfo(dtype)
    return info.min, info.max


def narrow_zero_points(block: QBlock, x: torch.Tensor, zero_dtype: torch.dtype) -> QBlock:
    """``block`` (asymmetric uniform, int16 zero points) with zero points stored as ``zero_dtype``.

    Groups whose zero point ``z`` fits are unchanged (same codes, same scale). A group whose
    ``z`` lies outside ``[zmin, zmax]`` (its range ``[lo, hi]`` stays far from 0) gets
    ``z' = clamp(z)`` and the smallest scale whose grid ``[-z' s, (L - z') s]`` still covers
    the range, ``s = hi / (L - z')`` (``lo > 0``) or ``s = lo / -z'`` (``hi < 0``), rounded up in
    the stored scale dtype; its codes are recomputed ``clamp(round(x / s) + z', 0, L)`` from
    ``x`` ``[R, N, d]`` (the tensor that was quantized). Math dictionary §18.7.
    """
    if block.zero is None or zero_dtype == torch.int16:
        return block
    zmin, zmax = _zero_range(zero_dtype)
    z = block.zero
    bad = (z < zmin) | (z > zmax)
    if not bool(bad.any()):
        return dataclasses.replace(block, zero=z.to(zero_dtype))
    from ..kernels.reference import expand_meta, unpack_codes

    L = (1 << block.bits) - 1
    xf = x.float()
    zc = z.clamp(zmin, zmax).to(torch.float32)
    # The group's range, recovered from the element-wise tensor: max/min over each group.
    big = torch.finfo(torch.float32).max
    bad_el = expand_meta(block, bad.float()).bool()  # [R, N, d]
    lo = _group_reduce(block, torch.where(bad_el, xf, torch.full_like(xf, big)), "amin")
    hi = _group_reduce(block, torch.where(bad_el, xf, torch.full_like(xf, -big)), "amax")
    need = torch.where(z < zmin, hi / (L - zc), lo / -zc.clamp(min=1))
    stored = need.to(block.scale.dtype)
    stored = torch.where(stored.float() < need, torch.nextafter(stored, torch.full_like(stored, float("inf"))), stored)
    new_scale = torch.where(bad, stored, block.scale)
    new_zero = torch.where(bad, zc.to(torch.int16), z)
    s_el = expand_meta(block, new_scale)
    z_el = expand_meta(block, new_zero)
    recoded = (xf / s_el).round().add(z_el).clamp(0, L).to(torch.uint8)
    codes = torch.where(bad_el, recoded, unpack_codes(block))
    R, N, d = x.shape
    packed = pack_bits(codes.contiguous(), block.bits).view(R, N, d * block.bits // 8)
    return dataclasses.replace(block, codes=packed, scale=new_scale, zero=new_zero.to(zero_dtype))


def _group_reduce(block: QBlock, xe: torch.Tensor, op: str) -> torch.Tensor:
    """Reduce ``xe`` ``[R, N, d]`` over each scale group of ``block``: the shape of ``block.scale``."""
    R, N, d = xe.shape
    gs = block.group_size
    if block.grouping == "token":
        return getattr(xe.view(R, N, d // gs, gs), op)(-1)
    return getattr(xe.view(R, N // gs, gs, d), op)(2)


class PackedKV:
    """Quantized keys and values of one layer, packed token-major.

    Attributes (``n`` tokens, ``G`` key scale groups, ``d`` head_dim, ``c`` channel group)
    ------------------------------------------------------------------------------------
    k_codes, v_codes : uint8 ``[b, h, n, d * bits / 8]`` (key and value bits may differ)
    k_scale, k_zero : per channel ``[b, h, G, d]``; per token ``[b, h, n, d / c]``
        (``k_zero`` of ``quant.zero_dtype``, int16 by default; None when symmetric or with
        Lloyd-Max levels)
    v_scale, v_zero : ``[b, h, n, d / c]``
    k_group : int32 ``[b, h, n]`` or None
        Per-channel keys only: each key's scale group, kept when tokens may be evicted (groups
        become ragged then); None while groups are whole (token ``t`` uses ``t // group_size``).
    rotation : :class:`Rotation` or None
        Its ``signs`` (or calibrated ``matrices``) are held and counted (category ``tables``).
    """

    _SLOTS = ("k_codes", "k_scale", "k_zero", "v_codes", "v_scale", "v_zero", "k_group")
    _CATEGORY = {"k_codes": "codes", "v_codes": "codes", "k_scale": "scales", "v_scale": "scales",
                 "k_zero": "zero_points", "v_zero": "zero_points", "k_group": "indices"}

    def __init__(self, quant: QuantConfig, dtype: torch.dtype, head_dim: int, track_groups: bool, layer: int = 0):
        self.quant, self.dtype, self.head_dim, self.layer = quant, dtype, head_dim, layer
        self.key_bits, self.value_bits = quant.bits_for(layer)
        self.channel_group = quant.channel_group_for(head_dim)
        self.per_channel_keys = quant.key_grouping == "channel"
        self.track_groups = track_groups and self.per_channel_keys
        self.k_codes = self.k_scale = self.k_zero = None
        self.v_codes = self.v_scale = self.v_zero = None
        self.k_group: torch.Tensor | None = None
        self.rotation: Rotation | None = None

    @property
    def length(self) -> int:
        return 0 if self.k_codes is None else self.k_codes.shape[2]

    def _lut(self, bits: int, device) -> torch.Tensor | None:
        """Lloyd-Max levels, or None for uniform levels (the kernels build those)."""
        return _lloyd_max(bits, str(device)) if self.quant.levels == "lloyd_max" else None

    def _levels(self, bits: int, codebook: bool) -> torch.Tensor:
        """The levels the codes index: a constant of the layout (like the formula), not held."""
        lut = self._lut(bits, self.k_codes.device) if codebook else None
        return uniform_lut(bits, self.quant.symmetric, self.k_codes.device) if lut is None else lut
    @property
    def key_scale_dtype(self) -> torch.dtype:
        """Per-channel key scales: ``scale_dtype``, float16 where that is the 8-bit norm code (values only)."""
        return torch.float16 if self.quant.scale_dtype == torch.uint8 else self.quant.scale_dtype

    def _stored_scale(self, scale: torch.Tensor) -> torch.Tensor:
        """Scales as held: 8-bit log codes with ``scale_dtype=torch.uint8`` (§18.8), else as computed."""
        return encode_log_scale(scale) if self.quant.scale_dtype == torch.uint8 else scale

    def append(self, keys: torch.Tensor, values: torch.Tensor) -> None:
        """Quantize ``[b, h, n, d]`` tokens (``n`` a multiple of ``group_size``) and append them.

        One fused quantize + pack per tensor (:func:`kv_cache.kernels.quantize_block`); with
        uniform levels bit for bit :func:`kv_cache.compression.quantize` (keys per channel or
        per token, values per token). Rotated layouts rotate first.
        """
        q = self.quant
        g, c = q.group_size, self.channel_group
        b, h, n, d = keys.shape
        R = b * h
        if keys.dtype != self.dtype:  # a residual held in a narrower dtype: quantize in the model's
            keys, values = keys.to(self.dtype), values.to(self.dtype)
        if q.rotation is not None and self.rotation is None:
            self.rotation = _make_rotation(q, self.layer, h, d, keys.device).with_keys(not self.per_channel_keys)
        if self._codes_tokens:  # the per-token layout in one fused pass each (§18.8): rotate, code, log-code
            signs = None if self.rotation is None else self.rotation.signs
            k3, v3 = keys.reshape(R, n, d), values.reshape(R, n, d)
            if self.key_bits == self.value_bits:  # one call for both (rows 0..R-1 keys, R..2R-1 values)
                codes, norms = code_tokens_raw(torch.cat([k3, v3]), self.key_bits,
                                               self._lut(self.key_bits, keys.device), c, signs)
                (kc, vc), (ks, vs) = codes.split(R), norms.split(R)
            else:
                kc, ks = code_tokens_raw(k3, self.key_bits, self._lut(self.key_bits, keys.device), c, signs)
                vc, vs = code_tokens_raw(v3, self.value_bits, self._lut(self.value_bits, keys.device), c, signs)
            self._append_blocks(kc, ks, None, vc, vs, None, b, h, n, (b, h, n, d // c))
            return
        if self.rotation is not None:
            keys, values = self.rotation.forward_keys(keys), self.rotation.forward(values)
        k3, v3 = keys.reshape(R, n, d), values.reshape(R, n, d)
        # 8-bit log-coded norms (§18.8): the kernel computes float32 norms, stored as codes below.
        # The codes stay those of the exact norm: norm-only codes are nearest levels of x / RMS(x).
        kernel_scale = torch.float32 if q.scale_dtype == torch.uint8 else q.scale_dtype
        if self.per_channel_keys:  # uniform levels with a zero point; float16 scales under 8-bit value norms
            kx = clip_groups(k3, q.clip_keys, 1, g)
            kq = quantize_block(kx, self.key_bits, "channel", g, q.symmetric, self.key_scale_dtype)
            k_meta_shape = (b, h, n // g, d)
        else:
            kx = clip_groups(k3, q.clip_keys, 2, c)
            kq = quantize_block(kx, self.key_bits, "token", c, q.symmetric, kernel_scale,
                                lut=self._lut(self.key_bits, keys.device))
            k_meta_shape = (b, h, n, d // c)
        vx = clip_groups(v3, q.clip_values, 2, c)
        vq = quantize_block(vx, self.value_bits, "token", c, q.symmetric, kernel_scale,
                            lut=self._lut(self.value_bits, keys.device))
        kq, vq = narrow_zero_points(kq, kx, q.zero_dtype), narrow_zero_points(vq, vx, q.zero_dtype)
        k_scale = kq.scale if self.per_channel_keys else self._stored_scale(kq.scale)
        self._append_blocks(kq.codes, k_scale, kq.zero, vq.codes, self._stored_scale(vq.scale), vq.zero, b, h, n,
                            k_meta_shape)

    @property
    def _codes_tokens(self) -> bool:
        """Whether :func:`~kv_cache.kernels.code_tokens` stores this layout: keys and values per
        token with codebook levels and 8-bit log norms, a Hadamard rotation (or none), no clipping."""
        q = self.quant
        return (not self.per_channel_keys and q.levels == "lloyd_max" and q.scale_dtype == torch.uint8
                and q.rotation in (None, "hadamard") and q.clip_keys >= 1.0 and q.clip_values >= 1.0
                and (self.rotation is None or self.rotation.keys))

    def _append_blocks(self, k_codes: torch.Tensor, k_scale: torch.Tensor, k_zero: torch.Tensor | None,
                       v_codes: torch.Tensor, v_scale: torch.Tensor, v_zero: torch.Tensor | None,
                       b: int, h: int, n: int, k_meta_shape: tuple) -> None:
        """Append ``n`` coded tokens of ``b * h`` rows: codes ``[R, n, P]``, scales and zero points as
        held (None: none), the keys' metadata of ``k_meta_shape``."""
        g = self.quant.group_size
        # decoding flushes (fewer tokens than GROW_TOKENS): room for the next ones, at most 1/8 of what is held
        held = self.length
        slack = min(GROW_TOKENS, held // 8) if n < GROW_TOKENS else 0
        k_slack = 0 if self.per_channel_keys else slack  # per-channel scales grow by whole groups
        if self.track_groups:
            first = 0 if self.k_scale is None else self.k_scale.shape[2]  # index into the scale table
            gid = torch.arange(first, first + n // g, device=k_codes.device, dtype=torch.int32)
            self.k_group = _cat(self.k_group, gid.repeat_interleave(g).expand(b, h, n).contiguous(), slack)
        self.k_codes = _cat(self.k_codes, k_codes.view(b, h, n, -1), slack)
        self.k_scale = _cat(self.k_scale, k_scale.view(k_meta_shape), k_slack)
        self.v_codes = _cat(self.v_codes, v_codes.view(b, h, n, -1), slack)
        self.v_scale = _cat(self.v_scale, v_scale.view(b, h, n, -1), slack)  # [b, h, n, d / c]
        if k_zero is not None:  # symmetric and codebook codes have no zero point (None)
            self.k_zero = _cat(self.k_zero, k_zero.view(k_meta_shape), k_slack)
        if v_zero is not None:
            self.v_zero = _cat(self.v_zero, v_zero.view(b, h, n, -1), slack)

    def dequantize(self) -> tuple[torch.Tensor, torch.Tensor]:
        """Keys and values ``[b, h, n, d]`` in ``dtype`` (math dictionary section 3), one fused
        unpack + dequantize pass each (:func:`kv_cache.kernels.dequantize_block`), rotated back."""
        b, h, n, _ = self.k_codes.shape
        kq, vq = self.qblocks()
        k = dequantize_block(kq, self.dtype).view(b, h, n, -1)
        v = dequantize_block(vq, self.dtype).view(b, h, n, -1)
        if self.rotation is not None:
            k, v = self.rotation.inverse_keys(k), self.rotation.inverse(v)
        return k, v

    def __setattr__(self, name: str, value) -> None:
        if name in self._SLOTS or name == "rotation":  # the blocks are views of these: rebuild them
            self.__dict__.pop(self._BLOCKS, None)
        object.__setattr__(self, name, value)

    _BLOCKS = "_qblocks_view"
    FIELDS = {name: name for name in ("quant", "dtype", "head_dim", "layer", "key_bits", "value_bits", "channel_group",
                                      "per_channel_keys", "track_groups", "k_codes", "k_scale", "k_zero", "k_group",
                                      "v_codes", "v_scale", "v_zero", "rotation")}
    """Saved fields (:mod:`kv_cache.cache.serialize_state`); the cached block view is not one."""
    """Attributes that are not state (views rebuilt on demand): not saved by ``cache.save``."""

    def qblocks(self) -> tuple[QBlock, QBlock]:
        """Keys and values as kernel blocks over rows ``R = batch * kv_heads`` (views, no copy);
        rotated layouts are in the rotated space.

        Kept between calls (views of the held tensors, no extra bytes) until a slot or the
        rotation is reassigned: decoding steps between two flushes reuse them."""
        blocks = self.__dict__.get(self._BLOCKS)
        if blocks is None:
            blocks = self._make_qblocks()
            object.__setattr__(self, self._BLOCKS, blocks)
        return blocks

    def _make_qblocks(self) -> tuple[QBlock, QBlock]:
        b, h, n, _ = self.k_codes.shape
        R, d, c = b * h, self.head_dim, self.channel_group

        def rows(t: torch.Tensor | None, width: int) -> torch.Tensor | None:
            return None if t is None else t.reshape(R, -1, width)

        table = log_scale_table(self.k_codes.device) if self.quant.scale_dtype == torch.uint8 else None
        # Views of the held slots, checked when they were stored: made without QBlock's checks
        # (a decoding step rebuilds them for every layer).
        if self.per_channel_keys:
            keys = QBlock.trusted(codes=rows(self.k_codes, self.k_codes.shape[-1]), bits=self.key_bits,
                                  lut=self._levels(self.key_bits, False), grouping="channel",
                                  scale=rows(self.k_scale, d), zero=rows(self.k_zero, d),
                                  group_size=self.quant.group_size,
                                  gid=None if self.k_group is None else self.k_group.reshape(R, n))
        else:
            # 8-bit log-coded norms (§18.8) stay codes: the kernels decode them through the table
            keys = QBlock.trusted(codes=rows(self.k_codes, self.k_codes.shape[-1]), bits=self.key_bits,
                                  lut=self._levels(self.key_bits, True), grouping="token",
                                  scale=rows(self.k_scale, d // c), zero=rows(self.k_zero, d // c), group_size=c,
                                  scale_table=table if self.k_scale.dtype == torch.uint8 else None)
        values = QBlock.trusted(codes=rows(self.v_codes, self.v_codes.shape[-1]), bits=self.value_bits,
                                lut=self._levels(self.value_bits, True), grouping="token",
                                scale=rows(self.v_scale, d // c), zero=rows(self.v_zero, d // c), group_size=c,
                                scale_table=table if self.v_scale.dtype == torch.uint8 else None)
        return keys, values

    def gather(self, idx: torch.Tensor) -> None:
        """Keep tokens ``idx`` (``[b, h, k]``) and drop key scale groups no head uses any more."""
        if self.per_channel_keys and self.k_group is None:  # whole groups so far: token t uses group t // g
            b, h, n = self.k_codes.shape[:3]
            gid = torch.arange(n, device=self.k_codes.device, dtype=torch.int32) // self.quant.group_size
            self.k_group = gid.expand(b, h, n).contiguous()
        per_token = ("k_codes", "v_codes", "v_scale", "v_zero", "k_group")
        if not self.per_channel_keys:
            per_token += ("k_scale", "k_zero")
        for name in per_token:
            t = getattr(self, name)
            if t is not None:
                setattr(self, name, gather_tokens(t, idx))
        if not self.per_channel_keys:
            return
        used = torch.unique(self.k_group)
        if used.numel() < self.k_scale.shape[2]:
            remap = torch.full((self.k_scale.shape[2],), -1, dtype=torch.int32, device=used.device)
            remap[used.long()] = torch.arange(used.numel(), dtype=torch.int32, device=used.device)
            self.k_scale = self.k_scale.index_select(2, used.long())
            if self.k_zero is not None:
                self.k_zero = self.k_zero.index_select(2, used.long())
            self.k_group = remap[self.k_group.long()]

    def row(self, b: int, h: int) -> "PackedKV":
        """Row ``(b, h)`` alone, ``[1, 1, n, ...]``, in tensors of its own (copies, not views)."""
        out = PackedKV.__new__(PackedKV)
        out.__dict__.update(self.__dict__)
        for name in self._SLOTS:
            t = getattr(self, name)
            setattr(out, name, None if t is None else t[b:b + 1, h:h + 1].clone())
        out.rotation = None if self.rotation is None else self.rotation.head(h)
        return out

    def named_tensors(self) -> dict[str, torch.Tensor]:
        """The held tensors: a slot that is the leading part of a buffer (:data:`GROW_TOKENS`)
        is reported as the whole buffer, room included."""
        out = {name: _held(t) for name in self._SLOTS if (t := getattr(self, name)) is not None}
        if self.rotation is not None:
            out.update(self.rotation.named_tensors())
        return out

    def map_tensors(self, fn) -> None:
        for name in self._SLOTS:
            t = getattr(self, name)
            if t is not None:
                setattr(self, name, fn(t))

    def add_nbytes(self, out: dict[str, int]) -> None:
        for name, t in self.named_tensors().items():
            out[self._CATEGORY.get(name, "tables")] += t.nbytes
