"""Attention that reads paged codes in place: block by block, with an online softmax.

The first step of the vLLM integration on CPU (pure torch; the compiled kernels and, on CUDA, the
Triton kernels are the next one). No function here decodes a whole sequence into a new buffer:
at most ``blocks_per_step`` blocks per request are decoded at a time, folded into running
``(max, sum, weighted values)`` and dropped.

A request's context is split in two: the ``n_cached`` tokens before this step, read from the
codes, and the step's own tokens (``Q`` queries), attended in full precision with a causal mask,
as vLLM's ``turboquant_attn.py`` does for prefill. (They were also written to the cache before
the forward, for later steps.)

Nothing here imports vLLM.
"""

from __future__ import annotations

import torch

from .codecs import PagedCodec, read_blocks


def _online_update(state, s: torch.Tensor, v: torch.Tensor, eq: str):
    """Fold scores ``s [..., T]`` and values ``v`` into ``(m, l, acc)`` (masked scores are -inf)."""
    m, l, acc = state
    m_new = torch.maximum(m, s.amax(dim=-1))
    m_safe = torch.where(torch.isinf(m_new), torch.zeros_like(m_new), m_new)
    alpha = torch.exp(m - m_safe)
    p = torch.exp(s - m_safe[..., None])
    l = l * alpha + p.sum(dim=-1)
    acc = acc * alpha[..., None] + torch.einsum(eq, p, v)
    return m_new, l, acc


def attend(
    q: torch.Tensor,
    cache: torch.Tensor,
    block_table: torch.Tensor,
    n_cached: torch.Tensor,
    k_new: torch.Tensor,
    v_new: torch.Tensor,
    codec: PagedCodec,
    rotation: torch.Tensor | None,
    scale: float,
    blocks_per_step: int = 8,
) -> torch.Tensor:
    """Causal attention of ``Q`` new tokens per request over paged codes plus themselves.

    Parameters
    ----------
    q : torch.Tensor, ``[R, Q, Hq, D]``
        Queries of the step's tokens (``Hq`` a multiple of ``H``, grouped as in GQA).
    cache : torch.Tensor, uint8, ``[num_blocks, H, block_size, slot_bytes]``
    block_table : torch.Tensor, int, ``[R, max_blocks]``
    n_cached : torch.Tensor, int, ``[R]``
        Tokens before the step, read from the codes (positions ``0 .. n_cached - 1``).
    k_new, v_new : torch.Tensor, ``[R, Q, H, D]``
        The step's keys and values in full precision (query ``i`` sees new tokens ``0 .. i``).
    codec : PagedCodec
    rotation : torch.Tensor or None, float32 ``[H, D, D]``
        Value rotation of rotated codecs (values are accumulated rotated, the output rotated back).
    scale : float
        Softmax scale.
    blocks_per_step : int
        Blocks decoded per step (per request).

    Returns
    -------
    torch.Tensor, float32, ``[R, Q, Hq, D]``
    """
    r, nq, hq, d = q.shape
    h = cache.shape[1]
    bs = cache.shape[2]
    g = hq // h
    qf = q.float().view(r, nq, h, g, d)
    dev = q.device
    m = torch.full((r, nq, h, g), float("-inf"), device=dev)
    state = (m, torch.zeros_like(m), torch.zeros(r, nq, h, g, d, device=dev))
    n_max = int(n_cached.max()) if n_cached.numel() else 0
    n_blocks = -(-n_max // bs)
    table = block_table[:, :n_blocks].long().clamp_min(0)
    for j0 in range(0, n_blocks, blocks_per_step):
        blk = table[:, j0:j0 + blocks_per_step]  # [R, c]
        c = blk.shape[1]
        k, v = read_blocks(cache, blk, codec)  # [R, c, H, bs, D]
        k = k.permute(0, 2, 1, 3, 4).reshape(r, h, c * bs, d)
        v = v.permute(0, 2, 1, 3, 4).reshape(r, h, c * bs, d)
        pos = j0 * bs + torch.arange(c * bs, device=dev)
        mask = pos[None, :] < n_cached[:, None]  # [R, T]
        s = torch.einsum("rqhgd,rhtd->rqhgt", qf, k) * scale
        s = s.masked_fill(~mask[:, None, None, None, :], float("-inf"))
        state = _online_update(state, s, v, "rqhgt,rhtd->rqhgd")
    kf = k_new.float()
    vf = v_new.float()
    if rotation is not None:
        vf = torch.einsum("rkhd,hde->rkhe", vf, rotation)
    s = torch.einsum("rqhgd,rkhd->rqhgk", qf, kf) * scale
    causal = torch.ones(nq, nq, dtype=torch.bool, device=dev).tril()
    s = s.masked_fill(~causal[None, :, None, None, :], float("-inf"))
    m, l, acc = _online_update(state, s, vf, "rqhgk,rkhd->rqhgd")
    out = acc / l[..., None]
    if rotation is not None:
        out = torch.einsum("rqhge,hde->rqhgd", out, rotation)
    return out.reshape(r, nq, hq, d)
