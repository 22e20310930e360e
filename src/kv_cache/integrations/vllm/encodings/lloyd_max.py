"""Rotated Lloyd-Max values with one 8-bit log-coded norm (math dictionary §18, §18.8): the
values of the ``*d`` codecs, stored in the rotated basis (:func:`..codecs.value_rotations`)."""

from __future__ import annotations

from functools import lru_cache

import torch

from ....compression.codebook import LOG_SCALE_MIN_EXP, LOG_SCALE_STEP, lloyd_max_gaussian, log_scale_range


@lru_cache(maxsize=8)
def value_levels(bits: int) -> tuple[torch.Tensor, torch.Tensor]:
    """The ``2**bits`` Lloyd-Max levels of a unit Gaussian (float32) and the midpoints between them."""
    levels = lloyd_max_gaussian(bits).float()
    return levels, (levels[:-1] + levels[1:]) * 0.5


@lru_cache(maxsize=1)
def log_norm_table() -> torch.Tensor:
    """The norm of each 8-bit log code, float32 ``[256]`` (code 0: norm 0)."""
    c = torch.arange(256, dtype=torch.float64)
    table = torch.pow(2.0, LOG_SCALE_MIN_EXP + (c - 1) * LOG_SCALE_STEP)
    table[0] = 0.0
    return table.float()


def encode_log_norm(rms: torch.Tensor) -> torch.Tensor:
    """RMS norms ``>= 0`` -> 8-bit log codes (§18.8); norms past the largest code are clamped to it."""
    lo, hi = log_scale_range()
    r = rms.double().clamp(max=hi)
    code = torch.round((torch.log2(r.clamp_min(lo)) - LOG_SCALE_MIN_EXP) / LOG_SCALE_STEP) + 1
    return torch.where(r > 0, code.clamp(1, 255), torch.zeros_like(code)).to(torch.uint8)


def encode(x_rot: torch.Tensor, bits: int) -> tuple[torch.Tensor, torch.Tensor]:
    """``[..., D]`` rotated float -> (codes ``[..., D]`` uint8, norm code ``[..., 1]`` uint8)."""
    xf = x_rot.float()
    rms = xf.square().mean(dim=-1, keepdim=True).sqrt()
    ncode = encode_log_norm(rms)
    s = log_norm_table().to(x_rot.device)[ncode.long()]
    v = torch.where(s > 0, xf / torch.where(s > 0, s, torch.ones_like(s)), torch.zeros_like(xf))
    _, mids = value_levels(bits)
    codes = torch.bucketize(v, mids.to(x_rot.device)).to(torch.uint8)
    return codes, ncode


def decode(codes: torch.Tensor, ncode: torch.Tensor, bits: int) -> torch.Tensor:
    """Codes ``[..., D]`` and norm codes ``[..., 1]`` -> rotated values ``[..., D]`` float32."""
    levels, _ = value_levels(bits)
    s = log_norm_table().to(codes.device)[ncode.long()]
    return levels.to(codes.device)[codes.long()] * s
