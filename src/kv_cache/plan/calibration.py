"""Calibrated KV rotations (OSCAR-style): fitting them on a model (math dictionary §17.7); the
file format and its loader are :mod:`kv_cache.compression.rotation_file`.

For each layer and KV head the post-RoPE queries of the query heads that share that KV head
are collected on calibration text and summed into ``C_Q = sum_t q_t^T q_t`` ``[d, d]``; the
rotation is ``R = V H`` with ``V`` the eigenvectors of ``C_Q`` (largest first) and ``H`` a
normalized (block-)Hadamard matrix (:func:`kv_cache.compression.rotation.calibrated_rotation`).
Zhou et al., "OSCAR: Offline Spectral Covariance-Aware Rotation for 2-bit KV Cache
Quantization" (2026).

* :func:`query_covariances` / :func:`calibrate_rotations` run the model once per window with
  forward hooks on its attention modules; the hooks are registered inside the function and
  removed in ``finally`` (the model's code and config are not touched).
* :func:`save_calibration` / :func:`load_calibration`: a safetensors file, one float32 tensor
  ``layers.<i>`` ``[kv_heads, d, d]`` per layer, and a JSON header (key
  :data:`METADATA_KEY`) with :data:`FORMAT_VERSION`, the model's architecture and shapes,
  the sha256 of the text and the token count. Loading validates all of it.
* :func:`rotation_matrices`: one layer's matrices for the cache (``QuantConfig(rotation=
  "calibrated", rotation_path=...)``), loaded once per file and checked against the layer's
  shapes.
"""

from __future__ import annotations

from typing import Any

import torch

from ..compression.rotation import calibrated_rotation
from ..compression.rotation_file import FORMAT_VERSION, KIND, model_shapes, text_sha256


def _attention_modules(model: torch.nn.Module) -> list[torch.nn.Module]:
    from ..cache.hooks import attention_classes as _attention_classes

    mods = [m for m in model.modules() if isinstance(m, _attention_classes())]
    if not mods:
        mt = getattr(getattr(model, "config", None), "model_type", None)
        raise ValueError(f"calibration recomputes queries of Llama, Mistral, Qwen2 and Qwen3 attention only; "
                         f"got model type {mt!r}")
    return mods


def query_covariances(
    model: torch.nn.Module,
    input_ids: torch.Tensor,
    attention_mask: torch.Tensor | None = None,
    window: int | None = None,
) -> tuple[dict[int, torch.Tensor], int]:
    """Per layer ``C_Q[h] = sum_t sum_{j in group(h)} q_{j,t}^T q_{j,t}``: float64 ``[kv_heads, d, d]``.

    ``q_{j,t}`` is the post-RoPE query of query head ``j`` at token ``t`` (recomputed from the
    attention module's own ``q_proj`` / ``q_norm`` and the rotary embedding it was called
    with); ``group(h)`` the query heads that share KV head ``h`` (``j // (q_heads / kv_heads)``,
    transformers' ``repeat_kv`` order). Padding (``attention_mask == 0``) is left out.

    Parameters
    ----------
    model : a transformers Llama / Mistral / Qwen2 / Qwen3 causal LM
    input_ids : torch.Tensor, int ``[batch, n]``
    attention_mask : torch.Tensor, ``[batch, n]``, optional
    window : int, optional
        Run the columns in independent windows of this many tokens (each from position 0);
        None: one pass.

    Returns
    -------
    (dict of layer index -> float64 ``[kv_heads, d, d]``, number of tokens counted)

    Raises
    ------
    TypeError, ValueError
        Bad ``input_ids`` / ``attention_mask`` / ``window``; an unsupported architecture; no token.
    """
    if not isinstance(input_ids, torch.Tensor) or input_ids.ndim != 2 or input_ids.dtype.is_floating_point:
        got = getattr(input_ids, "shape", type(input_ids).__name__)
        raise TypeError(f"input_ids must be an integer tensor [batch, n]; got {got}")
    if attention_mask is not None and attention_mask.shape != input_ids.shape:
        raise ValueError(f"attention_mask must have the shape of input_ids {tuple(input_ids.shape)}; "
                         f"got {tuple(attention_mask.shape)}")
    n = input_ids.shape[1]
    if window is None:
        window = max(n, 1)
    if isinstance(window, bool) or not isinstance(window, int) or window < 1:
        raise ValueError(f"window must be an int >= 1 or None; got {window!r}")
    shapes = model_shapes(model.config)
    kvh, group = shapes["kv_heads"], shapes["q_heads"] // shapes["kv_heads"]
    covs: dict[int, torch.Tensor] = {}
    weight: list[torch.Tensor | None] = [None]

    def hook(module, args, kwargs, output):
        from ..cache.hooks import post_rope_queries as _queries

        hidden = kwargs.get("hidden_states", args[0] if args else None)
        q = _queries(module, hidden, kwargs["position_embeddings"], hidden.shape[1]).double()  # [b, Hq, t, d]
        b, _, t, d = q.shape
        if weight[0] is not None:
            q = q * weight[0][:, None, :, None]
        q = q.view(b, kvh, group, t, d)
        c = torch.einsum("bhgtd,bhgte->hde", q, q)
        idx = module.layer_idx
        covs[idx] = c if idx not in covs else covs[idx] + c

    handles = [m.register_forward_hook(hook, with_kwargs=True) for m in _attention_modules(model)]
    count = 0
    try:
        with torch.no_grad():
            for s in range(0, n, window):
                ids = input_ids[:, s:s + window]
                mask = None if attention_mask is None else attention_mask[:, s:s + window]
                weight[0] = None if mask is None else mask.to(torch.float64)
                count += ids.numel() if mask is None else int(mask.sum())
                model(input_ids=ids, attention_mask=mask, use_cache=False)
    finally:
        for h in handles:
            h.remove()
    if count == 0:
        raise ValueError("calibration needs at least one (non-padding) token; got none")
    return covs, count


def calibrate_rotations(
    model: torch.nn.Module,
    input_ids: torch.Tensor,
    attention_mask: torch.Tensor | None = None,
    *,
    block: int | None = None,
    window: int | None = None,
) -> dict[str, torch.Tensor]:
    """Fit ``R = V H`` per layer and KV head on ``input_ids`` (§17.7).

    Parameters
    ----------
    model, input_ids, attention_mask, window
        As :func:`query_covariances`.
    block : int or None
        Hadamard block size; match the quantizer's channel group (``QuantConfig.channel_group``)
        so each scale group mixes directions of similar query energy. None: one Hadamard over
        the head (power-of-two blocks when ``head_dim`` is not a power of two).

    Returns
    -------
    dict
        ``"layers.<i>"`` -> float32 ``[kv_heads, head_dim, head_dim]``, orthonormal, for every
        layer ``i`` (row-vector convention: the cache stores ``k R``, ``v R``).

    Examples
    --------
    >>> tensors = calibrate_rotations(model, tok(text, return_tensors="pt").input_ids)  # doctest: +SKIP
    >>> save_calibration("calib.safetensors", tensors, calibration_meta(model, text, 4096))  # doctest: +SKIP
    """
    covs, _ = query_covariances(model, input_ids, attention_mask, window)
    num_layers = model_shapes(model.config)["num_layers"]
    missing = sorted(set(range(num_layers)) - set(covs))
    if missing:
        raise ValueError(f"no queries were seen for layers {missing}: is every layer's attention a supported module?")
    return {f"layers.{i}": calibrated_rotation(covs[i], block).float().contiguous() for i in range(num_layers)}


def calibration_meta(model: torch.nn.Module, text: str, tokens: int, block: int | None = None,
                     source: str = "") -> dict[str, Any]:
    """The metadata header of a calibration of ``model`` on ``text`` (``tokens`` tokens)."""
    return {"format_version": FORMAT_VERSION, "kind": KIND, **model_shapes(model.config),
            "text_sha256": text_sha256(text), "tokens": int(tokens), "hadamard_block": block, "source": source}
