"""``CompressedCache``: a transformers ``Cache`` whose layers quantize and evict."""

from __future__ import annotations

from contextlib import contextmanager
from typing import Any, Iterator

import torch
from transformers.cache_utils import Cache

from ..compression.global_budget import select_global
from ..policies.base import EvictionPolicy
from .architecture import check_decoder, layer_windows
from .rope_frame import rope_frames
from .config import QuantConfig
from .budgets import fixed_parts
import warnings

from ..attention.fidelity import (EVICTION_THRESHOLD, FIDELITY_THRESHOLD, RECENT_ATTENTION, broken_layers, eviction_limit,
                       eviction_message, eviction_past, fidelity_message)
from .layer import CompressedLayer
from .report import MemoryReport, fp16_kv_bytes, kv_geometry, layer_nbytes

TESTED_MODEL_TYPES = ("llama", "mistral", "qwen2", "qwen3", "gemma", "gemma2", "gemma3_text", "phi3", "olmo2",
                      "gpt_oss", "cohere2", "granite", "smollm3", "ministral", "olmo3", "exaone4")
"""Model types in the test grid (tiny random configs, ``tests/test_architectures.py``). Support is
by capability, not by this list: any decoder whose attention modules update the cache and then
call transformers' attention interface works (:mod:`.architecture`)."""

class FidelityWarning(UserWarning):
    """The fidelity check found layers whose attention the compressed cache wrecks (§26)."""


class PerformanceWarning(UserWarning):
    """A cache read takes a slow path, said once per cache: keys stored before RoPE in a layout the
    kernels cannot turn from their codes (a calibrated dense rotation, a head_dim that is not a
    power of two) are dequantized and turned densely at every step (§29.8)."""


class FidelityError(RuntimeError):
    """Raised instead of :class:`FidelityWarning` by a cache made with ``strict=True``."""


REFERENCE_MODEL_TYPES = ("llama", "mistral", "qwen2", "qwen3")
"""Model types whose queries the reference path's hooks can recompute (``q_proj`` [+ ``q_norm``])."""


def _layer_flag(name: str, doc: str) -> property:
    """A cache-level flag that reads and sets the same flag on every layer."""

    def get(self) -> bool:
        return any(getattr(layer, name) for layer in self.layers)

    def set_(self, value: bool) -> None:
        for layer in self.layers:
            setattr(layer, name, bool(value))

    return property(get, set_, doc=doc)


class CompressedCache(Cache):
    """Drop-in ``past_key_values`` for ``model.generate`` or a manual forward loop.

    Parameters
    ----------
    config : transformers.PretrainedConfig
        The model's config: any decoder (MHA, GQA, MQA); hybrid models' sliding-window layers
        (``config.layer_types``) hold at most their window and are quantized like the others,
        while eviction policies and precision tiers act on the full-attention layers.
    quant : QuantConfig or None
        How tokens are stored; None keeps them in the model dtype.
    plan : kv_cache.plan.CachePlan, optional
        Per-layer widths, budget, policy and tiers in one object (``kv_cache.plan.plan_for``,
        a preset, or a plan file); exclusive with ``quant`` / ``eviction``.
    eviction : EvictionPolicy or None
        Which tokens survive (:class:`~kv_cache.SnapKV`, :class:`~kv_cache.H2O`,
        :class:`~kv_cache.StreamingLLM`); policies need ``with kv_cache.compress(model, cache):``.
    strict : bool, default False
        The fidelity check (math dictionary §26): at the first prefill under
        :func:`kv_cache.compress` (or :func:`kv_cache.prefill`), every compressed layer compares
        the attention output of the prompt's last 8 queries over what it stored with the output
        over the full-precision prompt. A layer whose relative error passes
        ``fidelity_threshold`` makes the cache warn (:class:`FidelityWarning`) or, with
        ``strict=True``, raise (:class:`FidelityError`), naming the layers and what to do. The
        figures are in :meth:`memory_report` (``attention_errors``) either way. The same
        ``strict`` governs the eviction check (§26.1): after KVzip's eviction, the share of the
        attention of those last queries on the dropped slots, averaged over the evicting layers
        (``memory_report().evicted_attention``), warns or raises past ``eviction_threshold`` (times
        the share of full-attention layers on a hybrid model).
    fidelity_threshold : float, default 0.5
        The relative attention-output error past which a layer counts as wrecked.
    eviction_threshold : float, default :data:`~kv_cache.attention.fidelity.EVICTION_THRESHOLD`
        The mean share of the last queries' attention an eviction may drop (in (0, 1]) on a model
        whose every layer attends globally; a hybrid model's limit is this times its share of
        full-attention layers (:func:`~kv_cache.attention.fidelity.eviction_limit`).
    track_positions : bool, default False
        Keep, from the first eviction on, which arrivals each head still holds (a bitmap of one
        bit per token seen and KV head, counted in the bytes; math dictionary §29.6) even where
        keys are stored after RoPE: what the transform codec needs to code keys before RoPE
        (:func:`kv_cache.save_cache` with a basis fitted before RoPE, §27.6). Layers storing keys
        before RoPE always keep it.

    With both None the cache behaves exactly like ``DynamicCache``.

    Examples
    --------
    >>> cache = CompressedCache(model.config, quant=QuantConfig(bits=4), eviction=H2O(budget=0.5))  # doctest: +SKIP
    >>> with compress(model, cache):                                                               # doctest: +SKIP
    ...     out = model.generate(**inputs, past_key_values=cache, max_new_tokens=64)
    >>> cache.memory_report().ratio                                                                # doctest: +SKIP
    """

    def __init__(self, config: Any, *, quant: QuantConfig | None = None, eviction: EvictionPolicy | None = None,
                 plan: Any = None, strict: bool = False, fidelity_threshold: float = FIDELITY_THRESHOLD,
                 eviction_threshold: float = EVICTION_THRESHOLD, track_positions: bool = False):
        check_decoder(config)
        if not isinstance(strict, bool):
            raise TypeError(f"strict must be True or False; got {strict!r}")
        if not isinstance(track_positions, bool):
            raise TypeError(f"track_positions must be True or False; got {track_positions!r}")
        if isinstance(fidelity_threshold, bool) or not isinstance(fidelity_threshold, (int, float)) \
                or not fidelity_threshold > 0:
            raise ValueError(f"fidelity_threshold must be a number > 0; got {fidelity_threshold!r}")
        if isinstance(eviction_threshold, bool) or not isinstance(eviction_threshold, (int, float)) \
                or not 0 < eviction_threshold <= 1:
            raise ValueError(f"eviction_threshold must be a share of attention in (0, 1]; got {eviction_threshold!r}")
        self.strict, self.fidelity_threshold = strict, float(fidelity_threshold)
        self.eviction_threshold = float(eviction_threshold)
        if plan is not None:  # a kv_cache.plan.CachePlan (duck-typed: the plan layer sits above this one)
            if quant is not None or eviction is not None:
                raise ValueError("pass either plan= or quant=/eviction=, not both (a plan holds both)")
            for name in ("check_model", "quant_config", "eviction"):
                if not callable(getattr(plan, name, None)):
                    raise TypeError(f"plan must be a kv_cache.plan.CachePlan; got {type(plan).__name__}")
            plan.check_model(config)
            quant, eviction = plan.quant_config(), plan.eviction()
        geometry = kv_geometry(config)
        windows = layer_windows(config)
        if quant is not None and not isinstance(quant, QuantConfig):
            raise TypeError(f"quant must be a QuantConfig or None; got {type(quant).__name__}")
        if eviction is not None and not isinstance(eviction, EvictionPolicy):
            raise TypeError(f"eviction must be an EvictionPolicy (SnapKV, H2O, StreamingLLM) or None; "
                            f"got {type(eviction).__name__}")
        if quant is not None and quant.evicted_bits is not None and (eviction is None or not eviction.prefill_only):
            got = "no eviction policy" if eviction is None else f"{type(eviction).__name__}, which evicts while decoding"
            raise ValueError(
                f"QuantConfig.evicted_bits={quant.evicted_bits} stores the tokens a one-shot eviction policy does not "
                f"keep at that width; it needs eviction=KVzip(...) or SnapKV(...) (policies with prefill_only); "
                f"got {got}"
            )
        if quant is not None:
            quant = quant.for_model(config)  # the default's rule read from the model (§29.7)
        frames = rope_frames(config, geometry.head_dim) if quant is not None and quant.pre_rope else None
        if quant is not None:
            quant.check_head_dim(geometry.head_dim)
            quant.check_layers(geometry.layers)
            if eviction is not None and isinstance(eviction.budget, int):
                parts = fixed_parts(quant, eviction, eviction.window_tokens(eviction.budget))
                need = sum(parts.values())
                if eviction.budget < need:
                    raise ValueError(
                        f"budget ({eviction.budget}) must be >= {need}: quantization sinks "
                        f"({parts['quantization sinks']}) + residual up to max(residual_length, group_size) - 1 "
                        f"({parts['residual']}) + recent_window ({parts['recent_window']}) "
                        f"+ sink_tokens ({parts['sink_tokens']})"
                    )
        if eviction is not None and all(w is not None for w in windows):
            raise ValueError(
                f"{type(eviction).__name__} acts on full-attention layers, and every layer of this "
                f"{geometry.model_type!r} model slides over a window of {windows[0]} tokens (it holds at most that "
                "many already): use quantization alone (eviction=None)"
            )
        if quant is not None and any(w is not None for w in windows):
            need = max(quant.residual_length, quant.group_size)
            small = min(w for w in windows if w is not None)
            if small < need:
                raise ValueError(
                    f"a sliding window of {small} tokens is shorter than the quantized layout's full-precision "
                    f"residual (max(residual_length, group_size) = {need}): lower QuantConfig.residual_length / "
                    "group_size to at most the window"
                )
        self.quant, self.eviction, self.plan = quant, eviction, plan
        self.config, self.geometry = config, geometry
        self.head_dim = geometry.head_dim
        self.windows = windows
        layers = [CompressedLayer(i, quant if w is None or quant is None else quant.sliding_config(),
                                  eviction if w is None else None, w)
                  for i, w in enumerate(windows)]
        if frames is not None:
            for layer, frame in zip(layers, frames):
                layer.rope_frame = frame
        for layer in layers:  # the kept arrivals' bitmap also after RoPE (the transform codec's frame, §27.6)
            layer.track_arrivals = track_positions
        super().__init__(layers=layers)
        self._shared: dict[int, tuple] = {}
        for layer in self.layers:
            layer.share = self._share_budget
            layer.on_fidelity = self._fidelity_recorded
            layer.on_dense_read = self._dense_read
        checked = [i for i, layer in enumerate(self.layers) if layer.quant is not None or layer.policy is not None]
        self._last_checked = checked[-1] if checked else None

    def attention_errors(self) -> dict[int, float]:
        """``{layer: e}``: the fidelity check's relative attention-output error per layer (§26)."""
        return {i: layer.attention_error for i, layer in enumerate(self.layers) if layer.attention_error is not None}

    def _dense_read(self, layer: CompressedLayer, why: str) -> None:
        """A layer reads its keys through a dense dequantized copy: warn once per cache."""
        if getattr(self, "_dense_warned", False):
            return
        self._dense_warned = True
        warnings.warn(f"layer {layer.layer_idx} (and any other like it) reads its keys stored before RoPE through a "
                      f"dense dequantized copy at every step ({why}): slower than the kernels' read from the codes. "
                      "Use rotation='hadamard' or None on a power-of-two head_dim, or pre_rope=False",
                      PerformanceWarning, stacklevel=3)

    def _fidelity_recorded(self, layer: CompressedLayer) -> None:
        """Once the last checked layer has its figure (the end of the prefill's forward): warn, or
        raise with ``strict``, naming every layer past the threshold."""
        if layer.layer_idx != self._last_checked:
            return
        bad = broken_layers(self.attention_errors(), self.fidelity_threshold)
        if not bad:
            return
        message = fidelity_message(bad, self.fidelity_threshold, self.strict,
                                   {i: self._fidelity_setting(i) for i in bad})
        if self.strict:
            raise FidelityError(message)
        warnings.warn(message, FidelityWarning, stacklevel=2)

    def _fidelity_setting(self, i: int) -> tuple[int, int, str, bool]:
        """Layer ``i``'s ``(key_bits, value_bits, key_grouping, evicts)`` for the fidelity advice."""
        layer = self.layers[i]
        quant = layer.quant
        k, v = quant.bits_for(i) if quant is not None else (16, 16)
        return k, v, quant.key_grouping if quant is not None else "", layer.policy is not None

    def _share_budget(self, layer: CompressedLayer, scores, valid, forced, budget: int, floor: int,
                      before_attention: bool) -> None:
        """``scope="model"``: collect every layer's scores, then one top-k over all of them
        (per batch row), ``budget`` tokens per head on average (math dictionary §19)."""
        self._shared[layer.layer_idx] = (scores, valid, forced, budget, floor, before_attention)
        if len(self._shared) < sum(layer.policy is not None for layer in self.layers):
            return
        pending, self._shared = self._shared, {}
        order = sorted(pending)
        B = pending[order[0]][0].shape[0]
        total_valid = max(int(sum(pending[i][1][b].sum() for i in order)) for b in range(B))
        total_budget = sum(pending[i][3] * pending[i][0].shape[1] for i in order)
        if total_valid <= total_budget:
            if self._checks_after_forward(order):
                self._check_eviction()
            return
        floor = pending[order[0]][4]

        def select(k: int) -> dict[int, torch.Tensor]:
            masks = {i: [] for i in order}
            for b in range(B):
                sel = select_global([pending[i][0][b] for i in order], k, floor=floor,
                                    valid=[pending[i][1][b] for i in order], forced=[pending[i][2][b] for i in order])
                for i, m in zip(order, sel):
                    masks[i].append(m)
            return {i: torch.stack(m) for i, m in masks.items()}

        ratio = getattr(self.layers[order[0]].policy, "target_ratio", None)
        if ratio is not None and not any(self.layers[i].tiered for i in order):
            total_budget = self._budget_for_ratio(select, order, total_budget, total_valid, ratio, B)
        masks = select(total_budget)
        for i in order:
            self.layers[i].apply_keep_masks(masks[i], in_place=not pending[i][5])
        if self._checks_after_forward(order):
            self._check_eviction()

    def _checks_after_forward(self, order: list[int]) -> bool:
        """Whether the shared eviction that just acted is checked now: a one-shot eviction inside
        the prefill's forward (KVzap with ``decoding=False``); KVzip's is checked once its repeat
        pass is over (:meth:`finish_reconstruction`)."""
        layer = self.layers[order[0]]
        return layer.checks_eviction and not layer.policy.needs_reconstruction

    def _budget_for_ratio(self, select, order: list[int], budget: int, most: int, ratio: float, batch: int) -> int:
        """The largest model-wide token budget in ``[budget, most]`` whose cache holds at most
        ``fp16 bytes / ratio``, the bytes measured on copies of the layers' storages
        (:func:`.keep.bytes_if_kept`; math dictionary §19.6). Bisection to 0.5% of the range;
        ``budget`` when even it holds more."""
        from .keep import bytes_if_kept

        tokens = max(layer.seen for layer in self.layers)
        target = fp16_kv_bytes(self.config, tokens, batch=batch) / ratio
        pending_set = set(order)
        # what the eviction leaves as is: every layer's bytes but the evicted layers' storage and
        # starts, and the policies' scores (dropped once they have acted)
        fixed = 0
        for i, layer in enumerate(self.layers):
            evicted = i in pending_set
            parts = layer_nbytes(None if evicted else layer.storage, layer.demoted, layer._tail, {},
                                 None if evicted else layer._starts, layer.key_offset, None, layer.rope_frame)
            fixed += sum(parts.values()) + layer.arrival_bitmap_bytes(after_eviction=evicted)

        def held(k: int) -> int:
            masks = select(k)
            return fixed + sum(bytes_if_kept(self.layers[i].storage, masks[i], self.layers[i]._starts) for i in order)

        if held(budget) > target:
            return budget
        lo, hi = budget, most  # held(lo) <= target
        step = max(1, (most - budget) // 200)
        while hi - lo > step:
            mid = (lo + hi + 1) // 2
            lo, hi = (mid, hi) if held(mid) <= target else (lo, mid - 1)
        return lo

    @contextmanager
    def session(self) -> Iterator["CompressedCache"]:
        """Ask one question of a compressed context: tokens added inside the block (the question,
        the answer) go to a full-precision tail that is dropped on exit, and positions return to
        the context's length. The compressed context is read, never changed: no eviction, no
        quantization, no restoration of evicted tokens.

        >>> with cache.session():                                                 # doctest: +SKIP
        ...     out = model.generate(question_ids, past_key_values=cache, max_new_tokens=32)
        """
        if not any(layer.is_initialized for layer in self.layers):
            raise RuntimeError("cache.session() needs a prefilled context: prefill it first (kv_cache.prefill)")
        started = []
        try:
            for layer in self.layers:
                layer.begin_session()
                started.append(layer)
            yield self
        finally:
            for layer in started:
                layer.end_session()

    def begin_reconstruction(self, sinks: int, start: int, end: int) -> None:
        for layer in self.layers:
            layer.begin_reconstruction(sinks, start, end)

    def end_reconstruction_chunk(self) -> None:
        for layer in self.layers:
            layer.end_reconstruction_chunk()

    def finish_reconstruction(self) -> None:
        """Evict every layer with its KVzip scores (a model-wide budget selects once, at the end),
        then run the eviction check (§26.1)."""
        for layer in self.layers:
            layer.finish_reconstruction()
        self._check_eviction()

    def _check_eviction(self) -> None:
        """The eviction check (§26.1) once a one-shot eviction acted on every layer: warn, or
        raise with ``strict``, when the prompt's last queries' attention on what was dropped is
        past the limit."""
        for layer in self.layers:  # a layer the budget did not reach dropped nothing
            if layer.state.pop(RECENT_ATTENTION, None) is not None:
                layer.evicted_attention = 0.0
        shares = self.evicted_attention()
        limit = self.eviction_limit
        if not eviction_past(shares, limit):
            return
        message = eviction_message(shares, limit, self.strict, hybrid=any(w is not None for w in self.windows))
        if self.strict:
            raise FidelityError(message)
        warnings.warn(message, FidelityWarning, stacklevel=2)

    @property
    def eviction_limit(self) -> float:
        """The eviction check's limit (§26.1): ``eviction_threshold`` times the share of layers
        that attend globally (1 but on hybrid models; with none, nothing can be evicted)."""
        full = sum(w is None for w in self.windows)
        return eviction_limit(self.eviction_threshold, full, len(self.windows)) if full else self.eviction_threshold

    def evicted_attention(self) -> dict[int, float]:
        """``{layer: x}``: the eviction check's share of the prompt's last queries' attention on
        the slots KVzip dropped, per evicting layer (§26.1)."""
        return {i: layer.evicted_attention for i, layer in enumerate(self.layers)
                if layer.evicted_attention is not None}

    @property
    def awaiting_reconstruction(self) -> bool:
        return any(layer._awaiting_reconstruction for layer in self.layers)

    @property
    def needs_hooks(self) -> bool:
        """True when the eviction policy needs ``kv_cache.compress(model, cache)``."""
        return self.eviction is not None and (self.eviction.needs_attention or self.eviction.needs_hidden)

    native = _layer_flag("native", "True while :func:`kv_cache.compress` runs the model with the native "
                                   "attention function.")
    observed = _layer_flag("observed", "True while :func:`kv_cache.compress` observes the model's attention "
                                       "for this cache.")

    def held_tensors(self) -> dict[str, Any]:
        """Every tensor held, keyed ``"layer{i}.{slot}"``."""
        out = {}
        for i, layer in enumerate(self.layers):
            for name, t in layer.held_tensors().items():
                out[f"layer{i}.{name}"] = t
        return out

    def memory_report(self) -> MemoryReport:
        """Bytes actually held, by category, against an fp16 cache of every token seen."""
        cat = dict.fromkeys(("codes", "scales", "zero_points", "residual", "indices", "scores", "tables"), 0)
        per_layer, kept, elements, fp16, seen, saved = [], 0, 0, 0, 0, 0
        kinds: dict[str, int] = {}
        for layer in self.layers:
            by_cat = layer.nbytes_by_category()
            for key, nbytes in by_cat.items():
                cat[key] += nbytes
            per_layer.append(sum(by_cat.values()))
            kind = "full_attention" if layer.window is None else "sliding_attention"
            kinds[kind] = kinds.get(kind, 0) + per_layer[-1]
            if layer.is_initialized:
                b = layer.storage.batch
                seen = layer.seen
                heads = layer.head_lengths()  # [b, kv_heads]: differs per head under a shared budget
                kept += float(heads.float().mean())
                elements += 2 * self.head_dim * int(heads.sum())
                fp16 += fp16_kv_bytes(self.config, layer.seen, batch=b, layers=1)
                if layer.window is not None:
                    saved += fp16_kv_bytes(self.config, max(0, layer.seen - layer.kept_length()), batch=b, layers=1)
        n = max(1, sum(1 for layer in self.layers if layer.is_initialized))
        return MemoryReport(
            codes_bytes=cat["codes"], scales_bytes=cat["scales"], zero_points_bytes=cat["zero_points"],
            residual_bytes=cat["residual"], indices_bytes=cat["indices"], scores_bytes=cat["scores"],
            fp16_bytes=fp16, tokens_seen=seen, tokens_kept=kept / n, elements_kept=elements,
            per_layer_bytes=per_layer, tables_bytes=cat["tables"], budget_raised=self.raised_budgets(),
            notes=self._budget_notes() + self._hybrid_notes(), bytes_by_layer_kind=kinds,
            window_saved_fp16_bytes=saved, attention_errors=self.attention_errors(),
            fidelity_threshold=self.fidelity_threshold, evicted_attention=self.evicted_attention(),
            eviction_threshold=self.eviction_limit,
        )

    def raised_budgets(self) -> dict[int, tuple[int, int]]:
        """``{layer: (requested, kept)}`` for the layers whose fractional budget, resolved against
        the prompt, was below the slots every head keeps anyway and was raised to them
        (:meth:`CompressedLayer.resolved_budget`); empty when none was."""
        out = {}
        if self.eviction is None or not isinstance(self.eviction.budget, float):
            return out
        for i, layer in enumerate(self.layers):
            if layer.policy is not None and layer.is_initialized and layer.prompt_len is not None:
                requested, budget, _ = layer.resolved_budget()
                if budget > requested:
                    out[i] = (requested, budget)
        return out

    def _hybrid_notes(self) -> list[str]:
        """On a hybrid model with an eviction policy: the share of the held tokens that the policy
        reaches (the full-attention layers'; math dictionary §22.8), one line (none otherwise)."""
        full = [x for x in self.layers if x.policy is not None and x.is_initialized]
        sliding = [x for x in self.layers if x.window is not None and x.is_initialized]
        if not full or not sliding:
            return []
        def held(layers):
            return sum(float(x.head_lengths().float().mean()) for x in layers)
        def seen(layers):
            return sum(min(x.seen, x.seen if x.window is None else x.window - 1) for x in layers)
        reach = seen(full) / (seen(full) + seen(sliding))
        return [f"eviction acts on the {len(full)} full-attention layers only, {100 * reach:.0f}% of the tokens an "
                f"uncompressed cache would hold here (the sliding layers keep their window): "
                f"{held(full) + held(sliding):.0f} of those {seen(full) + seen(sliding)} tokens per KV head, "
                "summed over the layers, are held (math dictionary §22.8)"]

    def _budget_notes(self) -> list[str]:
        """One line per distinct raise of :meth:`raised_budgets`."""
        pol, groups = self.eviction, {}
        for i, pair in self.raised_budgets().items():
            groups.setdefault(pair, []).append(i)
        notes = []
        for (requested, budget), layers in groups.items():
            layer = self.layers[layers[0]]
            parts = fixed_parts(self.quant, pol, pol.window_tokens(requested))
            which = "every layer" if len(layers) == sum(x.policy is not None for x in self.layers) else "layers " + ", ".join(map(str, layers))
            notes.append(
                f"budget raised to the fixed parts' minimum in {which}: budget={pol.budget} of the "
                f"{layer.prompt_len}-token prompt is {requested} tokens, fewer than every head keeps anyway "
                f"({' + '.join(f'{k} {v}' for k, v in parts.items())} = {budget}); up to {budget} tokens are kept"
            )
        return notes
