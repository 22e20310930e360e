"""Fitting KVzap scorers on a model (math dictionary §24); the scorer itself is
:mod:`kv_cache.compression.scorer`, its file :mod:`kv_cache.compression.scorer_file`.

For each window of calibration text, the model prefills the window into a cache with a
:class:`~kv_cache.KVzip` policy while forward pre-hooks record the hidden states entering every
full-attention layer's attention; KVzip's reconstruction pass then scores every token in every
KV head (:func:`kv_cache.context.reconstruct` with ``finish=False``: nothing is evicted). The
pairs ``(hidden state, log KVzip score)`` of every window but the last are the training set, the
last window is held out: its R^2 (and the fraction of KVzip's top 25% the scorer also ranks in
its top 25%) is recorded in the file.
"""

from __future__ import annotations

import logging
from typing import Any

import torch

from ..cache import CompressedCache, compress
from ..cache.architecture import layer_windows
from ..cache.hooks import hidden_state_hooks
from ..compression.scorer import KINDS, RIDGE, check_ridge, fit_linear, fit_mlp, fit_static, log_targets, r_squared, score_hidden
from ..compression.scorer_file import Scorer, model_identity
from ..compression.rotation_file import text_sha256
from ..policies import KVzip

log = logging.getLogger(__name__)

SKIP_SINKS = 4
"""The first tokens of a window (attention sinks, always kept) are left out of the fit."""


def collect_pairs(model: Any, tokenizer: Any, ids: torch.Tensor, *, max_tokens_per_window: int = 1024,
                  seed: int = 0) -> tuple[dict[int, torch.Tensor], dict[int, torch.Tensor]]:
    """``(x, y)`` of one window ``ids`` ``[1, T]``: per scored layer, hidden states ``[n, hidden]``
    and log KVzip scores ``[n, kv_heads]`` (float32) of ``n <= max_tokens_per_window`` tokens drawn
    (seeded) among those after the first :data:`SKIP_SINKS`."""
    if ids.dim() != 2 or ids.shape[0] != 1 or ids.shape[1] <= SKIP_SINKS + 1:
        raise ValueError(f"a calibration window must be [1, T] with T > {SKIP_SINKS + 1}; got {tuple(ids.shape)}")
    layers = [i for i, w in enumerate(layer_windows(model.config)) if w is None]
    cache = CompressedCache(model.config, eviction=KVzip(budget=1.0, scope="head"))
    hidden: dict[int, torch.Tensor] = {}

    def grab(idx: int, h: torch.Tensor) -> None:
        hidden[idx] = h[0].detach().float()

    from ..context import reconstruct

    with torch.no_grad(), compress(model, cache):
        with hidden_state_hooks(model, grab, layers):
            model(input_ids=ids, past_key_values=cache, use_cache=True, logits_to_keep=1)
        reconstruct(model, cache, ids[0], tokenizer, finish=False)
    T = ids.shape[1]
    g = torch.Generator().manual_seed(seed)
    pick = SKIP_SINKS + torch.randperm(T - SKIP_SINKS, generator=g)[:max_tokens_per_window].sort().values
    xs, ys = {}, {}
    for i in layers:
        scores = cache.layers[i].state["kvzip"][0]  # [kv_heads, T]
        xs[i] = hidden[i][pick]
        ys[i] = log_targets(scores[:, pick].T)
    return xs, ys


def top_overlap(pred: torch.Tensor, y: torch.Tensor, keep: float = 0.25) -> float:
    """Fraction of the top ``keep`` of ``y`` ``[n, heads]`` (per head) also in the top ``keep`` of ``pred``."""
    n = y.shape[0]
    k = max(1, int(keep * n))
    hits = 0
    for h in range(y.shape[1]):
        a = set(y[:, h].topk(k).indices.tolist())
        b = set(pred[:, h].topk(k).indices.tolist())
        hits += len(a & b)
    return hits / (k * y.shape[1])


def collect_windows(model: Any, tokenizer: Any, text: str, *, tokens: int = 16384, window: int = 2048,
                    max_tokens_per_window: int = 1024, seed: int = 0, progress=None) -> dict[str, Any]:
    """The training and held-out pairs of ``text``: its first ``tokens`` tokens cut into windows of
    ``window`` tokens (at least 2; the last is held out), each scored by :func:`collect_pairs`.

    Returns ``{"train_x": {layer: [N, hidden]}, "train_y": {layer: [N, kv_heads]}, "held_x",
    "held_y" (the same for the last window), "windows": n, "window": window, "tokens": tokens,
    "samples_per_window", "seed"}`` (float32): what :func:`fit_collected` fits, so that several
    scorer kinds can be fitted on one set of KVzip passes.

    Raises
    ------
    ValueError
        A text too short for two windows; bad sizes.
    """
    for name, v in (("tokens", tokens), ("window", window), ("max_tokens_per_window", max_tokens_per_window)):
        if isinstance(v, bool) or not isinstance(v, int) or v < 1:
            raise ValueError(f"{name} must be an int >= 1; got {v!r}")
    if window <= SKIP_SINKS + 1:
        raise ValueError(f"window must be > {SKIP_SINKS + 1} tokens; got {window}")
    ids = tokenizer(text, return_tensors="pt").input_ids[:, :tokens]
    bos = getattr(tokenizer, "bos_token_id", None)
    body = ids[0, 1:] if bos is not None and int(ids[0, 0]) == bos else ids[0]
    n_windows = body.shape[0] // (window - 1 if bos is not None else window)
    if n_windows < 2:
        raise ValueError(f"the calibration text gives {int(body.shape[0])} tokens (of --tokens {tokens}): fitting needs at "
                         f"least 2 windows of {window} (one is held out); give a longer text or a smaller window")
    step = window - 1 if bos is not None else window
    train_x: dict[int, list] = {}
    train_y: dict[int, list] = {}
    held: tuple[dict, dict] = ({}, {})
    for w in range(n_windows):
        chunk = body[w * step:(w + 1) * step]
        win = torch.cat([torch.tensor([bos]), chunk]) if bos is not None else chunk
        xs, ys = collect_pairs(model, tokenizer, win[None], max_tokens_per_window=max_tokens_per_window, seed=seed + w)
        if w == n_windows - 1:
            held = (xs, ys)
        else:
            for i in xs:
                train_x.setdefault(i, []).append(xs[i])
                train_y.setdefault(i, []).append(ys[i])
        if progress:
            progress(w + 1, n_windows)
    return {"train_x": {i: torch.cat(v) for i, v in train_x.items()},
            "train_y": {i: torch.cat(v) for i, v in train_y.items()},
            "held_x": held[0], "held_y": held[1], "windows": n_windows, "window": window,
            "tokens": int(n_windows * window), "samples_per_window": max_tokens_per_window, "seed": seed}


def fit_collected(model: Any, text: str, pairs: dict[str, Any], *, kind: str = "linear", source: str = "",
                  mlp_width: int = 64, mlp_steps: int = 400, ridge: float = RIDGE) -> Scorer:
    """One scorer per layer of ``pairs`` (:func:`collect_windows` on ``text`` with ``model``),
    fitted on the training windows and scored on the held-out one (R^2 and top-25% overlap,
    recorded in the scorer's ``info``). ``mlp_width`` / ``mlp_steps``: the ``mlp`` kind's hidden
    width and Adam steps (:func:`~kv_cache.compression.scorer.fit_mlp`); ``ridge``: the ``linear``
    kind's penalty (:func:`~kv_cache.compression.scorer.fit_linear`)."""
    if kind not in KINDS:
        raise ValueError(f"kind must be one of {list(KINDS)}; got {kind!r}")
    ridge = check_ridge(ridge)
    seed = pairs["seed"]
    layers, r2, overlap = {}, {}, {}
    for i in sorted(pairs["train_x"]):
        x, y = pairs["train_x"][i], pairs["train_y"][i]
        if kind == "linear":
            ls = fit_linear(x, y, ridge=ridge)
        elif kind == "static":
            ls = fit_static(x, y)
        else:
            ls = fit_mlp(x, y, width=mlp_width, steps=mlp_steps, seed=seed)
        layers[i] = ls
        pred = score_hidden(ls, pairs["held_x"][i][None])[0].T
        r2[i], overlap[i] = r_squared(pred, pairs["held_y"][i]), top_overlap(pred, pairs["held_y"][i])
    info = {"text_sha256": text_sha256(text), "source": source, "tokens": pairs["tokens"], "window": pairs["window"],
            "windows": pairs["windows"], "held_out_windows": 1, "samples_per_window": pairs["samples_per_window"],
            "seed": seed, "target": "log max(KVzip score, 1e-7)",
            "held_out_r2": {str(k): round(v, 4) for k, v in r2.items()},
            "held_out_top25_overlap": {str(k): round(v, 4) for k, v in overlap.items()},
            "mean_held_out_r2": round(sum(r2.values()) / len(r2), 4),
            "mean_held_out_top25_overlap": round(sum(overlap.values()) / len(overlap), 4)}
    info["fitted_as"] = kind  # a static scorer is stored as a linear one with W = 0
    if kind == "mlp":
        info.update(mlp_width=mlp_width, mlp_steps=mlp_steps)
    elif kind == "linear":
        info.update(ridge=ridge)
    log.info("fitted %s scorers on %d layers: mean held-out R^2 %.3f, top-25%% overlap %.3f", kind, len(layers),
             info["mean_held_out_r2"], info["mean_held_out_top25_overlap"])
    return Scorer(layers, model_identity(model), info)


def fit_scorer(model: Any, tokenizer: Any, text: str, *, kind: str = "linear", tokens: int = 16384,
               window: int = 2048, max_tokens_per_window: int = 1024, seed: int = 0, source: str = "",
               mlp_width: int = 64, mlp_steps: int = 400, ridge: float = RIDGE, progress=None) -> Scorer:
    """Fit one scorer per full-attention layer of ``model`` on ``text`` (see the module docstring):
    :func:`collect_windows`, then :func:`fit_collected`. Returns the :class:`Scorer` (not saved).

    Raises
    ------
    ValueError
        An unknown ``kind``; a text too short for two windows; bad sizes.
    """
    if kind not in KINDS:
        raise ValueError(f"kind must be one of {list(KINDS)}; got {kind!r}")
    check_ridge(ridge)  # before the KVzip passes, not after them
    pairs = collect_windows(model, tokenizer, text, tokens=tokens, window=window,
                            max_tokens_per_window=max_tokens_per_window, seed=seed, progress=progress)
    return fit_collected(model, text, pairs, kind=kind, source=source, mlp_width=mlp_width, mlp_steps=mlp_steps,
                         ridge=ridge)


__all__ = ["SKIP_SINKS", "collect_pairs", "collect_windows", "fit_collected", "fit_scorer", "top_overlap"]
