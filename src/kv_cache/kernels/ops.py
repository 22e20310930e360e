"""Public ops on quantized blocks: compiled CPU kernels, Triton kernels on CUDA, or the torch reference.

Each op validates its arguments, then runs, by the device of its tensors (:mod:`._select`): the
compiled extension (built lazily by :mod:`._build`) on the CPU, the Triton kernels
(:mod:`kv_cache.kernels.triton`) on CUDA, else :mod:`.reference`. All give the same results
(bit-exact for the (de)quantizers up to the documented float rounding; see the tests).
Formulas: ``math_dictionary/kv-compression-math.md`` §15.
"""

from __future__ import annotations

import functools

import torch

from ..compression._arrays import raise_non_finite
from . import _build, _select, reference
from ._checks import (
    bad_group_error,
    check_attend_args,
    check_block,
    check_levels,
    check_mixed_args,
    check_out,
    check_out_dtype,
    check_quantize_args,
    midpoints,
)
from .qblock import QBlock, uniform_lut

_GROUPING_ID = {"channel": 0, "token": 1}
_OK, _NON_FINITE, _SCALE_UNREPRESENTABLE, _NORM_TOO_LARGE = 0, 1, 2, 4


def _compiled(*tensors: torch.Tensor | None):
    """The extension module if it is available and every tensor is on the CPU, else None."""
    return _select.compiled_for(tensors)


def _triton(*tensors: torch.Tensor | None):
    """The Triton backend (:mod:`kv_cache.kernels.triton`) if it serves these tensors, else None."""
    return _select.triton_for(tensors)


def _c(t: torch.Tensor | None) -> torch.Tensor | None:
    return None if t is None else t.contiguous()


def _p(t: torch.Tensor | None) -> torch.Tensor | None:
    """``t`` (``[R, n, w]`` or ``[R, n]``) as the attention kernel reads it: as is when each row's
    entries are contiguous, rows possibly a pitch apart (the leading part of a buffer with room,
    no copy); else a contiguous copy."""
    if t is None or t.is_contiguous():
        return t
    st = t.stride()
    if t.shape[0] > 1 and st[0] == 0 and t[0].is_contiguous():  # one buffer for every row (flat ragged)
        return t
    if t.dim() == 2:
        R, n = t.shape
        ok = (n <= 1 or st[1] == 1) and (R <= 1 or st[0] >= n)
        return t if ok else t.contiguous()
    R, n, w = t.shape
    ok = (w <= 1 or st[2] == 1) and (n <= 1 or st[1] == w)
    ok = ok and (R <= 1 or (w > 0 and st[0] % w == 0 and st[0] // w >= n))
    return t if ok else t.contiguous()


def dequantize_block(block: QBlock, out_dtype: torch.dtype = torch.float32, *,
                     out: torch.Tensor | None = None) -> torch.Tensor:
    """Fused unpack + dequantize: ``x_hat = scale * (lut[code] - zero)`` in one pass (§15.1); keys
    stored before RoPE (``block.rope``) come back as attention reads them, turned to their
    positions (§29.8, the torch path).

    Parameters
    ----------
    block : QBlock
        ``R`` rows of ``N`` tokens of ``d`` channels.
    out_dtype : {torch.float32, torch.float16, torch.bfloat16}, default float32
        The arithmetic is float32; the result is rounded (to nearest even) to ``out_dtype``.
    out : torch.Tensor, optional
        Contiguous ``[R, N, d]`` buffer of ``out_dtype`` to write into (e.g. a slice of a
        preallocated KV buffer); saves the allocation and its page faults.

    Returns
    -------
    torch.Tensor
        ``[R, N, d]`` of ``out_dtype``, on ``block.codes.device`` (``out`` when given). Equal
        to :func:`kv_cache.compression.quantizer.dequantize` of the same codes and metadata.

    Raises
    ------
    TypeError
        ``block`` is not a :class:`QBlock`, ``out_dtype`` is unsupported, ``out`` has another
        dtype.
    ValueError
        A group index of a ``"channel"`` block lies outside its scale table; ``out`` has the
        wrong shape or is not contiguous.

    Examples
    --------
    >>> x = torch.randn(2, 64, 32)
    >>> b = quantize_block(x, 4, "channel", 32)
    >>> dequantize_block(b).shape
    torch.Size([2, 64, 32])
    """
    block = check_block(block, "block")
    out_dtype = check_out_dtype(out_dtype)
    out = check_out(out, block, out_dtype)
    if block.rope is not None:  # keys before RoPE: as attention reads them (the torch path)
        result = reference._dequantize(block, out_dtype)
        return result if out is None else out.copy_(result)
    tri = _triton(block.codes)
    if tri is not None:
        return tri.dequantize_block(block, out_dtype, out)
    ext = _compiled(block.codes)
    if ext is None:
        result = reference._dequantize(block, out_dtype)
        return result if out is None else out.copy_(result)
    R, N, _ = block.codes.shape
    if out is None:
        out = torch.empty((R, N, block.head_dim), dtype=out_dtype, device=block.codes.device)
    ext.dequantize(block.codes.contiguous(), block.bits, block.lut.contiguous(), _GROUPING_ID[block.grouping],
                   block.scale.contiguous(), _c(block.zero), _c(block.gid), block.group_size, out,
                   _build.isa_flag(), _c(block.scale_table))
    return out


def quantize_block(
    x: torch.Tensor,
    bits: int,
    grouping: str,
    group_size: int,
    symmetric: bool = False,
    scale_dtype: torch.dtype = torch.float32,
    lut: torch.Tensor | None = None,
) -> QBlock:
    """Fused quantize + pack of ``x`` into a :class:`QBlock` (§15.2).

    Uniform levels (``lut`` None) reproduce :func:`kv_cache.compression.quantizer.quantize`
    bit for bit: ``"channel"`` is ``quantize(x, bits, axis=-2, group_size=group_size)``
    (statistics over ``group_size`` tokens per channel, KIVI keys) and ``"token"`` is
    ``quantize(x, bits, axis=-1, group_size=group_size)`` (over ``group_size`` channels of a
    token, KIVI values): same codes, same stored scales, same int16 zero points (math
    dictionary §1-§2). With a codebook ``lut`` the scale is the RMS of each group (norm only,
    computed in float64, stored in ``scale_dtype``) and the code is the nearest level of
    ``x / scale`` (midpoint boundaries, ties to the lower level); a group whose stored scale is
    0 dequantizes to 0.

    Parameters
    ----------
    x : torch.Tensor, ``[R, N, d]``
        float16, bfloat16 or float32, finite, non-empty; ``d * bits`` a multiple of 8.
    bits : {2, 3, 4, 8}
    grouping : {"channel", "token"}
    group_size : int
        Tokens per group (``"channel"``; ``N`` must be a multiple) or channels per group
        (``"token"``; must divide ``d``).
    symmetric : bool, default False
        Uniform levels only (ignored with a ``lut``): symmetric codes, no zero point.
    scale_dtype : {torch.float32, torch.float16, torch.bfloat16}, default float32
        Storage dtype of the scales (None: float32, as ``quantize()``); codes are computed
        with the stored scale.
    lut : torch.Tensor, optional
        float32 ``[2**bits]`` strictly increasing codebook levels (e.g. Lloyd-Max).

    Returns
    -------
    QBlock
        ``codes [R, N, d*bits/8]``; ``scale`` ``[R, N // group_size, d]`` (channel) or
        ``[R, N, d // group_size]`` (token) of ``scale_dtype``; ``zero`` int16 of the same
        shape (asymmetric uniform) or None; ``lut`` the uniform table or the given codebook.

    Raises
    ------
    ValueError
        Unsupported bits or grouping, bad rank or group size, empty input, NaN/Inf in ``x``,
        a ``scale_dtype`` that cannot hold the scales, an unsorted codebook.
    TypeError
        Non-tensor ``x``, unsupported dtype of ``x`` or ``scale_dtype``, non-bool ``symmetric``.

    Examples
    --------
    >>> x = torch.randn(1, 128, 64, dtype=torch.float16)
    >>> b = quantize_block(x, 4, "channel", 128, scale_dtype=torch.float16)
    >>> b.codes.shape, b.scale.shape, b.zero.dtype
    (torch.Size([1, 128, 32]), torch.Size([1, 1, 64]), torch.int16)
    """
    a = check_quantize_args(x, bits, grouping, group_size, symmetric, scale_dtype, lut, levels=False)
    tri = _triton(a.x)
    if tri is not None:  # checks the levels on the device, with the data (no extra host read)
        return tri.quantize_block(a)
    check_levels(a.lut)
    ext = _compiled(a.x)
    if ext is None:
        return reference._quantize(a)
    x = a.x.contiguous()
    R, N, d = x.shape
    gs = a.group_size
    meta_shape = (R, N // gs, d) if a.grouping == "channel" else (R, N, d // gs)
    codes = torch.empty((R, N, d * a.bits // 8), dtype=torch.uint8, device=x.device)
    scale = torch.empty(meta_shape, dtype=a.scale_dtype, device=x.device)
    uniform = a.lut is None
    zero = torch.empty(meta_shape, dtype=torch.int16, device=x.device) if uniform and not a.symmetric else None
    mids = None if uniform else midpoints(a.lut)
    status = ext.quantize(x, a.bits, _GROUPING_ID[a.grouping], gs, a.symmetric, mids, codes, scale, zero,
                          _build.isa_flag(), None, [])
    if status == _NON_FINITE:
        raise_non_finite(x, "x")
    if status == _SCALE_UNREPRESENTABLE:
        raise ValueError(
            f"scale_dtype={a.scale_dtype} cannot represent the scales of x "
            f"(max |x| = {float(x.abs().max()):.3g}); use a wider scale_dtype")
    lut_out = uniform_lut(a.bits, a.symmetric, x.device) if uniform else a.lut.contiguous()
    return QBlock(codes, a.bits, lut_out, a.grouping, scale, zero, gs)


def attend_block(
    q: torch.Tensor,
    kblock: QBlock,
    vblock: QBlock,
    scaling: float,
    start: torch.Tensor | None = None,
    length: torch.Tensor | None = None,
    return_logits: bool = False,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor | None]:
    """Attention of ``G`` queries per row over a quantized block, read from the codes (§15.3).

    ``s[r, g, t] = scaling * q[r, g] . k_hat[r, t]``, ``p = softmax(s)`` over the valid tokens
    ``start[r] <= t < length[r]``, ``out = sum_t p_t v_hat[r, t]``. Keys are never dequantized
    to memory: channel-grouped keys pre-scale the query per group (``q~_G = q * scale_G``,
    ``b_G = q~_G . zero_G``, ``s_t = q~_G(t) . lut[code_t] - b_G(t)``), token-grouped keys apply
    the token's scale to its decoded levels in an L1 tile and its zero point as a per-query
    bias; values accumulate ``sum_t p_t lut[code]`` per scale group and subtract
    ``sum_t p_t scale zero`` once. The compiled kernel splits the tokens into chunks across
    threads (online softmax with a running max per chunk, merged by log-sum-exp), and decodes
    each token's codes once for all ``G`` queries.

    Parameters
    ----------
    q : torch.Tensor, float32, ``[R, G, d]``
        The ``G`` query vectors that share KV row ``r`` (GQA: the query heads of a KV head times
        the query positions; the KV is never repeated).
    kblock, vblock : QBlock
        Keys ``[R, N, d]`` and values ``[R, N, d_v]`` (any grouping, bits, lut).
    scaling : float
        Score scale, usually ``d ** -0.5``.
    start, length : torch.Tensor, int32 ``[R]``, optional
        Valid tokens of row ``r`` are ``start[r] <= t < length[r]`` (None: 0 and ``N``):
        left padding and ragged lengths. A row with no valid token gets ``out = 0`` and
        ``lse = -inf``.
    return_logits : bool, default False
        Also return the scaled scores ``s`` (masked tokens ``-inf``), e.g. for eviction
        scores.

    Returns
    -------
    out : torch.Tensor, float32, ``[R, G, d_v]``
        ``sum_t p_t v_hat_t`` with ``p`` normalized over this block's valid tokens.
    lse : torch.Tensor, float32, ``[R, G]``
        ``log sum_t exp(s_t)`` over valid tokens (natural log): merge with other blocks by
        ``out = sum_b exp(lse_b - LSE) out_b``, ``LSE = logsumexp_b(lse_b)``.
    logits : torch.Tensor, float32, ``[R, G, N]``, or None

    Raises
    ------
    TypeError
        ``q`` not float32, blocks not :class:`QBlock`, non-integer ``start``/``length``,
        non-finite or non-numeric ``scaling``.
    ValueError
        Shapes that disagree (``R``, ``N``, ``d``), bad ``start``/``length`` shape, group
        indices outside the scale table.

    Examples
    --------
    >>> k = quantize_block(torch.randn(3, 256, 64), 4, "channel", 128)
    >>> v = quantize_block(torch.randn(3, 256, 64), 4, "token", 64)
    >>> out, lse, _ = attend_block(torch.randn(3, 2, 64), k, v, 64 ** -0.5)
    >>> out.shape, lse.shape
    (torch.Size([3, 2, 64]), torch.Size([3, 2]))
    """
    a = check_attend_args(q, kblock, vblock, scaling, start, length)
    k, v = a.k, a.v
    tri = None if k.flat else _triton(a.q, k.codes, v.codes)  # flat ragged blocks: the torch path on CUDA
    if tri is not None:
        return tri.attend_block(a, bool(return_logits))
    ext = _compiled(a.q, k.codes, v.codes)
    if ext is None:
        return reference._attend(a, bool(return_logits))
    R, G, _ = a.q.shape
    N = k.codes.shape[1]
    dev = a.q.device
    out = torch.empty((R, G, v.head_dim), dtype=torch.float32, device=dev)
    lse = torch.empty((R, G), dtype=torch.float32, device=dev)
    logits = torch.empty((R, G, N), dtype=torch.float32, device=dev) if return_logits else None
    try:
        ext.attend(a.q.contiguous(),
                   _p(k.codes), k.bits, k.lut.contiguous(), _GROUPING_ID[k.grouping],
                   _p(k.scale), _p(k.zero), _p(k.gid), k.group_size,
                   _p(v.codes), v.bits, v.lut.contiguous(), _GROUPING_ID[v.grouping],
                   _p(v.scale), _p(v.zero), _p(v.gid), v.group_size,
                   a.scaling, _c(a.start), _c(a.length), out, lse, logits, _build.isa_flag(),
                   None, [], [], None, None, _c(k.scale_table), _c(v.scale_table), [], [], _c(k.offsets), [], [],
                   *_rope_args(k), [], [], [])
    except ValueError as exc:  # the extension's group-index check
        raise bad_group_error() from exc
    return out, lse, logits


def _rope_args(k: QBlock) -> tuple[list, int, float]:
    """The compiled kernel's ``(k_rope, interleaved, factor)`` for keys stored before RoPE (none: empty)."""
    r = k.rope
    if r is None:
        return [], 0, 1.0
    pos = r.positions
    if not ((k.flat or pos.shape[0] <= 1 or pos.stride(0) == 0) and (pos.shape[1] <= 1 or pos.stride(1) == 1)):
        pos = pos.contiguous()  # kept as is: a flat block's rows, or one row of positions for every row (stride 0)
    return ([pos, r.inv_freq.contiguous(), _row_major(r.mean), _row_major(r.scale), _c(r.signs)],
            int(r.layout == "interleaved"), float(r.scaling))


def _row_major(t: torch.Tensor | None) -> torch.Tensor | None:
    """``t`` ``[R, d]`` as is when each row is contiguous and rows do not overlap (e.g. one slot
    of a ``[R, 2, d]`` offset), else a contiguous copy."""
    if t is None or t.is_contiguous():
        return t
    R, d = t.shape
    return t if (d <= 1 or t.stride(1) == 1) and (R <= 1 or t.stride(0) >= d) else t.contiguous()


def _rows(t: torch.Tensor) -> torch.Tensor:
    """``t`` ``[B, H, n, d]`` as is when each token's ``d`` channels are contiguous and tokens are
    ``d`` apart (any batch/head strides, e.g. a view into a larger buffer), else a contiguous copy."""
    if t.stride(-1) == 1 and (t.shape[2] <= 1 or t.stride(-2) == t.shape[-1]):
        return t
    return t.contiguous()


def _empty_block(R: int, d: int, device) -> QBlock:
    """A packed block of no tokens (8-bit codes, one scale per token): the kernel's stand-in
    when a mixed call has full-precision blocks only (made once per shape and device: it holds
    nothing, and a decoding step of a full-precision layer would otherwise build two)."""
    return _empty_block_on(R, d, str(device))


@functools.lru_cache(maxsize=64)
def _empty_block_on(R: int, d: int, device: str) -> QBlock:
    return QBlock(torch.empty((R, 0, d), dtype=torch.uint8, device=device), 8, uniform_lut(8, False, device),
                  "token", torch.empty((R, 0, 1), dtype=torch.float32, device=device), None, d)


def attend_mixed(
    q: torch.Tensor,
    scaling: float,
    *,
    packed: tuple[QBlock, QBlock, torch.Tensor | None] | None = None,
    dense: tuple | list = (),
    q_packed: torch.Tensor | None = None,
    value_inverse: torch.Tensor | None = None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """One attention over a layer's blocks in one softmax: a packed block read from its codes
    (as :func:`attend_block`) and full-precision blocks (sinks, residual, the new token), all
    split into work items of one parallel call and merged by log-sum-exp inside it (§16).

    This is a decoding step's whole attention for a layer in one kernel call, instead of one
    call per block plus a merge in torch.

    Parameters
    ----------
    q : torch.Tensor, float32, ``[R, G, d]``
        Queries per KV row ``r = b * H + h`` (``G`` query heads x positions share the row).
    scaling : float
        Score scale, usually ``d ** -0.5``.
    packed : ``(kblock, vblock, start)`` or a list of them, optional
        The packed tokens (:class:`QBlock` s over rows ``R``) and the first valid token per row
        (int32 ``[R]`` or None). A list entry may also be ``(kblock, vblock, start, q_packed,
        value_inverse)``: a block stored in a space of its own (e.g. a precision tier's demoted
        tokens, rotated by their own storage); the others use the arguments below.
    dense : sequence of ``(keys, values, start)``
        Full-precision blocks: ``keys`` ``[B, H, n, d]`` and ``values`` ``[B, H, n, d_v]``
        (float32, float16 or bfloat16, ``B * H = R``, each token's channels contiguous),
        ``start`` int32 ``[R]`` or None.
    q_packed : torch.Tensor, float32 ``[R, G, d]``, optional
        Queries of the packed block when its keys are stored rotated (``q R``: ``q.k = qR.kR``).
    value_inverse : torch.Tensor, optional
        The packed block's values are stored rotated: its share of the output is mapped back
        by ``o R^T`` of head ``r % H`` before the full-precision blocks join. Either ``R^T``
        itself, float32 ``[H, d_v, d_v]`` (``o @ value_inverse[r % H]``), or, for a Hadamard
        rotation ``R = diag(s) blockdiag(H_b / sqrt(b))``, its signs ``s``, int8 ``[H, d_v]``
        (``d_v`` even): ``(o blockdiag(H_b / sqrt(b))) * s``, which the compiled kernel applies
        as butterflies (§17) instead of a ``d_v x d_v`` product.

    Returns
    -------
    out : torch.Tensor, float32 ``[R, G, d_v]``
    lse : torch.Tensor, float32 ``[R, G]`` (``-inf`` and ``out = 0`` for a row with no valid token)

    Raises
    ------
    TypeError, ValueError
        As :func:`attend_block` for the packed block; dense blocks of another rank, dtype or
        row count; no block at all; ``q_packed``/``value_inverse`` without a packed block.

    Examples
    --------
    >>> k = quantize_block(torch.randn(3, 256, 64), 4, "channel", 128)
    >>> v = quantize_block(torch.randn(3, 256, 64), 4, "token", 64)
    >>> res = (torch.randn(1, 3, 5, 64), torch.randn(1, 3, 5, 64), None)
    >>> out, lse = attend_mixed(torch.randn(3, 2, 64), 0.125, packed=(k, v, None), dense=[res])
    >>> out.shape, lse.shape
    (torch.Size([3, 2, 64]), torch.Size([3, 2]))
    """
    a = check_mixed_args(q, scaling, packed, dense, q_packed, value_inverse)
    tensors = [a.q] + [t for blk in a.dense for t in blk[:2]]
    for p in a.packed:
        tensors += [p.q, p.k.codes, p.v.codes]
    flat = any(p.k.flat for p in a.packed) or any(blk[3] is not None for blk in a.dense)
    tri = None if flat else _triton(*tensors)  # flat ragged blocks: the torch path on CUDA
    if tri is not None:
        return tri.attend_mixed(a)
    ext = _compiled(*tensors)
    if ext is None:
        return reference._attend_mixed(a)
    R, G, d = a.q.shape
    if a.packed:
        k, v, qp, start = a.packed[0].k, a.packed[0].v, a.packed[0].q.contiguous(), a.packed[0].start
        length = a.packed[0].length
    else:
        dv = a.dense[0][1].shape[-1]
        k, v, qp, start = _empty_block(R, d, a.q.device), _empty_block(R, dv, a.q.device), a.q.contiguous(), None
        length = None
    dk_list = [_rows(blk[0]) for blk in a.dense]
    dv_list = [_rows(blk[1]) for blk in a.dense]
    dense_start = None
    if any(blk[2] is not None for blk in a.dense):
        dense_start = torch.stack([torch.zeros(R, dtype=torch.int32, device=a.q.device) if blk[2] is None else blk[2]
                                   for blk in a.dense]).contiguous()
    out = torch.empty((R, G, v.head_dim), dtype=torch.float32, device=a.q.device)
    lse = torch.empty((R, G), dtype=torch.float32, device=a.q.device)
    extra = [_rope_args(x.k) for x in a.packed[1:]]  # per extra packed block: (tensors, interleaved, factor)
    x_rope = ([e[0] for e in extra], [e[1] for e in extra], [e[2] for e in extra])
    try:
        ext.attend(qp,
                   _p(k.codes), k.bits, k.lut.contiguous(), _GROUPING_ID[k.grouping],
                   _p(k.scale), _p(k.zero), _p(k.gid), k.group_size,
                   _p(v.codes), v.bits, v.lut.contiguous(), _GROUPING_ID[v.grouping],
                   _p(v.scale), _p(v.zero), _p(v.gid), v.group_size,
                   a.scaling, _c(start), _c(length), out, lse, None, _build.isa_flag(),
                   a.q.contiguous(), dk_list, dv_list, dense_start, _c(a.inverses[0] if a.packed else None),
                   _c(k.scale_table), _c(v.scale_table),
                   [[_p(x.k.codes), x.k.lut.contiguous(), _p(x.k.scale), _p(x.k.zero), _p(x.k.gid), _c(x.k.scale_table),
                     _p(x.v.codes), x.v.lut.contiguous(), _p(x.v.scale), _p(x.v.zero), _p(x.v.gid), _c(x.v.scale_table),
                     _c(x.start), x.q.contiguous(), _c(vi), _c(x.k.offsets), _c(x.length if x.k.flat else None)]
                    for x, vi in zip(a.packed[1:], a.inverses[1:])],
                   [[x.k.bits, _GROUPING_ID[x.k.grouping], x.k.group_size, x.v.bits, _GROUPING_ID[x.v.grouping],
                     x.v.group_size] for x in a.packed[1:]],
                   _c(k.offsets), [_c(blk[3]) for blk in a.dense], [_c(blk[4]) for blk in a.dense],
                   *_rope_args(k), *x_rope)
    except ValueError as exc:
        raise bad_group_error() from exc
    return out, lse


__all__ = ["attend_block", "attend_mixed", "dequantize_block", "quantize_block"]


def compact_rows_(buf: torch.Tensor, keep: torch.Tensor) -> torch.Tensor:
    """In place, keep tokens ``keep`` of every row: ``buf[r, j] = buf[r, keep[r, j]]``, ``j < K``.

    Parameters
    ----------
    buf : torch.Tensor, ``[R, cap, ...]``, contiguous, any dtype
    keep : torch.Tensor, int64 ``[R, K]``, sorted ascending and unique per row, ``< cap``

    Returns
    -------
    ``buf`` (slots ``K..cap-1`` of each row are left as they were). The compiled path is one
    forward sweep of ``memmove`` per row (``keep[r, j] >= j``): no temporary, and only tokens
    after the first dropped one move. The torch path gathers into a temporary, then copies.

    Raises
    ------
    TypeError, ValueError
        ``keep`` not int64 ``[R, K]``, or shapes that do not match.
    """
    if keep.dtype != torch.int64 or keep.dim() != 2:
        raise TypeError(f"keep must be an int64 [R, K] tensor; got {keep.dtype} of shape {tuple(keep.shape)}")
    if buf.dim() < 2 or buf.shape[0] != keep.shape[0] or keep.shape[1] > buf.shape[1]:
        raise ValueError(f"buf must be [R, cap, ...] with R = {keep.shape[0]} and cap >= {keep.shape[1]}; "
                         f"got shape {tuple(buf.shape)}")
    if not buf.is_contiguous():
        raise ValueError("buf must be contiguous (it is compacted in place)")
    ext = _compiled(buf, keep)
    if ext is not None:
        ext.compact_rows(buf, keep.contiguous())
        return buf
    K = keep.shape[1]
    rows = torch.arange(buf.shape[0], device=buf.device).unsqueeze(1)
    buf[:, :K] = buf[rows, keep]
    return buf
