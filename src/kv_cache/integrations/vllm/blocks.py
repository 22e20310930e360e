"""Paged slots as the kernels' quantized blocks: codes read in place by the compiled CPU kernels
and, on CUDA, the Triton kernels (:func:`kv_cache.kernels.ops.attend_block`, math dictionary §15).

A few of a request's vLLM blocks are gathered by its block table (a copy of their packed bytes,
never decoded) into rows ``[R, T, slot_bytes]`` (``R`` = requests x kv heads). The fields of
each slot (math dictionary §28.1) then become :class:`~kv_cache.kernels.qblock.QBlock` views:

* per-channel key groups (§28.2): the codes, and per 32-token group the float16 scale ``s`` and
  minimum ``m`` that the group's 32 slots share; the kernels' form ``scale * (lut[c] - zero)``
  with ``lut = 0 .. 2^b - 1`` takes ``scale = s`` and ``zero = -m / s``. A group with ``s = 0``
  (a constant channel) has every code 0, so ``scale = 1``, ``zero = -m`` decodes it exactly;
* rotated Lloyd-Max values (§28.3): the codes with the Lloyd-Max levels as ``lut`` and the 8-bit
  log-coded norm as a ``uint8`` scale with its table (§18.8), one per token;
* q8: signed codes stored with a +128 offset, ``lut = -128 .. 127``, one float16 scale per token;
* KIVI values: per token and 32 channels, ``s`` and ``m`` as for the keys.

Only the metadata is converted (``[R, T / 32, D]`` float32 for the keys, per token for the
values); the codes go to the kernel as they lie in the slots. Nothing here imports vLLM.
"""

from __future__ import annotations

import torch

from ...kernels.qblock import QBlock, uniform_lut
from .codecs import KEY_GROUP, VALUE_CHANNEL_GROUP, PagedCodec, _levels, _log_norm_table


def _affine(s16: torch.Tensor, m16: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """float16 scale and minimum -> float32 ``(scale, zero)`` with ``scale * (c - zero) = m + c s``."""
    s, m = s16.float(), m16.float()
    scale = torch.where(s > 0, s, torch.ones_like(s))  # s = 0: every code is 0, the value is m
    return scale, -m / scale


def _token_int8(codes: torch.Tensor, meta: torch.Tensor, d: int) -> QBlock:
    scale = meta.contiguous().view(torch.float16)  # [R, T, 1]
    return QBlock(codes, 8, uniform_lut(8, True, codes.device), "token", scale, None, d)


def code_blocks(slots: torch.Tensor, codec: PagedCodec) -> tuple[QBlock, QBlock]:
    """Keys and values of gathered slots as quantized blocks.

    Parameters
    ----------
    slots : torch.Tensor, uint8, ``[R, T, codec.slot_bytes]``
        ``T`` a multiple of 32: whole blocks of one kv head per row, in token order.
    codec : PagedCodec

    Returns
    -------
    keys, values : QBlock
        ``[R, T, D]`` each; values in the rotated basis for rotated codecs.
    """
    if not isinstance(slots, torch.Tensor) or slots.dtype != torch.uint8 or slots.dim() != 3:
        raise ValueError(f"slots must be a uint8 [R, T, {codec.slot_bytes}] tensor; got "
                         f"{getattr(slots, 'dtype', type(slots).__name__)} {tuple(getattr(slots, 'shape', ()))}")
    r, t, c = slots.shape
    if c != codec.slot_bytes or t % KEY_GROUP:
        raise ValueError(f"slots must be [R, T, {codec.slot_bytes}] with T a multiple of {KEY_GROUP}; "
                         f"got {tuple(slots.shape)}")
    d = codec.head_dim
    o = codec.offsets()
    kc, km, vc, vm = (slots[..., o[i]:o[i + 1]] for i in range(4))
    dev = slots.device
    if codec.key_layout == "token_int8":
        keys = _token_int8(kc, km, d)
    else:  # per-channel groups: the group's 32 slots hold float16 [2, D] (scales, then minima)
        meta = km.contiguous().view(r, t // KEY_GROUP, KEY_GROUP * km.shape[-1]).view(torch.float16)
        scale, zero = _affine(meta[..., :d], meta[..., d:])
        keys = QBlock(kc, codec.key_bits, uniform_lut(codec.key_bits, False, dev), "channel", scale, zero,
                      KEY_GROUP)
    if codec.value_layout == "token_int8":
        values = _token_int8(vc, vm, d)
    elif codec.value_layout == "rotated_lloyd_max":
        levels, _ = _levels(codec.value_bits)
        values = QBlock(vc, codec.value_bits, levels.to(dev).contiguous(), "token", vm.contiguous(), None, d,
                        scale_table=_log_norm_table().to(dev))
    else:  # KIVI: per token, float16 scales then minima of each 32-channel group
        n = d // VALUE_CHANNEL_GROUP
        meta = vm.contiguous().view(torch.float16)  # [R, T, 2n]
        scale, zero = _affine(meta[..., :n], meta[..., n:])
        values = QBlock(vc, codec.value_bits, uniform_lut(codec.value_bits, False, dev), "token", scale, zero,
                        VALUE_CHANNEL_GROUP)
    return keys, values


__all__ = ["code_blocks"]
