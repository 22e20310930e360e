"""What quantizing one layer's keys or values costs, measured on a model (math dictionary §20.1).

For each calibration window the prefix is prefilled once with a full-precision cache. Then, for
every layer ``l``, half ``t`` (keys or values) and width ``b``, only that half of that layer is
replaced by its quantize -> dequantize round trip in the cache's own layout
(:class:`kv_cache.cache.packed.PackedKV` with ``quant`` at ``b`` bits: the same rotation,
grouping, levels and sink tokens), and the continuation is scored against the same
continuation over the untouched cache:

    D[l, t, b] = mean over windows and continuation positions of KL(P_full || P_{l,t,b})

The costs are first-order (one item at a time) and are added by :func:`allocate_bits`; the
combined allocation is then measured for real by ``kvcache eval``. Forward passes only; the
model is not modified (the cache is built with transformers' ``DynamicCache``).
"""

from __future__ import annotations

from dataclasses import replace
from typing import Sequence

import torch

from ..cache.config import QuantConfig


def _round_trip(quant: QuantConfig, bits: int, layer: int, keys: torch.Tensor,
                values: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Keys and values ``[b, h, n, d]`` after quantize -> dequantize at ``bits`` in ``quant``'s
    layout; the first ``sink_tokens`` and a tail shorter than one flush block stay exact."""
    from ..cache.packed import PackedKV

    q = replace(quant, bits=bits, key_bits=None, value_bits=None, layer_bits=())
    n = keys.shape[2]
    s = min(q.sink_tokens, n)
    m = ((n - s) // q.group_size) * q.group_size
    k, v = keys.clone(), values.clone()
    if m:
        packed = PackedKV(q, keys.dtype, keys.shape[-1], track_groups=False, layer=layer)
        packed.append(keys[:, :, s:s + m], values[:, :, s:s + m])
        kq, vq = packed.dequantize()
        k[:, :, s:s + m], v[:, :, s:s + m] = kq, vq
    return k, v


def _continuation_log_probs(model, layers: list[tuple[torch.Tensor, torch.Tensor]],
                            cont: torch.Tensor) -> torch.Tensor:
    from transformers import DynamicCache

    cache = DynamicCache()
    for i, (k, v) in enumerate(layers):
        cache.update(k, v, i)  # DynamicCache concatenates into new tensors: ``layers`` is never written
    logits = model(input_ids=cont, past_key_values=cache, use_cache=True).logits[0]
    return torch.log_softmax(logits.float(), dim=-1)


def measure_bit_costs(model, windows: Sequence[torch.Tensor], quant: QuantConfig, choices: Sequence[int],
                      prefix_len: int) -> torch.Tensor:
    """``D [2 * num_layers, len(choices)]``: the mean next-token KL of quantizing one layer's keys
    (row ``2 l``) or values (row ``2 l + 1``) at each width, everything else exact.

    Parameters
    ----------
    model : a transformers causal LM (its attention layers write a ``DynamicCache``)
    windows : sequence of int tensors ``[n]``
        Calibration token windows, each longer than ``prefix_len``.
    quant : QuantConfig
        The layout measured (its ``bits`` / ``key_bits`` / ``value_bits`` / ``layer_bits`` are
        replaced by each choice in turn).
    choices : sequence of int
        Widths to measure.
    prefix_len : int
        Tokens of each window held in the cache; the rest is the scored continuation.

    Returns
    -------
    torch.Tensor, float64 ``[2 * num_layers, len(choices)]``, >= 0 (clamped at 0 against
    rounding).

    Raises
    ------
    ValueError
        No window, a window not longer than ``prefix_len``, ``prefix_len`` < 1, a width
        ``quant`` cannot use (e.g. 8 bits with Lloyd-Max levels).
    """
    if not windows:
        raise ValueError("measure_bit_costs needs at least one calibration window; got none")
    if isinstance(prefix_len, bool) or not isinstance(prefix_len, int) or prefix_len < 1:
        raise ValueError(f"prefix_len must be an int >= 1; got {prefix_len!r}")
    for c in choices:
        replace(quant, bits=c, key_bits=None, value_bits=None, layer_bits=())  # validates the width
    from transformers import DynamicCache

    num_layers = model.config.num_hidden_layers
    total = torch.zeros(2 * num_layers, len(choices), dtype=torch.float64)
    with torch.no_grad():
        for w in windows:
            ids = torch.as_tensor(w).reshape(1, -1)
            if ids.shape[1] <= prefix_len:
                raise ValueError(f"each window must be longer than prefix_len={prefix_len}; got {ids.shape[1]} tokens")
            cache = DynamicCache()
            model(input_ids=ids[:, :prefix_len], past_key_values=cache, use_cache=True)
            exact = [(layer.keys, layer.values) for layer in cache.layers]
            cont = ids[:, prefix_len:]
            ref = _continuation_log_probs(model, exact, cont)
            p_ref = ref.exp()
            for li, (k, v) in enumerate(exact):
                for ci, bits in enumerate(choices):
                    kq, vq = _round_trip(quant, bits, li, k, v)
                    for half, (kk, vv) in enumerate(((kq, v), (k, vq))):
                        layers = list(exact)
                        layers[li] = (kk, vv)
                        lp = _continuation_log_probs(model, layers, cont)
                        kl = (p_ref * (ref - lp)).sum(-1).mean()
                        total[2 * li + half, ci] += float(kl)
    return (total / len(windows)).clamp_min(0.0)
