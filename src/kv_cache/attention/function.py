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

Calls the blocks cannot serve (a window that hides held tokens, logit soft-capping) go by
positions (:mod:`.dense`), which hands the policy the same statistics; KVzip's repeat chunk on a
full-attention layer is :func:`_reconstruction_pass` (soft-capped or not, math dictionary §22.7).

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
from .fidelity import (FIDELITY_QUERIES, checked_rows, layer_output_error, masked_attention,
                              query_attention)
from .key_offset import lse_shift, unshift_keys
from .reconstruction import one_pass_available, repeat_chunk_attention
from .dense import apply_learned_sinks, attend_positions, attend_positions_observed, materialize

ATTENTION_NAME = "kv_cache"
"""The name under which :func:`compressed_attention` is registered in transformers."""

_ACTIVE: ContextVar[Any] = ContextVar("kv_cache_active_cache", default=None)

def active_cache() -> Any:
    """The :class:`CompressedCache` whose ``compress`` block is running (or None)."""
    return _ACTIVE.get()


def _new_token_valid(attention_mask: torch.Tensor | None, q_len: int) -> torch.Tensor | None:
    """``[B, L]`` bool validity of this call's tokens, read off the diagonal of the 4-D mask
    (query ``i`` and its own token, the last ``L`` columns): a padded token is masked as a key
    everywhere, while a window or causality never hides a token from its own query."""
    if attention_mask is None or attention_mask.dim() != 4:
        return None
    i = torch.arange(q_len, device=attention_mask.device)
    rows = attention_mask[:, 0, -q_len:]  # [B, L, kv]
    diag = rows[:, i, rows.shape[-1] - q_len + i]
    valid = diag if diag.dtype == torch.bool else diag > torch.finfo(diag.dtype).min / 2
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
        this call's tokens is read from it (its diagonal), stored tokens carry their own masks.
    scaling : softmax scale (default ``d ** -0.5``; e.g. Gemma's ``query_pre_attn_scalar ** -0.5``)
    kwargs : ``sliding_window`` (the layer's window, checked against the cache's),
        ``softcap`` (Gemma 2 logit soft-capping), ``s_aux`` / ``sinks`` (gpt-oss learned sinks,
        ``[Hq]``): math dictionary §22.

    Returns
    -------
    ``(attn_output [B, L, Hq, d_v] in query.dtype, None)``

    Raises
    ------
    ValueError
        Dropout in training, a sliding window the cache's layer does not know, or a padding
        pattern other than left padding.
    """
    cache = _ACTIVE.get()
    idx = getattr(module, "layer_idx", None)
    layer = None if cache is None or idx is None or idx >= len(cache.layers) else cache.layers[idx]
    if layer is None or not layer.has_attention_view:
        from transformers.integrations.sdpa_attention import sdpa_attention_forward

        # Not a call over our cache (e.g. a DynamicCache, or no cache): plain sdpa.
        return sdpa_attention_forward(module, query, key, value, attention_mask, dropout=dropout,
                                      scaling=scaling, **kwargs)
    softcap, sinks = _check_options(module, dropout, kwargs, layer)
    B, Hq, L, d = query.shape
    Hkv = key.shape[1]
    G = Hq // Hkv
    scaling = d**-0.5 if scaling is None else scaling
    q = query.reshape(B, Hkv, G * L, d)
    view = layer.take_attention_view()
    try:
        if layer.reconstructing is not None and layer.window is None:
            return _reconstruction_pass(layer, query, q, key, value, scaling, G, sinks, softcap), None
        new_valid = _new_token_valid(attention_mask, L)
        starts = layer.stored_starts(new_valid, L)  # [B, Hkv] leading padding slots among the stored ones
        checking = layer.checks_fidelity(view, L)
        if checking and layer.checks_eviction:  # before the call: a policy acting in it evicts (KVzap once)
            layer.record_query_attention(_last_queries_attention(layer, q, key, scaling, G, L, softcap, new_valid))
        if softcap is not None or layer.reconstructing is not None or _window_hides(layer, view, L):
            out, lse = _positional(layer, view, q, key, value, scaling, G, L, starts, new_valid, softcap)
        else:
            out, lse = _blocks(layer, view, q, key, value, scaling, G, L, starts, new_valid, sinks is not None)
            if sinks is not None and layer.view_offset is not None:  # learned sinks see true logits (§25)
                lse = lse + lse_shift(q, layer.view_offset, scaling)
        if checking:
            layer.record_fidelity(*_prefill_error(layer, q, key, value, scaling, G, L, softcap, new_valid))
    finally:
        layer.attention_done()
    if sinks is not None:
        out, lse = apply_learned_sinks(out, lse, sinks, Hkv)
    return out.reshape(B, Hkv * G, L, -1).transpose(1, 2).to(query.dtype), None


def _prefill_error(layer, q, key, value, scaling, G, L, softcap, new_valid) -> tuple[float, float]:
    """The fidelity check (:mod:`kv_cache.attention.fidelity`, §26): ``(layer, head)``, the largest
    relative error over batch rows (the KV heads together) and over rows and heads, of the last
    queries' attention output over the stored (compressed) prompt against the full-precision
    prompt of this first prefill. NaN when the stored blocks cannot be read densely under
    soft-capping (heads of different lengths)."""
    m = min(FIDELITY_QUERIES, L)
    qs = q[:, :, checked_rows(G, L, m, q.device)]
    blocks = layer.stored_blocks() + layer.demoted_blocks()
    starts = layer._starts  # [B, Hkv] leading padding slots of the stored rows, or None
    valid = None if new_valid is None else new_valid[:, None, :].expand(-1, key.shape[1], -1)
    if softcap is None:
        parts, offset = [], 0
        for blk in blocks:
            start = None if starts is None else (starts - offset).clamp(0, blk.length)
            out, lse, _ = blk.attend(qs, scaling, start, None)
            parts.append((out, lse))
            offset += blk.length
        approx = parts[0][0] if len(parts) == 1 else merge(parts)[0]
    else:
        try:
            dense = materialize(blocks)
        except ValueError:
            return float("nan"), float("nan")
        k_hat, v_hat = unshift_keys(dense[0], layer.view_offset), dense[1]
        approx_valid = dense[2] if len(dense) > 2 else None  # ragged heads: their virtual padding
        if starts is not None:
            after = torch.arange(k_hat.shape[2], device=k_hat.device) >= starts.unsqueeze(-1)
            approx_valid = after if approx_valid is None else approx_valid & after
        approx = masked_attention(qs, k_hat, v_hat, scaling, softcap, approx_valid)
        key = unshift_keys(key, layer.view_offset)
    exact_key = key if valid is None else key.masked_fill(~valid[..., None], 0)
    err, heads = layer_output_error(qs, exact_key, value, approx, scaling, softcap, key_valid=valid)
    return float(err.max()), float(heads.max())


def _last_queries_attention(layer, q, key, scaling, G, L, softcap, new_valid) -> torch.Tensor:
    """The eviction check's attention (§26.1): the mean probabilities ``[B, Hkv, T]`` of the same
    last queries as the fidelity check over this first prefill's full-precision keys."""
    m = min(FIDELITY_QUERIES, L)
    qs = q[:, :, checked_rows(G, L, m, q.device)]
    valid = None if new_valid is None else new_valid[:, None, :].expand(-1, key.shape[1], -1)
    k = key if softcap is None else unshift_keys(key, layer.view_offset)  # a constant shift leaves softmax as is
    return query_attention(qs, k, scaling, softcap, valid)


def _window_hides(layer, view: list, L: int) -> bool:
    """Whether a sliding layer's window hides some held token from some query of this call: the
    ``S`` tokens held before it and its ``L`` tokens all fit in the window iff ``S + L <= W``
    (a decoded token is already in ``view``)."""
    if layer.window is None:
        return False
    held = sum(blk.length for blk in view) + (0 if L == 1 else L)
    return held > layer.window


def _positional(layer, view, q, key, value, scaling, G, L, starts, new_valid, softcap):
    """The call by positions (:mod:`.dense`): sliding windows, soft-capping, KVzip's repeat chunk
    on a sliding layer. Returns ``(out, lse)`` ``[B, Hkv, G * L, ...]`` float32 and hands a waiting
    policy the statistics of its queries over the same (soft-capped, windowed) softmax."""
    stored = materialize(view)  # (keys, values, held) float32; a decoded token is the view's last token
    held = None if stored is None else stored[2]
    if L == 1 and layer.reconstructing is None:
        keys, values = stored[0], stored[1]
        S = keys.shape[2] - 1
    else:
        S = 0 if stored is None else stored[0].shape[2]
        keys = key.float() if stored is None else torch.cat([stored[0], key.float()], 2)
        values = value.float() if stored is None else torch.cat([stored[1], value.float()], 2)
    keys = unshift_keys(keys, layer.view_offset)  # soft-capping is not shift-invariant: true keys (§25)
    B, H = keys.shape[:2]
    T = keys.shape[2]
    end = layer.position_end(L)  # one past the last query's position
    # Stored positions are only ordered, not exact, after eviction: a layer that evicts has no
    # window, so every stored key precedes every query and only the call's own tokens are causal.
    k_pos = torch.arange(end - T, end, device=keys.device)
    q_pos = k_pos[T - L:]
    valid = None
    if starts is not None or new_valid is not None or held is not None:
        valid = torch.ones(B, H, T, dtype=torch.bool, device=keys.device)
        if starts is not None:
            valid[:, :, :S] = torch.arange(S, device=keys.device) >= starts.unsqueeze(-1)
        if held is not None:  # a ragged block's virtual padding (math dictionary §19.2)
            valid[:, :, :held.shape[2]] &= held
        if new_valid is not None:
            valid[:, :, T - L:] = new_valid[:, None, :]
    n_stat = layer.query_window(L) if layer.awaits_observation else 0
    if n_stat:
        out, lse, attn = attend_positions_observed(q, keys, values, scaling, G, q_pos, k_pos, n_stat,
                                                   window=layer.window, softcap=softcap, key_valid=valid)
    else:
        attn = None
        out, lse = attend_positions(q, keys, values, scaling, G, q_pos, k_pos, window=layer.window,
                                    softcap=softcap, key_valid=valid)
    if layer.awaits_observation:
        layer.observe_attention(attn, n_stat, scaling)
    return out, lse


def _blocks(layer, view, q, key, value, scaling, G, L, starts, new_valid, need_lse: bool):
    """The block path (:mod:`.blocks`): every query sees every held token. Returns
    ``(out, lse)`` ``[B, Hkv, G * L, ...]`` float32 (``lse`` None for a first prefill served by
    sdpa unless ``need_lse``) and hands a waiting policy its statistics."""
    B, Hkv = key.shape[:2]
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
            return fused[0].reshape(B, Hkv, G * L, -1), fused[1].reshape(B, Hkv, G * L)
    if L == 1:
        view = join_new_token(view)
    parts, stats, offset = [], [], 0
    for blk in view:
        start = None if starts is None else (starts - offset).clamp(0, blk.length)
        out, lse, p = blk.attend(q, scaling, start, stat_rows)
        parts.append((out, lse))
        stats.append(p)
        offset += blk.length
    only_new = not view and not need_lse  # a first prefill: sdpa serves it (no log-sum-exp)
    if L > 1:
        out, lse, p = attend_new(q, key, value, scaling, G, new_valid, n_stat, sum_stats=only_new)
        parts.append((out, lse))
        stats.append(p)
    out, lse = parts[0] if len(parts) == 1 else merge(parts)
    if layer.awaits_observation:
        attn = None
        if n_stat:
            attn = _attention_sums(stats, parts, lse, stat_rows, B, Hkv, G, n_stat, only_new)
        layer.observe_attention(attn, n_stat, scaling)
    return out.float(), lse


def _reconstruction_pass(layer, query, q, key, value, scaling: float, G: int,
                         learned: torch.Tensor | None = None, softcap: float | None = None) -> torch.Tensor:
    """KVzip's repeat chunk on a full-attention layer (batch 1, nothing stored): the output
    attends to every stored token and causally to the chunk (on CPU, output and scores from the
    same flash passes: :func:`.reconstruction.repeat_chunk_attention`; elsewhere one sdpa call over
    the full-precision states; with ``learned`` sinks or ``softcap`` the chunked path by positions,
    which returns the log-sum-exp the sinks need and caps every logit); the layer receives the
    chunk's reconstruction scores (:func:`.blocks.reconstruction_scores`: of the soft-capped
    logits, without the learned sinks' share; math dictionary §19.3, §22.4)."""
    B, Hq, L, d = query.shape
    sinks, start, end = layer.reconstructing
    keys, values = layer.reconstruction_states()  # [B, Hkv, T, d], dequantized when packed, offset added back
    key = unshift_keys(key, layer.view_offset)
    if learned is None and softcap is None and one_pass_available(query, values):  # output and scores in one pass
        out, scores = repeat_chunk_attention(query, keys, values, key, value, scaling, sinks, start, end)
        layer.observe_reconstruction(scores)
        return out.to(query.dtype)
    T = keys.shape[2]
    all_k, all_v = torch.cat([keys, key.to(keys.dtype)], 2), torch.cat([values, value.to(values.dtype)], 2)
    if learned is None and softcap is None:
        pos = torch.arange(L, device=query.device)
        mask = torch.cat([torch.ones(L, T, dtype=torch.bool, device=query.device), pos[None, :] <= pos[:, None]],
                         dim=1)
        out = torch.nn.functional.scaled_dot_product_attention(query, all_k, all_v, attn_mask=mask, scale=scaling,
                                                               enable_gqa=True).transpose(1, 2)
    else:
        pos = torch.arange(T + L, device=query.device)
        o, lse = attend_positions(q, all_k, all_v, scaling, G, pos[T:], pos, softcap=softcap)
        if learned is not None:
            o, _ = apply_learned_sinks(o, lse, learned, key.shape[1])
        out = o.reshape(B, Hq, L, -1).transpose(1, 2)
    layer.observe_reconstruction(reconstruction_scores(q, keys, key, scaling, G, sinks, start, end, softcap))
    return out.to(query.dtype)


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


def _check_options(module, dropout: float, kwargs: dict, layer) -> tuple[float | None, torch.Tensor | None]:
    """Validate the call's options; return ``(softcap, learned sinks)`` (None when absent)."""
    if dropout and module.training:
        raise ValueError(f"{ATTENTION_NAME} attention does not implement dropout; got dropout={dropout}")
    window = kwargs.get("sliding_window")
    if window is not None and window != layer.window:
        raise ValueError(
            f"{type(module).__name__} (layer {layer.layer_idx}) attends with a sliding window of {window} tokens but "
            f"the cache built this layer with window {layer.window}: build the CompressedCache from this model's "
            "config (CompressedCache(model.config, ...))"
        )
    softcap = kwargs.get("softcap")
    if softcap is not None and (isinstance(softcap, bool) or not isinstance(softcap, (int, float)) or softcap <= 0):
        raise ValueError(f"softcap must be a positive number or None; got {softcap!r}")
    sinks = kwargs.get("s_aux", kwargs.get("sinks"))
    if sinks is not None and (not torch.is_tensor(sinks) or sinks.dim() != 1):
        raise ValueError(f"learned sinks (s_aux) must be a 1-D tensor of one logit per query head; got "
                         f"{type(sinks).__name__}{tuple(sinks.shape) if torch.is_tensor(sinks) else ''}")
    return (None if softcap is None else float(softcap)), sinks


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
