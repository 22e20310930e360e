"""Keys stored before RoPE (math dictionary §29): each layer's rotary frame, read from the config.

A layer with ``QuantConfig(pre_rope=True)`` receives the model's rotated keys ``k' = s R(p) k``,
stores ``k = R(p)^T k' / s`` (:func:`~kv_cache.compression.rope.remove_rope`) and rotates it back
at read time with the same tables. The two rotations use one frame, :class:`RopeFrame`, so a key
read back equals the key the model computed (up to float32 rounding and the code's own error)
whatever the frame is; what the frame decides is only how still the stored channels are. The
frame is the model's own where the config says what it is:

* ``rope_type`` ``"default"``, ``"linear"``, ``"yarn"``, ``"llama3"``, ``"longrope"``,
  ``"dynamic"`` and partial rotary (``partial_rotary_factor``): the frequencies come from
  transformers' own initialisers (``ROPE_INIT_FUNCTIONS``), the attention scaling included.
  ``"dynamic"`` (NTK) and ``"longrope"`` change the model's frequencies past the original
  context; the frame keeps the original ones (exact either way, the stored channels turn
  slowly there).
* Per-layer-type parameters (Gemma 3's local and global bases, ``config.rope_parameters`` keyed
  by ``layer_types``), and layers without RoPE (``no_rope_layers``: SmolLM3, Llama 4) whose keys
  are stored as they arrive.
* Pair layout by model type: interleaved pairs for GPT-J, CodeGen, Cohere, GLM, ERNIE 4.5 and
  Helium; ``rotate_half`` pairs for every other model.

Refused, with the reason and the fix: models without RoPE, and multimodal RoPE (``mrope_section``:
positions on three axes the cache does not see).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import torch

from ..compression.rope import rope_tables, rotate
from ..kernels.arrival import turn_stored_keys

INTERLEAVED_MODEL_TYPES = frozenset({"gptj", "codegen", "cohere", "cohere2", "glm", "glm4", "ernie4_5",
                                     "ernie4_5_moe", "helium"})
"""Model types whose RoPE pairs channels ``(2i, 2i + 1)`` (the others pair ``i`` with ``i + r/2``)."""

FIX = "use QuantConfig(pre_rope=False) (keys stored as the model hands them over)"


@dataclass(frozen=True, eq=False)
class RopeFrame:
    """One layer's rotary frame: ``inv_freq`` ``[r/2]`` float32 (``r`` the rotated channels),
    the attention scaling ``scaling`` and the pair ``layout`` (``"half"`` / ``"interleaved"``)."""

    inv_freq: torch.Tensor
    scaling: float
    layout: str

    def tables(self, positions: torch.Tensor, device: torch.device) -> tuple[torch.Tensor, torch.Tensor]:
        """``cos``/``sin`` ``[*positions.shape, r]`` float32 at integer ``positions``."""
        return rope_tables(self.inv_freq.to(device), positions.to(device), self.scaling, self.layout)

    def remove(self, keys: torch.Tensor, positions: torch.Tensor, offset: torch.Tensor | None = None) -> torch.Tensor:
        """``keys`` ``[b, h, n, d]`` as the model rotated them at ``positions`` (``[n]`` or
        ``[b, h, n]``) -> the keys before RoPE, in ``keys``' dtype; with a key ``offset``
        (``[b, h, 1 or 2, d]``, §29.7) also shifted (and scaled) as the layer stores them, in one pass."""
        if offset is None and positions.dim() != 1:
            return rotate(keys, positions.to(keys.device), self.inv_freq, self.scaling, self.layout, inverse=True)
        return turn_stored_keys(keys, positions, self.inv_freq, self.scaling, self.layout, inverse=True, offset=offset)

    def apply(self, keys: torch.Tensor, positions: torch.Tensor, offset: torch.Tensor | None = None) -> torch.Tensor:
        """Keys before RoPE ``[b, h, n, d]`` -> rotated at ``positions`` (``[n]`` or ``[b, h, n]``); with
        a key ``offset`` the stored keys are first brought back (``scale * k + mean``), in one pass."""
        if offset is None and positions.dim() != 1:
            return rotate(keys, positions.to(keys.device), self.inv_freq, self.scaling, self.layout)
        return turn_stored_keys(keys, positions, self.inv_freq, self.scaling, self.layout, offset=offset)


def _text_config(config: Any) -> Any:
    return config.get_text_config() if hasattr(config, "get_text_config") else config


def _parameters(text: Any, layer_type: str | None) -> dict | None:
    """The RoPE parameters of ``layer_type`` (None: the model's only set), or None without RoPE."""
    params = getattr(text, "rope_parameters", None)
    if params is None:  # transformers 4.x configs: rope_theta and rope_scaling
        theta = getattr(text, "rope_theta", None)
        if theta is None:
            return None
        params = {"rope_theta": theta, **(getattr(text, "rope_scaling", None) or {})}
    if layer_type is not None and isinstance(params.get(layer_type), dict):
        return params[layer_type]
    return params


def rope_frames(config: Any, head_dim: int) -> list[RopeFrame | None]:
    """Per layer, the frame keys are stored in under ``pre_rope`` (None: a layer without RoPE,
    whose keys are stored as they arrive).

    Raises
    ------
    ValueError
        The model has no RoPE, uses multimodal RoPE, or a rope type transformers does not know.
    """
    from transformers.modeling_rope_utils import ROPE_INIT_FUNCTIONS

    text = _text_config(config)
    model_type = getattr(text, "model_type", None)
    n = int(text.num_hidden_layers)
    types = list(getattr(text, "layer_types", None) or [None] * n)
    no_rope = getattr(text, "no_rope_layers", None)  # 1: the layer uses RoPE, 0: it does not
    layout = "interleaved" if model_type in INTERLEAVED_MODEL_TYPES else "half"
    frames: list[RopeFrame | None] = []
    cache: dict = {}
    for i in range(n):
        if no_rope is not None and i < len(no_rope) and not no_rope[i]:
            frames.append(None)
            continue
        layer_type = types[i] if i < len(types) else None
        keyed = layer_type if isinstance(getattr(text, "rope_parameters", None), dict) and \
            isinstance(text.rope_parameters.get(layer_type), dict) else None
        if keyed in cache:  # each layer holds (and counts) its own r/2 frequencies
            frames.append(RopeFrame(cache[keyed].inv_freq.clone(), cache[keyed].scaling, layout))
            continue
        params = _parameters(text, keyed)
        if params is None or params.get("rope_theta") is None:
            raise ValueError(f"QuantConfig(pre_rope=True) removes RoPE from the keys, and model type {model_type!r} "
                             f"has none (no rope_theta in its config): {FIX}")
        if params.get("mrope_section") is not None:
            raise ValueError(f"QuantConfig(pre_rope=True): model type {model_type!r} uses multimodal RoPE "
                             "(mrope_section: positions on three axes the cache does not see): " + FIX)
        rope_type = params.get("rope_type", params.get("type", "default")) or "default"
        if rope_type == "default":
            factor = params.get("partial_rotary_factor", getattr(text, "partial_rotary_factor", 1.0)) or 1.0
            dim = int(head_dim * factor)
            base = float(params["rope_theta"])
            inv_freq = 1.0 / (base ** (torch.arange(0, dim, 2, dtype=torch.int64).float() / dim))
            scaling = 1.0
        elif rope_type in ROPE_INIT_FUNCTIONS:
            inv_freq, scaling = ROPE_INIT_FUNCTIONS[rope_type](config if keyed is None else text, None,
                                                               layer_type=keyed)
        else:
            raise ValueError(f"QuantConfig(pre_rope=True): rope_type {rope_type!r} of model type {model_type!r} is "
                             f"not one transformers knows ({['default', *ROPE_INIT_FUNCTIONS]}): {FIX}")
        inv_freq = inv_freq.detach().float().cpu()
        if inv_freq.dim() != 1 or inv_freq.numel() == 0 or 2 * inv_freq.numel() > head_dim:
            raise ValueError(f"QuantConfig(pre_rope=True): model type {model_type!r} rotates {2 * inv_freq.numel()} "
                             f"channels of a {head_dim}-channel head: {FIX}")
        frame = RopeFrame(inv_freq, float(scaling), layout)
        cache[keyed] = frame
        frames.append(frame)
    return frames

