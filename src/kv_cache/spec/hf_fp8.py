"""The ``hf-fp8`` baseline: transformers' fp8 ``QuantizedCache`` backend, or a backport of it.

Newer transformers releases (5.24 has it) ship ``QuantizedCache("fp8", config)``, built on
``Fp8QuantizedLayer``; the release this project pins for kvpress compatibility (5.2) does not.
:func:`make_fp8_cache` uses transformers' class when the installed version has it and
otherwise this module's :class:`Fp8QuantizedLayerBackport`, which reproduces transformers'
algorithm line for line:

* the first ``update`` (the prefill) calibrates one float32 scale per tensor,
  ``s = max(amax(|x|) / 448, tiny)`` (448 = e4m3's largest finite value), separately for keys
  and values, and stores ``c = float8_e4m3fn(x / s)``;
* later tokens are quantized with that frozen scale and appended: no residual buffer, no
  re-quantization (values beyond ``448 s`` saturate to +-448 s: torch 2.13's CPU cast saturates);
* attention gets ``float(c) * s`` in the model's dtype.

Formula: math dictionary §14. The layer holds the codes (1 byte per element) and two scalars.
"""

from __future__ import annotations

import torch
from transformers import cache_utils
from transformers.cache_utils import Cache, QuantizedLayer

FP8_DTYPE = torch.float8_e4m3fn
FP8_MAX = float(torch.finfo(FP8_DTYPE).max)


def fp8_quantize(x: torch.Tensor, scale: torch.Tensor | None = None) -> tuple[torch.Tensor, torch.Tensor]:
    """Per-tensor fp8 e4m3 quantization (transformers' ``Fp8QuantizedLayer._quantize``).

    Parameters
    ----------
    x : torch.Tensor, any shape, floating point
    scale : torch.Tensor, shape ``[]``, float32, optional
        A frozen scale; None calibrates ``max(amax(|x|) / 448, tiny)``.

    Returns
    -------
    codes : torch.Tensor, shape of ``x``, ``torch.float8_e4m3fn``
    scale : torch.Tensor, shape ``[]``, float32
    """
    if not x.is_floating_point():
        raise TypeError(f"fp8_quantize needs a floating-point tensor; got dtype {x.dtype}")
    if scale is None:
        scale = (x.abs().amax().float() / FP8_MAX).clamp(min=torch.finfo(torch.float32).tiny)
    return (x.float() / scale).to(FP8_DTYPE), scale


def fp8_dequantize(codes: torch.Tensor, scale: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """Inverse of :func:`fp8_quantize`: ``float(codes) * scale`` cast to ``dtype`` (shape of ``codes``)."""
    return (codes.float() * scale).to(dtype)


class Fp8QuantizedLayerBackport(QuantizedLayer):
    """transformers' ``Fp8QuantizedLayer`` for releases that lack it (see the module docstring).

    Holds ``_quantized_keys`` / ``_quantized_values`` as ``(codes, scale)`` with codes
    ``[batch, kv_heads, seen, head_dim]`` float8_e4m3fn and scale ``[]`` float32; ``keys`` and
    ``values`` stay empty (no residual).
    """

    def __init__(self) -> None:
        super().__init__(nbits=8, axis_key=0, axis_value=0, q_group_size=0, residual_length=0)

    def lazy_initialization(self, key_states: torch.Tensor, value_states: torch.Tensor) -> None:
        super().lazy_initialization(key_states, value_states)
        self._quantized_keys = self._quantize(key_states)
        self._quantized_values = self._quantize(value_states)

    def _quantize(self, tensor, scale=None, axis=None):
        return fp8_quantize(tensor, scale)

    def _dequantize(self, q_tensor):
        codes, scale = q_tensor
        return fp8_dequantize(codes, scale, self.keys.dtype)

    def update(self, key_states: torch.Tensor, value_states: torch.Tensor, *args, **kwargs):
        """Append ``[batch, kv_heads, q, head_dim]`` states; returns all states dequantized."""
        self.cumulative_length += key_states.shape[-2]
        if not self.is_initialized:
            self.lazy_initialization(key_states, value_states)
            return key_states, value_states
        qk, sk = self._quantized_keys
        qv, sv = self._quantized_values
        self._quantized_keys = (torch.cat([qk, self._quantize(key_states, sk)[0]], dim=-2), sk)
        self._quantized_values = (torch.cat([qv, self._quantize(value_states, sv)[0]], dim=-2), sv)
        return self._dequantize(self._quantized_keys), self._dequantize(self._quantized_values)


def transformers_has_fp8() -> bool:
    """Whether the installed transformers ships the fp8 ``QuantizedCache`` backend."""
    return hasattr(cache_utils, "Fp8QuantizedLayer")


def make_fp8_cache(config) -> Cache:
    """transformers' ``QuantizedCache("fp8", config)`` when available, else the backport."""
    if transformers_has_fp8():
        return cache_utils.QuantizedCache("fp8", config)
    text = config.get_text_config(decoder=True)
    return Cache(layers=[Fp8QuantizedLayerBackport() for _ in range(text.num_hidden_layers)])


__all__ = ["FP8_DTYPE", "FP8_MAX", "Fp8QuantizedLayerBackport", "fp8_dequantize", "fp8_quantize",
           "make_fp8_cache", "transformers_has_fp8"]
