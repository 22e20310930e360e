"""Attention that reads paged codes in place: block by block, with an online softmax.

Two paths read a request's cached tokens; each part's output and log-sum-exp fold into the
running pair (math dictionary §28.4), so no function here decodes a whole sequence into a new
buffer:

* ``kernels`` (the default where they serve the device): the compiled CPU kernels, or the Triton
  kernel on CUDA, walk each request's block table and read the codes where they lie in vLLM's
  blocks (:func:`kv_cache.kernels.paged.attend_paged`, the codec's layout from :mod:`.blocks`):
  nothing is gathered or dequantized to memory;
* ``torch`` (``KV_CACHE_KERNELS=torch``, or a device neither serves): the part is decoded and
  attended with torch's CPU flash kernel, then dropped.

:func:`attend_batch` is what the backend calls once per layer and step: on a CPU with the
compiled kernels, one call for every request of the batch (decoding rows and prefill chunks
alike), the step's own tokens, the merge and the value rotation inside it
(:func:`kv_cache.kernels.paged_batch.attend_paged_batch`); otherwise :func:`attend` for the
decoding requests together and for each prefill chunk.

A request's context is split in two: the ``n_cached`` tokens before this step, read from the
codes, and the step's own tokens (``Q`` queries), attended in full precision with a causal mask,
as vLLM's ``turboquant_attn.py`` does for prefill. (They were also written to the cache before
the forward, for later steps.)

Nothing here imports vLLM.
"""

from __future__ import annotations

import torch

from ...kernels import backend
from ...kernels.paged import PagedRope, attend_paged, turn_keys
from ...kernels.paged_batch import attend_paged_batch
from .blocks import slot_layout
from .codecs import PagedCodec, read_blocks


def kernels_serve(device: torch.device | str) -> bool:
    """Whether the compiled (CPU) or Triton (CUDA) kernels serve ``device`` (builds them on the
    first call on a CPU; ``KV_CACHE_KERNELS=torch`` says no)."""
    return backend(device) in ("compiled", "triton")


def _check_key_rope(codec: PagedCodec, key_rope: PagedRope | None) -> None:
    """A codec storing keys before RoPE reads them only with the layer's frame."""
    if codec.pre_rope and key_rope is None:
        raise ValueError(f"kv_cache codec {codec.name!r} stores keys before RoPE: pass key_rope (the layer's frame)")


def _flash(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, causal: bool, scale: float,
           mask: torch.Tensor | None = None) -> tuple[torch.Tensor, torch.Tensor]:
    """``(softmax(q k^T * scale) v, logsumexp)`` for ``[B, H, L, D]`` inputs (torch's CPU flash kernel).

    Rows without any visible key come back as output 0 and log-sum-exp ``-inf``.
    """
    if q.device.type == "cpu":
        out, lse = torch.ops.aten._scaled_dot_product_flash_attention_for_cpu(
            q, k, v, 0.0, causal, attn_mask=mask, scale=scale)
    else:
        s = torch.einsum("bhqd,bhtd->bhqt", q, k) * scale
        if causal:
            s = s.masked_fill(~torch.ones(s.shape[-2:], dtype=torch.bool, device=q.device).tril(), float("-inf"))
        if mask is not None:
            s = s + mask
        lse = torch.logsumexp(s, dim=-1)
        out = torch.einsum("bhqt,bhtd->bhqd", torch.softmax(s, dim=-1), v)
    empty = torch.isinf(lse)
    if bool(empty.any()):
        out = torch.where(empty[..., None], torch.zeros_like(out), out)
    return out, lse


def _merge(state, part):
    """Combine two normalized partial attentions ``(out, lse)`` over disjoint key sets."""
    o1, l1 = state
    o2, l2 = part
    lse = torch.logaddexp(l1, l2)
    safe = torch.where(torch.isinf(lse), torch.zeros_like(lse), lse)
    return o1 * torch.exp(l1 - safe)[..., None] + o2 * torch.exp(l2 - safe)[..., None], lse


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
    kernels: bool | None = None,
    key_rope: PagedRope | None = None,
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
        Blocks decoded per step (per request) by the torch path; the kernels walk the whole table.
    kernels : bool, optional
        Read the codes with the compiled / Triton kernels (True) or decode each part with torch
        (False); None: the kernels where :func:`kernels_serve` says they serve the device.
    key_rope : PagedRope, optional
        The layer's frame for codecs storing keys before RoPE (``codec.pre_rope``; required
        there): cached token ``t`` is turned to position ``t`` at read.

    Returns
    -------
    torch.Tensor, float32, ``[R, Q, Hq, D]``
    """
    _check_key_rope(codec, key_rope)
    r, nq, hq, d = q.shape
    h = cache.shape[1]
    bs = cache.shape[2]
    g = hq // h
    dev = q.device
    # Queries of one kv head side by side: [R, H, G * Q, D] (row = g * Q + i) for the cached part,
    # where every query sees every key (no expansion of the keys to Hq heads).
    qf = q.float().permute(0, 2, 1, 3).reshape(r, h, g * nq, d)
    n_blocks = -(-int(n_cached.max()) // bs) if n_cached.numel() else 0
    table = block_table[:, :n_blocks].long().clamp_min(0)
    if kernels is None:
        kernels = n_blocks > 0 and kernels_serve(dev)
    read = _cached_by_kernels if kernels else _cached_by_torch
    state = read(qf, cache, table, n_cached, codec, scale, blocks_per_step, key_rope if codec.pre_rope else None)
    # the step's own tokens, causal: expand keys to the query heads
    o, lse = state
    o = o.view(r, h, g, nq, d).reshape(r, hq, nq, d)
    lse = lse.view(r, h, g, nq).reshape(r, hq, nq)
    vf = v_new.float()
    if rotation is not None:
        vf = torch.einsum("rkhd,hde->rkhe", vf, rotation)
    kf = k_new.float().permute(0, 2, 1, 3).repeat_interleave(g, dim=1)  # [R, Hq, Q, D]
    vf = vf.permute(0, 2, 1, 3).repeat_interleave(g, dim=1)
    qh = q.float().permute(0, 2, 1, 3)  # [R, Hq, Q, D]
    if nq == 1:  # a decode step: each query sees only its own new token (softmax weight 1)
        fresh = (vf, (qh * kf).sum(-1) * scale)
    else:
        fresh = _flash(qh.contiguous(), kf.contiguous(), vf.contiguous(), True, scale)
    out, _ = _merge((o, lse), fresh)
    out = out.permute(0, 2, 1, 3)  # [R, Q, Hq, D]
    if rotation is not None:  # query head h * G + i reads kv head h
        out = torch.einsum("rqhge,hde->rqhgd", out.reshape(r, nq, h, g, d), rotation).reshape(r, nq, hq, d)
    return out


def _cached_by_kernels(qf: torch.Tensor, cache: torch.Tensor, table: torch.Tensor, n_cached: torch.Tensor,
                       codec: PagedCodec, scale: float, blocks_per_step: int,
                       key_rope: PagedRope | None = None) -> tuple[torch.Tensor, torch.Tensor]:
    """``(output, log-sum-exp)`` of queries ``qf`` ``[R, H, M, D]`` over each request's cached
    tokens, read by the kernels through the block table, in place (``blocks_per_step`` unused)."""
    return attend_paged(qf, cache, table, n_cached.to(table.device), slot_layout(codec), scale, key_rope)


def _cached_by_torch(qf: torch.Tensor, cache: torch.Tensor, table: torch.Tensor, n_cached: torch.Tensor,
                     codec: PagedCodec, scale: float, blocks_per_step: int,
                     key_rope: PagedRope | None = None) -> tuple[torch.Tensor, torch.Tensor]:
    """``(output, log-sum-exp)`` of queries ``qf`` ``[R, H, M, D]`` over each request's cached
    tokens: ``blocks_per_step`` blocks at a time decoded, attended with torch's flash kernel, dropped."""
    r, h, m, d = qf.shape
    bs = cache.shape[2]
    dev = qf.device
    state = (torch.zeros(r, h, m, d, device=dev), torch.full((r, h, m), float("-inf"), device=dev))
    counts = n_cached.tolist()
    n_max = max(counts) if counts else 0
    uniform = all(c == n_max for c in counts)
    for j0 in range(0, table.shape[1], blocks_per_step):
        blk = table[:, j0:j0 + blocks_per_step]  # [R, c]
        c = blk.shape[1]
        k, v = read_blocks(cache, blk, codec)  # [R, c, H, bs, D]
        k = k.permute(0, 2, 1, 3, 4).reshape(r, h, c * bs, d)
        v = v.permute(0, 2, 1, 3, 4).reshape(r, h, c * bs, d)
        if key_rope is not None:  # token j0 * bs + i of the part at its position
            k = turn_keys(k, j0 * bs, key_rope)
        mask = None
        if uniform:  # one length for every request: slice, no mask
            t = min(c * bs, n_max - j0 * bs)
            k, v = k[:, :, :t].contiguous(), v[:, :, :t].contiguous()
        else:
            pos = j0 * bs + torch.arange(c * bs, device=dev)
            visible = pos[None, :] < n_cached.to(dev)[:, None]  # [R, T]
            mask = torch.zeros(r, 1, 1, c * bs, device=dev).masked_fill(~visible[:, None, None, :], float("-inf"))
        state = _merge(state, _flash(qf, k, v, False, scale, mask))
    return state


def attend_batch(
    q: torch.Tensor,
    cache: torch.Tensor,
    block_table: torch.Tensor,
    query_start: torch.Tensor,
    seq_lens: torch.Tensor,
    k_new: torch.Tensor,
    v_new: torch.Tensor,
    codec: PagedCodec,
    rotation: torch.Tensor | None,
    scale: float,
    blocks_per_step: int = 8,
    kernels: bool | None = None,
    key_rope: PagedRope | None = None,
) -> torch.Tensor:
    """One step's attention for every request of a vLLM batch.

    Parameters
    ----------
    q : torch.Tensor, ``[N, Hq, D]``
        The step's queries; request ``r`` owns rows ``query_start[r] .. query_start[r + 1]``.
    cache, codec, rotation, scale, blocks_per_step, key_rope : as :func:`attend`
    block_table : torch.Tensor, int, ``[R, max_blocks]``
    query_start : torch.Tensor, int, ``[R + 1]`` (CPU)
    seq_lens : torch.Tensor, int, ``[R]`` (CPU): tokens of each request including the step's
    k_new, v_new : torch.Tensor, ``[N, H, D]``, the step's keys and values
    kernels : bool, optional
        The one compiled call (True, where the compiled CPU kernels serve ``q``'s device) or
        :func:`attend` per group of requests (False); None: the compiled call where it serves.

    Returns
    -------
    torch.Tensor, float32, ``[N, Hq, D]`` (rows past ``query_start[-1]`` are 0)
    """
    _check_key_rope(codec, key_rope)
    if kernels is None:
        kernels = backend(q.device) == "compiled"
    if kernels:
        return attend_paged_batch(q, cache, block_table, query_start, seq_lens, k_new, v_new, slot_layout(codec),
                                  scale, rotation, key_rope if codec.pre_rope else None)
    n, hq, d = q.shape
    out = torch.zeros(n, hq, d, dtype=torch.float32, device=q.device)
    qsl = query_start.tolist()
    seq = seq_lens.tolist()
    decodes = [i for i in range(len(seq)) if qsl[i + 1] - qsl[i] == 1]
    if decodes:
        idx = torch.tensor([qsl[i] for i in decodes], device=q.device)
        rows = torch.tensor(decodes, device=block_table.device)
        n_cached = torch.tensor([seq[i] - 1 for i in decodes])
        res = attend(q[idx][:, None], cache, block_table[rows], n_cached, k_new[idx][:, None], v_new[idx][:, None],
                     codec, rotation, scale, blocks_per_step, key_rope=key_rope)
        out[idx] = res[:, 0]
    for i in range(len(seq)):
        a, b = qsl[i], qsl[i + 1]
        if b - a <= 1:
            continue
        res = attend(q[None, a:b], cache, block_table[i:i + 1], torch.tensor([seq[i] - (b - a)]), k_new[None, a:b],
                     v_new[None, a:b], codec, rotation, scale, blocks_per_step, key_rope=key_rope)
        out[a:b] = res[0]
    return out
