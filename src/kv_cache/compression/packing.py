"""Dense bit packing of unsigned integer codes into ``uint8`` storage.

``b``-bit codes are laid out little-endian in "words" of ``lcm(8, b)`` bits: 4 codes per byte
at 2 bits, 2 per byte at 4 bits, 8 codes per 3 bytes at 3 bits, 1 per byte at 8 bits.
Storage for ``n`` codes is ``ceil(n / k) * w`` bytes with ``k = lcm(8, b) / b`` codes per word
of ``w = lcm(8, b) / 8`` bytes, i.e. ``n * b / 8`` bytes up to the last partial word
(see ``math_dictionary/kv-compression-math.md`` section "Packed storage").
"""

from __future__ import annotations

import math
import sys

import torch

from ._arrays import check_int

SUPPORTED_BITS = (2, 3, 4, 8)


def _layout(bits: int) -> tuple[int, int]:
    """Return ``(codes_per_word, bytes_per_word)`` for ``bits``."""
    if isinstance(bits, bool) or bits not in SUPPORTED_BITS:
        raise ValueError(f"bits must be one of {list(SUPPORTED_BITS)}; got {bits!r}")
    word_bits = math.lcm(8, bits)
    return word_bits // bits, word_bits // 8


def packed_nbytes(num_codes: int, bits: int) -> int:
    """Bytes that :func:`pack_bits` uses for ``num_codes`` codes of ``bits`` bits."""
    k, w = _layout(bits)
    num_codes = check_int(num_codes, "num_codes", minimum=0)
    return -(-num_codes // k) * w


_WORD_DTYPE = {1: torch.uint8, 2: torch.int16, 4: torch.int32, 8: torch.int64}


def _fold_plan(bits: int) -> list[tuple[int, int]]:
    """Shift/mask steps that squeeze ``k`` byte-aligned codes into ``k * bits`` contiguous bits.

    Level ``j`` merges neighbouring units of ``bits * 2**j`` bits that sit ``8 * 2**j`` bits
    apart: ``u = (u | (u >> (8 * 2**j - bits * 2**j))) & mask_j``.
    """
    k, _ = _layout(bits)
    plan = []
    word_bits = 8 * k
    stride, width = 8, bits
    while stride < word_bits:
        mask = 0
        unit = (1 << (2 * width)) - 1
        for pos in range(0, word_bits, 2 * stride):
            mask |= unit << pos
        plan.append((stride - width, mask))
        stride, width = 2 * stride, 2 * width
    return plan


if sys.byteorder != "little":  # pragma: no cover - every supported CPU/GPU is little-endian
    raise ImportError("kv_cache.compression.packing assumes a little-endian machine")


def pack_bits(codes: torch.Tensor, bits: int) -> torch.Tensor:
    """Pack unsigned codes densely into bytes.

    The ``k`` codes of one word are first viewed as one ``k``-byte integer (one code per byte),
    then squeezed by :func:`_fold_plan`'s shifts and masks: a handful of whole-buffer integer
    ops, no per-code Python loop.

    Parameters
    ----------
    codes : torch.Tensor
        Integer tensor of any shape with values in ``[0, 2**bits - 1]``; it is flattened in
        C order. Values outside the range corrupt their neighbours (not checked, for speed).
    bits : int
        One of 2, 3, 4, 8.

    Returns
    -------
    torch.Tensor
        ``uint8`` tensor of shape ``[packed_nbytes(codes.numel(), bits)]`` on ``codes.device``.

    Raises
    ------
    ValueError
        Unsupported ``bits``.
    TypeError
        Non-integer ``codes``.
    """
    k, w = _layout(bits)
    if codes.dtype.is_floating_point or codes.dtype.is_complex or codes.dtype == torch.bool:
        raise TypeError(f"codes must have an integer dtype; got {codes.dtype}")
    flat = codes.reshape(-1).to(torch.uint8)
    if bits == 8:
        return flat if flat is not codes else flat.clone()
    pad = (-flat.numel()) % k
    if pad:
        flat = torch.cat([flat, flat.new_zeros(pad)])
    flat = flat.contiguous()
    if flat.untyped_storage().data_ptr() == codes.untyped_storage().data_ptr():
        flat = flat.clone()  # the folds below work in place; never touch the caller's codes
    u = flat.view(_WORD_DTYPE[k])
    for shift, mask in _fold_plan(bits):
        u |= u >> shift  # in place: large temporaries cost page faults on CPU
        u &= mask
    if w == 1:
        return u.to(torch.uint8)
    out = torch.empty((u.shape[0], w), dtype=torch.uint8, device=codes.device)
    for j in range(w):
        out[:, j] = (u >> (8 * j)) & 0xFF
    return out.reshape(-1)


def unpack_bits(packed: torch.Tensor, bits: int, num_codes: int) -> torch.Tensor:
    """Inverse of :func:`pack_bits` (the fold steps run backwards with left shifts).

    Parameters
    ----------
    packed : torch.Tensor
        ``uint8`` tensor produced by :func:`pack_bits`.
    bits : int
        One of 2, 3, 4, 8.
    num_codes : int
        Number of codes that were packed (the padding of the last word is dropped).

    Returns
    -------
    torch.Tensor
        ``uint8`` tensor of shape ``[num_codes]`` with values in ``[0, 2**bits - 1]``.

    Raises
    ------
    ValueError
        Unsupported ``bits`` or a ``packed`` size that does not match ``num_codes``.
    TypeError
        ``packed`` is not ``uint8``.
    """
    k, w = _layout(bits)
    num_codes = check_int(num_codes, "num_codes", minimum=0)
    if packed.dtype != torch.uint8:
        raise TypeError(f"packed must be uint8; got {packed.dtype}")
    expected = packed_nbytes(num_codes, bits)
    if packed.numel() != expected:
        raise ValueError(
            f"packed holds {packed.numel()} bytes but {num_codes} codes of {bits} bits "
            f"need {expected}"
        )
    flat = packed.reshape(-1)
    if bits == 8:
        return flat.clone()
    wd = _WORD_DTYPE[k]
    if w == 1:
        u = flat.to(wd)
    else:
        b = flat.view(-1, w).to(wd)
        u = b[:, 0] | (b[:, 1] << 8) | (b[:, 2] << 16)
    plan = _fold_plan(bits)
    code_mask = 0
    for pos in range(0, 8 * k, 8):
        code_mask |= ((1 << bits) - 1) << pos
    # Undo level j: split units of 2w bits back into units of w bits, whose mask is the
    # forward mask of level j - 1 (or the per-byte code mask at level 0).
    for j in reversed(range(len(plan))):
        mask = code_mask if j == 0 else plan[j - 1][1]
        u |= u << plan[j][0]
        u &= mask
    return u.contiguous().view(torch.uint8)[:num_codes]
