"""Per-token symmetric int8 (``q8``): codes ``round(x / s) + 128`` and one fp16 scale ``s``."""

from __future__ import annotations

import torch


def encode(x: torch.Tensor) -> torch.Tensor:
    """``[..., D]`` float -> ``[..., D + 2]`` uint8: codes ``round(x / s) + 128`` and fp16 ``s``."""
    xf = x.float()
    s = (xf.abs().amax(dim=-1, keepdim=True) / 127.0).half()
    sf = s.float()
    q = torch.where(sf > 0, torch.round(xf / torch.where(sf > 0, sf, torch.ones_like(sf))), torch.zeros_like(xf))
    codes = (q.clamp(-127, 127) + 128).to(torch.uint8)
    return torch.cat((codes, s.view(torch.uint8)), dim=-1)


def decode(codes: torch.Tensor, scale_bytes: torch.Tensor) -> torch.Tensor:
    """``[..., D]`` uint8 codes and ``[..., 2]`` uint8 (fp16 scale) -> ``[..., D]`` float32."""
    s = scale_bytes.contiguous().view(torch.float16).float()
    return (codes.float() - 128.0) * s
