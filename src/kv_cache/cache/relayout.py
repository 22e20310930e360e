"""A full-precision cache re-stored in a quantized layout, as a prefill of its kept tokens would
store them (math dictionary §27.5).

A transform-coded ``.kvc`` file (:mod:`kv_cache.codec`) decodes to full precision: the codec
codes full-precision K/V, whatever layout the cache used in memory. :func:`quantize_cache` then
puts the decoded tokens in the layout the reader asks for (for example ``QuantConfig(bits=4)``,
``q4d``), so a server holds a stored context at the same bytes as one it prefilled itself.

Per layer and ``(batch, head)`` row, in order: the row's kept tokens (every head its own count
after KVzip's model-wide budget) followed by the tokens appended after the eviction; the layer's
per-channel key offset taken from those keys (§25, when the layout centres keys); then the
layout's own path: the first ``sink_tokens`` tokens stay full precision, every whole group of
``group_size`` tokens is packed, the rest is the full-precision residual. Rows of different
lengths go into one packed ragged buffer (:class:`~.packed_ragged.PackedRaggedStorage`), as
KVzip's eviction leaves a prefilled cache.

What differs from a prefill: the key groups of a per-channel layout are formed over the kept
tokens (a prefill forms them over every token and evicts afterwards), and each row's codes are
made in head 0's rotation of its layer (a prefill uses each head's own; the layer records the
space of every row's codes, as the evicted tier does). The fidelity check (§26) needs the
prompt's queries and is not run: the layer's ``attention_error`` stays None.
"""

from __future__ import annotations

from typing import Any

import torch

from .config import QuantConfig
from ..attention.key_offset import key_offset, shift_keys
from .packed_ragged import PackedRaggedStorage
from .ragged import RaggedStorage
from .storage import FullPrecisionStorage, make_storage


def _rows(storage: Any) -> list[tuple[torch.Tensor, torch.Tensor]]:
    """The full-precision ``(keys, values)`` ``[1, 1, n_r, d]`` of every ``(b, h)`` row of a
    full-precision storage, its tokens in order; raises ``ValueError`` for any other layout."""
    b, h = storage.batch, storage.heads
    if isinstance(storage, FullPrecisionStorage):
        return [(storage.keys[i:i + 1, j:j + 1], storage.values[i:i + 1, j:j + 1]) for i in range(b) for j in range(h)]
    if isinstance(storage, RaggedStorage) and all(isinstance(r, FullPrecisionStorage) for r in storage.rows):
        return [(r.keys, r.values) for r in storage.rows]
    if isinstance(storage, PackedRaggedStorage) and storage.packed is None and isinstance(storage.tail,
                                                                                          FullPrecisionStorage):
        out, start = [], 0
        for r, n in enumerate(storage.fp_len):
            i, j = divmod(r, h)
            k = storage.fp_keys[:, :, start:start + n] if n else storage.tail.keys[:1, :1, :0]
            v = storage.fp_values[:, :, start:start + n] if n else storage.tail.values[:1, :1, :0]
            start += n
            tk, tv = storage.tail.keys[i:i + 1, j:j + 1], storage.tail.values[i:i + 1, j:j + 1]
            out.append((torch.cat([k, tk], dim=2), torch.cat([v, tv], dim=2)))
        return out
    raise ValueError(f"quantize_cache: a layer held as {type(storage).__name__} is not full precision; only a "
                     "full-precision cache (a codec file decodes to one) can be re-stored in a quantized layout")


def _store(q: QuantConfig, keys: torch.Tensor, values: torch.Tensor, track: bool, layer: int
           ) -> tuple[Any, torch.Tensor | None]:
    """``keys`` / ``values`` ``[b, h, n, d]`` stored in layout ``q`` as a prefill stores them, and the
    key offset ``[b, h, 1, d]`` float32 they were stored against (None: the layout does not centre)."""
    mu = None
    if q.center_keys:
        mu = key_offset(keys, q.sink_tokens) if keys.shape[2] else keys.new_zeros(*keys.shape[:2], 1,
                                                                                    keys.shape[-1]).float()
    st = make_storage(q, keys[:, :, :0], values[:, :, :0], track, layer=layer)
    if keys.shape[2]:
        st.append(shift_keys(keys, mu), values)
    return st, mu


def _restore(layer: Any, q: QuantConfig) -> tuple[Any, torch.Tensor | None]:
    """The storage of ``layer`` (full precision) re-stored in layout ``q``, and its key offset."""
    storage = layer.storage
    track = layer.policy is not None or layer.is_sliding
    if isinstance(storage, FullPrecisionStorage):  # every head the same tokens: one rectangular storage
        return _store(q, storage.keys, storage.values, track, layer.layer_idx)
    rows = [_store(q, k, v, True, layer.layer_idx) for k, v in _rows(storage)]
    b, h = storage.batch, storage.heads
    st = PackedRaggedStorage.from_rows([r for r, _ in rows], b, h, list(storage.lead))
    mu = torch.cat([m for _, m in rows]).reshape(b, h, 1, -1) if q.center_keys else None
    return st, mu


def restorable(quant: QuantConfig) -> QuantConfig:
    """The layout decoded tokens are re-stored in for ``quant``: itself, or for the default's keys
    before RoPE its per-channel layout after RoPE (:meth:`QuantConfig.after_rope`; the decoded keys
    carry their rotation, and removing it needs each kept token's position). An explicit
    ``pre_rope=True`` raises ``ValueError``."""
    if not quant.pre_rope:
        return quant
    try:
        return quant.after_rope()
    except ValueError:  # pre_rope=True was asked for
        raise ValueError("quantize_cache: re-storing decoded keys before RoPE (pre_rope=True) is not supported; "
                         "pass the layout with pre_rope=False (or QuantConfig(bits=b), which then stores keys "
                         "per channel after RoPE)") from None


def quantize_cache(cache: Any, quant: QuantConfig) -> None:
    """Re-store every layer of the full-precision ``cache`` (a :class:`~kv_cache.CompressedCache`
    with ``quant=None``, outside any session) in the layout of ``quant``, in place; see the
    module docstring. Afterwards ``cache.quant`` is ``quant`` as the model holds it
    (:meth:`QuantConfig.for_model`) and new tokens go into that layout. The default's keys before
    RoPE are stored per channel after RoPE instead (:meth:`QuantConfig.after_rope`: the decoded
    keys carry their rotation); an explicit ``pre_rope=True`` is refused.

    Raises
    ------
    TypeError
        ``quant`` is not a :class:`QuantConfig`.
    ValueError
        The cache is quantized already, holds a precision tier, is inside a session, or
        ``quant`` does not fit the model (head dim, layers, sliding windows).
    """
    from .cache import CompressedCache

    if not isinstance(quant, QuantConfig):
        raise TypeError(f"quant must be a QuantConfig; got {type(quant).__name__}")
    if not isinstance(cache, CompressedCache):
        raise TypeError(f"cache must be a CompressedCache; got {type(cache).__name__}")
    if cache.quant is not None:
        raise ValueError(f"quantize_cache: the cache is quantized already ({cache.quant!r}); it re-stores a "
                         "full-precision cache only")
    if quant.evicted_bits is not None:
        raise ValueError("quantize_cache: QuantConfig.evicted_bits (precision tiers) needs the evicted tokens, "
                         "which a stored cache no longer holds; use a QuantConfig without evicted_bits")
    if any(layer._tail is not None for layer in cache.layers):
        raise ValueError("quantize_cache: the cache is inside a session(); call it outside")
    if any(layer.demoted is not None for layer in cache.layers):
        raise ValueError("quantize_cache: the cache holds a precision tier; only a full-precision cache can be "
                         "re-stored")
    quant = restorable(quant)
    # the per-layer configs and every check of the layout against the model, as a new cache makes them
    shape = CompressedCache(cache.config, quant=quant)
    new = [_restore(layer, target.quant) if layer.storage is not None else (None, None)
           for layer, target in zip(cache.layers, shape.layers)]
    for layer, target, (st, mu) in zip(cache.layers, shape.layers, new):
        layer.quant = target.quant
        if st is not None:
            layer.storage, layer.key_offset = st, mu
            layer.attention_error = None
    cache.quant = shape.quant


__all__ = ["quantize_cache", "restorable"]
