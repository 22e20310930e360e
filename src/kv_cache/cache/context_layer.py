"""The compress-once parts of a :class:`~kv_cache.cache.layer.CompressedLayer` (its methods
``begin_session`` ... ``finish_reconstruction``): sessions and KVzip's reconstruction pass
(math dictionary §19.3-§19.4): pure helpers, and :class:`CompressOnceLayer`, the methods.

* A *session* (:meth:`kv_cache.CompressedCache.session`) answers one question from a compressed
  context: new tokens go to a full-precision tail that is dropped on exit, the context is read
  and never changed, and positions return to the context's length.
* The *reconstruction pass* (:func:`kv_cache.context.reconstruct`) feeds repeat chunks that are
  attended but never stored; each chunk's scores are kept as a running max, then the layer
  evicts with them.
"""

from __future__ import annotations

import torch

from ..attention.key_offset import unshift_keys
from .storage import FullPrecisionStorage
from .tiers import TIERS_NEED_NATIVE

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


class CompressOnceLayer:
    """The compress-once methods of :class:`~kv_cache.cache.layer.CompressedLayer`: sessions
    (§19.4) and KVzip's reconstruction pass (§19.3). A mixin over the layer's storage, its
    ``seen`` count, ``state``, ``policy`` and eviction (``_evict``, ``_score_inputs``)."""

    # ------------------------------------------------------------------ compress once, ask many (§19.4)
    def begin_session(self) -> None:
        """From now on new tokens go to a full-precision tail that :meth:`end_session` drops: the
        compressed context is read, never changed (no eviction, no quantization of the tail)."""
        if self._tail is not None:
            raise RuntimeError(f"layer {self.layer_idx} is already in a session")
        if self._awaiting_reconstruction:
            raise RuntimeError(RECONSTRUCTION_MISSING)
        self._session_seen = self.seen
        self._tail = session_tail(self.storage, getattr(self, "dtype", None), getattr(self, "device", None))

    def end_session(self) -> None:
        """Drop the tail (the question and its answer) and return to the context's length."""
        self._tail = None
        self.seen = self._session_seen

    def _session_update(self, key_states: torch.Tensor, value_states: torch.Tensor):
        self.seen += key_states.shape[2]
        if self.native:
            self._view = (self.stored_blocks() + self._tail.attention_update(key_states, value_states)
                          + self.demoted_blocks())
            return key_states, value_states
        if self.demoted is not None:
            raise RuntimeError(TIERS_NEED_NATIVE)
        k, v = self.stored_states()
        tk, tv = self._tail.update(key_states, value_states)
        return torch.cat([k, tk], dim=2), torch.cat([v, tv], dim=2)

    # ------------------------------------------------------------------ KVzip's reconstruction pass (§19.3)
    @property
    def reconstructing(self) -> tuple[int, int, int] | None:
        """``(sinks, start, end)`` while the stored context slots ``[start, end)`` are repeated."""
        return self._reconstruct

    def begin_reconstruction(self, sinks: int, start: int, end: int) -> None:
        """Attend the repeat chunk without storing it; a layer with a policy scores context slots
        ``[start, end)``, a layer without one (a sliding-window layer) only attends."""
        if self.policy is not None and not self._awaiting_reconstruction:
            raise RuntimeError(f"layer {self.layer_idx} has no prefilled context awaiting KVzip scores")
        self._reconstruct = (sinks, start, end)

    def reconstruction_states(self) -> tuple[torch.Tensor, torch.Tensor]:
        """The stored keys and values in full precision ``[batch, kv_heads, T, d]`` (keys as the
        model computed them, the offset added back): what the repeat chunks attend."""
        keys, values = self.stored_states()
        return unshift_keys(keys, self.view_offset), values

    def observe_reconstruction(self, scores: torch.Tensor) -> None:
        """``scores`` ``[batch, kv_heads, end - start]``: this chunk's max probabilities; kept as the max."""
        _, s, e = self._reconstruct
        st = self.storage
        self.state["kvzip"] = running_max(self.state.get("kvzip"), scores, s, e, (st.batch, st.heads, st.length))
        self._view = None

    def end_reconstruction_chunk(self) -> None:
        self._reconstruct = None
        self._view = None

    def finish_reconstruction(self) -> None:
        """Evict with the reconstruction scores (shared budgets wait for every layer)."""
        self._awaiting_reconstruction = False
        self._reconstruct = None
        if self.policy is None:  # a sliding-window layer: attended, never scored
            return
        shape = (self.storage.batch, self.storage.heads, self.kept_length())
        self.state.setdefault("kvzip", torch.zeros(shape))
        valid = None
        if self._starts is not None:
            valid = torch.arange(shape[2], device=self._starts.device) >= self._starts.unsqueeze(-1)
        self._evict(self._score_inputs(shape, key_valid=valid), valid)
        self.state.pop("kvzip", None)
        self.state.pop("kvzip_continuation", None)
