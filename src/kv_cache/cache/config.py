"""Quantized-storage settings of :class:`kv_cache.CompressedCache`."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import torch

from ..compression.packing import SUPPORTED_BITS


@dataclass(frozen=True)
class QuantConfig:
    """How cached tokens are stored (KIVI layout by default).

    Parameters
    ----------
    bits : {2, 3, 4, 8}
    group_size : int, default 32
        Keys: tokens per group of a per-channel scale (and the flush block: the residual is
        quantized ``group_size`` tokens at a time). Values: channels per group of a per-token
        scale; must divide ``head_dim``.
    residual_length : int, default 32
        Full-precision residual: when it reaches ``max(residual_length, group_size)`` tokens,
        all its whole groups are quantized (KIVI), so between 0 and
        ``max(residual_length, group_size) - 1`` of the most recent tokens are full precision.
    sink_tokens : int, default 0
        The first tokens of every sequence kept in full precision, never quantized.
    symmetric : bool, default False
    scale_dtype : torch.dtype, default torch.float16
        Storage dtype of scales (zero points are int16).
    """

    bits: int = 4
    group_size: int = 32
    residual_length: int = 32
    sink_tokens: int = 0
    symmetric: bool = False
    scale_dtype: Any = torch.float16

    def __post_init__(self) -> None:
        if isinstance(self.bits, bool) or self.bits not in SUPPORTED_BITS:
            raise ValueError(f"QuantConfig.bits must be one of {list(SUPPORTED_BITS)}; got {self.bits!r}")
        for name in ("group_size", "residual_length", "sink_tokens"):
            v = getattr(self, name)
            low = 1 if name == "group_size" else 0
            if isinstance(v, bool) or not isinstance(v, int) or v < low:
                raise ValueError(f"QuantConfig.{name} must be an int >= {low}; got {v!r}")
        if self.scale_dtype not in (torch.float16, torch.bfloat16, torch.float32):
            raise ValueError(
                "QuantConfig.scale_dtype must be one of torch.float16, torch.bfloat16, torch.float32; "
                f"got {self.scale_dtype!r}"
            )

    def check_head_dim(self, head_dim: int) -> None:
        """Raise if values' channel groups or the token-major packing cannot tile ``head_dim``."""
        if head_dim % self.group_size and self.group_size < head_dim:
            raise ValueError(
                f"QuantConfig.group_size ({self.group_size}) must divide head_dim ({head_dim}) "
                "for per-token value groups (or be >= head_dim)"
            )
        if (head_dim * self.bits) % 8:
            raise ValueError(
                f"head_dim * bits must be a multiple of 8 so each token's codes fill whole bytes; "
                f"got head_dim={head_dim}, bits={self.bits}"
            )
