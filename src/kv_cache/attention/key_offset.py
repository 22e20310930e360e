"""The per-channel key offset of a layer (math dictionary §25): pure helpers.

Some models put a large offset on a few key channels, the same for every token: Qwen2's
learned key bias is the known case. A per-token layout (a rotation, then one norm per key
vector) then spends its whole range on the offset, and the part of each key that differs
between tokens, the only part softmax sees, drowns in the rounding.

Softmax is invariant to a logit shift that is the same for every key a query sees:
``q . (k_t - mu) = q . k_t - q . mu``. So a layer stores every key as ``k_t - mu``, with one
``mu`` per batch row and KV head taken from the prompt's own keys at prefill (no calibration,
no file), and attention is unchanged. Two readers are not shift-invariant and add the shift
back: logit soft-capping (the keys are read densely, ``mu`` is added to them) and learned
attention sinks (a per-head logit outside the keys: the log-sum-exp is corrected by
``scaling * q . mu``, :func:`lse_shift`).
"""

from __future__ import annotations

import torch


def key_offset(keys: torch.Tensor, skip: int = 0) -> torch.Tensor:
    """The per-channel mean of ``keys`` ``[b, h, n, d]`` over tokens ``skip..n-1``, float32 ``[b, h, 1, d]``.

    ``skip``: the leading tokens left out of the mean (the attention-sink tokens, whose keys
    are unlike the rest; they are stored in full precision anyway). When the call holds no
    more than ``skip`` tokens, every token is used. NaN or Inf keys raise (a key offset of
    NaN would silently turn every stored key into NaN).

    Raises
    ------
    ValueError
        ``keys`` not 4-D, empty, or not finite.
    """
    if keys.dim() != 4:
        raise ValueError(f"keys must be [batch, kv_heads, tokens, head_dim]; got shape {tuple(keys.shape)}")
    if keys.shape[2] == 0:
        raise ValueError("the key offset needs at least one token; got 0")
    body = keys[:, :, skip:] if keys.shape[2] > skip else keys
    mu = body.float().mean(dim=2, keepdim=True)
    if not bool(torch.isfinite(mu).all()):
        raise ValueError("the keys hold NaN or Inf: the per-channel key offset cannot be taken from them")
    return mu


def shift_keys(keys: torch.Tensor, offset: torch.Tensor | None) -> torch.Tensor:
    """``keys - offset`` in the keys' dtype (``offset`` None: ``keys`` unchanged)."""
    return keys if offset is None else keys - offset.to(keys.dtype)


def unshift_keys(keys: torch.Tensor, offset: torch.Tensor | None) -> torch.Tensor:
    """``keys + offset`` in the keys' dtype: the keys the model computed (``offset`` None: unchanged)."""
    return keys if offset is None else keys + offset.to(keys.dtype)


def lse_shift(q: torch.Tensor, offset: torch.Tensor, scaling: float) -> torch.Tensor:
    """``scaling * q . mu`` ``[B, Hkv, M]`` float32 for grouped queries ``q`` ``[B, Hkv, M, d]`` and
    ``offset`` ``[B, Hkv, 1, d]``: what every logit over shifted keys lacks."""
    return (q.float() @ offset.float().transpose(-1, -2)).squeeze(-1) * scaling
