"""Uniform asymmetric groups: the grid ``mn + c * s`` with fp16 scale and minimum
(:func:`uniform`, shared with :mod:`.channel_keys`), and KIVI's per-token values in groups of
:data:`VALUE_CHANNEL_GROUP` channels (``q4``)."""

from __future__ import annotations

import torch

VALUE_CHANNEL_GROUP = 32
"""Channels per scale of KIVI's per-token values."""


def uniform(x: torch.Tensor, mn: torch.Tensor, mx: torch.Tensor, bits: int):
    """Codes of ``x`` on the grid ``mn + c * s`` (``s = (mx - mn) / (2**bits - 1)``, both stored fp16)."""
    top = (1 << bits) - 1
    s16 = ((mx - mn) / top).half()
    m16 = mn.half()
    sf, mf = s16.float(), m16.float()
    q = torch.where(sf > 0, torch.round((x - mf) / torch.where(sf > 0, sf, torch.ones_like(sf))), torch.zeros_like(x))
    return q.clamp(0, top).to(torch.uint8), s16, m16


def encode_channel_groups(x: torch.Tensor, bits: int) -> tuple[torch.Tensor, torch.Tensor]:
    """``[..., D]`` -> (codes ``[..., D]``, meta ``[..., 4 * D / 32]`` uint8: fp16 scales then minima)."""
    d = x.shape[-1]
    xg = x.float().view(*x.shape[:-1], d // VALUE_CHANNEL_GROUP, VALUE_CHANNEL_GROUP)
    mn = xg.amin(dim=-1, keepdim=True)
    mx = xg.amax(dim=-1, keepdim=True)
    codes, s16, m16 = uniform(xg, mn, mx, bits)
    meta = torch.cat((s16.squeeze(-1), m16.squeeze(-1)), dim=-1)  # [..., 2 D / 32]
    return codes.view(*x.shape), meta.contiguous().view(torch.uint8)


def decode_channel_groups(codes: torch.Tensor, meta: torch.Tensor) -> torch.Tensor:
    """Codes ``[..., D]`` and meta ``[..., 4 * D / 32]`` -> values ``[..., D]`` float32."""
    d = codes.shape[-1]
    n = d // VALUE_CHANNEL_GROUP
    m = meta.contiguous().view(torch.float16).float()  # [..., 2 n]
    s, mn = m[..., :n, None], m[..., n:, None]
    cg = codes.float().view(*codes.shape[:-1], n, VALUE_CHANNEL_GROUP)
    return (mn + cg * s).view(*codes.shape)
