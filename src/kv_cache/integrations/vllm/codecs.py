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

The encodings a slot is made of: :mod:`.encodings` (one file each). Nothing here imports vLLM.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from ...compression.rotation import RandomizedHadamard
from .encodings import channel_keys, lloyd_max, token_int8, uniform
from .encodings.bits import pack, unpack
from .encodings.channel_keys import KEY_GROUP
from .encodings.lloyd_max import log_norm_table, value_levels
from .encodings.uniform import VALUE_CHANNEL_GROUP

_levels, _log_norm_table = value_levels, log_norm_table  # the old private names

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
        vbytes = token_int8.encode(value)
    elif codec.value_layout == "rotated_lloyd_max":
        codes, ncode = lloyd_max.encode(value, codec.value_bits)
        vbytes = torch.cat((pack(codes, codec.value_bits), ncode), dim=-1)
    else:
        codes, meta = uniform.encode_channel_groups(value, codec.value_bits)
        vbytes = torch.cat((pack(codes, codec.value_bits), meta), dim=-1)
    cache[blk, :, off, o[2]:o[4]] = vbytes
    # keys
    if codec.key_layout == "token_int8":
        cache[blk, :, off, o[0]:o[2]] = token_int8.encode(key)
    else:
        channel_keys.write(cache, key, slot, codec)


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
        k = token_int8.decode(raw[..., o[0]:o[1]], raw[..., o[1]:o[2]])
    else:
        k = channel_keys.decode(raw[..., o[0]:o[1]], raw[..., o[1]:o[2]], codec.key_bits, d)
    vc, vm = raw[..., o[2]:o[3]], raw[..., o[3]:o[4]]
    if codec.value_layout == "token_int8":
        v = token_int8.decode(vc, vm)
    elif codec.value_layout == "rotated_lloyd_max":
        v = lloyd_max.decode(unpack(vc, codec.value_bits, d), vm, codec.value_bits)
    else:
        v = uniform.decode_channel_groups(unpack(vc, codec.value_bits, d), vm)
    return k, v
