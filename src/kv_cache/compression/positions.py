"""Which arrivals each head keeps: the positions of a layer storing keys before RoPE (math
dictionary §29.6), as a bitmap of one bit per token seen and KV head.

A layer storing keys before RoPE rotates every stored key back by its own position at read time.
Until the first eviction the ``n`` stored slots of every head are the last ``n`` arrivals and
nothing is held for them. After it, the layer holds ``kept`` ``[batch, kv_heads, ceil(A / 8)]``
uint8: bit ``p`` of row ``(b, h)`` is set iff that head still holds the token that arrived ``p``-th
(``A`` arrivals so far). A head's slots hold its kept arrivals in order, so slot ``j`` of the row
is its ``j``-th set bit; heads holding different numbers of tokens (shared budgets) are read
right-aligned, as the ragged layouts show them. One bit per token seen (``1 / (2 d)`` bits per
element, 0.008 at ``d = 64``) is less than an int32 index per kept token as soon as more than
one token in 32 is kept.

Pure functions over ``[batch, kv_heads, ...]`` tensors.
"""

from __future__ import annotations

import torch

_WEIGHTS = torch.tensor([1, 2, 4, 8, 16, 32, 64, 128], dtype=torch.uint8)


def pack_mask(mask: torch.Tensor) -> torch.Tensor:
    """bool ``[..., A]`` -> uint8 ``[..., ceil(A / 8)]``, bit ``p % 8`` of byte ``p // 8`` (LSB first)."""
    if mask.dtype != torch.bool:
        raise TypeError(f"mask must be bool; got {mask.dtype}")
    A = mask.shape[-1]
    pad = (-A) % 8
    m = torch.nn.functional.pad(mask.to(torch.uint8), (0, pad)).reshape(*mask.shape[:-1], -1, 8)
    return (m * _WEIGHTS.to(m.device)).sum(-1, dtype=torch.uint8)


def unpack_mask(packed: torch.Tensor, arrivals: int) -> torch.Tensor:
    """uint8 ``[..., ceil(A / 8)]`` -> bool ``[..., A]`` (``A = arrivals``), the inverse of :func:`pack_mask`."""
    if packed.dtype != torch.uint8:
        raise TypeError(f"packed must be uint8; got {packed.dtype}")
    if packed.shape[-1] * 8 < arrivals:
        raise ValueError(f"{packed.shape[-1]} bytes hold {packed.shape[-1] * 8} bits; {arrivals} arrivals asked")
    bits = (packed.unsqueeze(-1) & _WEIGHTS.to(packed.device)) != 0
    return bits.reshape(*packed.shape[:-1], -1)[..., :arrivals]


def slot_positions(mask: torch.Tensor, length: int) -> torch.Tensor:
    """bool ``[B, H, A]`` (the arrivals each row keeps) -> int64 ``[B, H, length]``: row ``r``'s
    kept arrivals in order, right-aligned (its first ``length - count_r`` slots, virtual padding of
    a ragged layout, read 0)."""
    B, H, A = mask.shape
    counts = mask.sum(-1)  # [B, H]
    if counts.numel() and int(counts.max()) > length:
        raise ValueError(f"a row keeps {int(counts.max())} arrivals, more than its {length} slots")
    arange = torch.arange(A, device=mask.device).expand(B, H, A)
    # rank of each kept arrival among its row's kept ones, shifted so every row ends at slot length - 1
    rank = mask.cumsum(-1) - 1 + (length - counts).unsqueeze(-1)
    out = torch.zeros(B, H, length, dtype=torch.int64, device=mask.device)
    b, h, p = mask.nonzero(as_tuple=True)
    out[b, h, rank[b, h, p]] = arange[b, h, p]
    return out


def kept_mask(positions: torch.Tensor, keep: torch.Tensor, arrivals: int) -> torch.Tensor:
    """The arrivals still held after keeping slots ``keep`` of rows whose slots hold ``positions``.

    ``positions`` int ``[B, H, T]`` (:func:`slot_positions`, or the implicit last arrivals
    expanded); ``keep`` either int64 ``[B, H, K]`` slot indices (every row keeps ``K``) or bool
    ``[B, H, T]`` slot masks (rows keep different numbers). Returns bool ``[B, H, arrivals]``.
    """
    B, H = positions.shape[:2]
    out = torch.zeros(B, H, arrivals, dtype=torch.bool, device=positions.device)
    if keep.dtype == torch.bool:
        b, h, t = keep.nonzero(as_tuple=True)
        out[b, h, positions[b, h, t].long()] = True
        return out
    out.scatter_(2, positions.long().gather(2, keep.to(positions.device)), True)
    return out


_ARANGE: dict[str, torch.Tensor] = {}


def arange_i32(n: int, device) -> torch.Tensor:
    """``arange(n)`` as int32 ``[n]``: a leading view of one buffer per device, grown by doubling
    (a constant of the code, like a table of levels: a decoding step slices the positions of its
    slots out of it instead of building ``n`` of them)."""
    key = str(torch.device(device))
    buf = _ARANGE.get(key)
    if buf is None or buf.numel() < n:
        buf = torch.arange(max(n, 2 * (0 if buf is None else buf.numel()), 1024), dtype=torch.int32, device=device)
        _ARANGE[key] = buf
    return buf[:n]


__all__ = ["arange_i32", "kept_mask", "pack_mask", "slot_positions", "unpack_mask"]
