"""The fidelity check: the compressed prompt's attention-output error at prefill (math dictionary §26).

At a prefill the layer has the prompt's full-precision keys and values in hand, and the cache
has just stored their compressed form. For the last :data:`FIDELITY_QUERIES` queries of the
prompt (each query head), the check compares the attention output over the stored tokens
with the output over the full-precision ones:

``e = ||O_hat - O||_F / ||O||_F`` per batch row, over its KV heads together (each head's ``G``
query heads and ``m`` queries), where ``O = softmax(s q K^T) V`` over every prompt token and
``O_hat`` the same over what the cache holds (quantized, and after any eviction done in the
same call). Both sides let every checked query see the whole prompt. The layer keeps the
largest ``e`` over batch rows (:func:`layer_output_error`); the largest per-head ratio is kept
as a diagnostic (a head with a small output, e.g. one reading an attention sink, made that
figure cry wolf on the 4-bit default). A value past :data:`FIDELITY_THRESHOLD` means the cache
wrecks that layer's attention: the cache warns, and with ``strict=True`` raises.

A few queries against the stored tokens: one small matmul per layer at prefill, never during
decoding. Eviction done after the prefill's forward (KVzip's repeat pass) is not in the figure.

The eviction check (math dictionary §26.1) covers it: at the same prefill a KVzip layer keeps
the attention of the same last queries, ``a = mean over the G m rows of softmax(s q K^T)``
``[B, Hkv, T]``; once KVzip has chosen what to keep, the layer's figure is the share of that
attention on the dropped slots, ``x = sum_{t dropped} a_t`` (the largest over batch rows of the
mean over KV heads). The cache takes the mean of ``x`` over the evicting layers; past
:data:`EVICTION_THRESHOLD` it warns, and with ``strict=True`` raises.
"""

from __future__ import annotations

import torch

FIDELITY_QUERIES = 8
"""Queries per layer the check reads (the prompt's last ones)."""

FIDELITY_THRESHOLD = 0.5
"""Relative attention-output error (a layer's heads together) past which a layer is reported as
broken. Measured (``docs/results/archive/diary.md``, "Keys before RoPE: the whole cache"): the 4-bit
default reaches 0.11-0.22 on the three families' *Moby Dick* windows and SmolLM2's needles;
per-token keys after RoPE reach 1.16 on Qwen2.5 (+48% perplexity), ``q2d`` 0.72 on SmolLM2
(+19.7%)."""

ADVICE = ("use a layout that keeps this model's keys (QuantConfig(bits=4, key_grouping='channel'): per-channel "
          "key groups, or QuantConfig.kivi(bits=4)), more bits (bits=8), or keep these layers in full precision "
          "(layer_bits={layer: 8})")
"""The advice when nothing is known of the layers' settings (:func:`fidelity_advice` otherwise)."""


def fidelity_advice(settings: dict[int, tuple[int, int, str, bool]]) -> str:
    """What to do about the broken layers, built from what they hold so that it never recommends
    the setting already in use. ``settings`` maps each broken layer to ``(key_bits, value_bits,
    key_grouping, evicts)`` (bits 16 for a layer held in full precision; ``evicts``: the layer's
    eviction policy dropped tokens during the prefill)."""
    if not settings:
        return ADVICE
    options = []
    if any(g == "token" and min(k, v) < 16 for k, v, g, _ in settings.values()):
        options.append("keys per channel instead of per token (QuantConfig(bits=b, key_grouping='channel'), "
                       "about 0.6 more bits per element, or QuantConfig.kivi(bits=b); key_grouping='token' is in use)")
    coded = {i: (k, v) for i, (k, v, _, _) in settings.items() if min(k, v) < 16}
    narrow = min((min(kv) for kv in coded.values()), default=16)
    if narrow < 4:
        options.append(f"more bits (bits=4; {narrow} are in use)")
    elif narrow < 8:
        options.append(f"more bits (bits=8; {narrow} are in use)")
    short = [i for i, kv in coded.items() if min(kv) < 8]
    if short:
        shown = ", ".join(f"{i}: 8" for i in short[:4]) + (", ..." if len(short) > 4 else "")
        options.append(f"8 bits for these layers only (layer_bits={{{shown}}})")
    if any(evicts for *_, evicts in settings.values()):
        options.append("keep more tokens (a larger eviction budget)")
    if not options:
        options.append("report it: these layers hold 8-bit codes or more and no eviction, which the check "
                       "has never seen break")
    return ", or ".join([", ".join(options[:-1]), options[-1]] if len(options) > 1 else options)


EVICTION_THRESHOLD = 0.25
"""Mean share of the last queries' attention (over the evicting layers) past which an eviction
is reported as harmful on a model whose every layer attends globally (§26.1); a hybrid model's
limit is this times its share of full-attention layers (:func:`eviction_limit`). Measured on the
golden Moby Dick window (768 tokens, 256 scored): KVzip keeping 25% drops 0.12 (SmolLM2, +3.4%
perplexity) and 0.20 (Qwen2.5, +3.1%), keeping 10% drops 0.30 (+5.1%) and 0.29 (+6.9%); on
Gemma 3 270M (3 full-attention layers of 18, 1,792 tokens) keeping half drops 0.24-0.27 for +19%."""


def eviction_limit(threshold: float, full_layers: int, layers: int) -> float:
    """The eviction check's limit on the mean dropped share (§26.1): ``threshold`` scaled by the
    share of layers that attend globally. On a hybrid model only the full-attention layers read
    the tokens past the sliding window, and eviction drops them there: the same dropped share
    removes a larger part of the model's reads of those tokens than on a model whose every
    layer reads them (Gemma 3 270M: 0.25 for +19%, against 0.29 for +6.9% on Qwen2.5)."""
    if layers < 1 or not 0 < full_layers <= layers:
        raise ValueError(f"full_layers must be in [1, layers]; got {full_layers} of {layers}")
    return threshold * full_layers / layers


RECENT_ATTENTION = "recent_attention"
"""The layer-state slot of :func:`query_attention` between the prefill and KVzip's eviction."""


def attention_probabilities(q: torch.Tensor, keys: torch.Tensor, scaling: float, softcap: float | None = None,
                            key_valid: torch.Tensor | None = None) -> torch.Tensor:
    """``softmax(cap(s q K^T))`` in float32, every query over every valid key: ``q`` ``[B, H, M, d]``,
    ``keys`` ``[B, H, T, d]``, ``key_valid`` ``[B, H, T]`` bool or None. Returns ``[B, H, M, T]``
    (rows of a query with no valid key are 0)."""
    logits = (q.float() @ keys.float().transpose(-1, -2)) * scaling
    if softcap is not None:
        logits = softcap * torch.tanh(logits / softcap)
    if key_valid is not None:
        logits = logits.masked_fill(~key_valid[:, :, None, :], float("-inf"))
    return torch.softmax(logits, dim=-1).nan_to_num(0.0)


def masked_attention(q: torch.Tensor, keys: torch.Tensor, values: torch.Tensor, scaling: float,
                     softcap: float | None = None, key_valid: torch.Tensor | None = None) -> torch.Tensor:
    """``softmax(cap(s q K^T)) V`` in float32 (:func:`attention_probabilities`): ``values``
    ``[B, H, T, d_v]``. Returns ``[B, H, M, d_v]``."""
    return attention_probabilities(q, keys, scaling, softcap, key_valid) @ values.float()


def attention_output_error(q: torch.Tensor, keys: torch.Tensor, values: torch.Tensor,
                           approx_out: torch.Tensor, scaling: float, softcap: float | None = None,
                           key_valid: torch.Tensor | None = None) -> torch.Tensor:
    """Relative error of an approximate attention output, per batch row and KV head.

    Parameters
    ----------
    q : ``[B, Hkv, M, d]`` grouped queries (the ``G`` query heads of each KV head and the checked
        positions together)
    keys, values : ``[B, Hkv, T, d]`` the full-precision prompt
    approx_out : ``[B, Hkv, M, d_v]`` the output of the same queries over the compressed cache
    scaling : the softmax scale; softcap : logit soft-capping (Gemma 2) or None
    key_valid : ``[B, Hkv, T]`` bool (False: a padding slot) or None

    Returns
    -------
    float32 ``[B, Hkv]``: ``||approx_out - o|| / ||o||`` (0 where ``o`` is 0 and so is the error).

    Raises
    ------
    ValueError
        Mismatched ranks or shapes.
    """
    return _ratio(*_error_norms(q, keys, values, approx_out, scaling, softcap, key_valid))


def _error_norms(q, keys, values, approx_out, scaling, softcap, key_valid) -> tuple[torch.Tensor, torch.Tensor]:
    """``(||approx_out - o||, ||o||)`` per batch row and KV head, float32 ``[B, Hkv]``, after the
    shape checks of :func:`attention_output_error`."""
    if q.dim() != 4 or keys.dim() != 4 or values.dim() != 4 or approx_out.dim() != 4:
        raise ValueError("q, keys, values and approx_out must be 4-D [B, Hkv, *, d]; got "
                         f"{[tuple(t.shape) for t in (q, keys, values, approx_out)]}")
    if keys.shape[:3] != values.shape[:3] or q.shape[:2] != keys.shape[:2] or approx_out.shape[:3] != q.shape[:3]:
        raise ValueError(f"shapes do not match: q {tuple(q.shape)}, keys {tuple(keys.shape)}, values "
                         f"{tuple(values.shape)}, approx_out {tuple(approx_out.shape)}")
    exact = masked_attention(q, keys, values, scaling, softcap, key_valid)
    return (approx_out.float() - exact).flatten(2).norm(dim=-1), exact.flatten(2).norm(dim=-1)


def _ratio(err: torch.Tensor, ref: torch.Tensor) -> torch.Tensor:
    """``err / ref``, and ``err`` where ``ref`` is 0 (0 when both are)."""
    return torch.where(ref > 0, err / ref.clamp_min(torch.finfo(torch.float32).tiny), err)


def layer_output_error(q: torch.Tensor, keys: torch.Tensor, values: torch.Tensor,
                       approx_out: torch.Tensor, scaling: float, softcap: float | None = None,
                       key_valid: torch.Tensor | None = None) -> tuple[torch.Tensor, torch.Tensor]:
    """The layer's figure of the fidelity check and the per-head one, from one attention pass.

    Same arguments as :func:`attention_output_error`. Returns float32 ``(layer [B], heads [B, Hkv])``:
    ``layer = ||O_hat - O||_F / ||O||_F`` over every KV head of a batch row together (a head
    whose output is small, e.g. one that reads an attention sink with a small value, weighs as
    little in the figure as in the layer's output), and ``heads`` the per-head ratios of
    :func:`attention_output_error`.
    """
    err, ref = _error_norms(q, keys, values, approx_out, scaling, softcap, key_valid)  # [B, Hkv]
    return _ratio(err.square().sum(-1).sqrt(), ref.square().sum(-1).sqrt()), _ratio(err, ref)


def query_attention(q: torch.Tensor, keys: torch.Tensor, scaling: float, softcap: float | None = None,
                    key_valid: torch.Tensor | None = None) -> torch.Tensor:
    """The mean attention of the checked queries over the prompt: ``q`` ``[B, Hkv, M, d]`` (the
    ``G`` query heads of each KV head and the last ``m`` positions together), ``keys``
    ``[B, Hkv, T, d]`` in full precision, ``key_valid`` ``[B, Hkv, T]`` bool or None. Returns
    float32 ``[B, Hkv, T]``, each row summing to 1 over its valid slots (§26.1)."""
    if q.dim() != 4 or keys.dim() != 4 or q.shape[:2] != keys.shape[:2]:
        raise ValueError(f"q and keys must be 4-D [B, Hkv, *, d] with the same B, Hkv; got {tuple(q.shape)} and "
                         f"{tuple(keys.shape)}")
    return attention_probabilities(q, keys, scaling, softcap, key_valid).mean(2)


def evicted_share(attention: torch.Tensor, keep: torch.Tensor) -> float:
    """A layer's eviction figure (§26.1): the share of ``attention`` ``[B, Hkv, T]`` (from
    :func:`query_attention`) on the slots ``keep`` ``[B, Hkv, T]`` bool drops, the mean over KV
    heads, the largest over batch rows. 0 when nothing is dropped, 1 when everything read is."""
    if attention.shape != keep.shape or keep.dtype != torch.bool:
        raise ValueError(f"attention and keep must have the same [B, Hkv, T] shape and keep must be bool; got "
                         f"{tuple(attention.shape)} and {tuple(keep.shape)} {keep.dtype}")
    return min(1.0, float((attention.float() * ~keep).sum(-1).mean(-1).max()))


def eviction_past(shares: dict[int, float], limit: float) -> bool:
    """Whether the mean of the evicting layers' figures is past ``limit`` (NaN counts as past;
    no figure, as not)."""
    if not shares:
        return False
    mean = sum(shares.values()) / len(shares)
    return not mean <= limit


def eviction_message(shares: dict[int, float], threshold: float, strict: bool = False, hybrid: bool = False) -> str:
    """The warning / error text of the eviction check: the mean share, the worst layers, what to do
    (``hybrid``: the model has sliding-window layers, where fewer bits and no eviction is the other way)."""
    mean = sum(shares.values()) / len(shares)
    worst = ", ".join(f"layer {i}: {x:.2f}" for i, x in sorted(shares.items(), key=lambda kv: -kv[1])[:4])
    return (f"the eviction drops {100 * mean:.0f}% of the attention the prompt's last queries pay, on average over the "
            f"{len(shares)} evicting layer(s), past the limit {threshold:.3g} ({worst}): the continuation will miss "
            f"tokens it reads. To fix it, keep more tokens (a larger budget), or keep the evicted tokens at low "
            f"precision instead of dropping them (QuantConfig(..., evicted_bits=2); `o2` in method specs)"
            + ("; on this hybrid model the evicting layers are its only readers past the window: fewer bits and no "
               "eviction usually cost less (QuantConfig(bits=3); the presets do this, math dictionary §23.3)"
               if hybrid else "")
            + ("; or pass strict=False to go on with a warning" if strict else ""))


def checked_rows(G: int, L: int, m: int, device) -> torch.Tensor:
    """Row indices of the last ``m`` of ``L`` positions in grouped queries ``[B, Hkv, G * L, d]``."""
    return (torch.arange(G, device=device)[:, None] * L + torch.arange(L - m, L, device=device)[None, :]).reshape(-1)


def broken_layers(errors: dict[int, float], threshold: float) -> dict[int, float]:
    """The layers whose error is past ``threshold`` (NaN counts as past), in layer order."""
    return {i: e for i, e in sorted(errors.items()) if not e <= threshold}


def fidelity_message(bad: dict[int, float], threshold: float, strict: bool = False,
                     settings: dict[int, tuple[int, int, str, bool]] | None = None) -> str:
    """The warning / error text naming the broken layers and what to do (:func:`fidelity_advice`
    of ``settings``, the layers' own; the generic :data:`ADVICE` without them)."""
    worst = ", ".join(f"layer {i}: {e:.2f}" for i, e in bad.items())
    return (f"the compressed cache wrecks the attention of {len(bad)} layer(s): relative attention-output error "
            f"on the prompt's last queries past {threshold} ({worst}). To fix it, "
            f"{fidelity_advice(settings) if settings else ADVICE}"
            + ("; or pass strict=False to go on with a warning" if strict else ""))
