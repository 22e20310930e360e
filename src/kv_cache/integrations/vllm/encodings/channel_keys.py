"""Per-channel keys in groups of :data:`KEY_GROUP` consecutive slots of one block: a group's
per-channel scale and minimum are spread over its slots, and every write re-encodes the groups it
touches (the module docstring of :mod:`..codecs` says why and what it costs)."""

from __future__ import annotations

import math
from typing import TYPE_CHECKING

import torch

from .bits import pack, unpack
from .uniform import uniform

if TYPE_CHECKING:
    from ..codecs import PagedCodec

KEY_GROUP = 32
"""Tokens per per-channel key group (one group never spans two blocks)."""


def decode(codes: torch.Tensor, meta: torch.Tensor, bits: int, d: int) -> torch.Tensor:
    """Keys of whole groups: codes ``[..., 32 * g, Kc]``, meta ``[..., 32 * g, D/8]`` -> ``[..., 32 * g, D]``.

    The metadata of a group is the concatenation of its 32 slots' shares: ``4 D`` bytes, read as
    float16 ``[2, D]`` (scales, then minima).
    """
    lead, t = codes.shape[:-2], codes.shape[-2]
    g = t // KEY_GROUP
    m = meta.contiguous().view(*lead, g, KEY_GROUP * meta.shape[-1]).view(torch.float16).float()  # [..., g, 2D]
    s, mn = m[..., None, :d], m[..., None, d:]  # [..., g, 1, D]
    c = unpack(codes, bits, d).float().view(*lead, g, KEY_GROUP, d)
    return (mn + c * s).view(*lead, t, d)


def write(cache: torch.Tensor, key: torch.Tensor, slot_mapping: torch.Tensor, codec: PagedCodec) -> None:
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
    old = decode(stored[..., kc0:km0], stored[..., km0:kc1], bits, d)  # [U, H, 32, D]
    ar = torch.arange(KEY_GROUP, device=slot.device)
    valid = ar[None, :] < first[:, None]  # [U, 32]
    vals = torch.where(valid[:, None, :, None], old, torch.zeros_like(old))
    vals[inv, :, within] = key.float()
    valid[inv, within] = True
    vmask = valid[:, None, :, None]
    mn = torch.where(vmask, vals, torch.full_like(vals, math.inf)).amin(dim=2, keepdim=True)  # [U, H, 1, D]
    mx = torch.where(vmask, vals, torch.full_like(vals, -math.inf)).amax(dim=2, keepdim=True)
    codes, s16, m16 = uniform(vals, mn, mx, bits)
    meta = torch.cat((s16, m16), dim=-1).contiguous().view(torch.uint8)  # [U, H, 1, 4D]
    meta = meta.view(uniq.numel(), h, KEY_GROUP, codec.key_meta_bytes)
    cache5[ublk, :, ug, :, kc0:kc1] = torch.cat((pack(codes, bits), meta), dim=-1)
