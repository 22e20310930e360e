"""Lloyd-Max levels of N(0, 1) and the norm-only codebook quantizer (math dictionary §18).

After a randomized Hadamard rotation (:mod:`kv_cache.compression.rotation`) the coordinates of
a KV vector divided by its RMS are close to N(0, 1), so the MSE-optimal scalar quantizer of the
standard Gaussian (Lloyd, 1982; Max, 1960) needs no per-group offset or range: one norm per
vector (or group of channels) and ``b``-bit codes into fixed levels. The pure-torch functions
here are the reference of :func:`kv_cache.kernels.quantize_block` with
``lut=lloyd_max_gaussian(bits)`` and ``grouping="token"`` (same codes, same scales).
"""

from __future__ import annotations

import functools
import math
from typing import Any

import torch

from ._arrays import FLOAT_DTYPES, check_int, raise_non_finite

LLOYD_MAX_BITS = (1, 2, 3, 4)
"""Bit widths with Lloyd-Max levels. 8 bits is left out: plain Lloyd iteration needs ~10^5
steps there, and 8-bit uniform codes are already close to lossless."""

LLOYD_TOL = 1e-7
"""Bound on the error of every level (see :func:`_lloyd_levels`)."""

_MAX_ITER = 100_000
_INV_SQRT_2PI = 1.0 / math.sqrt(2.0 * math.pi)


def _check_bits(bits: Any) -> int:
    if isinstance(bits, bool) or not isinstance(bits, int) or bits not in LLOYD_MAX_BITS:
        raise ValueError(f"bits must be one of {list(LLOYD_MAX_BITS)}; got {bits!r}")
    return bits


def _pdf(t: float) -> float:
    return 0.0 if math.isinf(t) else _INV_SQRT_2PI * math.exp(-0.5 * t * t)


def _upper_tail(t: float) -> float:
    """``1 - Phi(t)`` via ``erfc`` (no cancellation for the tail cells)."""
    return 0.0 if t == math.inf else 0.5 * math.erfc(t / math.sqrt(2.0))


@functools.lru_cache(maxsize=None)
def _lloyd_levels(bits: int) -> tuple[float, ...]:
    """Positive half of the Lloyd-Max levels (float64), ascending.

    The levels are symmetric and their count ``2**b`` is even, so the middle threshold is 0
    and only the positive half is iterated: thresholds ``t_0 = 0``,
    ``t_i = (y_{i-1} + y_i) / 2``, ``t_n = inf``; levels ``y_i = E[X | t_i < X < t_{i+1}] =
    (phi(t_i) - phi(t_{i+1})) / (Q(t_i) - Q(t_{i+1}))`` with ``Q = 1 - Phi``. Lloyd's
    iteration converges linearly, so it stops on the a-posteriori bound of the distance to
    the fixed point, ``step * r / (1 - r) < LLOYD_TOL`` (``r`` the ratio of successive
    steps, and the step itself below ``LLOYD_TOL``), not on the step alone (which would stop
    ~30x too early at 4 bits).
    """
    n = (1 << bits) // 2
    levels = [3.0 * (i + 0.5) / n for i in range(n)]
    prev_step = math.inf
    for _ in range(_MAX_ITER):
        t = [0.0] + [(levels[i] + levels[i + 1]) / 2 for i in range(n - 1)] + [math.inf]
        new = [(_pdf(t[i]) - _pdf(t[i + 1])) / (_upper_tail(t[i]) - _upper_tail(t[i + 1])) for i in range(n)]
        step = max(abs(a - b) for a, b in zip(new, levels))
        levels = new
        if step == 0.0:
            return tuple(levels)
        rate = step / prev_step  # 0 on the first step: no estimate yet, the step test guards it
        if step < LLOYD_TOL and 0.0 < rate < 1.0 and step * rate / (1.0 - rate) < LLOYD_TOL:
            return tuple(levels)
        prev_step = step
    raise RuntimeError(f"Lloyd iteration for {bits} bits did not converge in {_MAX_ITER} steps")


def lloyd_max_gaussian(bits: int) -> torch.Tensor:
    """The ``2**bits`` levels of the Lloyd-Max (MSE-optimal scalar) quantizer of N(0, 1).

    Fixed point of the Lloyd conditions (§18): thresholds are midpoints of adjacent levels and
    each level is the conditional mean of its cell, ``E[X | a < X < b] = (phi(a) - phi(b)) /
    (Phi(b) - Phi(a))``, computed on the exact Gaussian (``math.erfc``) to within 1e-7.
    Cached; every call returns a fresh tensor.

    Parameters
    ----------
    bits : {1, 2, 3, 4}

    Returns
    -------
    torch.Tensor
        float32 ``[2**bits]``, strictly increasing, symmetric about 0: usable as the ``lut``
        of :func:`kv_cache.kernels.quantize_block` (2-4 bits).

    Raises
    ------
    ValueError
        ``bits`` is not one of 1, 2, 3, 4.

    Examples
    --------
    >>> lloyd_max_gaussian(2)
    tensor([-1.5104, -0.4528,  0.4528,  1.5104])
    """
    half = _lloyd_levels(_check_bits(bits))
    levels = [-v for v in reversed(half)] + list(half)
    return torch.tensor(levels, dtype=torch.float64, device="cpu").to(torch.float32)


@functools.lru_cache(maxsize=None)
def lloyd_max_mse(bits: int) -> float:
    """Expected squared error ``E[(X - Q(X))^2]`` of :func:`lloyd_max_gaussian` on N(0, 1).

    Summed over cells in closed form (float64 levels): with ``m0 = Phi(b) - Phi(a)``,
    ``m1 = phi(a) - phi(b)``, ``m2 = m0 + a phi(a) - b phi(b)``, a cell with level ``y``
    contributes ``m2 - 2 y m1 + y^2 m0``. 1 bit: ``1 - 2/pi = 0.3634``; 2: 0.1175; 3: 0.03454;
    4: 0.009497 (Max, 1960).

    Raises
    ------
    ValueError
        ``bits`` is not one of 1, 2, 3, 4.
    """
    half = _lloyd_levels(_check_bits(bits))
    t = [0.0] + [(half[i] + half[i + 1]) / 2 for i in range(len(half) - 1)] + [math.inf]
    total = 0.0
    for i, y in enumerate(half):
        a, b = t[i], t[i + 1]
        m0 = _upper_tail(a) - _upper_tail(b)
        m1 = _pdf(a) - _pdf(b)
        m2 = m0 + a * _pdf(a) - (0.0 if b == math.inf else b * _pdf(b))
        total += m2 - 2.0 * y * m1 + y * y * m0
    return 2.0 * total  # the negative half mirrors the positive one


def norm_codebook_bits_per_element(bits: int, group_size: int, scale_bits: int = 16) -> float:
    """Storage cost ``bits + scale_bits / group_size`` (one fp16 norm per group by default)."""
    return _check_bits(bits) + check_int(scale_bits, "scale_bits", minimum=1) / check_int(
        group_size, "group_size", minimum=1)


def _group_size(d: int, group_size: Any) -> int:
    if group_size is None:
        return d
    gs = check_int(group_size, "group_size", minimum=1)
    if d % gs:
        raise ValueError(f"group_size must divide the last dim d={d}; got {gs}")
    return gs


def quantize_norm_codebook(
    x: torch.Tensor, bits: int, group_size: int | None = None
) -> tuple[torch.Tensor, torch.Tensor]:
    """Norm-only codebook quantization: ``scale = RMS(group)``, ``code = nearest level of x / scale``.

    §18: ``scale = sqrt(sum_c x_c^2 / g)`` over each group of ``g`` consecutive channels
    (summed in float64), then the stored scale is used for ``x / scale`` and the code is the
    index of the nearest Lloyd-Max level (boundaries at midpoints, a tie goes to the lower
    level); a group with scale 0 gets ``x / scale := 0``. Equal, code for code and scale for
    scale, to ``kv_cache.kernels.quantize_block(x, bits, "token", g, lut=lloyd_max_gaussian(bits),
    scale_dtype=torch.float32)`` for a float16/bfloat16/float32 ``[R, N, d]`` input.

    Parameters
    ----------
    x : torch.Tensor, ``[..., d]``
        float16, bfloat16, float32 or float64, finite; leading dims may be empty. Best after a
        rotation (:class:`~kv_cache.compression.rotation.RandomizedHadamard`).
    bits : {1, 2, 3, 4}
    group_size : int, optional
        Channels per norm; must divide ``d``. Default ``d`` (one norm per vector).

    Returns
    -------
    codes : torch.Tensor, uint8, ``[..., d]``
        Level indices in ``[0, 2**bits)`` (unpacked).
    scale : torch.Tensor, ``[..., d // group_size]``
        float32 (float64 for float64 input; the codes then use float64 ``x / scale``).

    Raises
    ------
    TypeError
        Non-tensor or non-floating ``x``.
    ValueError
        Unsupported ``bits``, a ``group_size`` that does not divide ``d``, a 0-d tensor or
        ``d = 0``, NaN or Inf in ``x``.

    Examples
    --------
    >>> codes, scale = quantize_norm_codebook(torch.tensor([[1.0, -1.0, 3.0, -3.0]]), 2)
    >>> codes, scale
    (tensor([[2, 1, 3, 0]], dtype=torch.uint8), tensor([[2.2361]]))
    """
    bits = _check_bits(bits)
    if not isinstance(x, torch.Tensor):
        raise TypeError(f"x must be a torch.Tensor; got {type(x).__name__}")
    if x.dtype not in FLOAT_DTYPES:
        raise TypeError(f"x must have a floating dtype (float16, bfloat16, float32, float64); got {x.dtype}")
    if x.ndim < 1 or x.shape[-1] == 0:
        raise ValueError(f"x must be [..., d] with d >= 1; got shape {tuple(x.shape)}")
    d = x.shape[-1]
    gs = _group_size(d, group_size)
    work = torch.float64 if x.dtype == torch.float64 else torch.float32
    xg = x.to(work).reshape(*x.shape[:-1], d // gs, gs)
    # Sum of squares in float64 then rounded once to the stored dtype, as quantize_block does.
    rms = (xg.double().square().sum(-1) / gs).sqrt()
    if not bool(torch.isfinite(rms).all()):
        raise_non_finite(x, "x")
    scale = rms.to(work)
    s = scale.unsqueeze(-1)
    v = torch.where(s != 0, xg / s, torch.zeros((), dtype=work, device=x.device))
    levels = lloyd_max_gaussian(bits).to(device=x.device)
    mids = ((levels[:-1] + levels[1:]) * 0.5).to(work)  # float32 midpoints, as the kernels use
    codes = torch.bucketize(v, mids).to(torch.uint8).reshape(x.shape)
    return codes, scale


def dequantize_norm_codebook(
    codes: torch.Tensor, scale: torch.Tensor, bits: int, dtype: torch.dtype | None = None
) -> torch.Tensor:
    """Reconstruct ``x_hat = scale[group] * levels[code]`` (§18).

    Parameters
    ----------
    codes : torch.Tensor, integer, ``[..., d]``
        Values in ``[0, 2**bits)``.
    scale : torch.Tensor, floating, ``[..., d // g]``
        One norm per group of ``g`` consecutive channels (``g`` inferred from the shapes).
    bits : {1, 2, 3, 4}
    dtype : torch.dtype, optional
        Output dtype; default float32 (float64 for a float64 ``scale``). The product is formed
        in float32 (float64) and rounded once, as :func:`kv_cache.kernels.dequantize_block`.

    Returns
    -------
    torch.Tensor, ``[..., d]``

    Raises
    ------
    TypeError
        Non-tensor inputs, non-integer ``codes``, non-floating ``scale`` or ``dtype``.
    ValueError
        Unsupported ``bits``, shapes that do not match, codes out of range.
    """
    bits = _check_bits(bits)
    for t, name in ((codes, "codes"), (scale, "scale")):
        if not isinstance(t, torch.Tensor):
            raise TypeError(f"{name} must be a torch.Tensor; got {type(t).__name__}")
    if codes.dtype.is_floating_point or codes.dtype.is_complex or codes.dtype == torch.bool:
        raise TypeError(f"codes must have an integer dtype (e.g. uint8); got {codes.dtype}")
    if scale.dtype not in FLOAT_DTYPES:
        raise TypeError(
            f"scale must have a floating dtype (float16, bfloat16, float32, float64); got {scale.dtype}")
    work = torch.float64 if scale.dtype == torch.float64 else torch.float32
    dtype = work if dtype is None else dtype
    if dtype not in FLOAT_DTYPES:
        raise TypeError(f"dtype must be one of float16, bfloat16, float32, float64; got {dtype!r}")
    if (codes.ndim < 1 or scale.ndim != codes.ndim or codes.shape[:-1] != scale.shape[:-1]
            or scale.shape[-1] == 0 or codes.shape[-1] % scale.shape[-1]):
        raise ValueError(
            f"codes [..., d] and scale [..., d // g] must share leading dims, with scale's last dim "
            f"dividing d; got codes {tuple(codes.shape)} and scale {tuple(scale.shape)}")
    if codes.numel() and (int(codes.min()) < 0 or int(codes.max()) >= 1 << bits):
        raise ValueError(f"codes must lie in [0, {1 << bits}) for {bits}-bit levels; got "
                         f"[{int(codes.min())}, {int(codes.max())}]")
    gs = codes.shape[-1] // scale.shape[-1]
    levels = lloyd_max_gaussian(bits).to(device=codes.device, dtype=work)
    x = levels[codes.long()] * scale.to(work).repeat_interleave(gs, dim=-1)
    return x.to(dtype)


LOG_SCALE_STEP = 1.0 / 12.0
"""Octaves per code of the 8-bit log-coded norms (§18.8): neighbouring scales differ by 5.9%."""
LOG_SCALE_MIN_EXP = -13.0
"""``log2`` of the smallest non-zero 8-bit norm (code 1); code 255 is ``2**(-13 + 254/12) = 287``."""


def log_scale_range() -> tuple[float, float]:
    """``(smallest, largest)`` non-zero scale an 8-bit log code represents."""
    return 2.0 ** LOG_SCALE_MIN_EXP, 2.0 ** (LOG_SCALE_MIN_EXP + 254 * LOG_SCALE_STEP)


def encode_log_scale(scale: torch.Tensor) -> torch.Tensor:
    """Norms ``>= 0`` as 8-bit log codes (§18.8): ``0 -> 0``, else
    ``c = clamp(round((log2 s - E_min) / step) + 1, 1, 255)``.

    A norm is then stored to within ``2**(step / 2) - 1 = 2.9%`` (RMS ~1.7%), which adds about
    ``3e-4 |x|^2`` to the squared error: < 1% of a 3-bit Lloyd-Max code's 0.0345. Norms below
    ``2**E_min`` (1.2e-4) round up to it.

    Parameters
    ----------
    scale : torch.Tensor, float, any shape, finite, ``>= 0``

    Returns
    -------
    torch.Tensor, uint8, same shape

    Raises
    ------
    TypeError
        A non-floating tensor.
    ValueError
        NaN/Inf, a negative norm, or a norm above the largest code (the message gives the range).

    Examples
    --------
    >>> encode_log_scale(torch.tensor([0.0, 1.0, 2.0]))
    tensor([  0, 157, 169], dtype=torch.uint8)
    """
    if not isinstance(scale, torch.Tensor) or not scale.dtype.is_floating_point:
        raise TypeError(f"scale must be a floating torch.Tensor; got {getattr(scale, 'dtype', type(scale).__name__)}")
    s = scale.double()
    lo, hi = log_scale_range()
    low, top = torch.stack(torch.aminmax(s)).tolist() if s.numel() else (0.0, 0.0)  # one pass, one host read
    if not (math.isfinite(low) and math.isfinite(top)):
        raise_non_finite(scale, "scale")
    if low < 0:
        raise ValueError(f"norms must be >= 0; got a minimum of {low:.3g}")
    if top > hi * 2.0 ** (LOG_SCALE_STEP / 2):
        raise ValueError(f"8-bit log-coded norms hold {lo:.3g}..{hi:.3g}; got a norm of {top:.3g} "
                         "(use scale_dtype=torch.float16)")
    code = torch.round((torch.log2(s.clamp_min(lo)) - LOG_SCALE_MIN_EXP) / LOG_SCALE_STEP) + 1
    return torch.where(s > 0, code.clamp(1, 255), torch.zeros_like(code)).to(torch.uint8)


def decode_log_scale(codes: torch.Tensor, dtype: torch.dtype = torch.float32) -> torch.Tensor:
    """The norms of :func:`encode_log_scale` codes: ``0 -> 0``, else ``2**(E_min + (c - 1) step)``.

    Parameters
    ----------
    codes : torch.Tensor, uint8
    dtype : torch.dtype, default float32
        Output dtype (float16 holds every code: 1.2e-4 .. 287).
    """
    if not isinstance(codes, torch.Tensor) or codes.dtype != torch.uint8:
        raise TypeError(f"codes must be a uint8 torch.Tensor; got {getattr(codes, 'dtype', type(codes).__name__)}")
    # One lookup in the 256-entry table (attention decodes every stored norm at every call).
    return torch.take(_log_scale_table(str(codes.device)), codes.long()).to(dtype)


def log_scale_table(device: Any = None) -> torch.Tensor:
    """The norm of every 8-bit log code, float32 ``[256]``: ``decode_log_scale(arange(256))``.

    A constant of the format (like a codebook's levels), computed once per device; the kernels
    read uint8 scale codes through it (``QBlock.scale_table``).
    """
    return _log_scale_table(str(torch.device("cpu" if device is None else device)))


@functools.lru_cache(maxsize=8)
def _log_scale_table(device: str) -> torch.Tensor:
    """``decode_log_scale`` of every code 0..255, float32, on ``device`` (computed once)."""
    c = torch.arange(256, dtype=torch.float32, device=device)  # the float32 arithmetic of §18.8, code by code
    s = torch.exp2(LOG_SCALE_MIN_EXP + (c - 1.0) * LOG_SCALE_STEP)
    return torch.where(c > 0, s, torch.zeros_like(s))


__all__ = [
    "LLOYD_MAX_BITS",
    "decode_log_scale",
    "log_scale_table",
    "dequantize_norm_codebook",
    "encode_log_scale",
    "log_scale_range",
    "lloyd_max_gaussian",
    "lloyd_max_mse",
    "norm_codebook_bits_per_element",
    "quantize_norm_codebook",
]
