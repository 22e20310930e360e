"""One layer of :class:`kv_cache.CompressedCache`: the transformers layer contract plus eviction.

The layer knows the order of operations; its :mod:`~kv_cache.cache.storage` knows the layout
(full precision, or sinks | packed codes | residual). Per call:

1. ``update`` appends this call's tokens to the storage. Under :func:`kv_cache.compress` it keeps
   the *view* (the stored blocks) for the attention function, which reads it in place; otherwise
   it returns the stored tokens dequantized, followed by this call's tokens as given.
2. A policy that needs attention statistics (SnapKV, H2O) gets them from the attention function
   (or the reference path's hook, :meth:`observe`) and evicts; one that needs none (StreamingLLM)
   evicts in ``update``; outside ``compress`` a policy that needs attention raises at once.
3. A shared budget (``scope`` ``"layer"`` / ``"model"``) turns the storage into ragged rows in one
   buffer (:mod:`~kv_cache.cache.packed_ragged`).

This module holds the transformers layer contract and eviction. The compress-once methods
(sessions, KVzip's pass, §19.3-§19.4) are :class:`~kv_cache.cache.context_layer.CompressOnceLayer`
and the precision tiers' (``QuantConfig.evicted_bits``, §21)
:class:`~kv_cache.cache.tiers.TiersLayer`; keys stored before RoPE (their frame, positions and
rotated reads, §29) :class:`~kv_cache.cache.pre_rope_layer.PreRopeLayer`; all mixed into
:class:`CompressedLayer`; a
sliding-window layer's trim (§22), the budgets and the checks are pure helpers in
:mod:`~kv_cache.cache.window`, :mod:`~kv_cache.cache.budgets` and :mod:`~kv_cache.cache.checks`.

Positions: ``get_seq_length`` is the number of tokens *seen*, so RoPE stays absolute after
eviction; ``get_mask_sizes`` returns ``kv_length = kept + q_len`` and ``kv_offset = seen - kept``,
so the kept tokens line up with the last ``kept`` columns of the 2-D attention mask.
"""

from __future__ import annotations

from typing import Any

import torch
from transformers.cache_utils import CacheLayerMixin

from ..compression.selection import left_padding_starts, mask_key_valid, select_tokens, starts_after
from ..policies.base import EvictionPolicy, ScoreInputs
from .config import QuantConfig
from .budgets import check_budget_fits, forced_slots, layer_masks, resolved_budget
from .checks import check_policy_can_act
from .context_layer import CompressOnceLayer
from ..attention.fidelity import RECENT_ATTENTION, evicted_share
from .keep import keep_slots
from .ragged import ragged_state
from ..attention.key_offset import key_offset, shift_keys, unshift_keys
from .report import layer_nbytes, layer_tensors
from .pre_rope_layer import PreRopeLayer
from .rope_frame import RopeFrame
from .tiers import TIERS_NEED_NATIVE, TiersLayer
from .window import slide
from .storage import FullPrecisionStorage, LayerStorage, gather_tokens, make_storage
from ..attention.blocks import FullBlock

_FORCE = torch.finfo(torch.float32).max


class CompressedLayer(PreRopeLayer, CompressOnceLayer, TiersLayer, CacheLayerMixin):
    """Cache layer with quantized storage (``quant``) and eviction (``policy``), both optional.

    Attributes
    ----------
    storage : LayerStorage or None — the tokens held (None until the first ``update``)
    demoted : LayerStorage or None — the evicted tier (``QuantConfig.evicted_bits``), never appended to
    state : dict — the policy's per-token state (e.g. H2O's accumulated attention), ``[batch, kv_heads, kept]``
    window : int or None — a sliding layer's window ``W`` (it holds at most ``W - 1`` tokens between calls)
    observed, native : bool — True while :func:`kv_cache.compress` observes this layer / runs
        :func:`kv_cache.attention.compressed_attention`, which reads the stored blocks in place
    """

    is_compileable = False

    def __init__(self, layer_idx: int, quant: QuantConfig | None, policy: EvictionPolicy | None,
                 window: int | None = None):
        super().__init__()
        if window is not None and policy is not None:
            raise ValueError(f"layer {layer_idx} slides over a window of {window} tokens: eviction policies act on "
                             "full-attention layers only")
        self.layer_idx = layer_idx
        self.quant = quant
        self.policy = policy
        self.window = window  # sliding window W in positions (None: full attention); holds <= W - 1 tokens
        self.is_sliding = window is not None  # read by transformers' mask builders
        self.seen = 0
        self.prompt_len: int | None = None
        self.storage: LayerStorage | None = None
        self.demoted: LayerStorage | None = None
        self.state: dict[str, torch.Tensor] = {}
        self.observed = False
        self.native = False
        self._pending: torch.Tensor | bool | None = None
        self._view: list | None = None
        self._starts: torch.Tensor | None = None  # [b, h] leading padding slots (native attention)
        self._prefill_done = False
        self.share = None  # the cache's collector of model-wide shared budgets (scope="model")
        self._awaiting_reconstruction = False  # KVzip: prefilled, scores not computed yet
        self._reconstruct: tuple[int, int, int] | None = None  # (sinks, start, end) of the chunk repeated now
        self._tail: FullPrecisionStorage | None = None  # a session's question/answer tokens
        self._session_seen = 0
        self.hidden_in: torch.Tensor | None = None  # set by compress()'s hook for a policy with needs_hidden
        self._hidden: torch.Tensor | None = None  # this call's hidden states, until the policy scored them
        self._since_evict = 0  # tokens appended since the last eviction (decode-time evict_every)
        self.key_offset: torch.Tensor | None = None  # [b, h, 1, d] float32: keys are held as k - mu (§25)
        self.attention_error: float | None = None  # the fidelity check at prefill (§26)
        self.head_attention_error: float | None = None  # its largest per-head ratio (a diagnostic)
        self.evicted_attention: float | None = None  # the eviction check after KVzip's pass (§26.1)
        self.on_fidelity = None  # the cache's callback once this layer's check is recorded
        self.on_dense_read = None  # the cache's callback when keys before RoPE are read densely
        self.rope_frame: RopeFrame | None = None  # keys stored before RoPE (§29), set by the cache
        self.track_arrivals = False  # keep the kept arrivals' bitmap after RoPE too (§27.6), set by the cache
        self.kept_arrivals: torch.Tensor | None = None  # [b, h, ceil(A / 8)] uint8 bitmap, after an eviction (§29.6)
        self.demoted_arrivals: torch.Tensor | None = None  # the same for the evicted tier's tokens
        self._arrived = 0  # tokens appended to the storage so far (implicit positions: the last n of them)

    # ------------------------------------------------------------------ transformers API
    def lazy_initialization(self, key_states: torch.Tensor, value_states: torch.Tensor) -> None:
        self.dtype, self.device = key_states.dtype, key_states.device
        b, h, _, d = key_states.shape
        if self.quant is not None:
            self.quant.check_head_dim(d)
        empty_k = key_states.new_empty((b, h, 0, d))
        empty_v = value_states.new_empty((b, h, 0, value_states.shape[-1]))
        self.storage = make_storage(self.quant, empty_k, empty_v,
                                    track_groups=self.policy is not None or self.is_sliding,
                                    layer=self.layer_idx)
        self.is_initialized = True

    def update(
        self,
        key_states: torch.Tensor,
        value_states: torch.Tensor,
        cache_kwargs: dict[str, Any] | None = None,
        **kwargs: Any,  # newer transformers pass `kwargs=`; nothing in it is needed here
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """Append ``[batch, kv_heads, q_len, head_dim]`` states; return all kept states.

        Previously stored tokens come back in full precision (dequantized); the ``q_len`` new
        ones come back exactly as given, so a prefill attends to its own full-precision states.
        """
        if not self.is_initialized:
            self.lazy_initialization(key_states, value_states)
        given = key_states
        # Keys before RoPE (§29): what is stored loses its rotation; a repeat chunk or a session's
        # tail is never quantized, and is kept and attended as the model computed it.
        stores = self._reconstruct is None and self._tail is None
        shifted = self.rope_frame is not None and stores and self.key_offset is not None  # in one pass with it
        if self.rope_frame is not None and stores:
            key_states = self.rope_frame.remove(key_states, self._new_positions(key_states.shape[2]), self.key_offset)
        if self.seen == 0 and self.key_offset is None and self.quant is not None and self.quant.center_keys:
            self.key_offset = key_offset(key_states, self.quant.sink_tokens, self.quant.scale_keys)  # from the prompt
        if (self.rope_frame is None or stores) and not shifted:
            key_states = shift_keys(key_states, self.key_offset)
        hidden, self.hidden_in = self.hidden_in, None
        if self._reconstruct is not None:  # KVzip's repeat pass: attend, never store, positions unchanged
            self._view = self.stored_blocks()
            return key_states, value_states
        if self._tail is not None:
            return self._session_update(key_states, value_states)
        check_policy_can_act(self, key_states.shape[0])
        q_len = key_states.shape[2]
        if self.prompt_len is None:
            self.prompt_len = q_len
        self.seen += q_len
        acts = self.policy is not None and not (self.policy.prefill_only and self._prefill_done)
        self._hidden = hidden if acts else None
        self._since_evict += q_len
        if self.native:
            # The attention function reads the stored blocks in place (a decoded token included).
            if self.rope_frame is not None:  # the stored keys rotated back, this call's as given
                view = self.stored_blocks()
                self._append(key_states, value_states)
                self._view = view + ([FullBlock(given, value_states)] if q_len == 1 else []) + self.demoted_blocks()
                self._pending = True if acts else None
                return given, value_states
            self._view = self.storage.attention_update(key_states, value_states) + self.demoted_blocks()
            self._grow_arrivals(q_len)
            self._pending = True if acts else None
            return key_states, value_states
        if self.demoted is not None:
            raise RuntimeError(TIERS_NEED_NATIVE)
        if self.rope_frame is not None:
            stored, values = self.stored_states()
            self._append(key_states, value_states)
            keys = torch.cat([stored, given.to(stored.dtype)], dim=2)
            values = torch.cat([values, value_states.to(values.dtype)], dim=2)
        else:
            keys, values = self.storage.update(key_states, value_states)
            self._grow_arrivals(q_len)
        self._slide()  # the returned states are materialized: the window's oldest tokens can go now
        if acts:
            if self.observed:
                self._pending = keys
            else:  # a policy that needs no attention (checked above) evicts here; attention still sees all
                self._evict(self._score_inputs(keys.shape[:3], keys=keys), None, before_attention=True)
        return unshift_keys(keys, self.view_offset), values  # the model's own attention may soft-cap

    def get_seq_length(self) -> int:
        """Tokens seen (absolute length), not tokens kept: positions stay absolute after eviction."""
        return self.seen

    def get_mask_sizes(self, cache_position: torch.Tensor | int) -> tuple[int, int]:
        # transformers <= 5.2x passes cache_position; newer releases pass the query length.
        q_len = cache_position if isinstance(cache_position, int) else cache_position.shape[0]
        kept = self.kept_length()
        return kept + q_len, self.seen - kept

    def get_max_cache_shape(self) -> int:
        return -1

    def get_max_length(self) -> int:  # the name of get_max_cache_shape in newer transformers
        return -1

    def reset(self) -> None:
        kept = (self.observed, self.native, self.share, self.on_fidelity, self.on_dense_read, self.rope_frame,
                self.track_arrivals)
        self.__init__(self.layer_idx, self.quant, self.policy, self.window)
        (self.observed, self.native, self.share, self.on_fidelity, self.on_dense_read, self.rope_frame,
         self.track_arrivals) = kept

    def crop(self, max_length: int) -> None:
        raise RuntimeError(
            "CompressedCache cannot be cropped (evicted and quantized tokens cannot be restored); "
            "assisted decoding and contrastive search are not supported"
        )

    def reorder_cache(self, beam_idx: torch.LongTensor) -> None:
        self.batch_select_indices(beam_idx)

    def batch_select_indices(self, indices: torch.Tensor) -> None:
        """Keep rows ``indices`` of the batch in every held tensor."""
        self._map_tensors(lambda t: t.index_select(0, indices.to(t.device)))

    def batch_repeat_interleave(self, repeats: int) -> None:
        self._map_tensors(lambda t: t.repeat_interleave(repeats, dim=0))

    def _map_tensors(self, fn) -> None:
        if self.storage is not None:
            self.storage.map_tensors(fn)
        if self.demoted is not None:
            self.demoted.map_tensors(fn)
        if self.key_offset is not None:
            self.key_offset = fn(self.key_offset)
        if self.kept_arrivals is not None:
            self.kept_arrivals = fn(self.kept_arrivals)
        if self.demoted_arrivals is not None:
            self.demoted_arrivals = fn(self.demoted_arrivals)
        self.state = {name: fn(t) for name, t in self.state.items()}
        if self._starts is not None:
            self._starts = fn(self._starts)

    def kept_length(self) -> int:
        """Tokens currently stored (sinks + quantized + residual, and a session's tail); the
        longest head's count when heads hold different numbers (a shared budget)."""
        n = 0 if self.storage is None else self.storage.length
        return n + (0 if self._tail is None else self._tail.length)

    def head_lengths(self) -> torch.Tensor:
        """``[batch, kv_heads]`` int64: tokens each head represents (differs under a shared
        budget), the evicted tier's included."""
        st = self.storage
        if st is None:
            return torch.zeros(0, 0, dtype=torch.int64)
        tail = 0 if self._tail is None else self._tail.length
        out = st.head_lengths() + tail
        return out if self.demoted is None else out + self.demoted.head_lengths()

    # ------------------------------------------------------------------ the observer seam
    @property
    def awaits_observation(self) -> bool:
        """True when the last ``update`` stored tokens that the policy must see scored
        (the observer then calls :meth:`observe` after the attention call)."""
        return self._pending is not None

    def query_window(self, q_len: int) -> int:
        """How many trailing queries of a ``q_len``-token call the policy needs (0: none)."""
        if self.policy is None:
            return 0
        return self.policy.query_window(q_len, self.policy.budget_tokens(self.layer_idx, self.prompt_len or q_len))

    def observe(self, query: torch.Tensor | None, attention_mask: torch.Tensor | None, scaling: float) -> None:
        """Post-attention step (called by :func:`kv_cache.compress`'s hook): score and evict.

        ``query``: the last :meth:`query_window` post-RoPE queries ``[batch, q_heads, n, head_dim]``
        (None when the policy needs none); ``attention_mask``: the model's 4-D mask or None.
        """
        keys, self._pending = self._pending, None
        if keys is None:
            return
        valid = mask_key_valid(attention_mask, keys)
        lead = self.storage.protected()[0]
        if lead and not bool(valid[:, :lead].all()):
            # The reference path lines kept tokens up with the mask's last columns; padding kept as
            # a full-precision sink would read as valid there. The native attention masks it.
            raise ValueError(
                "QuantConfig.sink_tokens would keep left padding as sink tokens, which the reference "
                "attention path cannot mask after eviction: use kv_cache.compress(model, cache) "
                "(attention='native') for padded batches with quantization sinks"
            )
        inputs = self._score_inputs(keys.shape[:3], keys=keys, query=query, scaling=scaling,
                                    key_valid=None if bool(valid.all()) else valid)
        self._evict(inputs, valid[:, None, :])

    # ------------------------------------------------------------------ the fidelity check (§26)
    def checks_fidelity(self, view: list, q_len: int) -> bool:
        """Whether this attention call is the layer's first prefill of a compressed cache (the
        fidelity check runs once, then)."""
        return (self.attention_error is None and not view and q_len > 1 and self._reconstruct is None
                and self._tail is None and (self.quant is not None or self.policy is not None))

    @property
    def checks_eviction(self) -> bool:
        """Whether this layer's eviction follows the prefill's forward (KVzip's repeat pass, or KVzap
        acting once after the prefill under a model-wide budget, as the presets and plans use it)
        and drops what it does not keep: the eviction check (§26.1) then needs the prompt's last
        queries' attention, recorded at the fidelity check."""
        pol = self.policy
        once = pol is not None and (pol.needs_reconstruction
                                    or (pol.needs_hidden and pol.prefill_only and pol.scope == "model"))
        return once and not self.tiered

    def record_query_attention(self, attention: torch.Tensor) -> None:
        """``attention`` ``[batch, kv_heads, T]``: the mean probabilities of the prompt's last
        queries (:func:`.fidelity.query_attention`), held until KVzip evicts (§26.1)."""
        self.state[RECENT_ATTENTION] = attention

    def _record_eviction(self, keep: torch.Tensor) -> None:
        """``keep`` ``[batch, kv_heads, T]`` bool: the slots kept; the share of the recorded
        attention on the others is this layer's eviction figure (§26.1)."""
        attention = self.state.pop(RECENT_ATTENTION, None)
        # recorded over the first prefill's tokens: a context prefilled in several calls has more
        # slots than the recorded queries saw, and is left unmeasured (None) rather than misread
        if attention is not None and attention.shape == keep.shape:
            self.evicted_attention = evicted_share(attention.to(keep.device), keep)

    def record_fidelity(self, error: float, head_error: float | None = None) -> None:
        """The fidelity check's figure at prefill (§26) and its largest per-head ratio (a diagnostic)."""
        self.attention_error, self.head_attention_error = error, head_error
        if self.on_fidelity is not None:
            self.on_fidelity(self)

    # ------------------------------------------------------------------ the native-attention seam
    @property
    def has_attention_view(self) -> bool:
        """True between a native ``update`` and the attention call that reads its view."""
        return self._view is not None

    def take_attention_view(self) -> list:
        """The blocks stored before this call (:mod:`kv_cache.attention.blocks`), once."""
        view, self._view = self._view, None
        return view

    def position_end(self, q_len: int) -> int:
        """One past the absolute position of the last query of the call in flight (KVzip's
        repeat chunk sits after the context without being counted as seen)."""
        return self.seen + (q_len if self._reconstruct is not None else 0)

    def attention_done(self) -> None:
        """Called by the attention function after it read this layer's view: a sliding layer
        drops the tokens its window no longer reaches (math dictionary §22)."""
        self._slide()

    def _slide(self) -> None:
        """A sliding layer keeps the last ``W - 1`` tokens (:func:`.window.slide`); a session's
        context and KVzip's repeat pass leave the storage as it is."""
        if self.window is not None and self.storage is not None and self._tail is None and self._reconstruct is None:
            self._starts = slide(self.storage, self._starts, self.window, self.device)

    def stored_starts(self, new_valid: torch.Tensor | None, q_len: int) -> torch.Tensor | None:
        """Leading padding slots ``[batch, kv_heads]`` of the blocks stored before this call
        (None: none), then record the padding of this call's ``q_len`` tokens.

        ``new_valid`` ``[batch, q_len]`` bool (None: all valid). Only left padding is
        supported: a row's padding must precede all of its valid tokens.
        """
        before = self._starts
        if new_valid is not None:
            self._starts = left_padding_starts(before, new_valid, self.storage.heads, self.kept_length() - q_len)
        return before

    def observe_attention(self, attention: torch.Tensor | None, queries: int, scaling: float) -> None:
        """Native counterpart of :meth:`observe`: ``attention`` ``[batch, q_heads, T]`` are the
        probabilities of the last ``queries`` (= :meth:`query_window`) queries summed per head
        (None when the policy needs none), computed by the attention function over every
        stored token."""
        self._pending = None
        if self.policy.needs_reconstruction:  # KVzip: scored by its own pass (kv_cache.prefill)
            self._awaiting_reconstruction = True
            self._prefill_done = True
            if attention is not None and queries:  # the prompt's last queries: the continuation score (§19.7)
                self.state["kvzip_continuation"] = self.policy.continuation_scores(attention, self.storage.heads)
            return
        shape = (self.storage.batch, self.storage.heads, self.kept_length())
        valid = None
        if self._starts is not None:
            valid = torch.arange(shape[2], device=self._starts.device) >= self._starts.unsqueeze(-1)  # [b, h, T]
        self._evict(self._score_inputs(shape, attention=attention, attention_queries=queries, scaling=scaling,
                                       key_valid=valid), valid)

    # ------------------------------------------------------------------ eviction
    def resolved_budget(self) -> tuple[int, int, int]:
        """``(requested, budget, window)`` in tokens for this layer's prompt (:func:`.budgets.resolved_budget`)."""
        return resolved_budget(self.policy, self.quant, self.layer_idx, self.prompt_len)

    def _score_inputs(self, shape, **fields) -> ScoreInputs:
        fields.setdefault("scaling", 1.0)
        for name in ("keys", "query", "key_valid"):
            fields.setdefault(name, None)
        fields.setdefault("device", self.device)
        fields.setdefault("hidden", self._hidden)
        self._hidden = None  # held by the inputs only while this call is scored
        return ScoreInputs(shape=tuple(shape), state=self.state, layer_idx=self.layer_idx, **fields)

    def _evict(self, inputs: ScoreInputs, valid: torch.Tensor | None, before_attention: bool = False) -> None:
        """Score the ``T`` stored slots (``inputs.shape``: every token attention uses is stored
        now) and keep the policy's choice; ``valid`` ``[batch, 1 or kv_heads, T]``.
        ``before_attention``: the tensors ``update`` returns are still to be read, so the
        storage must not compact in place."""
        pol = self.policy
        T = inputs.shape[2]
        _, budget, window = self.resolved_budget()
        # H2O must accumulate every step, even before the budget is reached.
        scores = pol.score(inputs) if not pol.prefill_only else None
        if pol.prefill_only:
            self._prefill_done = True
        shared, threshold = pol.scope != "head", getattr(pol, "threshold", None)
        if (shared or threshold is not None) and self.seen > self.prompt_len and self._since_evict <= pol.eviction_slack():
            return  # decoding: a ragged layer evicts every eviction_slack() + 1 tokens (KVzap's evict_every)
        self._since_evict = 0
        if threshold is not None:
            self._evict_threshold(scores, valid, threshold, window, before_attention)
            return
        if T <= budget + pol.eviction_slack() and pol.scope != "model":
            return  # within the budget (H2O with evict_every = k: within budget + k - 1)
        if scores is None:
            scores = pol.score(inputs)
        scores = scores.float().clone()
        # Slots the storage holds in full precision (quantization sinks, the residual) are never
        # evicted: it keeps every head's quantized part rectangular and the residual append-only.
        lead, trail = self.storage.protected()
        check_budget_fits(self.layer_idx, budget, lead, trail, window, pol.sink_tokens)
        if shared:
            self._evict_shared(scores, valid, budget, lead, trail, window, before_attention)
            return
        scores[..., :lead] = _FORCE
        if trail:
            scores[..., T - trail:] = _FORCE
        keep = select_tokens(scores, budget, recent_window=window, sink_tokens=pol.sink_tokens, valid=valid)
        if self.tiered or RECENT_ATTENTION in self.state:
            masks = torch.zeros(scores.shape, dtype=torch.bool, device=keep.device).scatter_(-1, keep, True)
            self._record_eviction(masks)
            if self.tiered:
                self._demote(masks)
        self.state = {name: gather_tokens(t, keep) for name, t in self.state.items()}
        self._starts = starts_after(self._starts, keep)
        self._keep_positions(keep)
        self.storage.gather(keep, in_place=not before_attention)

    def _evict_shared(self, scores, valid, budget: int, lead: int, trail: int, window: int,
                      before_attention: bool) -> None:
        """One top-k over the heads of this layer (``scope="layer"``) or, through the cache, of
        every layer (``scope="model"``): ``budget`` tokens per head on average (math dictionary §19)."""
        pol = self.policy
        H = scores.shape[1]
        valid, forced = forced_slots(self.policy, self.storage.protected(), scores, valid, window)
        floor = pol.floor_tokens(budget)
        if pol.scope == "model":
            if self.share is None:
                raise RuntimeError(f"layer {self.layer_idx} has no cache to share its budget with (scope='model')")
            self.share(self, scores, valid, forced, budget, floor, before_attention)
            return
        if int(valid.sum(-1).sum(-1).max()) > budget * H:
            self.apply_keep_masks(layer_masks(scores, budget * H, floor, valid, forced), in_place=not before_attention)

    def _evict_threshold(self, scores, valid, threshold: float, window: int, before_attention: bool) -> None:
        """Keep the valid slots scoring ``>= threshold`` and the forced ones (KVzap's threshold):
        heads keep different numbers of tokens (math dictionary §24)."""
        valid, forced = forced_slots(self.policy, self.storage.protected(), scores, valid, window)
        masks = valid & ((scores >= threshold) | forced)
        if not bool((masks != valid).any()):
            return
        self.apply_keep_masks(masks, in_place=not before_attention)

    def apply_keep_masks(self, masks: torch.Tensor, in_place: bool = True) -> None:
        """Keep the slots ``masks`` (bool ``[batch, kv_heads, T]``, every protected slot set):
        heads keeping different numbers of tokens become ragged rows that hold only those."""
        self._record_eviction(masks)
        if self.tiered:
            self._demote(masks)
        self._keep_positions(masks)
        self.state = {name: ragged_state(t, masks) for name, t in self.state.items()}
        self.storage, self._starts = keep_slots(self.storage, masks, self._starts, in_place)

    # ------------------------------------------------------------------ accounting
    def held_tensors(self) -> dict[str, torch.Tensor]:
        """Every tensor this layer holds, by slot name (:func:`.report.layer_tensors`)."""
        return layer_tensors(self.storage, self.demoted, self._tail, self.state, self._starts, self.key_offset,
                             self._arrival_bitmaps(), self.rope_frame)

    def nbytes_by_category(self) -> dict[str, int]:
        """Bytes held by category (:func:`.report.layer_nbytes`)."""
        return layer_nbytes(self.storage, self.demoted, self._tail, self.state, self._starts, self.key_offset,
                            self._arrival_bitmaps(), self.rope_frame)
