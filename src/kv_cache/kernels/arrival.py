"""A decoding step's few tokens, each in one compiled call: the store of an arriving token in a
token-grouped layout (:func:`code_tokens`: rotate, code, log-code the norm) and the turn of a few
keys between the stored frame and the model's (:func:`turn_stored_keys`: the arriving key, the sinks).

Like :mod:`.ops`: the compiled CPU kernels where they serve the tensors, else the same steps in
torch, with the same results. Formulas: ``math_dictionary/kv-compression-math.md`` §18.8, §29.2,
§29.7, §29.10.
"""

from __future__ import annotations

import torch

from ..compression._arrays import raise_non_finite
from . import _build
from ._checks import _hadamard_on, check_levels, check_quantize_args, midpoints
from .ops import _GROUPING_ID, _NON_FINITE, _NORM_TOO_LARGE, _compiled, _triton, quantize_block
from .qblock import QBlock


def code_tokens(x: torch.Tensor, bits: int, lut: torch.Tensor, group_size: int,
                signs: torch.Tensor | None = None) -> QBlock:
    """Per-token codes with codebook levels and 8-bit log-coded norms, rotated first: the store
    of a token-grouped layout (math dictionary §18.8, §25) in one fused pass.

    Equals ``quantize_block(x R, bits, "token", group_size, scale_dtype=float32, lut=lut)``
    with its norms replaced by :func:`~kv_cache.compression.codebook.encode_log_scale` codes
    (the codes are those of the exact norm), where ``x R = (x * signs[r % H]) H / sqrt(d)`` in
    float32 whatever ``x``'s dtype
    (``H`` the Sylvester matrix, :class:`~kv_cache.cache.packed.Rotation`) and ``signs`` None
    means no rotation. The compiled CPU kernel rotates, codes and log-codes each token in one
    call (a decoding step's arrival: one call instead of a dozen torch ops); other devices, a
    head_dim that is not a power of two, and the torch backend compose the same steps in torch.

    Parameters
    ----------
    x : torch.Tensor, ``[R, N, d]``, float16 / bfloat16 / float32, finite, non-empty
    bits : {2, 3, 4, 8}
    lut : torch.Tensor, float32 ``[2**bits]``, strictly increasing levels
    group_size : int
        Channels per norm, a divisor of ``d``.
    signs : torch.Tensor, optional
        int8 ``[H, d]`` (``R`` a multiple of ``H``): row ``r`` is rotated with ``signs[r % H]``.

    Returns
    -------
    QBlock
        ``codes [R, N, d*bits/8]``, ``scale`` uint8 ``[R, N, d // group_size]`` (log codes,
        ``scale_table`` the code -> norm table), ``zero`` None.

    Raises
    ------
    ValueError, TypeError
        As :func:`quantize_block`; ``signs`` of another shape or dtype; a norm above the largest
        8-bit log code (the message gives the range).

    Examples
    --------
    >>> b = code_tokens(torch.randn(3, 2, 64), 4, torch.linspace(-2, 2, 16), 64)
    >>> b.codes.shape, b.scale.dtype
    (torch.Size([3, 2, 32]), torch.uint8)
    """
    from ..compression.codebook import log_scale_table

    codes, scale = code_tokens_raw(x, bits, lut, group_size, signs)
    return QBlock(codes, bits, lut.contiguous(), "token", scale, None, group_size,
                  scale_table=log_scale_table(codes.device))


def code_tokens_raw(x: torch.Tensor, bits: int, lut: torch.Tensor, group_size: int,
                    signs: torch.Tensor | None = None) -> tuple[torch.Tensor, torch.Tensor]:
    """:func:`code_tokens` without the block around it: ``(codes [R, N, d*bits/8], norm codes
    uint8 [R, N, d // group_size])`` (the store of a decoding step's arrival: one kernel call)."""
    from ..compression.codebook import LOG_SCALE_MIN_EXP, LOG_SCALE_STEP, encode_log_scale, log_scale_range

    a = check_quantize_args(x, bits, "token", group_size, False, torch.float32, lut, levels=False)
    R, N, d = a.x.shape
    if signs is not None:
        if not isinstance(signs, torch.Tensor) or signs.dtype != torch.int8 or signs.dim() != 2 \
                or signs.shape[1] != d or signs.shape[0] < 1 or R % signs.shape[0]:
            raise ValueError(f"signs must be int8 [H, d={d}] with R={R} a multiple of H; got "
                             f"{getattr(signs, 'dtype', type(signs).__name__)} of shape "
                             f"{tuple(getattr(signs, 'shape', ()))}")
    check_levels(a.lut)
    ext = _compiled(a.x)
    if ext is None or (signs is not None and d & (d - 1)) or _triton(a.x) is not None:
        xr = a.x
        if signs is not None:  # x R = (x * s) B, B = blockdiag(H_b / sqrt(b)) (one block at a power-of-two d)
            H = signs.shape[0]
            b = _hadamard_on(d, str(a.x.device))  # float32, as the compiled kernel rotates
            s4 = signs.to(device=a.x.device, dtype=torch.float32)[None, :, None, :]
            xr = ((a.x.float().view(R // H, H, N, d) * s4) @ b).reshape(R, N, d)
        blk = quantize_block(xr, bits, "token", group_size, False, torch.float32, a.lut)
        return blk.codes, encode_log_scale(blk.scale)
    x = a.x.contiguous()
    lo, hi = log_scale_range()
    codes = torch.empty((R, N, d * bits // 8), dtype=torch.uint8, device=x.device)
    scale = torch.empty((R, N, d // group_size), dtype=torch.uint8, device=x.device)
    status = ext.quantize(x, bits, _GROUPING_ID["token"], group_size, False, midpoints(a.lut), codes, scale, None,
                          _build.isa_flag(), None if signs is None else signs.contiguous(),
                          [lo, LOG_SCALE_MIN_EXP, LOG_SCALE_STEP, hi * 2.0 ** (LOG_SCALE_STEP / 2)])
    if status == _NON_FINITE:
        raise_non_finite(x, "x")
    if status == _NORM_TOO_LARGE:
        raise ValueError(f"8-bit log-coded norms hold {lo:.3g}..{hi:.3g}; got a larger norm "
                         "(use scale_dtype=torch.float16)")
    return codes, scale


TURN_TOKENS = 64
"""Tokens up to which :func:`turn_stored_keys` takes its compiled loop (a decoding step's few keys); a
prefill's thousands go through torch's vectorized rotation."""


def turn_stored_keys(x: torch.Tensor, positions: torch.Tensor, inv_freq: torch.Tensor, scaling: float = 1.0,
              layout: str = "half", inverse: bool = False, offset: torch.Tensor | None = None) -> torch.Tensor:
    """A few keys between the frame a cache stores them in and the model's (math dictionary §29.2,
    §29.7): ``f R(p) (scale * x + mean)``, or with ``inverse`` ``(R(p)^T x / f - mean) / scale``.

    The sinks a decoding step reads and the token it stores, in one compiled call on the CPU
    instead of a dozen torch ops (up to :data:`TURN_TOKENS` tokens); elsewhere (more tokens,
    positions that differ per row, other devices) the same steps in torch (:func:`kv_cache.compression.rope.rotate`). Angles are float32 products
    ``p * w``, as transformers computes them.

    Parameters
    ----------
    x : torch.Tensor, ``[B, H, n, d]``, floating
    positions : torch.Tensor, integer ``[n]`` (or ``[B, H, n]``: the torch path)
    inv_freq : torch.Tensor, float32 ``[r/2]``, ``r <= d``
    scaling : float, the rope type's attention scaling ``f`` (on the turned channels only)
    layout : {"half", "interleaved"}
    inverse : bool, default False
    offset : torch.Tensor, optional
        ``[B, H, 1, d]`` (mean) or ``[B, H, 2, d]`` (mean, scale), any float dtype.

    Returns
    -------
    torch.Tensor, ``x``'s shape and dtype (computed in float32).
    """
    from ..compression.rope import LAYOUTS, rotate

    if layout not in LAYOUTS:
        raise ValueError(f"layout must be one of {LAYOUTS}; got {layout!r}")
    if x.dim() != 4 or not x.dtype.is_floating_point:
        raise ValueError(f"x must be a floating [B, H, n, d] tensor; got {x.dtype} of shape {tuple(x.shape)}")
    B, H, n, d = x.shape
    ext = _compiled(x)
    if ext is not None and positions.dim() == 1 and 0 < n <= TURN_TOKENS and not positions.is_floating_point() \
            and 2 * inv_freq.numel() <= d and scaling > 0:
        x3 = x.reshape(B * H, n, d).float().contiguous()
        out = torch.empty_like(x3)
        off = None if offset is None else offset.reshape(B * H, offset.shape[2], d).float().contiguous()
        ext.turn_keys(x3, positions.to(device=x.device, dtype=torch.int64).contiguous(),
                      inv_freq.float().contiguous(), float(scaling), layout == "interleaved", bool(inverse), off, out)
        return out.view(B, H, n, d).to(x.dtype)
    if inverse:
        y = rotate(x, positions, inv_freq, scaling, layout, inverse=True)
        if offset is None:
            return y
        y = y.float() - offset[:, :, :1].float()
        return (y / offset[:, :, 1:].float() if offset.shape[2] == 2 else y).to(x.dtype)
    if offset is not None:
        xf = x.float() * offset[:, :, 1:].float() if offset.shape[2] == 2 else x.float()
        x = (xf + offset[:, :, :1].float()).to(x.dtype)
    return rotate(x, positions, inv_freq, scaling, layout)


__all__ = ["TURN_TOKENS", "code_tokens", "code_tokens_raw", "turn_stored_keys"]
