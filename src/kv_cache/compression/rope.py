"""Rotary position embedding, applied and removed (math dictionary §29): the pure functions under
keys stored before RoPE.

A RoPE model rotates each key's channel pairs by angles proportional to its position,
``k' = s * R(p) k`` (``s`` the rope type's attention scaling, 1 for plain RoPE), and hands the
cache ``k'`` with the ``cos = s cos(p w)``, ``sin = s sin(p w)`` it used. Because ``R(p)`` is a
rotation, ``k`` comes back exactly: ``k = R(p)^T k' / s^2``. Before RoPE a channel's offset (a
Qwen2 key bias included) is a constant; after it, channel pairs turn with position and
per-channel statistics smear. Storing ``k`` and rotating at read time keeps the statistics still.

Two pair layouts exist in transformers:

* ``"half"`` (Llama, Qwen2, Gemma, Mistral, GPT-NeoX, ...): channel ``i`` pairs with
  ``i + r/2`` over the first ``r`` channels (``rotate_half``); ``cos``/``sin`` repeat their
  ``r/2`` frequencies twice, ``[f0..f_{r/2-1}, f0..f_{r/2-1}]``.
* ``"interleaved"`` (GPT-J, Cohere, GLM): channel ``2i`` pairs with ``2i + 1``; ``cos``/``sin``
  repeat each frequency twice in a row, ``[f0, f0, f1, f1, ...]``.

Partial rotary (``r < head_dim``, e.g. Phi, StableLM) rotates the first ``r`` channels and
passes the rest through. Shapes: ``x`` is ``[..., T, D]`` (``[batch, kv_heads, T, head_dim]`` in
the cache), ``cos``/``sin`` are ``[T, r]`` or ``[batch, T, r]`` (transformers' own), broadcast
over the heads, or ``[batch, heads, T, r]`` (one position per head and slot: the kept tokens of
an evicting cache). Computation is float32; the output has ``x``'s dtype.
"""

from __future__ import annotations

import torch

LAYOUTS = ("half", "interleaved")
"""How channels pair up under the rotation (see the module docstring)."""


def _check(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, layout: str) -> int:
    if layout not in LAYOUTS:
        raise ValueError(f"layout must be one of {LAYOUTS}; got {layout!r}")
    for name, t in (("x", x), ("cos", cos), ("sin", sin)):
        if not isinstance(t, torch.Tensor):
            raise TypeError(f"{name} must be a torch.Tensor; got {type(t).__name__}")
        if not t.is_floating_point():
            raise TypeError(f"{name} must be a floating-point tensor; got {t.dtype}")
    if x.dim() < 2:
        raise ValueError(f"x must be [..., T, D] (at least 2 dims); got shape {tuple(x.shape)}")
    if cos.shape != sin.shape:
        raise ValueError(f"cos and sin must have the same shape; got {tuple(cos.shape)} and {tuple(sin.shape)}")
    if cos.dim() not in (2, 3, 4):
        raise ValueError(f"cos/sin must be [T, r], [batch, T, r] or [batch, heads, T, r]; got shape {tuple(cos.shape)}")
    r, d = cos.shape[-1], x.shape[-1]
    if r % 2 or r > d or r == 0:
        raise ValueError(f"the rotary width (cos.shape[-1]) must be even, > 0 and <= head_dim {d}; got {r}")
    if cos.shape[-2] != x.shape[-2]:
        raise ValueError(f"cos/sin cover {cos.shape[-2]} positions, x holds {x.shape[-2]} tokens")
    return r


def _broadcast(c: torch.Tensor, x: torch.Tensor) -> torch.Tensor:
    """``[T, r]``, ``[B, T, r]`` or ``[B, H, T, r]`` -> broadcastable against ``x`` ``[B, H, T, D]``
    (or ``[T, D]``)."""
    c = c.float()
    if c.dim() == 3 and x.dim() == 4:
        return c[:, None]
    return c


def _swap(x: torch.Tensor, layout: str) -> torch.Tensor:
    """``rotate_half`` of the layout: each pair ``(a, b)`` -> ``(-b, a)``."""
    if layout == "half":
        a, b = x.chunk(2, dim=-1)
        return torch.cat((-b, a), dim=-1)
    a, b = x[..., 0::2], x[..., 1::2]
    return torch.stack((-b, a), dim=-1).flatten(-2)


def apply_rope(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, layout: str = "half") -> torch.Tensor:
    """``x * cos + swap(x) * sin`` on the first ``r = cos.shape[-1]`` channels (transformers'
    ``apply_rotary_pos_emb`` for keys); the other channels pass through. Output: ``x``'s dtype."""
    r = _check(x, cos, sin, layout)
    xf = x.float()
    rot, rest = xf[..., :r], xf[..., r:]
    c, s = _broadcast(cos, xf), _broadcast(sin, xf)
    out = rot * c + _swap(rot, layout) * s
    return torch.cat((out, rest), dim=-1).to(x.dtype) if r < x.shape[-1] else out.to(x.dtype)


def remove_rope(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, layout: str = "half") -> torch.Tensor:
    """The inverse of :func:`apply_rope` with the same ``cos``/``sin``:
    ``(x * cos - swap(x) * sin) / (cos^2 + sin^2)`` on the rotated channels (the division undoes
    a rope type's attention scaling ``s``, since ``cos^2 + sin^2 = s^2``). Exact up to float32
    rounding. Output: ``x``'s dtype."""
    r = _check(x, cos, sin, layout)
    xf = x.float()
    rot, rest = xf[..., :r], xf[..., r:]
    c, s = _broadcast(cos, xf), _broadcast(sin, xf)
    norm = c * c + s * s
    if bool((norm <= 0).any()):
        raise ValueError("cos^2 + sin^2 must be > 0 at every position (a zero attention scaling cannot be undone)")
    out = (rot * c - _swap(rot, layout) * s) / norm
    return torch.cat((out, rest), dim=-1).to(x.dtype) if r < x.shape[-1] else out.to(x.dtype)


def rope_tables(inv_freq: torch.Tensor, positions: torch.Tensor, scaling: float = 1.0,
                layout: str = "half") -> tuple[torch.Tensor, torch.Tensor]:
    """``cos``/``sin`` ``[*positions.shape, r]`` (float32) of the frequencies ``inv_freq``
    ``[r/2]`` at integer ``positions``, in ``layout``'s channel order, times ``scaling``: what a
    transformers rotary embedding returns, rebuilt at read time from ``r/2`` floats per layer.
    Angles are float32 products ``p * w``, as transformers computes them, so the tables equal the
    model's own to the bit and a key rotated at read time equals the one the model rotated."""
    if layout not in LAYOUTS:
        raise ValueError(f"layout must be one of {LAYOUTS}; got {layout!r}")
    if inv_freq.dim() != 1 or inv_freq.numel() == 0:
        raise ValueError(f"inv_freq must be [r/2] with r/2 >= 1; got shape {tuple(inv_freq.shape)}")
    if positions.is_floating_point():
        raise TypeError(f"positions must be integers; got {positions.dtype}")
    angles = positions.float()[..., None] * inv_freq.float()
    if layout == "half":
        angles = torch.cat((angles, angles), dim=-1)
    else:
        angles = angles.repeat_interleave(2, dim=-1)
    return angles.cos() * scaling, angles.sin() * scaling


def rotate(x: torch.Tensor, positions: torch.Tensor, inv_freq: torch.Tensor, scaling: float = 1.0,
           layout: str = "half", inverse: bool = False) -> torch.Tensor:
    """:func:`apply_rope` (``inverse``: :func:`remove_rope`) with the tables of :func:`rope_tables`
    built on the fly, each pair rotated once: ``x`` ``[..., T, D]``, ``positions`` integer
    ``[T]`` or broadcastable to ``x.shape[:-1]`` (``[B, H, T]``), ``inv_freq`` ``[r/2]``.

    The angles are the same float32 products ``p * w`` (one cosine and sine per pair, not per
    channel), so the result equals the table functions' up to float32 rounding order; no
    ``[T, r]`` table or swapped copy is made. Output: ``x``'s dtype."""
    if layout not in LAYOUTS:
        raise ValueError(f"layout must be one of {LAYOUTS}; got {layout!r}")
    if positions.is_floating_point():
        raise TypeError(f"positions must be integers; got {positions.dtype}")
    half = inv_freq.numel()
    r, d = 2 * half, x.shape[-1]
    if half == 0 or r > d:
        raise ValueError(f"2 * inv_freq.numel() must be in [2, head_dim {d}]; got {r}")
    if not scaling > 0:
        raise ValueError(f"scaling must be > 0 (a zero attention scaling cannot be undone); got {scaling!r}")
    angles = positions.float()[..., None] * inv_freq.float().to(x.device)
    c, s = angles.cos(), angles.sin()
    xf = x.float()
    if layout == "half":
        a, b = xf[..., :half], xf[..., half:r]
    else:
        a, b = xf[..., 0:r:2], xf[..., 1:r:2]
    if inverse:
        oa, ob = (a * c + b * s) / scaling, (b * c - a * s) / scaling
    else:
        oa, ob = (a * c - b * s) * scaling, (a * s + b * c) * scaling
    pairs = torch.cat((oa, ob), dim=-1) if layout == "half" else torch.stack((oa, ob), dim=-1).flatten(-2)
    return (torch.cat((pairs, xf[..., r:]), dim=-1) if r < d else pairs).to(x.dtype)


__all__ = ["LAYOUTS", "apply_rope", "remove_rope", "rope_tables", "rotate"]
