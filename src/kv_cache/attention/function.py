"""``compressed_attention``: the attention function that reads a :class:`CompressedCache` directly.

Registered in transformers' public ``AttentionInterface`` (and ``AttentionMaskInterface``)
under :data:`ATTENTION_NAME`; :func:`kv_cache.compress` switches the model to it with
``model.set_attn_implementation`` for the duration of the block and back afterwards. No
transformers code is patched.

Per layer call (the layer's ``update`` ran just before, appended this call's tokens and kept
the *view*: the blocks stored before them):

1. every stored block is attended on its own (:mod:`.blocks`): full-precision blocks with a
   matmul, packed blocks by the kernels straight from the codes (keys: the query is scaled by
   the group scales once, never a dequantized key matrix; values: ``sum_t (p_t s_t) c_t``);
2. this call's tokens are attended causally in full precision;
3. the blocks are merged by log-sum-exp into one softmax (:func:`.blocks.merge`);
4. if the layer's policy awaits an observation, the probabilities of the last
   ``layer.query_window(q_len)`` queries are summed per query head (``[B, Hq, T]``) and handed
   to the layer, which scores and evicts: no second pass over ``q_proj`` and RoPE.

GQA is handled by grouping the query heads of each KV head (K/V are never repeated). Masks are
the layer's own: each stored row has a start (left padding, per KV head after eviction) and its
own length, so layers and heads may hold different numbers of tokens.
"""

from __future__ import annotations

from contextlib import contextmanager
from contextvars import ContextVar
from typing import Any, Iterator

import torch

from .blocks import attend_new, fused_decode, join_new_token, merge, reconstruction_scores

ATTENTION_NAME = "kv_cache"
"""The name under which :func:`compressed_attention` is registered in transformers."""

_ACTIVE: ContextVar[Any] = ContextVar("kv_cache_active_cache", default=None)

UNSUPPORTED_KWARGS = ("softcap", "s_aux", "sinks")
"""Attention options of some architectures (Gemma-2 logit soft-capping, gpt-oss learned sinks)
that this function does not implement: a model passing them gets a clear error."""


def active_cache() -> Any:
    """The :class:`CompressedCache` whose ``compress`` block is running (or None)."""
    return _ACTIVE.get()


def _new_token_valid(attention_mask: torch.Tensor | None, q_len: int) -> torch.Tensor | None:
    """``[B, L]`` bool validity of this call's tokens, read off the last row of the 4-D mask."""
    if attention_mask is None or attention_mask.dim() != 4:
        return None
    row = attention_mask[:, 0, -1, -q_len:]
    valid = row if row.dtype == torch.bool else row > torch.finfo(row.dtype).min / 2
    return None if bool(valid.all()) else valid


def compressed_attention(
    module: torch.nn.Module,
    query: torch.Tensor,
    key: torch.Tensor,
    value: torch.Tensor,
    attention_mask: torch.Tensor | None,
    scaling: float | None = None,
    dropout: float = 0.0,
    **kwargs: Any,
) -> tuple[torch.Tensor, None]:
    """transformers attention-interface function over the compressed cache.

    Parameters
    ----------
    module : the attention module (``module.layer_idx`` names the cache layer)
    query : ``[B, Hq, L, d]`` post-RoPE queries of this call
    key, value : ``[B, Hkv, L, d]``, this call's new tokens (what the layer's ``update`` returned)
    attention_mask : the model's 4-D boolean mask (sdpa layout) or None; only the padding of
        this call's tokens is read from it, stored tokens carry their own masks.
    scaling : softmax scale (default ``d ** -0.5``)

    Returns
    -------
    ``(attn_output [B, L, Hq, d_v] in query.dtype, None)``

    Raises
    ------
    ValueError
        Dropout in training, an unsupported option (:data:`UNSUPPORTED_KWARGS`), a sliding
        window shorter than the context, or a padding pattern other than left padding.
    """
    cache = _ACTIVE.get()
    idx = getattr(module, "layer_idx", None)
    layer = None if cache is None or idx is None or idx >= len(cache.layers) else cache.layers[idx]
    if layer is None or not layer.has_attention_view:
        from transformers.integrations.sdpa_attention import sdpa_attention_forward

        # Not a call over our cache (e.g. a DynamicCache, or no cache): plain sdpa.
        return sdpa_attention_forward(module, query, key, value, attention_mask, dropout=dropout,
                                      scaling=scaling, **kwargs)
    _check_options(module, dropout, kwargs, layer)
    B, Hq, L, d = query.shape
    Hkv = key.shape[1]
    G = Hq // Hkv
    scaling = d**-0.5 if scaling is None else scaling
    q = query.reshape(B, Hkv, G * L, d)
    view = layer.take_attention_view()
    if layer.reconstructing is not None:
        return _reconstruction_pass(layer, query, q, key, value, scaling, G), None
    new_valid = _new_token_valid(attention_mask, L)
    starts = layer.stored_starts(new_valid, L)  # [B, Hkv] leading padding slots among the stored ones
    n_stat = layer.query_window(L) if layer.awaits_observation else 0
    stat_rows = None
    if n_stat:
        stat_rows = (torch.arange(G, device=q.device)[:, None] * L
                     + torch.arange(L - n_stat, L, device=q.device)[None, :]).reshape(-1)
    # A decoded token (L == 1) is already in the view (storage.attention_update); a longer call's
    # tokens are attended causally below.
    if L == 1 and not n_stat:
        fused = fused_decode(view, q, scaling, starts)
        if fused is not None:  # the whole step in one kernel call
            if layer.awaits_observation:
                layer.observe_attention(None, 0, scaling)
            return fused.reshape(B, Hkv * G, L, -1).transpose(1, 2).to(query.dtype), None
    if L == 1:
        view = join_new_token(view)
    parts, stats, offset = [], [], 0
    for blk in view:
        start = None if starts is None else (starts - offset).clamp(0, blk.length)
        out, lse, p = blk.attend(q, scaling, start, stat_rows)
        parts.append((out, lse))
        stats.append(p)
        offset += blk.length
    only_new = not view
    if L > 1:
        out, lse, p = attend_new(q, key, value, scaling, G, new_valid, n_stat, sum_stats=only_new)
        parts.append((out, lse))
        stats.append(p)
    out, lse = merge(parts)
    if layer.awaits_observation:
        attn = None
        if n_stat:
            attn = _attention_sums(stats, parts, lse, stat_rows, B, Hkv, G, n_stat, only_new)
        layer.observe_attention(attn, n_stat, scaling)
    out = out.reshape(B, Hkv * G, L, -1).transpose(1, 2).to(query.dtype)
    return out, None


def _reconstruction_pass(layer, query, q, key, value, scaling: float, G: int) -> torch.Tensor:
    """KVzip's repeat chunk (batch 1, nothing stored): the output attends to every stored token
    and causally to the chunk (one fused sdpa call over the full-precision states); the layer
    receives the chunk's reconstruction scores (:func:`.blocks.reconstruction_scores`)."""
    B, Hq, L, d = query.shape
    sinks, start, end = layer.reconstructing
    keys, values = layer.reconstruction_states()  # [B, Hkv, T, d], dequantized when packed
    T = keys.shape[2]
    pos = torch.arange(L, device=query.device)
    mask = torch.cat([torch.ones(L, T, dtype=torch.bool, device=query.device), pos[None, :] <= pos[:, None]], dim=1)
    out = torch.nn.functional.scaled_dot_product_attention(
        query, torch.cat([keys, key.to(keys.dtype)], 2), torch.cat([values, value.to(values.dtype)], 2),
        attn_mask=mask, scale=scaling, enable_gqa=True)
    layer.observe_reconstruction(reconstruction_scores(q, keys, key, scaling, G, sinks, start, end))
    return out.transpose(1, 2).to(query.dtype)


def _attention_sums(stats, parts, lse, stat_rows, B, Hkv, G, n, only_new) -> torch.Tensor:
    """``[B, Hq, T]``: probabilities of the ``n`` stat queries (each head), summed over queries."""
    if only_new:  # one block: its in-block probabilities are final and already summed
        return stats[-1].reshape(B, Hkv * G, -1)
    lse_rows = lse[:, :, stat_rows]  # [B, Hkv, G * n]
    cols = []
    for p, (_, lse_b) in zip(stats, parts):
        w = torch.exp(lse_b[:, :, stat_rows] - lse_rows).nan_to_num_(0.0)  # block share of each row
        cols.append((p * w.unsqueeze(-1)).reshape(B, Hkv, G, n, -1).sum(3))
    return torch.cat(cols, dim=-1).reshape(B, Hkv * G, -1)


def _check_options(module, dropout: float, kwargs: dict, layer) -> None:
    if dropout and module.training:
        raise ValueError(f"{ATTENTION_NAME} attention does not implement dropout; got dropout={dropout}")
    for name in UNSUPPORTED_KWARGS:
        if kwargs.get(name) is not None:
            raise ValueError(
                f"{ATTENTION_NAME} attention does not implement {name!r} ({type(module).__name__}); "
                "use kv_cache.compress(model, cache, attention='reference')"
            )
    window = kwargs.get("sliding_window")
    if window is not None and layer.seen > window:
        raise ValueError(
            f"{type(module).__name__} uses a sliding window of {window} tokens but the cache has seen "
            f"{layer.seen}: {ATTENTION_NAME} attention keeps every stored token in view; use "
            "kv_cache.compress(model, cache, attention='reference') or a context within the window"
        )


@contextmanager
def activate(cache: Any) -> Iterator[None]:
    """Make ``cache`` the one :func:`compressed_attention` reads while the block runs."""
    token = _ACTIVE.set(cache)
    try:
        yield
    finally:
        _ACTIVE.reset(token)


def register() -> None:
    """Register :func:`compressed_attention` (and its mask: sdpa's) under :data:`ATTENTION_NAME`.

    Idempotent: an entry in transformers' registries of attention functions, which is what
    they are for; nothing else changes.
    """
    from transformers import AttentionInterface
    from transformers.masking_utils import AttentionMaskInterface, sdpa_mask

    AttentionInterface.register(ATTENTION_NAME, compressed_attention)
    AttentionMaskInterface.register(ATTENTION_NAME, sdpa_mask)
