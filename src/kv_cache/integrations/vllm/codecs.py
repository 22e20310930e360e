"""Paged codecs: what one token slot of a vLLM KV block holds, as pure torch functions.

vLLM gives every layer a paged cache ``[num_blocks, num_kv_heads, block_size, slot_bytes]``
(uint8; the head-major ``LBHNC`` layout of the CPU platform). Every codec here stores one byte
row per (block, kv head, token slot)::

    [ key codes | key metadata | value codes | value metadata ]

and nothing else: no per-sequence state, so a block is self-contained and vLLM's prefix cache can
share it between requests. Keys are never rotated (queries need no rotation); values of the
``*d`` codecs are stored rotated, and the attention accumulates them in the rotated basis and
rotates the output back once per query (:func:`value_rotations`).

Codecs (``head_dim = D``; bytes per slot and kv head):

=====  ==============================================================  =====================
name   layout                                                          bytes (D = 64)
=====  ==============================================================  =====================
q8     keys and values per token, symmetric int8, one fp16 scale each  2 D + 4   (132)
q4d    keys per channel in 32-token groups, uniform 4-bit, fp16 scale   D/2 + D/8 + D/2 + 1
       and fp16 minimum per channel and group, spread over the group's   (73)
       32 slots (D/8 bytes per slot); values rotated (randomized
       Hadamard), 4-bit Lloyd-Max levels, one 8-bit log-coded norm
q3d    as q4d with 3-bit codes                                          3D/8 + D/8 + 3D/8 + 1
q2d    as q4d with 2-bit codes                                          D/4 + D/8 + D/4 + 1
q4     KIVI: keys as q4d; values per token, uniform 4-bit in groups of  D/2 + D/8 + D/2 + D/8
       32 channels, fp16 scale and minimum per group                    (80)
q4db   as q4d, keys stored before RoPE (below)                          as q4d
q3db   as q3d, keys stored before RoPE                                  as q3d
q2db   as q2d, keys stored before RoPE                                  as q2d
=====  ==============================================================  =====================

**Keys before RoPE** (the ``*b`` codecs, math dictionary §29.9). vLLM hands the backend keys
already rotated at their positions; these codecs turn each key back (``k = R(p)^T k' / f``, the
layer's :class:`~kv_cache.cache.rope_frame.RopeFrame`) before its per-channel group is encoded,
and the attention turns it again at read, token ``t`` of a request at position ``t``. Before RoPE a
key channel's offset is a constant instead of a rotating pair, so the per-channel ranges of a
group are narrower and the same bytes hold finer steps. Positions are the tokens' indices in the
block table, so a block still holds no per-sequence state (prefix caching shares it as before).

**Per-channel key groups in a paged cache.** A key group is 32 consecutive slots of one block
(CPU block sizes are multiples of 32). Its per-channel scale and minimum are only final when the
group is full, so each write re-derives them from the group's stored tokens (dequantized) and
the new ones, and re-encodes the group: the grid only widens, so codes written earlier are moved
onto the wider grid (an extra rounding of at most half a new step each time the range grows,
which happens a few times per group while decoding; prefill chunks write whole groups at once).
A full group is never rewritten, except vLLM's recompute of the last prompt token on a full
prefix-cache hit, which re-encodes the group from its own dequantized values and the same key
(the codes then move by at most one step). The library's float16 sinks and 32-token float16
residual are per-sequence state: they have no paged form and are dropped here (documented quality
cost in ``docs/vllm.md``).

Nothing here imports vLLM.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from functools import lru_cache

import torch

from ...compression.codebook import LOG_SCALE_MIN_EXP, LOG_SCALE_STEP, lloyd_max_gaussian, log_scale_range
from ...compression.packing import pack_bits, unpack_bits
from ...compression.rotation import RandomizedHadamard

KEY_GROUP = 32
"""Tokens per per-channel key group (one group never spans two blocks)."""
VALUE_CHANNEL_GROUP = 32
"""Channels per scale of KIVI's per-token values."""

_SPECS = {
    # name: (key layout, key bits, value layout, value bits, keys before RoPE)
    "q8": ("token_int8", 8, "token_int8", 8, False),
    "q4d": ("channel", 4, "rotated_lloyd_max", 4, False),
    "q3d": ("channel", 3, "rotated_lloyd_max", 3, False),
    "q2d": ("channel", 2, "rotated_lloyd_max", 2, False),
    "q4": ("channel", 4, "uniform_channel_groups", 4, False),
    "q4db": ("channel", 4, "rotated_lloyd_max", 4, True),
    "q3db": ("channel", 3, "rotated_lloyd_max", 3, True),
    "q2db": ("channel", 2, "rotated_lloyd_max", 2, True),
}
CODECS: tuple[str, ...] = tuple(_SPECS)
"""Codec names accepted in ``additional_config={"kv_cache": {"codec": ...}}``."""
DEFAULT_CODEC = "q4d"


@dataclass(frozen=True)
class PagedCodec:
    """The byte layout of one token slot for one kv head.

    Parameters
    ----------
    name : {"q8", "q4d", "q3d", "q2d", "q4", "q4db", "q3db", "q2db"}
    head_dim : int
        Multiple of 32 for the channel-grouped codecs (KIVI values, the key metadata share), of 8
        for q8.
    """

    name: str
    head_dim: int

    def __post_init__(self) -> None:
        if self.name not in _SPECS:
            raise ValueError(f"kv_cache codec must be one of {list(CODECS)}; got {self.name!r}")
        d = self.head_dim
        if isinstance(d, bool) or not isinstance(d, int) or d <= 0:
            raise ValueError(f"head_dim must be a positive int; got {d!r}")
        need = 8 if self.name == "q8" else 32
        if d % need:
            raise ValueError(f"kv_cache codec {self.name!r} needs a head_dim that is a multiple of {need}; got {d}")

    @property
    def key_layout(self) -> str:
        return _SPECS[self.name][0]

    @property
    def key_bits(self) -> int:
        return _SPECS[self.name][1]

    @property
    def value_layout(self) -> str:
        return _SPECS[self.name][2]

    @property
    def value_bits(self) -> int:
        return _SPECS[self.name][3]

    @property
    def pre_rope(self) -> bool:
        """Keys stored before RoPE (turned back at write, turned at read)."""
        return _SPECS[self.name][4]

    @property
    def rotated_values(self) -> bool:
        return self.value_layout == "rotated_lloyd_max"

    @property
    def key_code_bytes(self) -> int:
        return self.head_dim * self.key_bits // 8

    @property
    def key_meta_bytes(self) -> int:
        # token_int8: one fp16 scale; channel: (fp16 scale + fp16 minimum) x D over 32 slots
        return 2 if self.key_layout == "token_int8" else 4 * self.head_dim // KEY_GROUP

    @property
    def value_code_bytes(self) -> int:
        return self.head_dim * self.value_bits // 8

    @property
    def value_meta_bytes(self) -> int:
        if self.value_layout == "token_int8":
            return 2
        if self.value_layout == "rotated_lloyd_max":
            return 1
        return 4 * (self.head_dim // VALUE_CHANNEL_GROUP)

    @property
    def slot_bytes(self) -> int:
        """Bytes of one (token, kv head) slot: what vLLM's KV spec declares per head and token."""
        return self.key_code_bytes + self.key_meta_bytes + self.value_code_bytes + self.value_meta_bytes

    @property
    def bits_per_element(self) -> float:
        """Stored bits per K or V element, metadata included."""
        return 8 * self.slot_bytes / (2 * self.head_dim)

    def offsets(self) -> tuple[int, int, int, int, int]:
        """Byte offsets ``(key codes, key meta, value codes, value meta, end)`` in a slot."""
        a = self.key_code_bytes
        b = a + self.key_meta_bytes
        c = b + self.value_code_bytes
        return 0, a, b, c, c + self.value_meta_bytes


# ---------------------------------------------------------------------------------------------
# Bit packing along the last dim (D codes -> D * bits / 8 bytes; D is a multiple of 8).


def _pack(codes: torch.Tensor, bits: int) -> torch.Tensor:
    """``[..., D]`` uint8 codes -> ``[..., D * bits // 8]`` uint8 bytes."""
    if bits == 8:
        return codes
    d = codes.shape[-1]
    return pack_bits(codes.contiguous(), bits).view(*codes.shape[:-1], d * bits // 8)


def _unpack(packed: torch.Tensor, bits: int, d: int) -> torch.Tensor:
    """``[..., D * bits // 8]`` uint8 bytes -> ``[..., D]`` uint8 codes."""
    if bits == 8:
        return packed
    if bits == 4 and _nibble_low_first():  # the common case, two shifts instead of the fold plan
        return torch.stack((packed & 0x0F, packed >> 4), dim=-1).view(*packed.shape[:-1], d)
    n = packed.numel() * 8 // bits
    return unpack_bits(packed.contiguous().view(-1), bits, n).view(*packed.shape[:-1], d)


@lru_cache(maxsize=1)
def _nibble_low_first() -> bool:
    """Whether :func:`pack_bits` puts the first 4-bit code in the low nibble (checked once)."""
    probe = pack_bits(torch.tensor([1, 2], dtype=torch.uint8), 4)
    return int(probe[0]) == 0x21


# ---------------------------------------------------------------------------------------------
# Per-token symmetric int8 (q8).


def _encode_token_int8(x: torch.Tensor) -> torch.Tensor:
    """``[..., D]`` float -> ``[..., D + 2]`` uint8: codes ``round(x / s) + 128`` and fp16 ``s``."""
    xf = x.float()
    s = (xf.abs().amax(dim=-1, keepdim=True) / 127.0).half()
    sf = s.float()
    q = torch.where(sf > 0, torch.round(xf / torch.where(sf > 0, sf, torch.ones_like(sf))), torch.zeros_like(xf))
    codes = (q.clamp(-127, 127) + 128).to(torch.uint8)
    return torch.cat((codes, s.view(torch.uint8)), dim=-1)


def _decode_token_int8(codes: torch.Tensor, scale_bytes: torch.Tensor) -> torch.Tensor:
    """``[..., D]`` uint8 codes and ``[..., 2]`` uint8 (fp16 scale) -> ``[..., D]`` float32."""
    s = scale_bytes.contiguous().view(torch.float16).float()
    return (codes.float() - 128.0) * s


# ---------------------------------------------------------------------------------------------
# Rotated Lloyd-Max values with one 8-bit log-coded norm (§18, §18.8).


@lru_cache(maxsize=8)
def value_levels(bits: int) -> tuple[torch.Tensor, torch.Tensor]:
    levels = lloyd_max_gaussian(bits).float()
    return levels, (levels[:-1] + levels[1:]) * 0.5


@lru_cache(maxsize=1)
def log_norm_table() -> torch.Tensor:
    c = torch.arange(256, dtype=torch.float64)
    table = torch.pow(2.0, LOG_SCALE_MIN_EXP + (c - 1) * LOG_SCALE_STEP)
    table[0] = 0.0
    return table.float()


_levels, _log_norm_table = value_levels, log_norm_table  # the old private names


def _encode_log_norm(rms: torch.Tensor) -> torch.Tensor:
    """RMS norms ``>= 0`` -> 8-bit log codes (§18.8); norms past the largest code are clamped to it."""
    lo, hi = log_scale_range()
    r = rms.double().clamp(max=hi)
    code = torch.round((torch.log2(r.clamp_min(lo)) - LOG_SCALE_MIN_EXP) / LOG_SCALE_STEP) + 1
    return torch.where(r > 0, code.clamp(1, 255), torch.zeros_like(code)).to(torch.uint8)


def _encode_lloyd_max(x_rot: torch.Tensor, bits: int) -> tuple[torch.Tensor, torch.Tensor]:
    """``[..., D]`` rotated float -> (codes ``[..., D]`` uint8, norm code ``[..., 1]`` uint8)."""
    xf = x_rot.float()
    rms = xf.square().mean(dim=-1, keepdim=True).sqrt()
    ncode = _encode_log_norm(rms)
    s = log_norm_table().to(x_rot.device)[ncode.long()]
    v = torch.where(s > 0, xf / torch.where(s > 0, s, torch.ones_like(s)), torch.zeros_like(xf))
    _, mids = value_levels(bits)
    codes = torch.bucketize(v, mids.to(x_rot.device)).to(torch.uint8)
    return codes, ncode


def _decode_lloyd_max(codes: torch.Tensor, ncode: torch.Tensor, bits: int) -> torch.Tensor:
    """Codes ``[..., D]`` and norm codes ``[..., 1]`` -> rotated values ``[..., D]`` float32."""
    levels, _ = value_levels(bits)
    s = log_norm_table().to(codes.device)[ncode.long()]
    return levels.to(codes.device)[codes.long()] * s


# ---------------------------------------------------------------------------------------------
# Uniform asymmetric groups (KIVI values: per token, 32 channels per group).


def _encode_uniform_channel_groups(x: torch.Tensor, bits: int) -> tuple[torch.Tensor, torch.Tensor]:
    """``[..., D]`` -> (codes ``[..., D]``, meta ``[..., 4 * D / 32]`` uint8: fp16 scales then minima)."""
    d = x.shape[-1]
    xg = x.float().view(*x.shape[:-1], d // VALUE_CHANNEL_GROUP, VALUE_CHANNEL_GROUP)
    mn = xg.amin(dim=-1, keepdim=True)
    mx = xg.amax(dim=-1, keepdim=True)
    codes, s16, m16 = _uniform(xg, mn, mx, bits)
    meta = torch.cat((s16.squeeze(-1), m16.squeeze(-1)), dim=-1)  # [..., 2 D / 32]
    return codes.view(*x.shape), meta.contiguous().view(torch.uint8)


def _decode_uniform_channel_groups(codes: torch.Tensor, meta: torch.Tensor) -> torch.Tensor:
    d = codes.shape[-1]
    n = d // VALUE_CHANNEL_GROUP
    m = meta.contiguous().view(torch.float16).float()  # [..., 2 n]
    s, mn = m[..., :n, None], m[..., n:, None]
    cg = codes.float().view(*codes.shape[:-1], n, VALUE_CHANNEL_GROUP)
    return (mn + cg * s).view(*codes.shape)


def _uniform(x: torch.Tensor, mn: torch.Tensor, mx: torch.Tensor, bits: int):
    """Codes of ``x`` on the grid ``mn + c * s`` (``s = (mx - mn) / (2**bits - 1)``, both stored fp16)."""
    top = (1 << bits) - 1
    s16 = ((mx - mn) / top).half()
    m16 = mn.half()
    sf, mf = s16.float(), m16.float()
    q = torch.where(sf > 0, torch.round((x - mf) / torch.where(sf > 0, sf, torch.ones_like(sf))), torch.zeros_like(x))
    return q.clamp(0, top).to(torch.uint8), s16, m16


# ---------------------------------------------------------------------------------------------
# Per-channel key groups.


def _decode_channel_keys(codes: torch.Tensor, meta: torch.Tensor, bits: int, d: int) -> torch.Tensor:
    """Keys of whole groups: codes ``[..., 32 * g, Kc]``, meta ``[..., 32 * g, D/8]`` -> ``[..., 32 * g, D]``.

    The metadata of a group is the concatenation of its 32 slots' shares: ``4 D`` bytes, read as
    float16 ``[2, D]`` (scales, then minima).
    """
    lead, t = codes.shape[:-2], codes.shape[-2]
    g = t // KEY_GROUP
    m = meta.contiguous().view(*lead, g, KEY_GROUP * meta.shape[-1]).view(torch.float16).float()  # [..., g, 2D]
    s, mn = m[..., None, :d], m[..., None, d:]  # [..., g, 1, D]
    c = _unpack(codes, bits, d).float().view(*lead, g, KEY_GROUP, d)
    return (mn + c * s).view(*lead, t, d)


def _write_channel_keys(cache: torch.Tensor, key: torch.Tensor, slot_mapping: torch.Tensor, codec: PagedCodec) -> None:
    """Write keys ``[N, H, D]`` at ``slot_mapping`` ``[N]``, re-encoding every touched 32-slot group.

    A group's stored tokens are the slots before the first new one in that group (tokens of one
    sequence arrive in order; a rewrite from the group's start, as after a preemption, discards
    the old content).
    """
    nb, h, bs, _ = cache.shape
    d, bits = codec.head_dim, codec.key_bits
    kc0, km0, kc1 = 0, codec.key_code_bytes, codec.key_code_bytes + codec.key_meta_bytes
    groups = bs // KEY_GROUP
    cache5 = cache.view(nb, h, groups, KEY_GROUP, cache.shape[-1])
    slot = slot_mapping.long()
    blk, off = slot // bs, slot % bs
    gid = blk * groups + off // KEY_GROUP
    within = off % KEY_GROUP
    uniq, inv = torch.unique(gid, return_inverse=True)
    first = torch.full((uniq.numel(),), KEY_GROUP, dtype=torch.long, device=slot.device)
    first = first.scatter_reduce(0, inv, within, reduce="amin")
    ublk, ug = uniq // groups, uniq % groups
    stored = cache5[ublk, :, ug]  # [U, H, 32, C]
    old = _decode_channel_keys(stored[..., kc0:km0], stored[..., km0:kc1], bits, d)  # [U, H, 32, D]
    ar = torch.arange(KEY_GROUP, device=slot.device)
    valid = ar[None, :] < first[:, None]  # [U, 32]
    vals = torch.where(valid[:, None, :, None], old, torch.zeros_like(old))
    vals[inv, :, within] = key.float()
    valid[inv, within] = True
    vmask = valid[:, None, :, None]
    mn = torch.where(vmask, vals, torch.full_like(vals, math.inf)).amin(dim=2, keepdim=True)  # [U, H, 1, D]
    mx = torch.where(vmask, vals, torch.full_like(vals, -math.inf)).amax(dim=2, keepdim=True)
    codes, s16, m16 = _uniform(vals, mn, mx, bits)
    meta = torch.cat((s16, m16), dim=-1).contiguous().view(torch.uint8)  # [U, H, 1, 4D]
    meta = meta.view(uniq.numel(), h, KEY_GROUP, codec.key_meta_bytes)
    cache5[ublk, :, ug, :, kc0:kc1] = torch.cat((_pack(codes, bits), meta), dim=-1)


# ---------------------------------------------------------------------------------------------
# Public pure functions.


def first_kv_head(rank: int, world: int, total_kv_heads: int) -> int:
    """The model-wide index of the first kv head a tensor-parallel rank holds.

    vLLM's ``QKVParallelLinear`` split: with at least as many kv heads as ranks, rank ``r`` holds
    heads ``r * total / world ...``; with fewer, each head is replicated on ``world / total``
    consecutive ranks and rank ``r`` holds head ``r // (world / total)``.
    """
    for name, v in (("rank", rank), ("world", world), ("total_kv_heads", total_kv_heads)):
        if not isinstance(v, int) or isinstance(v, bool) or v < (0 if name == "rank" else 1):
            raise ValueError(f"{name} must be an int >= {0 if name == 'rank' else 1}; got {v!r}")
    if rank >= world:
        raise ValueError(f"rank must be < world ({world}); got {rank}")
    if total_kv_heads >= world:
        if total_kv_heads % world:
            raise ValueError(f"{total_kv_heads} kv heads do not split over {world} tensor-parallel ranks")
        return rank * (total_kv_heads // world)
    if world % total_kv_heads:
        raise ValueError(f"{world} tensor-parallel ranks do not replicate {total_kv_heads} kv heads evenly")
    return rank // (world // total_kv_heads)


def value_rotations(codec: PagedCodec, layer: int, num_kv_heads: int, device=None,
                    first_head: int = 0) -> torch.Tensor | None:
    """``R`` per kv head, float32 ``[H, D, D]`` (``x_rot = x @ R[h]``), or None for unrotated codecs.

    The randomized Hadamard rotation of ``(layer, first_head + h)`` of the library
    (:meth:`RandomizedHadamard.for_head`): a constant of the format, the same in every process.
    ``first_head`` is the model-wide index of this process's first kv head
    (:func:`first_kv_head` under tensor parallelism), so that a head keeps its rotation whatever
    the number of ranks: a run with 2 ranks stores the codes a run with 1 stores.
    """
    if not codec.rotated_values:
        return None
    if not isinstance(first_head, int) or isinstance(first_head, bool) or first_head < 0:
        raise ValueError(f"first_head must be an int >= 0; got {first_head!r}")
    mats = [RandomizedHadamard.for_head(codec.head_dim, layer, first_head + h).matrix(torch.float32)
            for h in range(num_kv_heads)]
    return torch.stack(mats).to(device)


def write_slots(
    cache: torch.Tensor,
    key: torch.Tensor,
    value: torch.Tensor,
    slot_mapping: torch.Tensor,
    codec: PagedCodec,
    rotation: torch.Tensor | None,
    kernels: bool | None = None,
    rope=None,
    positions: torch.Tensor | None = None,
) -> None:
    """Encode tokens into their slots of a paged cache, in place.

    Parameters
    ----------
    cache : torch.Tensor, uint8, ``[num_blocks, num_kv_heads, block_size, codec.slot_bytes]``
        ``block_size`` a multiple of 32.
    key, value : torch.Tensor, ``[N, num_kv_heads, head_dim]``, float16 / bfloat16 / float32
    slot_mapping : torch.Tensor, int, ``[N]``
        ``block * block_size + offset`` per token; negative entries (padding) are skipped.
    codec : PagedCodec
    rotation : torch.Tensor or None
        :func:`value_rotations` for rotated codecs.
    kernels : bool, optional
        Encode with the compiled kernel (:func:`kv_cache.kernels.paged.write_paged`, one call) where
        it serves the cache (None, the default), or always with the torch ops below (False).
    rope : RopeFrame, optional
        The layer's rotary frame (:mod:`kv_cache.cache.rope_frame`); required by the ``*b``
        codecs, which store keys before RoPE.
    positions : torch.Tensor, int, ``[N]``, optional
        Each token's position (its index in its request); required with ``rope``.

    Raises
    ------
    ValueError
        Shapes that do not match the codec, a block size that is not a multiple of 32, a
        pre-RoPE codec without its frame or positions.
    """
    if cache.dtype != torch.uint8 or cache.ndim != 4 or cache.shape[-1] != codec.slot_bytes:
        raise ValueError(f"cache must be uint8 [blocks, kv_heads, block_size, {codec.slot_bytes}]; "
                         f"got {cache.dtype} {tuple(cache.shape)}")
    if cache.shape[2] % KEY_GROUP:
        raise ValueError(f"block_size must be a multiple of {KEY_GROUP}; got {cache.shape[2]}")
    h, d = cache.shape[1], codec.head_dim
    if key.shape != value.shape or key.ndim != 3 or key.shape[1:] != (h, d):
        raise ValueError(f"key and value must be [N, {h}, {d}]; got {tuple(key.shape)} and {tuple(value.shape)}")
    if codec.pre_rope:
        if rope is None or positions is None:
            raise ValueError(f"kv_cache codec {codec.name!r} stores keys before RoPE: pass the layer's rope frame "
                             "and each token's position (or use the codec without 'b', e.g. "
                             f"{codec.name[:-1]!r})")
        if positions.dim() != 1 or positions.shape[0] != key.shape[0] or positions.is_floating_point():
            raise ValueError(f"positions must be an int [N={key.shape[0]}] tensor; got {positions.dtype} "
                             f"{tuple(positions.shape)}")
        if positions.numel() and int(positions.min()) < 0:
            raise ValueError(f"positions must be >= 0; got {int(positions.min())}")
    keep = slot_mapping >= 0
    if not bool(keep.all()):
        key, value, slot_mapping = key[keep], value[keep], slot_mapping[keep]
        if codec.pre_rope:
            positions = positions[keep.to(positions.device)]
    if slot_mapping.numel() == 0:
        return
    if codec.pre_rope:  # k = R(p)^T k' / f, [N, H, D] float32
        key = rope.remove(key.float().permute(1, 0, 2)[None], positions.long())[0].permute(1, 0, 2)
    slot = slot_mapping.long()
    total = cache.shape[0] * cache.shape[2]
    if int(slot.max()) >= total:
        raise ValueError(f"slot_mapping: slot {int(slot.max())} is outside the cache's {total} slots")
    if codec.rotated_values:  # values are stored in the rotated basis (both paths)
        value = torch.einsum("nhd,hde->nhe", value.float(), rotation)
    if kernels is not False:
        from ...kernels.paged import write_paged
        from .blocks import slot_layout  # blocks imports this module

        if write_paged(cache, key, value, slot, slot_layout(codec)):
            return
    bs = cache.shape[2]
    blk, off = slot // bs, slot % bs
    o = codec.offsets()
    # values (per token)
    if codec.value_layout == "token_int8":
        vbytes = _encode_token_int8(value)
    elif codec.value_layout == "rotated_lloyd_max":
        codes, ncode = _encode_lloyd_max(value, codec.value_bits)
        vbytes = torch.cat((_pack(codes, codec.value_bits), ncode), dim=-1)
    else:
        codes, meta = _encode_uniform_channel_groups(value, codec.value_bits)
        vbytes = torch.cat((_pack(codes, codec.value_bits), meta), dim=-1)
    cache[blk, :, off, o[2]:o[4]] = vbytes
    # keys
    if codec.key_layout == "token_int8":
        cache[blk, :, off, o[0]:o[2]] = _encode_token_int8(key)
    else:
        _write_channel_keys(cache, key, slot, codec)


def read_blocks(cache: torch.Tensor, blocks: torch.Tensor, codec: PagedCodec) -> tuple[torch.Tensor, torch.Tensor]:
    """Decode whole blocks.

    Parameters
    ----------
    cache : torch.Tensor, uint8, ``[num_blocks, H, block_size, slot_bytes]``
    blocks : torch.Tensor, int, any shape ``S``
        Block ids.

    Returns
    -------
    keys, values : torch.Tensor, float32, ``[*S, H, block_size, D]``
        Values in the rotated basis for rotated codecs (see :func:`value_rotations`).
    """
    raw = cache[blocks.long()]  # [*S, H, bs, C]
    d = codec.head_dim
    o = codec.offsets()
    if codec.key_layout == "token_int8":
        k = _decode_token_int8(raw[..., o[0]:o[1]], raw[..., o[1]:o[2]])
    else:
        k = _decode_channel_keys(raw[..., o[0]:o[1]], raw[..., o[1]:o[2]], codec.key_bits, d)
    vc, vm = raw[..., o[2]:o[3]], raw[..., o[3]:o[4]]
    if codec.value_layout == "token_int8":
        v = _decode_token_int8(vc, vm)
    elif codec.value_layout == "rotated_lloyd_max":
        v = _decode_lloyd_max(_unpack(vc, codec.value_bits, d), vm, codec.value_bits)
    else:
        v = _decode_uniform_channel_groups(_unpack(vc, codec.value_bits, d), vm)
    return k, v
