"""What a model's attention needs from the cache, read from its config (support by capability).

Any decoder whose attention modules update the cache and then call transformers' attention
interface works; this module reads the per-layer facts that change what a layer holds:

* ``config.layer_types`` (``"full_attention"`` / ``"sliding_attention"``) and
  ``config.sliding_window``: a sliding layer sees the last ``W`` positions (itself included), so
  it holds at most ``W - 1`` tokens between calls (transformers' ``DynamicSlidingWindowLayer``
  keeps the same; math dictionary §22). Mistral-style configs with ``sliding_window`` and no
  ``layer_types`` slide on every layer; Qwen2-style configs slide only with
  ``use_sliding_window``.
* Layer types the cache cannot hold (chunked attention, linear attention / state-space layers)
  are refused with the layer, the type and what to do.

Attention-time options (logit soft-capping, learned sinks, scaling) arrive with each call and are
handled by :mod:`kv_cache.attention`.
"""

from __future__ import annotations

from typing import Any

FULL, SLIDING = "full_attention", "sliding_attention"
LAYER_TYPES = (FULL, SLIDING)
"""Layer types the cache holds; others (e.g. ``"chunked_attention"``, ``"linear_attention"``)
are refused by :func:`layer_windows`."""


def _text_config(config: Any) -> Any:
    return config.get_text_config() if hasattr(config, "get_text_config") else config


def layer_windows(config: Any) -> list[int | None]:
    """Per layer, the sliding window ``W`` in positions (None: full attention).

    Parameters
    ----------
    config : a transformers ``PretrainedConfig`` (a multimodal config's text part is read)

    Returns
    -------
    ``list`` of ``num_hidden_layers`` entries.

    Raises
    ------
    ValueError
        A layer type other than :data:`LAYER_TYPES`, a ``layer_types`` list of the wrong
        length, or a sliding layer without a positive ``sliding_window``.
    """
    text = _text_config(config)
    n = int(text.num_hidden_layers)
    window = getattr(text, "sliding_window", None)
    types = getattr(text, "layer_types", None)
    if types is None:
        slides = window is not None and getattr(text, "use_sliding_window", True) is not False
        types = [SLIDING if slides else FULL] * n
    types = list(types)
    if len(types) != n:
        raise ValueError(f"config.layer_types lists {len(types)} layers but the model has {n}")
    out: list[int | None] = []
    for i, kind in enumerate(types):
        if kind == FULL:
            out.append(None)
        elif kind == SLIDING:
            if not isinstance(window, int) or isinstance(window, bool) or window < 1:
                raise ValueError(f"layer {i} is {SLIDING!r} but config.sliding_window is {window!r}; "
                                 "expected a positive int")
            out.append(window)
        else:
            raise ValueError(
                f"layer {i} of model type {getattr(text, 'model_type', None)!r} is {kind!r}: CompressedCache holds "
                f"{list(LAYER_TYPES)} layers only; use transformers' own cache (DynamicCache) for this model"
            )
    return out


def check_decoder(config: Any) -> None:
    """Raise unless ``config`` describes a decoder whose K/V shape the cache can read."""
    text = _text_config(config)
    missing = [a for a in ("num_hidden_layers", "num_attention_heads", "hidden_size") if getattr(text, a, None) is None]
    if missing:
        raise ValueError(
            f"CompressedCache needs a decoder config with num_hidden_layers, num_attention_heads and hidden_size; "
            f"{type(config).__name__} (model type {getattr(text, 'model_type', None)!r}) lacks {missing}"
        )
    if getattr(text, "is_encoder_decoder", False):
        raise ValueError(f"CompressedCache holds a decoder's self-attention cache; model type "
                         f"{getattr(text, 'model_type', None)!r} is an encoder-decoder")
