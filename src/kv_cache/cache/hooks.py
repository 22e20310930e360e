"""``compress(model, cache)``: forward hooks that feed attention statistics to eviction policies.

The hooks are registered on the attention modules only inside the ``with`` block and removed
in ``finally``; the model's code and config are not touched. While they are on, the cache's
layers know they are observed (``layer.observed``). After each attention call whose layer
:attr:`~CompressedLayer.awaits_observation`, the hook recomputes the last
:meth:`~CompressedLayer.query_window` post-RoPE queries (the policy says how many: SnapKV its
observation window, H2O every query of the call, StreamingLLM none) from the module's own
``q_proj`` (and ``q_norm`` for Qwen3) and hands them to :meth:`~CompressedLayer.observe`, which
scores and evicts. The hook knows nothing about any one policy.
"""

from __future__ import annotations

from contextlib import contextmanager
from typing import Any, Iterator

import torch

from .cache import SUPPORTED_MODEL_TYPES, CompressedCache


def _attention_classes() -> tuple[type, ...]:
    from transformers.models.llama.modeling_llama import LlamaAttention
    from transformers.models.mistral.modeling_mistral import MistralAttention
    from transformers.models.qwen2.modeling_qwen2 import Qwen2Attention
    from transformers.models.qwen3.modeling_qwen3 import Qwen3Attention

    return (LlamaAttention, MistralAttention, Qwen2Attention, Qwen3Attention)


def _queries(module: torch.nn.Module, hidden: torch.Tensor, position_embeddings: Any, n: int) -> torch.Tensor:
    """Post-RoPE queries of the last ``n`` positions: ``[batch, q_heads, n, head_dim]``."""
    from transformers.models.llama.modeling_llama import apply_rotary_pos_emb

    h = hidden[:, -n:]
    q = module.q_proj(h).view(h.shape[0], n, -1, module.head_dim)
    if hasattr(module, "q_norm"):
        q = module.q_norm(q)
    q = q.transpose(1, 2)
    cos, sin = position_embeddings
    q, _ = apply_rotary_pos_emb(q, q, cos[:, -n:], sin[:, -n:])
    return q


@contextmanager
def compress(model: torch.nn.Module, cache: CompressedCache) -> Iterator[CompressedCache]:
    """Let ``cache``'s eviction policy observe ``model``'s attention while the block runs.

    Raises
    ------
    TypeError
        ``cache`` is not a :class:`CompressedCache`.
    ValueError
        ``model`` has no supported attention modules (Llama, Mistral, Qwen2, Qwen3).
    """
    if not isinstance(cache, CompressedCache):
        raise TypeError(f"cache must be a CompressedCache; got {type(cache).__name__}")
    classes = _attention_classes()
    modules = [m for m in model.modules() if isinstance(m, classes)]
    if not modules:
        mt = getattr(getattr(model, "config", None), "model_type", None)
        raise ValueError(f"no supported attention modules in model type {mt!r}; supported: {list(SUPPORTED_MODEL_TYPES)}")

    def hook(module, args, kwargs, output):
        idx = module.layer_idx
        if idx >= len(cache.layers):
            return
        layer = cache.layers[idx]
        if not layer.awaits_observation:
            return
        hidden = kwargs.get("hidden_states", args[0] if args else None)
        n = layer.query_window(hidden.shape[1])
        query = None
        if n:
            with torch.no_grad():
                query = _queries(module, hidden, kwargs["position_embeddings"], n)
        layer.observe(query, kwargs.get("attention_mask"), module.scaling)

    handles = [m.register_forward_hook(hook, with_kwargs=True) for m in modules]
    was_observed = cache.observed
    cache.observed = True
    try:
        yield cache
    finally:
        cache.observed = was_observed
        for h in handles:
            h.remove()
