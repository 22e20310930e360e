"""KVzip's repeat chunk in one pass over its keys: the chunk's attention output and its
reconstruction scores from the same log-sum-exps (math dictionary §19.3, "One pass").

A repeat chunk's queries attend to every stored token and causally to the chunk itself (the
model's forward), while KVzip scores slot ``t`` of the repeated range ``[start, end)`` by its
probability under a softmax restricted to the sinks, that range and the chunk. Computed apart,
the restricted softmax runs the chunk's logits over those keys a second time, with a
log-sum-exp over every one of them. Here the keys are split into three parts, each attended once
by a flash kernel that returns its log-sum-exp:

* ``ctx``: the sinks and the repeated range (every query sees all of them),
* ``rest``: the other stored tokens (every query sees all of them),
* ``own``: the chunk's own tokens (causal).

The output is the log-sum-exp merge of the three; the restricted normalizer is
``lse_ctx (+) lse_own``, so a slot's score is ``exp(max_{g,i}(q_{g,i} . k_t tau - lse_{g,i}))``:
one matrix product over the repeated range, no softmax over it. Same scores and output as
:func:`~kv_cache.attention.blocks.reconstruction_scores` beside torch's sdpa, up to float rounding.
"""

from __future__ import annotations

import torch

from .blocks import STAT_CHUNK_BYTES, merge

_FLASH_CPU = getattr(torch.ops.aten, "_scaled_dot_product_flash_attention_for_cpu", None)


def one_pass_available(query: torch.Tensor, values: torch.Tensor) -> bool:
    """Whether :func:`repeat_chunk_attention` serves ``query`` ``[..., d]`` over ``values``
    ``[..., d_v]``: on CPU, in a dtype torch's CPU flash kernel takes (float32, bfloat16,
    float16), with ``d_v = d`` (the kernel's one head size). Otherwise the chunk takes the
    two-pass path (sdpa, then :func:`~kv_cache.attention.blocks.reconstruction_scores`)."""
    return (_FLASH_CPU is not None and query.device.type == "cpu" and query.shape[-1] == values.shape[-1]
            and query.dtype in (torch.float32, torch.bfloat16, torch.float16))


def _flash(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, scaling: float, causal: bool
           ) -> tuple[torch.Tensor, torch.Tensor]:
    """``(out [B, H, M, d_v], lse [B, H, M] float32)`` of ``softmax(q k^T scaling) v``."""
    out, lse = _FLASH_CPU(q, k, v, 0.0, causal, scale=scaling)
    return out, lse.float()


def repeat_chunk_attention(
    query: torch.Tensor,
    stored_keys: torch.Tensor,
    stored_values: torch.Tensor,
    new_keys: torch.Tensor,
    new_values: torch.Tensor,
    scaling: float,
    sinks: int,
    start: int,
    end: int,
) -> tuple[torch.Tensor, torch.Tensor]:
    """A repeat chunk's attention output and KVzip scores in one pass (module docstring).

    Parameters
    ----------
    query : ``[B, Hq, L, d]``, the chunk's post-RoPE queries (``Hq = G * Hkv``)
    stored_keys, stored_values : ``[B, Hkv, T, d]`` each, the stored context in full precision
        (keys as the model computed them)
    new_keys, new_values : ``[B, Hkv, L, d]`` each, the chunk's own tokens
    scaling : the softmax scale
    sinks : the first ``sinks`` stored slots, in the scores' softmax (``sinks <= start``)
    start, end : the repeated slots ``[start, end)``, ``end <= T``

    Returns
    -------
    out : ``[B, L, Hq, d]`` in the stored keys' dtype (the layout attention functions return)
    scores : float32 ``[B, Hkv, end - start]``, each repeated slot's largest probability over the
        chunk's queries and the query heads of its KV head (math dictionary §19.3)

    Raises
    ------
    ValueError
        Slots outside ``0 <= sinks <= start <= end <= T``, query heads that are not a
        multiple of the KV heads, or values of another head size than the keys.
    """
    B, Hq, L, d = query.shape
    H, T = stored_keys.shape[1], stored_keys.shape[2]
    if not 0 <= sinks <= start <= end <= T:
        raise ValueError(f"need 0 <= sinks <= start <= end <= T; got sinks={sinks}, start={start}, end={end}, T={T}")
    if Hq % H:
        raise ValueError(f"query heads ({Hq}) must be a multiple of the KV heads ({H})")
    if stored_values.shape[-1] != d or new_values.shape[-1] != d:
        raise ValueError(f"the one-pass repeat chunk needs values of the keys' head size {d}; got "
                         f"{stored_values.shape[-1]} (use the two-pass path: one_pass_available is False)")
    G = Hq // H
    dtype = stored_keys.dtype
    q = query.to(dtype)
    qg = q.reshape(B, H, G * L, d)  # the query heads of a KV head as rows of one attention
    ctx_k = torch.cat([stored_keys[:, :, :sinks], stored_keys[:, :, start:end]], 2)
    ctx_v = torch.cat([stored_values[:, :, :sinks], stored_values[:, :, start:end]], 2)
    # the chunk's own tokens, causally: per query head (the mask is not shared by stacked rows)
    own_k = new_keys.to(dtype).repeat_interleave(G, 1)
    own_v = new_values.to(dtype).repeat_interleave(G, 1)
    o_own, l_own = _flash(q, own_k, own_v, scaling, True)
    parts = [(o_own.reshape(B, H, G * L, -1), l_own.reshape(B, H, G * L))]
    lse_restricted = parts[0][1]  # [B, H, G * L]
    if ctx_k.shape[2]:
        parts.append(_flash(qg, ctx_k, ctx_v, scaling, False))
        lse_restricted = torch.logaddexp(lse_restricted, parts[1][1])
    if sinks < start or end < T:
        rest_k = torch.cat([stored_keys[:, :, sinks:start], stored_keys[:, :, end:]], 2)
        rest_v = torch.cat([stored_values[:, :, sinks:start], stored_values[:, :, end:]], 2)
        parts.append(_flash(qg, rest_k, rest_v, scaling, False))
    out, _ = merge([(o.float(), lse) for o, lse in parts])  # one softmax over the parts (§16)
    scores = _max_probability(qg, stored_keys[:, :, start:end], lse_restricted, scaling)
    out = out.reshape(B, H * G, L, -1).transpose(1, 2).to(dtype)
    return out, scores


def _max_probability(qg: torch.Tensor, keys: torch.Tensor, lse: torch.Tensor, scaling: float) -> torch.Tensor:
    """``[B, H, n]`` float32: ``exp(max_rows(q_row . k_t scaling - lse_row))`` for ``qg``
    ``[B, H, M, d]``, ``keys`` ``[B, H, n, d]``, ``lse`` ``[B, H, M]``; rows in blocks of at most
    :data:`~kv_cache.attention.blocks.STAT_CHUNK_BYTES` of logits."""
    B, H, M, _ = qg.shape
    n = keys.shape[2]
    best = torch.full((B, H, n), float("-inf"), device=qg.device)
    if n == 0:
        return best
    kt = keys.float().transpose(-1, -2)
    step = max(1, STAT_CHUNK_BYTES // max(1, 4 * n * B * H))
    for s in range(0, M, step):
        e = min(M, s + step)
        logits = (qg[:, :, s:e].float() @ kt).mul_(scaling).sub_(lse[:, :, s:e, None])
        best = torch.maximum(best, logits.amax(2))
    return best.exp_()


__all__ = ["one_pass_available", "repeat_chunk_attention"]
