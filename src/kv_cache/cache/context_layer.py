"""The compress-once parts of a :class:`~kv_cache.cache.layer.CompressedLayer` (its methods
``begin_session`` ... ``finish_reconstruction``): sessions and KVzip's reconstruction pass
(math dictionary §19.3-§19.4), as pure helpers.

* A *session* (:meth:`kv_cache.CompressedCache.session`) answers one question from a compressed
  context: new tokens go to a full-precision tail that is dropped on exit, the context is read
  and never changed, and positions return to the context's length.
* The *reconstruction pass* (:func:`kv_cache.context.reconstruct`) feeds repeat chunks that are
  attended but never stored; each chunk's scores are kept as a running max, then the layer
  evicts with them.
"""

from __future__ import annotations

import torch

from .storage import FullPrecisionStorage

RECONSTRUCTION_MISSING = (
    "KVzip scores the context with a reconstruction pass after the prefill, which did not run: prefill "
    "the context with kv_cache.prefill(model, cache, input_ids, tokenizer=tokenizer) (or "
    "kv_cache.CompressedContext), then generate or ask"
)


def session_tail(storage, dtype: torch.dtype, device) -> FullPrecisionStorage | None:
    """An empty full-precision tail ``[batch, kv_heads, 0, d]`` shaped like ``storage``'s tokens
    (None for a layer that holds nothing yet): where a session's question and answer go."""
    if storage is None:
        return None
    t = storage.named_tensors()
    k = next(v for n, v in t.items() if n.endswith("keys") and v.dim() == 4)
    v = next(v for n, v in t.items() if n.endswith("values") and v.dim() == 4)
    b, h = storage.batch, storage.heads
    return FullPrecisionStorage(torch.empty(b, h, 0, k.shape[-1], dtype=dtype, device=device),
                                torch.empty(b, h, 0, v.shape[-1], dtype=dtype, device=device))


def running_max(acc: torch.Tensor | None, scores: torch.Tensor, start: int, end: int, shape) -> torch.Tensor:
    """KVzip's score of each stored slot, the max over repeat chunks (math dictionary §19.3):
    ``acc[..., start:end] = max(acc[..., start:end], scores)``, ``acc`` float32 ``shape`` =
    ``[batch, kv_heads, T]`` made on first use; ``scores`` ``[batch, kv_heads, end - start]``."""
    if acc is None:
        acc = torch.zeros(shape, device=scores.device)
    acc[..., start:end] = torch.maximum(acc[..., start:end], scores.float())
    return acc
