"""Host-side helpers of the Triton kernels: a :class:`QBlock` as kernel arguments, and its group check."""

from __future__ import annotations

import torch

from .._checks import bad_group_error
from ..qblock import QBlock


def pow2(n: int) -> int:
    """The smallest power of two ``>= n`` (1 for ``n <= 1``)."""
    return 1 << max(0, (int(n) - 1).bit_length())


def _rows(t: torch.Tensor) -> torch.Tensor:
    """``t`` (``[R, n, w]`` or ``[R, n]``) with its last dim contiguous (any row and token strides)."""
    return t if t.shape[-1] <= 1 or t.stride(-1) == 1 else t.contiguous()


def _strides(t: torch.Tensor) -> tuple[int, int]:
    return t.stride(0), t.stride(1)


def block_args(b: QBlock) -> tuple[tuple, dict]:
    """``(tensors and strides, constexpr flags)`` of ``b`` in the order of ``_tiles.dequant_tile``.

    Absent tensors (zero, gid, scale table) are replaced by the codes (never read: their flag is off)."""
    codes = _rows(b.codes)
    scale = _rows(b.scale)
    zero = codes if b.zero is None else _rows(b.zero)
    gid = codes if b.gid is None else _rows(b.gid)
    table = b.lut if b.scale_table is None else b.scale_table.contiguous()
    tensors = (codes, *_strides(codes), b.lut.contiguous(), scale, *_strides(scale), zero, *_strides(zero),
               gid, *_strides(gid), table, b.group_size)
    flags = dict(BITS=b.bits, TOKEN=b.grouping == "token", ZERO=b.zero is not None, GID=b.gid is not None,
                 CODED=b.scale_table is not None)
    return tensors, flags


_CHECKED = "_kv_cache_groups_checked"


def check_groups(b: QBlock) -> None:
    """Raise the ops' ``ValueError`` when a group index of ``b`` (``gid``) lies outside its scale table.

    The kernels read the scale row a token's ``gid`` names, so the indices are checked here, on
    the host, before any kernel reads them: a ``gid`` costs one synchronisation (its min and max)
    the first time a block is used, and none afterwards (recorded on the block with the tensor's
    version counter; a decoding step reuses the block until the next flush). Without ``gid`` the
    group ``t // group_size`` is in range by :class:`QBlock`'s own shape check.
    """
    gid = b.gid
    if gid is None or gid.numel() == 0:
        return
    if getattr(b, _CHECKED, None) == (gid._version, gid.data_ptr()):
        return
    lo, hi = torch.aminmax(gid)
    lo, hi = torch.stack([lo, hi]).tolist()
    if lo < 0 or hi >= b.scale.shape[1]:
        raise bad_group_error()
    object.__setattr__(b, _CHECKED, (gid._version, gid.data_ptr()))  # a cache, not a field (frozen dataclass)
