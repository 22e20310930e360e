"""``CompressedCache``: a transformers ``Cache`` whose layers quantize and evict."""

from __future__ import annotations

from contextlib import contextmanager
from typing import Any, Iterator

import torch
from transformers.cache_utils import Cache

from ..compression.global_budget import select_global
from ..policies.base import EvictionPolicy
from .config import QuantConfig
from .layer import CompressedLayer, fixed_parts
from .report import MemoryReport, fp16_kv_bytes, kv_geometry

SUPPORTED_MODEL_TYPES = ("llama", "mistral", "qwen2", "qwen3", "gemma", "phi3", "olmo2")
"""Model types whose attention modules update the cache and then call transformers' attention
interface with the returned states (tested on tiny random configs of each)."""

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
        The model's config (Llama, Mistral, Qwen2, Qwen3: MHA or GQA).
    quant : QuantConfig or None
        How tokens are stored; None keeps them in the model dtype.
    eviction : EvictionPolicy or None
        Which tokens survive (:class:`~kv_cache.SnapKV`, :class:`~kv_cache.H2O`,
        :class:`~kv_cache.StreamingLLM`); policies need ``with kv_cache.compress(model, cache):``.

    With both None the cache behaves exactly like ``DynamicCache``.

    Examples
    --------
    >>> cache = CompressedCache(model.config, quant=QuantConfig(bits=4), eviction=H2O(budget=0.5))  # doctest: +SKIP
    >>> with compress(model, cache):                                                               # doctest: +SKIP
    ...     out = model.generate(**inputs, past_key_values=cache, max_new_tokens=64)
    >>> cache.memory_report().ratio                                                                # doctest: +SKIP
    """

    def __init__(self, config: Any, *, quant: QuantConfig | None = None, eviction: EvictionPolicy | None = None):
        geometry = kv_geometry(config)
        if geometry.model_type not in SUPPORTED_MODEL_TYPES:
            raise ValueError(
                f"CompressedCache supports model types {list(SUPPORTED_MODEL_TYPES)}; got {geometry.model_type!r}"
            )
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
        self.quant, self.eviction = quant, eviction
        self.config, self.geometry = config, geometry
        self.head_dim = geometry.head_dim
        layers = [CompressedLayer(i, quant, eviction) for i in range(geometry.layers)]
        super().__init__(layers=layers)
        self._shared: dict[int, tuple] = {}
        for layer in self.layers:
            layer.share = self._share_budget

    def _share_budget(self, layer: CompressedLayer, scores, valid, forced, budget: int, floor: int,
                      before_attention: bool) -> None:
        """``scope="model"``: collect every layer's scores, then one top-k over all of them
        (per batch row), ``budget`` tokens per head on average (math dictionary §19)."""
        self._shared[layer.layer_idx] = (scores, valid, forced, budget, floor, before_attention)
        if len(self._shared) < len(self.layers):
            return
        pending, self._shared = self._shared, {}
        order = sorted(pending)
        B = pending[order[0]][0].shape[0]
        total_valid = max(int(sum(pending[i][1][b].sum() for i in order)) for b in range(B))
        total_budget = sum(pending[i][3] * pending[i][0].shape[1] for i in order)
        if total_valid <= total_budget:
            return
        floor = pending[order[0]][4]
        masks = {i: [] for i in order}
        for b in range(B):
            sel = select_global([pending[i][0][b] for i in order], total_budget, floor=floor,
                                valid=[pending[i][1][b] for i in order], forced=[pending[i][2][b] for i in order])
            for i, m in zip(order, sel):
                masks[i].append(m)
        for i in order:
            self.layers[i].apply_keep_masks(torch.stack(masks[i]), in_place=not pending[i][5])

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
        """Evict every layer with its KVzip scores (a model-wide budget selects once, at the end)."""
        for layer in self.layers:
            layer.finish_reconstruction()

    @property
    def awaiting_reconstruction(self) -> bool:
        return any(layer._awaiting_reconstruction for layer in self.layers)

    @property
    def needs_hooks(self) -> bool:
        """True when the eviction policy needs ``kv_cache.compress(model, cache)``."""
        return self.eviction is not None and self.eviction.needs_attention

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
        per_layer, kept, elements, fp16, seen = [], 0, 0, 0, 0
        for layer in self.layers:
            by_cat = layer.nbytes_by_category()
            for key, nbytes in by_cat.items():
                cat[key] += nbytes
            per_layer.append(sum(by_cat.values()))
            if layer.is_initialized:
                b = layer.storage.batch
                seen = layer.seen
                heads = layer.head_lengths()  # [b, kv_heads]: differs per head under a shared budget
                kept += float(heads.float().mean())
                elements += 2 * self.head_dim * int(heads.sum())
                fp16 += fp16_kv_bytes(self.config, layer.seen, batch=b, layers=1)
        n = max(1, sum(1 for layer in self.layers if layer.is_initialized))
        return MemoryReport(
            codes_bytes=cat["codes"], scales_bytes=cat["scales"], zero_points_bytes=cat["zero_points"],
            residual_bytes=cat["residual"], indices_bytes=cat["indices"], scores_bytes=cat["scores"],
            fp16_bytes=fp16, tokens_seen=seen, tokens_kept=kept / n, elements_kept=elements,
            per_layer_bytes=per_layer, tables_bytes=cat["tables"], budget_raised=self.raised_budgets(),
            notes=self._budget_notes(),
        )

    def raised_budgets(self) -> dict[int, tuple[int, int]]:
        """``{layer: (requested, kept)}`` for the layers whose fractional budget, resolved against
        the prompt, was below the slots every head keeps anyway and was raised to them
        (:meth:`CompressedLayer.resolved_budget`); empty when none was."""
        out = {}
        if self.eviction is None or not isinstance(self.eviction.budget, float):
            return out
        for i, layer in enumerate(self.layers):
            if layer.is_initialized and layer.prompt_len is not None:
                requested, budget, _ = layer.resolved_budget()
                if budget > requested:
                    out[i] = (requested, budget)
        return out

    def _budget_notes(self) -> list[str]:
        """One line per distinct raise of :meth:`raised_budgets`."""
        pol, groups = self.eviction, {}
        for i, pair in self.raised_budgets().items():
            groups.setdefault(pair, []).append(i)
        notes = []
        for (requested, budget), layers in groups.items():
            layer = self.layers[layers[0]]
            parts = fixed_parts(self.quant, pol, pol.window_tokens(requested))
            which = "every layer" if len(layers) == len(self.layers) else "layers " + ", ".join(map(str, layers))
            notes.append(
                f"budget raised to the fixed parts' minimum in {which}: budget={pol.budget} of the "
                f"{layer.prompt_len}-token prompt is {requested} tokens, fewer than every head keeps anyway "
                f"({' + '.join(f'{k} {v}' for k, v in parts.items())} = {budget}); up to {budget} tokens are kept"
            )
        return notes
