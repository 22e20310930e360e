"""Bit packing along the last dim (``D`` codes -> ``D * bits / 8`` bytes; ``D`` a multiple of 8)."""

from __future__ import annotations

from functools import lru_cache

import torch

from ....compression.packing import pack_bits, unpack_bits


def pack(codes: torch.Tensor, bits: int) -> torch.Tensor:
    """``[..., D]`` uint8 codes -> ``[..., D * bits // 8]`` uint8 bytes."""
    if bits == 8:
        return codes
    d = codes.shape[-1]
    return pack_bits(codes.contiguous(), bits).view(*codes.shape[:-1], d * bits // 8)


def unpack(packed: torch.Tensor, bits: int, d: int) -> torch.Tensor:
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
