"""Argument checks shared by the compiled ops (:mod:`.ops`) and the torch reference."""

from __future__ import annotations

import functools
import math
import weakref
from dataclasses import dataclass

import torch

from ..compression.rotation import hadamard_matrix
from .qblock import SCALE_DTYPES, QBlock, _names, check_bits, check_grouping

X_DTYPES = (torch.float16, torch.bfloat16, torch.float32)
OUT_DTYPES = (torch.float16, torch.bfloat16, torch.float32)


def check_block(block, name: str) -> QBlock:
    if not isinstance(block, QBlock):
        raise TypeError(f"{name} must be a QBlock; got {type(block).__name__}")
    return block


def check_out_dtype(out_dtype) -> torch.dtype:
    if out_dtype not in OUT_DTYPES:
        raise TypeError(f"out_dtype must be one of {_names(OUT_DTYPES)}; got {out_dtype!r}")
    return out_dtype


def check_out(out, block: QBlock, out_dtype: torch.dtype) -> torch.Tensor | None:
    """Validate an ``out=`` buffer for a dequantized block: ``[R, N, d]`` of ``out_dtype``, contiguous."""
    if out is None:
        return None
    if not isinstance(out, torch.Tensor):
        raise TypeError(f"out must be None or a torch.Tensor; got {type(out).__name__}")
    R, N, _ = block.codes.shape
    shape = (R, N, block.head_dim)
    if out.dtype != out_dtype:
        raise TypeError(f"out must have dtype out_dtype={out_dtype}; got {out.dtype}")
    if tuple(out.shape) != shape:
        raise ValueError(f"out must have shape [R, N, d] = {list(shape)}; got {list(out.shape)}")
    if not out.is_contiguous() or out.device != block.codes.device:
        raise ValueError(f"out must be contiguous and on {block.codes.device}")
    return out


@dataclass(frozen=True)
class QuantizeArgs:
    x: torch.Tensor
    bits: int
    grouping: str
    group_size: int
    symmetric: bool
    scale_dtype: torch.dtype
    lut: torch.Tensor | None


def check_quantize_args(x, bits, grouping, group_size, symmetric, scale_dtype, lut, levels: bool = True
                        ) -> QuantizeArgs:
    """Validate :func:`~kv_cache.kernels.quantize_block`'s arguments (finiteness is checked later).

    ``levels=False`` leaves the values of ``lut`` to :func:`check_levels` (or to a kernel that
    checks them on the device: reading them here would synchronize a GPU)."""
    bits = check_bits(bits)
    grouping = check_grouping(grouping)
    if not isinstance(x, torch.Tensor):
        raise TypeError(f"x must be a torch.Tensor; got {type(x).__name__}")
    if x.dtype not in X_DTYPES:
        raise TypeError(f"x must be one of {_names(X_DTYPES)}; got {x.dtype}")
    if x.dim() != 3:
        raise ValueError(f"x must be rank 3 [R, N, d]; got shape {tuple(x.shape)}")
    if x.numel() == 0:
        raise ValueError(f"x is empty (shape {tuple(x.shape)}); nothing to compress")
    _, N, d = x.shape
    if (d * bits) % 8:
        raise ValueError(f"d * bits must be a multiple of 8 (whole bytes per token); got d={d}, bits={bits}")
    if isinstance(group_size, bool) or not isinstance(group_size, int) or group_size < 1:
        raise ValueError(f"group_size must be an int >= 1; got {group_size!r}")
    if grouping == "channel" and N % group_size:
        raise ValueError(f"channel grouping needs N a multiple of group_size; got N={N}, group_size={group_size}")
    if grouping == "token" and d % group_size:
        raise ValueError(f"token grouping needs group_size dividing d={d}; got group_size={group_size}")
    if not isinstance(symmetric, bool):
        raise TypeError(f"symmetric must be a bool; got {symmetric!r}")
    if scale_dtype is None:  # as quantize(): the statistics dtype
        scale_dtype = torch.float32
    if scale_dtype not in SCALE_DTYPES:
        raise TypeError(f"scale_dtype must be one of {_names(SCALE_DTYPES)}; got {scale_dtype!r}")
    if lut is not None:
        if not isinstance(lut, torch.Tensor):
            raise TypeError(f"lut must be None or a torch.Tensor; got {type(lut).__name__}")
        if lut.dtype != torch.float32 or tuple(lut.shape) != (1 << bits,):
            raise ValueError(
                f"lut must be float32 of shape [{1 << bits}] for {bits}-bit codes; got {lut.dtype} "
                f"of shape {tuple(lut.shape)}")
        if levels:
            check_levels(lut)
        lut = lut.to(x.device)
    return QuantizeArgs(x, bits, grouping, group_size, symmetric, scale_dtype, lut)


LEVELS_ERROR = "lut (codebook levels) must be finite and strictly increasing"


_CHECKED_LEVELS: dict[int, tuple] = {}
"""Codebooks already checked and their midpoints, by ``id``: ``(weakref, version, midpoints)``. A
layout's levels are one tensor reused by every store (a decoding step's arrival codes one token
per layer): checked and reduced once, again only if the tensor was modified in place
(``_version``) or another tensor took its ``id``."""


def _checked(lut: torch.Tensor) -> torch.Tensor | None:
    hit = _CHECKED_LEVELS.get(id(lut))
    if hit is not None and hit[0]() is lut and hit[1] == lut._version:
        return hit[2]
    return None


def check_levels(lut: torch.Tensor | None) -> None:
    """Raise ``ValueError`` unless the codebook ``lut`` (None: uniform levels) is finite and strictly increasing."""
    if lut is None or _checked(lut) is not None:
        return
    if not bool(torch.isfinite(lut).all()) or not bool((lut[1:] > lut[:-1]).all()):
        raise ValueError(LEVELS_ERROR)
    if len(_CHECKED_LEVELS) >= 64:
        _CHECKED_LEVELS.clear()
    _CHECKED_LEVELS[id(lut)] = (weakref.ref(lut), lut._version, ((lut[:-1] + lut[1:]) * 0.5).contiguous())


def midpoints(lut: torch.Tensor) -> torch.Tensor:
    """Decision boundaries of a sorted codebook: ``(lut[i] + lut[i+1]) / 2`` in float32."""
    hit = _checked(lut)
    return ((lut[:-1] + lut[1:]) * 0.5).contiguous() if hit is None else hit


@dataclass(frozen=True)
class AttendArgs:
    q: torch.Tensor
    k: QBlock
    v: QBlock
    scaling: float
    start: torch.Tensor | None
    length: torch.Tensor | None


def _row_index(t, name: str, R: int) -> torch.Tensor | None:
    if t is None:
        return None
    if not isinstance(t, torch.Tensor):
        raise TypeError(f"{name} must be None or an integer tensor [R]; got {type(t).__name__}")
    if t.dtype.is_floating_point or t.dtype.is_complex or t.dtype == torch.bool:
        raise TypeError(f"{name} must be an integer tensor (int32); got {t.dtype}")
    if tuple(t.shape) != (R,):
        raise ValueError(f"{name} must have shape [R] = [{R}]; got {list(t.shape)}")
    return t if t.dtype == torch.int32 else t.to(torch.int32)


def check_attend_args(q, kblock, vblock, scaling, start, length) -> AttendArgs:
    """Validate :func:`~kv_cache.kernels.attend_block`'s arguments."""
    k = check_block(kblock, "kblock")
    v = check_block(vblock, "vblock")
    if not isinstance(q, torch.Tensor):
        raise TypeError(f"q must be a torch.Tensor; got {type(q).__name__}")
    if q.dtype != torch.float32:
        raise TypeError(f"q must be float32; got {q.dtype}")
    if q.dim() != 3:
        raise ValueError(f"q must be rank 3 [R, G, d]; got shape {tuple(q.shape)}")
    R = k.codes.shape[0]
    if q.shape[0] != R or v.codes.shape[0] != R:
        raise ValueError(
            f"q, kblock and vblock must have the same rows R; got {q.shape[0]}, {R}, {v.codes.shape[0]}")
    if k.codes.shape[1] != v.codes.shape[1]:
        raise ValueError(f"kblock and vblock must hold the same N tokens; got {k.codes.shape[1]} and {v.codes.shape[1]}")
    if q.shape[2] != k.head_dim:
        raise ValueError(f"q has d={q.shape[2]} but kblock holds d={k.head_dim}")
    if v.rope is not None:
        raise ValueError("rope (keys stored before RoPE) applies to kblock only; got it on vblock")
    if isinstance(scaling, bool) or not isinstance(scaling, (int, float)) or not math.isfinite(scaling):
        raise TypeError(f"scaling must be a finite float; got {scaling!r}")
    if k.flat != v.flat or (k.flat and (k.offsets is not v.offsets and not torch.equal(k.offsets, v.offsets))):
        raise ValueError("kblock and vblock of a flat ragged block must share their offsets")
    length = _row_index(length, "length", R)
    if k.flat:  # a row's tokens end at its own length
        length = k.lengths if length is None else torch.minimum(length, k.lengths)
    return AttendArgs(q, k, v, float(scaling), _row_index(start, "start", R), length)


def bad_group_error() -> ValueError:
    return ValueError(
        "a group index in gid is outside [0, scale.shape[1]) (or gid is None and N exceeds "
        "scale.shape[1] * group_size)")


DENSE_DTYPES = (torch.float32, torch.float16, torch.bfloat16)


@dataclass(frozen=True)
class MixedArgs:
    q: torch.Tensor                       # [R, G, d] float32: queries of the full-precision blocks
    packed: tuple                         # AttendArgs of each packed block (queries: q, or q R when rotated)
    dense: tuple                          # ((keys [B, H, n, dk], values [B, H, n, dv], start [R] int32 | None,
                                          #   offsets [R] int64 | None, lengths [R] int32 | None), ...)
    inverses: tuple                       # per packed block: [H', dv, dv] float32, [H', dv] int8 signs, or None
    scaling: float


def check_mixed_args(q, scaling, packed, dense, q_packed, value_inverse) -> MixedArgs:
    """Validate :func:`~kv_cache.kernels.attend_mixed`'s arguments."""
    if not isinstance(q, torch.Tensor):
        raise TypeError(f"q must be a torch.Tensor; got {type(q).__name__}")
    if q.dtype != torch.float32 or q.dim() != 3:
        raise TypeError(f"q must be a float32 [R, G, d] tensor; got {q.dtype} of shape {tuple(q.shape)}")
    if isinstance(scaling, bool) or not isinstance(scaling, (int, float)) or not math.isfinite(scaling):
        raise TypeError(f"scaling must be a finite float; got {scaling!r}")
    R, _, d = q.shape
    dv = None
    ps, inverses = [], []
    if packed is not None:
        many = isinstance(packed, list)
        for blk in packed if many else [packed]:
            if not isinstance(blk, tuple) or len(blk) not in ((3, 5) if many else (3,)):
                raise TypeError("packed must be None, a (kblock, vblock, start) tuple or a list of them (entries "
                                "may add their own q_packed and value_inverse)")
            qp, vi = (q if q_packed is None else q_packed, value_inverse) if len(blk) == 3 else (blk[3], blk[4])
            if not isinstance(qp, torch.Tensor) or tuple(qp.shape) != tuple(q.shape):
                raise ValueError(f"q_packed must have q's shape {tuple(q.shape)}; got "
                                 f"{tuple(getattr(qp, 'shape', ()))}")
            ps.append(check_attend_args(qp, blk[0], blk[1], scaling, blk[2], None))
            if dv is not None and ps[-1].v.head_dim != dv:
                raise ValueError(f"packed blocks hold values of d_v={ps[-1].v.head_dim} and {dv}")
            dv = ps[-1].v.head_dim
            inverses.append(_check_inverse(vi, dv, R))
    if not ps and (q_packed is not None or value_inverse is not None):
        raise ValueError("q_packed and value_inverse apply to the packed block; got them with packed=None")
    blocks = []
    for i, blk in enumerate(dense):
        if not isinstance(blk, tuple) or len(blk) not in (3, 5):
            raise TypeError(f"dense[{i}] must be a (keys, values, start) tuple, or (keys, values, start, offsets, "
                            "lengths) for a flat ragged block")
        k, v, st = blk[:3]
        off, ln = blk[3:] if len(blk) == 5 else (None, None)
        if (off is None) != (ln is None):
            raise ValueError(f"dense[{i}]: a flat ragged block needs both offsets and lengths")
        if off is not None:
            if not isinstance(off, torch.Tensor) or off.dtype != torch.int64 or tuple(off.shape) != (R,):
                raise ValueError(f"dense[{i}] offsets must be int64 [R] = [{R}]")
            ln = _row_index(ln, f"dense[{i}] lengths", R)
        for name, t in (("keys", k), ("values", v)):
            if not isinstance(t, torch.Tensor) or t.dim() != 4:
                raise ValueError(f"dense[{i}] {name} must be a rank-4 [B, H, n, d] tensor")
            if t.dtype not in DENSE_DTYPES:
                raise TypeError(f"dense[{i}] {name} must be one of {_names(DENSE_DTYPES)}; got {t.dtype}")
        if k.dtype != v.dtype or k.shape[:3] != v.shape[:3] or k.shape[0] * k.shape[1] != R:
            raise ValueError(f"dense[{i}]: keys {tuple(k.shape)} {k.dtype} and values {tuple(v.shape)} {v.dtype} "
                             f"must share dtype and [B, H, n] with B * H = R = {R}")
        if k.shape[3] != d:
            raise ValueError(f"dense[{i}] keys have d={k.shape[3]} but q has d={d}")
        if dv is not None and v.shape[3] != dv:
            raise ValueError(f"dense[{i}] values have d_v={v.shape[3]}, the other blocks {dv}")
        dv = v.shape[3]
        blocks.append((k, v, _row_index(st, f"dense[{i}] start", R), off, ln))
    if not ps and not blocks:
        raise ValueError("attend_mixed needs a packed block or at least one dense block; got neither")
    return MixedArgs(q, tuple(ps), tuple(blocks), tuple(inverses), float(scaling))


def _check_inverse(vi, dv: int, R: int) -> torch.Tensor | None:
    """``value_inverse`` of one packed block: None, dense ``R^T`` per head (float32 ``[H, d_v, d_v]``)
    or the signs of a Hadamard rotation (int8 ``[H, d_v]``, ``d_v`` even; see
    :func:`value_inverse_matrices`), ``R`` a multiple of ``H``."""
    if vi is None:
        return None
    ok = isinstance(vi, torch.Tensor) and vi.dim() in (2, 3) and vi.shape[0] > 0 and R % vi.shape[0] == 0 and (
        (vi.dtype == torch.float32 and vi.dim() == 3 and tuple(vi.shape[1:]) == (dv, dv))
        or (vi.dtype == torch.int8 and vi.dim() == 2 and vi.shape[1] == dv and dv >= 2 and dv % 2 == 0))
    if not ok:
        raise ValueError(f"value_inverse must be float32 [H, d_v, d_v] = [H, {dv}, {dv}] (R^T per head) or "
                         f"int8 [H, d_v] = [H, {dv}] (Hadamard signs, d_v even), with R = {R} a multiple of "
                         f"H >= 1; got {getattr(vi, 'dtype', type(vi).__name__)} of shape "
                         f"{tuple(getattr(vi, 'shape', ()))}")
    return vi


@functools.lru_cache(maxsize=16)
def _hadamard_on(dim: int, device: str) -> torch.Tensor:
    return hadamard_matrix(dim, dtype=torch.float32).to(device)


def value_inverse_matrices(vi: torch.Tensor | None) -> torch.Tensor | None:
    """A checked ``value_inverse`` as float32 ``[H, d_v, d_v]`` matrices (None stays None).

    Signs ``s`` (int8 ``[H, d_v]``) name the rotation ``R = diag(s) B`` with
    ``B = blockdiag(H_b / sqrt(b))`` (:func:`~kv_cache.compression.rotation.hadamard_matrix`, the
    blocks of :func:`~kv_cache.compression.rotation.pow2_blocks`), so ``o R^T = (o B) * s``: the
    matrix ``B * s`` (column ``j`` times ``s_j``). The compiled kernel applies the signs by
    butterflies instead; the torch and Triton paths multiply by this matrix."""
    if vi is None or vi.dim() == 3:
        return vi
    b = _hadamard_on(vi.shape[-1], str(vi.device))
    return (b.unsqueeze(0) * vi.to(torch.float32).unsqueeze(1)).contiguous()
