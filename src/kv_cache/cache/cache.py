"""``CompressedCache``: a transformers ``Cache`` whose layers quantize and evict."""

from __future__ import annotations

from typing import Any

from transformers.cache_utils import Cache

from ..policies.base import EvictionPolicy
from .config import QuantConfig
from .layer import CompressedLayer
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
        if quant is not None:
            quant.check_head_dim(geometry.head_dim)
            if eviction is not None and isinstance(eviction.budget, int):
                res = max(quant.residual_length, quant.group_size) - 1
                window = eviction.window_tokens(eviction.budget)
                need = quant.sink_tokens + res + window + eviction.sink_tokens
                if eviction.budget < need:
                    raise ValueError(
                        f"budget ({eviction.budget}) must be >= {need}: quantization sinks ({quant.sink_tokens}) + "
                        f"residual up to max(residual_length, group_size) - 1 ({res}) "
                        f"+ recent_window ({window}) + sink_tokens ({eviction.sink_tokens})"
                    )
        self.quant, self.eviction = quant, eviction
        self.config, self.geometry = config, geometry
        self.head_dim = geometry.head_dim
        layers = [CompressedLayer(i, quant, eviction) for i in range(geometry.layers)]
        super().__init__(layers=layers)

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
                k = layer.kept_length()
                kept += k
                elements += 2 * b * self.geometry.kv_heads * self.head_dim * k
                fp16 += fp16_kv_bytes(self.config, layer.seen, batch=b, layers=1)
        n = max(1, sum(1 for layer in self.layers if layer.is_initialized))
        return MemoryReport(
            codes_bytes=cat["codes"], scales_bytes=cat["scales"], zero_points_bytes=cat["zero_points"],
            residual_bytes=cat["residual"], indices_bytes=cat["indices"], scores_bytes=cat["scores"],
            fp16_bytes=fp16, tokens_seen=seen, tokens_kept=kept / n, elements_kept=elements,
            per_layer_bytes=per_layer, tables_bytes=cat["tables"],
        )
