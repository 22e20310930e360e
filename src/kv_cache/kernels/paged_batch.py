"""A serving step's attention for every request in one call: paged codes plus the step's own
tokens (math dictionary §28.6).

vLLM hands an attention layer one flat batch per step: ``N`` scheduled tokens, request ``r``
owning rows ``query_start[r] .. query_start[r + 1]`` (one row for a decoding request, a chunk
for a prefilling one), of which the last are its new tokens: ``seq_lens[r]`` counts them too.
:func:`attend_paged_batch` computes, for every token of every request, the softmax attention over

* the request's ``n_r = seq_lens[r] - Q_r`` earlier tokens, read from the paged codes where they
  lie (:mod:`.paged`'s tiles, keys before RoPE turned at read), and
* the step's own tokens of that request up to itself (causal), in full precision,

merged by log-sum-exp; when the cache holds rotated values (``value_rotation`` ``R_h``), the
cached share is accumulated in the rotated space and mapped back once per query row
(``o R_h^T``) before the step's own tokens join. On a CPU this is one compiled call per layer and
step: no per-request Python, no dequantized buffer, no separate merge. Elsewhere (CUDA, or
``KV_CACHE_KERNELS=torch``) :func:`reference_attend_paged_batch` composes :func:`.paged.attend_paged`
per group of requests with torch (the test oracle).
"""

from __future__ import annotations

import torch

from . import _build, _select
from .paged import PagedRope, SlotLayout, attend_paged, check_paged_args, kind_ids


def _check_batch(q, cache, block_table, query_start, seq_lens, k_new, v_new, layout, value_rotation, key_rope):
    """Validate :func:`attend_paged_batch`'s arguments (clear errors naming what was received)."""
    for name, t in (("q", q), ("query_start", query_start), ("seq_lens", seq_lens), ("k_new", k_new),
                    ("v_new", v_new)):
        if not isinstance(t, torch.Tensor):
            raise TypeError(f"{name} must be a torch.Tensor; got {type(t).__name__}")
    if q.dim() != 3 or not q.dtype.is_floating_point:
        raise ValueError(f"q must be a floating [N, Hq, D] tensor; got {q.dtype} {tuple(q.shape)}")
    n, hq, d = q.shape
    r = block_table.shape[0] if isinstance(block_table, torch.Tensor) and block_table.dim() == 2 else -1
    if query_start.dim() != 1 or query_start.shape[0] != r + 1 or query_start.dtype.is_floating_point:
        raise ValueError(f"query_start must be an int [R + 1] = [{r + 1}] tensor; got {query_start.dtype} "
                         f"{tuple(query_start.shape)}")
    h = cache.shape[1] if isinstance(cache, torch.Tensor) and cache.dim() == 4 else -1
    # the paged part's own checks, on a [R, H, 1, D] stand-in for the queries
    check_paged_args(q.new_empty(max(r, 0), max(h, 0), 1, d), cache, block_table, seq_lens, layout, key_rope)
    if hq % h:
        raise ValueError(f"q has {hq} query heads, not a multiple of the cache's {h} kv heads")
    for name, t in (("k_new", k_new), ("v_new", v_new)):
        if tuple(t.shape) != (n, h, d) or not t.dtype.is_floating_point:
            raise ValueError(f"{name} must be a floating [N, H, D] = [{n}, {h}, {d}] tensor; got {t.dtype} "
                             f"{tuple(t.shape)}")
    if value_rotation is not None and (not isinstance(value_rotation, torch.Tensor)
                                       or tuple(value_rotation.shape) != (h, d, d)):
        raise ValueError(f"value_rotation must be None or a [H, D, D] = [{h}, {d}, {d}] tensor; got "
                         f"{tuple(getattr(value_rotation, 'shape', ())) or type(value_rotation).__name__}")
    qs = query_start.long()
    if r > 0:
        lengths = qs[1:] - qs[:-1]
        if int(qs[0]) < 0 or bool((lengths < 0).any()) or int(qs[-1]) > n:
            raise ValueError(f"query_start must rise from >= 0 to at most N = {n}; got {qs.tolist()[:8]}...")
        if bool((seq_lens.long() < lengths).any()):
            raise ValueError("seq_lens must count each request's scheduled tokens too (seq_lens >= its rows in q)")


def attend_paged_batch(q: torch.Tensor, cache: torch.Tensor, block_table: torch.Tensor, query_start: torch.Tensor,
                       seq_lens: torch.Tensor, k_new: torch.Tensor, v_new: torch.Tensor, layout: SlotLayout,
                       scale: float, value_rotation: torch.Tensor | None = None,
                       key_rope: PagedRope | None = None) -> torch.Tensor:
    """Every request's attention for one step (module docstring).

    Parameters
    ----------
    q : torch.Tensor, ``[N, Hq, D]``
        The step's queries, request ``r``'s in rows ``query_start[r] .. query_start[r + 1]``;
        query head ``h * G + g`` reads kv head ``h`` (``G = Hq / H``).
    cache : torch.Tensor, uint8, ``[num_blocks, H, block_size, S]``
    block_table : torch.Tensor, int32 or int64, ``[R, max_blocks]``
    query_start : torch.Tensor, int, ``[R + 1]``
    seq_lens : torch.Tensor, int, ``[R]``
        Each request's tokens including the step's: its first ``seq_lens[r] - Q_r`` are read from
        the cache.
    k_new, v_new : torch.Tensor, ``[N, H, D]``
        The step's keys (after RoPE, as the model attends them) and values, in full precision.
    layout : SlotLayout
    scale : float
        Softmax scale.
    value_rotation : torch.Tensor, ``[H, D, D]``, optional
        The cache stores values as ``v R_h``: the cached share is mapped back by ``R_h^T``.
    key_rope : PagedRope, optional
        The cache stores keys before RoPE: cached token ``t`` is turned to position ``t``.

    Returns
    -------
    torch.Tensor, float32, ``[N, Hq, D]``
        Rows of no request (past ``query_start[-1]``) are 0.

    Raises
    ------
    TypeError, ValueError
        Shapes or dtypes that do not match, ``query_start`` not rising, ``seq_lens`` below a
        request's scheduled tokens, or a block id outside the cache.
    """
    _check_batch(q, cache, block_table, query_start, seq_lens, k_new, v_new, layout, value_rotation, key_rope)
    ext = _select.compiled_for((q, cache, block_table, k_new, v_new))
    if ext is None:
        return reference_attend_paged_batch(q, cache, block_table, query_start, seq_lens, k_new, v_new, layout,
                                            scale, value_rotation, key_rope)
    out = torch.zeros(q.shape, dtype=torch.float32)
    klut, vlut = layout.luts("cpu")
    kk, vk = kind_ids(layout)
    vinv = None if value_rotation is None else value_rotation.float().transpose(-1, -2).contiguous()
    ext.attend_paged_batch(q.float().contiguous(), cache.contiguous(), block_table.to(torch.int32),
                           query_start.long().contiguous(), seq_lens.long().contiguous(),
                           k_new.float().contiguous(), v_new.float().contiguous(), kk, layout.key_bits, klut, vk,
                           layout.value_bits, vlut, layout.norm_table, list(layout.offsets[:4]), float(scale), out,
                           _build.isa_flag(), None if key_rope is None else key_rope.inv_freq.contiguous(),
                           int(key_rope is not None and key_rope.layout == "interleaved"),
                           1.0 if key_rope is None else float(key_rope.scaling), vinv)
    return out


def reference_attend_paged_batch(q: torch.Tensor, cache: torch.Tensor, block_table: torch.Tensor,
                                 query_start: torch.Tensor, seq_lens: torch.Tensor, k_new: torch.Tensor,
                                 v_new: torch.Tensor, layout: SlotLayout, scale: float,
                                 value_rotation: torch.Tensor | None = None,
                                 key_rope: PagedRope | None = None) -> torch.Tensor:
    """:func:`attend_paged_batch` composed per request: the cached part by
    :func:`~kv_cache.kernels.paged.attend_paged` (Triton on CUDA, the torch reference elsewhere),
    the step's tokens by a causal softmax in float32, merged by log-sum-exp. Same arguments and
    returns."""
    _check_batch(q, cache, block_table, query_start, seq_lens, k_new, v_new, layout, value_rotation, key_rope)
    n, hq, d = q.shape
    h = cache.shape[1]
    g = hq // h
    out = torch.zeros(n, hq, d, dtype=torch.float32, device=q.device)
    qs = query_start.long().tolist()
    for r in range(block_table.shape[0]):
        a, b = qs[r], qs[r + 1]
        if b == a:
            continue
        nq = b - a
        qf = q[a:b].float().view(nq, h, g, d).permute(1, 2, 0, 3).reshape(1, h, g * nq, d)  # row = g * Q + i
        cached = torch.tensor([int(seq_lens[r]) - nq], device=block_table.device)
        o_c, l_c = attend_paged(qf, cache, block_table[r:r + 1], cached, layout, scale, key_rope)
        o_c, l_c = o_c[0].view(h, g, nq, d), l_c[0].view(h, g, nq)
        if value_rotation is not None:  # the cached share back from the rotated space: o R_h^T
            o_c = torch.einsum("hgqe,hde->hgqd", o_c, value_rotation.float())
        kf, vf = k_new[a:b].float().transpose(0, 1), v_new[a:b].float().transpose(0, 1)  # [H, Q, D]
        s = torch.einsum("hgqd,htd->hgqt", qf[0].view(h, g, nq, d), kf) * scale
        s = s.masked_fill(torch.ones(nq, nq, dtype=torch.bool, device=q.device).triu(1), float("-inf"))
        l_n = torch.logsumexp(s, -1)
        o_n = torch.einsum("hgqt,htd->hgqd", torch.softmax(s, -1), vf)
        lse = torch.logaddexp(l_c, l_n)
        o = o_c * torch.exp(l_c - lse)[..., None] + o_n * torch.exp(l_n - lse)[..., None]  # l_c = -inf: weight 0
        out[a:b] = o.permute(2, 0, 1, 3).reshape(nq, hq, d)
    return out


__all__ = ["attend_paged_batch", "reference_attend_paged_batch"]
