"""Integer quantization of KV tensors: symmetric / asymmetric, per-channel or per-token, grouped.

Formulas: ``math_dictionary/kv-compression-math.md`` sections 1-3. The seed API
(:func:`quantize_per_channel_symmetric`, :func:`quantize_per_channel_asymmetric`,
:func:`dequantize`, :func:`quantization_error`) is a thin layer over :func:`quantize`.

Conventions
-----------
* **Reduced axis.** Statistics (max, min) are taken along ``axis`` in groups of ``group_size``
  consecutive elements; every other index gets its own scale. For a KV tensor
  ``[batch, kv_heads, seq_len, head_dim]``: ``axis=-2`` is *per-channel* (statistics over
  tokens, KIVI's choice for keys), ``axis=-1`` is *per-token* (statistics over channels,
  KIVI's choice for values). ``axis=None`` is the seed's layout: the tensor is viewed as
  ``[-1, C]`` and each channel is reduced over all leading elements.
* **Code range.** Symmetric codes are ``q in [-qmax, qmax]`` with ``qmax = 2**(b-1) - 1``;
  asymmetric codes are ``q in [0, 2**b - 1]``. Both are stored as unsigned ``b``-bit codes
  packed densely by :mod:`kv_cache.compression.packing` (symmetric codes are offset by
  ``2**(b-1)``; that offset is implicit and costs no bytes).
* **Dtypes.** Statistics are computed in float32 (float64 for float64 input). ``scale`` is
  stored in ``scale_dtype`` (default: the statistics dtype) and the codes are computed with
  the *stored* scale, so dequantization sees exactly what quantization used. ``zero_point``
  is int16. :func:`dequantize` returns the input's dtype unless told otherwise.
* **Degenerate groups.** A constant group (``max == min``) gets ``scale = max|x|`` and codes
  ``+-1`` (or 0), so it round-trips exactly (an all-zero tensor gives scale 1e-8/qmax and
  codes 0). For the asymmetric case the scale is floored at ``max|x| * 2**-14`` so that the
  zero point always fits int16 (the "zero-point range guard"; it only binds when a group
  varies by less than ``(qmax - qmin) * 2**-14`` of its magnitude, and its error bound
  ``max|x| * 2**-15`` is below float16 resolution).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import numpy as np
import torch

from ._arrays import check_float, check_int, check_min_rank, raise_non_finite, to_numpy, to_torch
from .packing import SUPPORTED_BITS, pack_bits, unpack_bits

SCALE_FLOOR = 1e-8
"""The seed's lower bound on ``max|x|`` (symmetric) and ``max - min`` (asymmetric)."""

ZERO_POINT_GUARD = 2.0**-14
"""Asymmetric scales are at least ``max|x| * ZERO_POINT_GUARD`` so ``|zero_point| < 2**15``."""

FP16_SCALE_MIN = 2.0**-24
"""Uniform scales stored in float16 are at least its smallest positive value: a group whose range
is below ``SCALE_FLOOR``'s grid in float16 (a near-constant channel, e.g. a pre-RoPE key channel
a QK-norm gain nearly zeroes) is coded on the finest float16 grid instead of being refused."""

_TORCH_BY_NUMPY = {
    np.dtype(np.float16): torch.float16,
    np.dtype(np.float32): torch.float32,
    np.dtype(np.float64): torch.float64,
}


def _torch_dtype(dtype: Any) -> torch.dtype:
    if isinstance(dtype, torch.dtype):
        return dtype
    try:
        return _TORCH_BY_NUMPY[np.dtype(dtype)]
    except (TypeError, KeyError) as exc:
        raise TypeError(
            f"dtype must be one of float16, bfloat16, float32, float64; got {dtype!r}"
        ) from exc


def _check_bits(bits: Any) -> int:
    if isinstance(bits, bool) or not isinstance(bits, (int, np.integer)) or int(bits) not in SUPPORTED_BITS:
        raise ValueError(f"bits must be one of {list(SUPPORTED_BITS)}; got {bits!r}")
    return int(bits)


def code_range(bits: int, symmetric: bool) -> tuple[int, int]:
    """Return ``(qmin, qmax)``: ``(-(2**(b-1) - 1), 2**(b-1) - 1)`` or ``(0, 2**b - 1)``."""
    bits = _check_bits(bits)
    if symmetric:
        qmax = (1 << (bits - 1)) - 1
        return -qmax, qmax
    return 0, (1 << bits) - 1


@dataclass
class QuantizedTensor:
    """Packed integer codes plus the metadata that dequantization needs.

    Attributes
    ----------
    data : uint8 array/tensor, shape ``[packed_nbytes(numel, bits)]``
        The codes, densely packed (``bits`` bits each). ``data.nbytes`` is the real storage.
    scale : float array/tensor
        One scale per group: ``shape`` with the reduced axis replaced by the number of
        groups (``[1, C]`` for ``axis=None``). dtype ``scale_dtype``.
    zero_point : int16 array/tensor
        Same shape as ``scale`` (asymmetric), or empty (symmetric: the zero point is 0).
    bits : int
    shape : tuple of int
        Shape of the original tensor.
    dtype : numpy.dtype or torch.dtype
        dtype of the original tensor; :func:`dequantize` returns it by default.
    axis : int or None
        Non-negative reduced axis, or ``None`` for the seed's ``[-1, C]`` layout.
    group_size : int
        Elements per group along the reduced axis (the last group may be shorter).
    symmetric : bool
    """

    data: Any
    scale: Any
    zero_point: Any
    bits: int
    shape: tuple[int, ...]
    dtype: Any
    axis: int | None
    group_size: int
    symmetric: bool

    @property
    def numel(self) -> int:
        """Number of quantized elements."""
        return int(np.prod(self.shape, dtype=np.int64))

    @property
    def nbytes(self) -> int:
        """Bytes held: ``data.nbytes + scale.nbytes + zero_point.nbytes``."""
        return int(self.data.nbytes + self.scale.nbytes + self.zero_point.nbytes)

    @property
    def bits_per_element(self) -> float:
        """Effective bits per element from the bytes actually held (codes + metadata)."""
        return 8.0 * self.nbytes / max(self.numel, 1)

    def codes(self) -> Any:
        """Unpacked integer codes, shape ``shape``, dtype int16 (signed for symmetric)."""
        packed, was_numpy = to_torch(self.data, "data")
        q = unpack_bits(packed, self.bits, self.numel).to(torch.int16)
        if self.symmetric:
            q -= 1 << (self.bits - 1)
        q = q.reshape(self.shape)
        return q.numpy() if was_numpy else q


CHUNK_ELEMENTS = 1 << 18
"""Quantization works in blocks of about this many elements so its temporaries stay in cache."""

DEQUANT_CHUNK_ELEMENTS = 1 << 21
"""Dequantization has fewer passes per element; per-op overhead dominates below this size
(a decode step dequantizes one layer of a few hundred thousand elements at a time)."""


def _grouped(x: torch.Tensor, axis: int, group_size: int) -> tuple[torch.Tensor, int]:
    """View ``x`` as ``[R, g, Q]``: ``R = prod(shape[:axis]) * G`` groups rows, ``Q = prod(shape[axis+1:])``.

    The axis is first padded to ``G * g`` by replicating its last element (which leaves every
    group's min and max unchanged). Returns the view and the padded length ``G * g``.
    """
    n = x.shape[axis]
    groups = -(-n // group_size)
    padded = groups * group_size
    if padded != n:
        edge = x.narrow(axis, n - 1, 1).expand(*x.shape[:axis], padded - n, *x.shape[axis + 1 :])
        x = torch.cat([x, edge], dim=axis)
    pre = int(np.prod(x.shape[:axis], dtype=np.int64))
    post = int(np.prod(x.shape[axis + 1 :], dtype=np.int64))
    return x.reshape(pre * groups, group_size, post), padded


def _blocks(rows: int, group: int, cols: int, chunk: int = CHUNK_ELEMENTS):
    """Yield ``(row_slice, col_slice)`` blocks of about ``chunk`` elements of ``[R, g, Q]``."""
    per_row = group * cols
    if rows * per_row <= chunk:
        yield slice(None), slice(None)
    elif per_row <= chunk:
        step = max(1, chunk // per_row)
        for r in range(0, rows, step):
            yield slice(r, r + step), slice(None)
    else:
        step = max(1, chunk // group)
        for r in range(rows):
            for c in range(0, cols, step):
                yield slice(r, r + 1), slice(c, c + step)


def quantize(
    x: Any,
    bits: int = 4,
    *,
    axis: int | None = -2,
    group_size: int | None = None,
    symmetric: bool = False,
    scale_dtype: Any = None,
) -> QuantizedTensor:
    """Quantize ``x`` to packed ``bits``-bit codes with one scale per group.

    Implements ``math_dictionary/kv-compression-math.md`` section 1 (symmetric: scale =
    max|x| / qmax, q = clip(round(x / scale), -qmax, qmax)) and section 2 (asymmetric:
    scale = (max - min) / (qmax - qmin), zero_point = round(qmin - min / scale),
    q = clip(round(x / scale) + zero_point, qmin, qmax)); grouping as in KIVI (Liu et al., 2024).

    Parameters
    ----------
    x : numpy.ndarray or torch.Tensor, rank >= 1 (rank >= 2 when ``axis`` is None)
        Floating tensor (float16, bfloat16, float32, float64), finite, non-empty. For KV
        caches: ``[batch, kv_heads, seq_len, head_dim]``.
    bits : {2, 3, 4, 8}
    axis : int or None, default -2
        Axis along which statistics are taken (see module docstring). ``None``: the seed's
        per-channel layout ``[-1, C]``.
    group_size : int or None
        Group length along ``axis``; ``None`` means the whole axis. A group size larger than
        the axis is the whole axis.
    symmetric : bool, default False
    scale_dtype : dtype, optional
        Storage dtype of ``scale`` (e.g. ``torch.float16`` to halve metadata). Default: the
        statistics dtype (float32; float64 for float64 input).

    Returns
    -------
    QuantizedTensor
        numpy arrays if ``x`` is numpy, torch tensors (on ``x.device``) otherwise.

    Raises
    ------
    ValueError
        Unsupported bits, empty input, NaN/Inf, bad axis or group size, wrong rank.
    TypeError
        Non-array input, integer/bool/complex dtype, unsupported ``scale_dtype``.

    Examples
    --------
    >>> import numpy as np
    >>> qt = quantize(np.ones((16, 8), np.float32), bits=4, axis=0)
    >>> qt.data.nbytes, qt.scale.shape
    (64, (1, 8))
    """
    bits = _check_bits(bits)
    t, was_numpy = to_torch(x, "x")
    # Finiteness is checked from each block's min/max below (NaN and Inf propagate into
    # them), which saves a full pass over the input.
    check_float(t, "x", finite=False)
    if not isinstance(symmetric, (bool, np.bool_)):
        raise TypeError(f"symmetric must be a bool; got {symmetric!r}")
    orig_shape = tuple(t.shape)
    if axis is None:
        check_min_rank(t, 2, "x", "when axis=None ([..., C]; the last dim is the channel)")
        t = t.reshape(-1, orig_shape[-1])
        work_axis = 0
    else:
        axis = check_int(axis, "axis")
        if not -t.ndim <= axis < t.ndim:
            raise ValueError(
                f"axis must be in [{-t.ndim}, {t.ndim - 1}] for a rank-{t.ndim} tensor; got {axis}"
            )
        work_axis = axis % t.ndim
    n = t.shape[work_axis]
    g = n if group_size is None else min(check_int(group_size, "group_size", minimum=1), n)
    stat_dtype = torch.float64 if t.dtype == torch.float64 else torch.float32
    store_dtype = stat_dtype if scale_dtype is None else _torch_dtype(scale_dtype)

    x3, padded = _grouped(t, work_axis, g)  # [R, g, Q]
    rows, _, cols = x3.shape
    qmin, qmax = code_range(bits, symmetric)
    codes = torch.empty(x3.shape, dtype=torch.uint8, device=t.device)
    scale_stored = torch.empty((rows, 1, cols), dtype=store_dtype, device=t.device)
    zero_point = torch.empty(
        (rows, 1, cols) if not symmetric else (0,), dtype=torch.int16, device=t.device
    )
    for rs, cs in _blocks(rows, g, cols):
        c = x3[rs, :, cs]
        mx = c.amax(1, keepdim=True).to(stat_dtype)
        mn = c.amin(1, keepdim=True).to(stat_dtype)
        if not (bool(torch.isfinite(mx).all()) and bool(torch.isfinite(mn).all())):
            raise_non_finite(t, "x")
        amax = torch.maximum(mn.abs(), mx.abs())
        constant = (mn == mx) & (amax > 0)
        if symmetric:
            scale = amax.clamp(min=SCALE_FLOOR) / qmax
        else:
            scale = (mx - mn).clamp(min=SCALE_FLOOR) / (qmax - qmin)
            scale = torch.maximum(scale, amax * ZERO_POINT_GUARD)
        scale = torch.where(constant, amax, scale)
        # An all-zero group: any scale codes it exactly (code = zero point); 1 fits every scale dtype.
        scale = torch.where(amax == 0, torch.ones_like(scale), scale)
        if store_dtype == torch.float16:  # float16's smallest, 2**-24: a tiny group's scale stays nonzero
            scale = scale.clamp_min(FP16_SCALE_MIN)
        # Quantize with the scale exactly as stored, so dequantize reproduces this grid.
        stored = scale.to(store_dtype)
        if store_dtype != stat_dtype:
            if not bool(torch.isfinite(stored).all()) or bool((stored == 0).any()):
                raise ValueError(
                    f"scale_dtype={store_dtype} cannot represent the scales of x "
                    f"(max |x| = {float(amax.max()):.3g}); use a wider scale_dtype"
                )
            scale = stored.to(stat_dtype)
        scale_stored[rs, :, cs] = stored
        q = torch.div(c, scale).round_()  # promotes to the statistics dtype
        if symmetric:
            q.clamp_(-qmax, qmax).add_(1 << (bits - 1))
        else:
            zp = (qmin - mn / scale).round_()
            q.add_(zp).clamp_(qmin, qmax)
            zero_point[rs, :, cs] = zp
        codes[rs, :, cs] = q
    codes = codes.reshape(*t.shape[:work_axis], padded, *t.shape[work_axis + 1 :])
    if padded != n:
        codes = codes.narrow(work_axis, 0, n)
    data = pack_bits(codes.contiguous(), bits)
    group_shape = (*t.shape[:work_axis], padded // g, *t.shape[work_axis + 1 :])
    scale_out = scale_stored.reshape(group_shape)
    if not symmetric:
        zero_point = zero_point.reshape(group_shape)
    dtype: Any = t.dtype
    if was_numpy:
        data, scale_out, zero_point = to_numpy(data), to_numpy(scale_out), to_numpy(zero_point)
        dtype = np.dtype(x.dtype)
    return QuantizedTensor(
        data=data,
        scale=scale_out,
        zero_point=zero_point,
        bits=bits,
        shape=orig_shape,
        dtype=dtype,
        axis=None if axis is None else work_axis,
        group_size=g,
        symmetric=bool(symmetric),
    )


def dequantize(qt: QuantizedTensor, dtype: Any = None) -> Any:
    """Reconstruct ``x_hat = (q - zero_point) * scale`` (math dictionary section 3).

    Parameters
    ----------
    qt : QuantizedTensor
    dtype : dtype, optional
        Output dtype; default ``qt.dtype`` (the original tensor's dtype). The arithmetic runs
        in the dtype of ``qt.scale`` widened to at least float32.

    Returns
    -------
    numpy.ndarray or torch.Tensor
        Shape ``qt.shape``; numpy if ``qt`` holds numpy arrays.

    Raises
    ------
    TypeError
        ``qt`` is not a :class:`QuantizedTensor` or ``dtype`` is unsupported.
    """
    if not isinstance(qt, QuantizedTensor):
        raise TypeError(f"qt must be a QuantizedTensor; got {type(qt).__name__}")
    packed, was_numpy = to_torch(qt.data, "qt.data")
    scale, _ = to_torch(qt.scale, "qt.scale")
    out_dtype = _torch_dtype(qt.dtype if dtype is None else dtype)
    math_dtype = torch.float64 if scale.dtype == torch.float64 else torch.float32
    if qt.axis is None:
        work_shape: tuple[int, ...] = (-1, qt.shape[-1])
        axis = 0
    else:
        work_shape, axis = qt.shape, qt.axis
    q = unpack_bits(packed, qt.bits, qt.numel).reshape(work_shape)
    q3, padded = _grouped(q, axis, qt.group_size)  # [R, g, Q]
    rows, g, cols = q3.shape
    scale3 = scale.reshape(rows, 1, cols).to(math_dtype)
    if qt.symmetric:
        offset: Any = 1 << (qt.bits - 1)
    else:
        zp, _ = to_torch(qt.zero_point, "qt.zero_point")
        offset = zp.reshape(rows, 1, cols).to(math_dtype)

    def block(rs: slice, cs: slice) -> torch.Tensor:
        c = q3[rs, :, cs].to(math_dtype)
        c.sub_(offset if qt.symmetric else offset[rs, :, cs])
        return c.mul_(scale3[rs, :, cs])

    if rows * g * cols <= DEQUANT_CHUNK_ELEMENTS:
        xh = block(slice(None), slice(None)).to(out_dtype)
    else:
        xh = torch.empty(q3.shape, dtype=out_dtype, device=q3.device)
        for rs, cs in _blocks(rows, g, cols, DEQUANT_CHUNK_ELEMENTS):
            xh[rs, :, cs] = block(rs, cs)
    xh = xh.reshape(*q.shape[:axis], padded, *q.shape[axis + 1 :])
    if padded != q.shape[axis]:
        xh = xh.narrow(axis, 0, q.shape[axis])
    xh = xh.reshape(qt.shape)
    return to_numpy(xh) if was_numpy else xh


def quantize_per_channel_symmetric(x: Any, bits: int = 8) -> QuantizedTensor:
    """The seed's symmetric per-channel quantizer: the last dim is the channel.

    ``qmax = 2**(bits-1) - 1``, ``scale_c = max(max|x_c|, 1e-8) / qmax``,
    ``q = clip(round(x / scale_c), -qmax, qmax)``; statistics over all leading elements.
    Equivalent to ``quantize(x, bits, axis=None, symmetric=True)``.
    """
    return quantize(x, bits, axis=None, symmetric=True)


def quantize_per_channel_asymmetric(x: Any, bits: int = 8) -> QuantizedTensor:
    """The seed's asymmetric per-channel quantizer: the last dim is the channel.

    ``scale_c = max(max_c - min_c, 1e-8) / (qmax - qmin)``,
    ``zero_point_c = round(qmin - min_c / scale_c)``,
    ``q = clip(round(x / scale_c) + zero_point_c, qmin, qmax)`` with ``[qmin, qmax] = [0, 2**b - 1]``.
    Equivalent to ``quantize(x, bits, axis=None, symmetric=False)``.
    """
    return quantize(x, bits, axis=None, symmetric=False)


def quantization_error(original: Any, qt: QuantizedTensor) -> dict[str, float]:
    """Error and storage metrics of ``qt`` against ``original`` (math dictionary section 4).

    Returns
    -------
    dict
        ``rmse``, ``max_abs_error``, ``mean_abs_error`` (float32 statistics of
        ``original - dequantize(qt)``), ``compression_ratio`` = ``original.nbytes /
        (data.nbytes + scale.nbytes + zero_point.nbytes)`` and ``bits_per_element`` (the
        bytes actually held, times 8, per element).

    Raises
    ------
    ValueError
        Shape mismatch, empty or non-finite ``original``.
    """
    if not isinstance(qt, QuantizedTensor):
        raise TypeError(f"qt must be a QuantizedTensor; got {type(qt).__name__}")
    t, _ = to_torch(original, "original")
    check_float(t, "original")
    if tuple(t.shape) != tuple(qt.shape):
        raise ValueError(f"original has shape {tuple(t.shape)} but qt was made from shape {qt.shape}")
    xh, _ = to_torch(dequantize(qt, dtype=torch.float64 if t.dtype == torch.float64 else torch.float32), "x_hat")
    err = (t.to(xh.dtype) - xh).abs()
    return {
        "rmse": float(torch.sqrt(torch.mean(err * err))),
        "max_abs_error": float(err.max()),
        "mean_abs_error": float(err.mean()),
        "compression_ratio": float(t.element_size() * t.numel()) / qt.nbytes,
        "bits_per_element": qt.bits_per_element,
    }


def metadata_bits_per_element(
    bits: int, group_size: int, scale_bits: int = 16, zero_point_bits: int = 16
) -> float:
    """Effective bits per element ``b + (s + z) / g`` (math dictionary section 5).

    ``zero_point_bits=0`` for symmetric quantization. Packing padding is not included; use
    :attr:`QuantizedTensor.bits_per_element` for the exact figure of a stored tensor.
    """
    bits = _check_bits(bits)
    g = check_int(group_size, "group_size", minimum=1)
    s = check_int(scale_bits, "scale_bits", minimum=0)
    z = check_int(zero_point_bits, "zero_point_bits", minimum=0)
    return bits + (s + z) / g


__all__ = [
    "QuantizedTensor",
    "SCALE_FLOOR",
    "ZERO_POINT_GUARD",
    "code_range",
    "dequantize",
    "metadata_bits_per_element",
    "quantization_error",
    "quantize",
    "quantize_per_channel_asymmetric",
    "quantize_per_channel_symmetric",
]
