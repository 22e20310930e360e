"""``compress(model, cache)``: attention over the compressed cache, and the statistics policies need.

By default (``attention="native"``) the model runs :func:`kv_cache.attention.compressed_attention`
for the duration of the block, which reads the storage in place and hands each layer's policy
the attention probabilities it asked for. The reference path (``attention="reference"``) keeps
the model's own attention and uses forward hooks. The hooks are registered on the attention modules only inside the ``with`` block and removed
in ``finally``; the model's code and config are not touched. While they are on, the cache's
layers know they are observed (``layer.observed``). After each attention call whose layer
:attr:`~CompressedLayer.awaits_observation`, the hook recomputes the last
:meth:`~CompressedLayer.query_window` post-RoPE queries (the policy says how many: SnapKV its
observation window, H2O every query of the call, StreamingLLM none) from the module's own
``q_proj`` (and ``q_norm`` for Qwen3) and hands them to :meth:`~CompressedLayer.observe`, which
scores and evicts. The hook knows nothing about any one policy.
"""

from __future__ import annotations

from contextlib import ExitStack, contextmanager
from typing import Any, Iterator

import torch

from ..attention import ATTENTION_NAME, activate, register
from .architecture import check_decoder
from .cache import REFERENCE_MODEL_TYPES, CompressedCache


def attention_classes() -> tuple[type, ...]:
    from transformers.models.llama.modeling_llama import LlamaAttention
    from transformers.models.mistral.modeling_mistral import MistralAttention
    from transformers.models.qwen2.modeling_qwen2 import Qwen2Attention
    from transformers.models.qwen3.modeling_qwen3 import Qwen3Attention

    return (LlamaAttention, MistralAttention, Qwen2Attention, Qwen3Attention)


def post_rope_queries(module: torch.nn.Module, hidden: torch.Tensor, position_embeddings: Any, n: int) -> torch.Tensor:
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


def attention_modules(model: torch.nn.Module) -> dict[int, torch.nn.Module]:
    """``{layer_idx: module}``: each decoder layer's attention module, found by capability (a module
    whose class name says attention and that carries the ``layer_idx`` transformers gives it,
    the innermost one where they nest)."""
    found: dict[int, torch.nn.Module] = {}
    for m in model.modules():
        idx = getattr(m, "layer_idx", None)
        if isinstance(idx, int) and "attention" in type(m).__name__.lower():
            inner = any(c is not m and isinstance(getattr(c, "layer_idx", None), int)
                        and "attention" in type(c).__name__.lower() for c in m.modules())
            if not inner:
                found[idx] = m
    return found


@contextmanager
def hidden_state_hooks(model: torch.nn.Module, on_hidden, layers: list[int]) -> Iterator[None]:
    """Call ``on_hidden(layer_idx, hidden [batch, q_len, hidden_size])`` with the hidden states
    entering the attention of each of ``layers`` (after the layer's input norm), through forward
    pre-hooks registered for the block only.

    Raises
    ------
    ValueError
        A layer whose attention module cannot be found (:func:`attention_modules`).
    """
    modules = attention_modules(model)
    missing = [i for i in layers if i not in modules]
    if missing:
        raise ValueError(
            f"cannot find the attention module of layers {missing[:8]} (a module named *Attention* with a "
            f"`layer_idx`) in {type(model).__name__}: the hidden states a learned scorer (KVzap) reads cannot be "
            "captured on this model; use another policy"
        )

    def pre(module, args, kwargs):
        hidden = kwargs.get("hidden_states", args[0] if args else None)
        if hidden is not None:
            on_hidden(module.layer_idx, hidden)

    handles = [modules[i].register_forward_pre_hook(pre, with_kwargs=True) for i in layers]
    try:
        yield
    finally:
        for h in handles:
            h.remove()


ATTENTION_MODES = ("native", "reference")
"""``native``: :func:`kv_cache.attention.compressed_attention` reads the compressed storage and
hands the policy its statistics; ``reference``: the model's own attention (sdpa / eager) over
dequantized tokens, with forward hooks that recompute the policy's queries."""


@contextmanager
def compress(
    model: torch.nn.Module, cache: CompressedCache, *, attention: str = "native"
) -> Iterator[CompressedCache]:
    """Run ``model`` over ``cache`` with attention that reads the compressed storage.

    Parameters
    ----------
    model : a transformers decoder (support by capability, :mod:`.architecture`)
    cache : CompressedCache
    attention : {"native", "reference"}, default "native"
        ``native`` switches the model to :func:`kv_cache.attention.compressed_attention`
        (``model.set_attn_implementation``) for the block and back afterwards; eviction
        policies get their statistics from it. ``reference`` keeps the model's sdpa / eager
        attention over dequantized tokens and registers forward hooks that recompute the
        queries the policy needs (Llama, Mistral, Qwen2, Qwen3 only): the slower path the
        native one is tested against.

    Raises
    ------
    TypeError
        ``cache`` is not a :class:`CompressedCache`.
    ValueError
        Unknown ``attention``; an unsupported model type; ``reference`` on a model without
        supported attention modules.
    """
    if not isinstance(cache, CompressedCache):
        raise TypeError(f"cache must be a CompressedCache; got {type(cache).__name__}")
    if attention not in ATTENTION_MODES:
        raise ValueError(f"attention must be one of {list(ATTENTION_MODES)}; got {attention!r}")
    if not hasattr(model, "config") or not hasattr(model, "set_attn_implementation"):
        raise TypeError(f"model must be a transformers PreTrainedModel; got {type(model).__name__}")
    check_decoder(model.config)
    with ExitStack() as stack:
        scored = [i for i, layer in enumerate(cache.layers) if getattr(layer.policy, "needs_hidden", False)]
        if scored:  # KVzap: the scorer must be this model's, and reads each layer's input
            cache.eviction.bind(model)

            def hand(idx: int, hidden: torch.Tensor) -> None:
                cache.layers[idx].hidden_in = hidden

            stack.enter_context(hidden_state_hooks(model, hand, scored))
        if attention == "native":
            stack.enter_context(_native_attention(model, cache))
        else:
            stack.enter_context(_observer_hooks(model, cache))
        yield cache


@contextmanager
def _native_attention(model: torch.nn.Module, cache: CompressedCache) -> Iterator[None]:
    register()
    previous = model.config._attn_implementation
    model.set_attn_implementation(ATTENTION_NAME)
    was = cache.observed, cache.native
    cache.observed, cache.native = True, True
    try:
        with activate(cache):
            yield
    finally:
        cache.observed, cache.native = was
        model.set_attn_implementation(previous)


@contextmanager
def _observer_hooks(model: torch.nn.Module, cache: CompressedCache) -> Iterator[None]:
    classes = attention_classes()
    modules = [m for m in model.modules() if isinstance(m, classes)]
    if not modules:
        mt = getattr(getattr(model, "config", None), "model_type", None)
        raise ValueError(f"attention='reference' recomputes queries for {list(REFERENCE_MODEL_TYPES)} only; "
                         f"got model type {mt!r}: use attention='native'")

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
                query = post_rope_queries(module, hidden, kwargs["position_embeddings"], n)
        layer.observe(query, kwargs.get("attention_mask"), module.scaling)

    handles = [m.register_forward_hook(hook, with_kwargs=True) for m in modules]
    was_observed = cache.observed
    cache.observed = True
    try:
        yield
    finally:
        cache.observed = was_observed
        for h in handles:
            h.remove()
