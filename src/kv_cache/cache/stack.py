"""Several asked contexts decoded as one batch: rows of different lengths in one cache.

A :class:`~kv_cache.CompressedCache` session (:meth:`~kv_cache.CompressedCache.session`) answers
one question: the question's tokens and the answer go to a full-precision tail after the
compressed context. To decode several such answers together, each row needs its own context
(the same one repeated, or different ones) followed by its own question, and questions and
contexts differ in length. Left padding cannot express that (the padding would sit between a
context and its question), and packed per-channel key groups cannot be shifted by a padding that
is not a whole number of groups.

:func:`stack_sessions` builds instead a batch cache whose every layer holds its rows in the
packed ragged layout (:class:`~kv_cache.cache.packed_ragged.PackedRaggedStorage`, the layout a
shared eviction budget already uses): row ``(b, h)`` holds context ``b``'s stored tokens of head
``h`` exactly as stored (sinks, packed codes with their own scale tables, residual;
:func:`~kv_cache.cache.stack_rows.head_rows`, contexts whose heads hold different numbers of
tokens included), then question ``b``'s tokens in full precision, every row right-aligned in one buffer and read at its
own offset, its virtual leading slots masked. Nothing is recomputed or re-quantized: the codes,
scales and full-precision tokens are copied (a context asked by several rows is copied once per
row). Decoding then runs inside the batch cache's own :meth:`~kv_cache.CompressedCache.session`:
every row gains one token per step in a rectangular full-precision tail, at its own absolute
position (``position_ids`` per row), and the softmax over a row's tokens is the one its
one-at-a-time session computes (the same tokens, attended in different blocks and merged by
log-sum-exp, math dictionary §16).

:func:`stack_reason` says why a cache cannot be a row (None when it can); :func:`layout_key`
groups the caches that can share one batch (the same layout and quantization per layer).
"""

from __future__ import annotations

from typing import Any, Sequence

import torch

from .cache import CompressedCache
from .packed_ragged import PackedRaggedStorage
from .ragged import RaggedStorage
from .stack_rows import ROW_LAYOUTS, head_rows
from .storage import FullPrecisionStorage


def stack_reason(cache: CompressedCache) -> str | None:
    """Why ``cache`` cannot be a row of :func:`stack_sessions` (None: it can).

    A row is a prefilled, batch-1 cache whose every layer holds one of
    :data:`~kv_cache.cache.stack_rows.ROW_LAYOUTS` (rectangular, or heads of different lengths
    after a shared budget): not a precision tier's demoted tokens, a sliding window, left
    padding, or a KVzip pass still due."""
    if not isinstance(cache, CompressedCache):
        return f"not a CompressedCache ({type(cache).__name__})"
    for i, layer in enumerate(cache.layers):
        st = layer.storage
        if st is None or not layer.is_initialized:
            return f"layer {i} holds nothing (the context is not prefilled)"
        if not isinstance(st, ROW_LAYOUTS):
            return f"layer {i} holds {type(st).__name__}, which is not split into rows"
        if st.batch != 1:
            return f"layer {i} holds a batch of {st.batch} rows"
        if layer.demoted is not None:
            return f"layer {i} holds a precision tier's demoted tokens"
        if layer.window is not None:
            return f"layer {i} slides over a window of {layer.window} tokens"
        if any(getattr(st, "lead", ())) or (not st.ragged and layer._starts is not None):
            return f"layer {i} holds left padding"
        if layer._awaiting_reconstruction or layer._tail is not None or layer._reconstruct is not None:
            return f"layer {i} is in a session or a KVzip pass"
    return None


def _row_layout(st) -> tuple:
    """``(row layout, quantization, sinks)`` of a layer's rows (a ragged layout's tail or rows say)."""
    unit = st.tail if isinstance(st, PackedRaggedStorage) else st.rows[0] if isinstance(st, RaggedStorage) else st
    quant = getattr(unit, "quant", None)
    return type(unit).__name__, None if quant is None else repr(quant), getattr(unit, "n_sinks", 0)


def layout_key(cache: CompressedCache) -> tuple:
    """Caches with equal keys can be rows of one batch: per layer, the rows' layout (full
    precision or quantized, whether or not the heads hold different numbers of tokens), its
    quantization (:class:`~kv_cache.QuantConfig`), sinks, dtype, device and whether keys carry an
    offset."""
    return tuple((*_row_layout(layer.storage), str(getattr(layer, "dtype", None)),
                  str(getattr(layer, "device", None)), layer.key_offset is None) for layer in cache.layers)


def session_states(cache: CompressedCache) -> list[tuple[torch.Tensor, torch.Tensor]]:
    """Per layer, the tokens added inside the session now open on ``cache`` (a question), as
    stored: ``(keys, values)`` ``[batch, kv_heads, n, head_dim]`` (keys less the layer's key
    offset). ``RuntimeError`` outside a session."""
    out = []
    for i, layer in enumerate(cache.layers):
        if layer._tail is None:
            raise RuntimeError(f"layer {i} is not in a session: open cache.session() and feed the question first")
        out.append(layer._tail.read())
    return out


def _row(row, keys: torch.Tensor, values: torch.Tensor):
    """A row storage (``batch = heads = 1``, its own tensors) with ``keys``/``values`` ``[1, 1, n, d]``
    (a question, full precision) after its tokens: the question joins the residual (never
    quantized here). A residual held narrower than the question (``QuantConfig.residual_dtype``,
    e.g. float16 on a float32 model) is widened to the question's dtype: exact, and attention
    reads both in float32."""
    if isinstance(row, FullPrecisionStorage):
        return FullPrecisionStorage(torch.cat([row.keys, keys], dim=2), torch.cat([row.values, values], dim=2))
    wide = torch.promote_types(row.keys.dtype, keys.dtype)
    row.keys = torch.cat([row.keys.to(wide), keys.to(wide)], dim=2)
    row.values = torch.cat([row.values.to(wide), values.to(wide)], dim=2)
    return row


def stack_sessions(caches: Sequence[CompressedCache], questions: Sequence[list[tuple[torch.Tensor, torch.Tensor]]],
                   config: Any) -> CompressedCache:
    """One batch cache of ``len(caches)`` rows: row ``b`` holds ``caches[b]``'s context followed by
    ``questions[b]`` (per layer ``(keys, values)`` ``[1, kv_heads, n_b, head_dim]``, as
    :func:`session_states` returns them); see the module docstring.

    Every cache must pass :func:`stack_reason` and share one :func:`layout_key`; ``config`` is
    the model's config. The caches are read, never changed. Decode the result inside
    ``kv_cache.compress(model, batch)`` and ``batch.session()``, with per-row ``position_ids``."""
    if not caches:
        raise ValueError("stack_sessions needs at least one cache; got none")
    if len(questions) != len(caches):
        raise ValueError(f"stack_sessions needs one question per cache; got {len(questions)} for {len(caches)}")
    for b, c in enumerate(caches):
        why = stack_reason(c)
        if why is not None:
            raise ValueError(f"cache {b} cannot be a batch row: {why}")
        if len(questions[b]) != len(c.layers):
            raise ValueError(f"question {b} has states for {len(questions[b])} layers; the cache has {len(c.layers)}")
    keys = {layout_key(c) for c in caches}
    if len(keys) != 1:
        raise ValueError(f"the caches have {len(keys)} different layouts (quantization, dtype or device per layer); "
                         "stack only caches of one layout_key")
    out = CompressedCache(config)
    B = len(caches)
    for i, layer in enumerate(out.layers):
        src = [c.layers[i] for c in caches]
        H = src[0].storage.heads
        rows = [_row(row, *(t[:, h:h + 1] for t in questions[b][i]))
                for b, s in enumerate(src) for h, row in enumerate(head_rows(s.storage))]
        layer.storage = PackedRaggedStorage.from_rows(rows, B, H)
        layer.quant, layer.dtype, layer.device = src[0].quant, src[0].dtype, src[0].device
        layer.key_offset = None if src[0].key_offset is None else torch.cat([s.key_offset for s in src], dim=0)
        layer._starts = layer.storage.starts()
        layer.seen = layer.prompt_len = layer.storage.length
        layer._prefill_done = True
        layer.is_initialized = True
    return out


__all__ = ["layout_key", "session_states", "stack_reason", "stack_sessions"]
