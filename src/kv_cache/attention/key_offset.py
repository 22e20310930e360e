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


SCALE_FLOOR = 0.01
"""A channel's scale (``scale=True``) is at least this fraction of the row's mean channel scale:
a constant channel (scale 0 after centering) is divided by a finite number."""


def key_offset(keys: torch.Tensor, skip: int = 0, scale: bool | str = False) -> torch.Tensor:
    """The per-channel mean of ``keys`` ``[b, h, n, d]`` over tokens ``skip..n-1``, float32 ``[b, h, 1, d]``;
    with ``scale`` also the per-channel RMS of ``keys - mean`` over the same tokens (floored at
    :data:`SCALE_FLOOR` of the row's mean), as ``[b, h, 2, d]``: row 0 the mean, row 1 the scale
    (keys stored before RoPE are held as ``(k - mu) / sigma``, math dictionary §29.7); with
    ``scale="sqrt"`` row 1 is ``sqrt(sigma)`` (half-whitening, §29.7: the scale that minimizes
    the logit error of a per-token code for queries of equal energy in every channel).

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
    if not scale:
        return mu
    sigma = (body.float() - mu).square().mean(dim=2, keepdim=True).sqrt()
    floor = SCALE_FLOOR * sigma.mean(dim=-1, keepdim=True)
    sigma = torch.maximum(sigma, floor).clamp_min(torch.finfo(torch.float32).tiny)
    if scale == "sqrt":
        sigma = sigma.sqrt()
    elif scale is not True:
        raise ValueError(f"scale must be False, True or 'sqrt'; got {scale!r}")
    return torch.cat([mu, sigma], dim=2)


def shift_keys(keys: torch.Tensor, offset: torch.Tensor | None) -> torch.Tensor:
    """``keys - offset`` in the keys' dtype (``offset`` None: ``keys`` unchanged); an offset with a
    scale row (``[b, h, 2, d]``): ``(keys - mean) / scale``."""
    if offset is None:
        return keys
    if offset.shape[2] == 2:
        return ((keys.float() - offset[:, :, :1]) / offset[:, :, 1:]).to(keys.dtype)
    return keys - offset.to(keys.dtype)


def unshift_keys(keys: torch.Tensor, offset: torch.Tensor | None) -> torch.Tensor:
    """``keys + offset`` in the keys' dtype: the keys the model computed (``offset`` None: unchanged);
    an offset with a scale row: ``keys * scale + mean``."""
    if offset is None:
        return keys
    if offset.shape[2] == 2:
        return (keys.float() * offset[:, :, 1:] + offset[:, :, :1]).to(keys.dtype)
    return keys + offset.to(keys.dtype)


def lse_shift(q: torch.Tensor, offset: torch.Tensor, scaling: float) -> torch.Tensor:
    """``scaling * q . mu`` ``[B, Hkv, M]`` float32 for grouped queries ``q`` ``[B, Hkv, M, d]`` and
    ``offset`` ``[B, Hkv, 1, d]``: what every logit over shifted keys lacks."""
    return (q.float() @ offset[:, :, :1].float().transpose(-1, -2)).squeeze(-1) * scaling
