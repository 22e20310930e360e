"""Compress a context once, ask it anything: the prefill driver and :class:`CompressedContext`.

* :func:`prefill` prefills a context into a :class:`~kv_cache.CompressedCache` and compresses
  it; for a policy scored by a pass of its own (:class:`~kv_cache.KVzip`) it runs that pass:
  the model reads a "repeat the previous context" prompt and the context again, chunk by
  chunk, each chunk's attention scores the stored tokens it repeats, and nothing of the pass
  stays in the cache or the positions. Then the cache evicts.
* :class:`CompressedContext` holds one compressed context and answers any number of
  questions from it (:meth:`CompressedCache.session`: each question starts from the same
  compressed context at its original positions; the question and answer are dropped after),
  and saves / loads it (:mod:`kv_cache.cache.serialize`).
* :func:`fit_context` checks a document against the model's positions before any work
  (:func:`max_context_tokens`: ``max_position_embeddings``, less the room KVzip's
  reconstruction pass reads after the context), and cuts it only when told what to keep.

Inside: :mod:`.fit` (a document's tokens against the positions), :mod:`.prefill_pass` (the
prefill and KVzip's pass), :mod:`.compressed` (:class:`CompressedContext`).
"""

from ..generation import forward_at  # noqa: F401 (defined there; kv_cache.context.forward_at stays importable)
from .compressed import CompressedContext
from .fit import (KEEP, _ids, _text_ids, check_text, fit_context, max_context_tokens, max_positions,  # noqa: F401
                  reconstruction_positions, text_token_ids, token_ids)
from .prefill_pass import PrefillStats, between_layers, prefill, reconstruct

__all__ = ["KEEP", "CompressedContext", "PrefillStats", "between_layers", "check_text", "fit_context", "forward_at",
           "max_context_tokens", "max_positions", "prefill", "reconstruct", "reconstruction_positions",
           "text_token_ids", "token_ids"]
