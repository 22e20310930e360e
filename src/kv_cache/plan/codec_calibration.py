"""Fit a model's codec basis on calibration text (``kvcache calibrate-codec``, math dictionary §27.1).

The model reads windows of the calibration texts into a full-precision
:class:`~kv_cache.CompressedCache`; the keys (after RoPE, as cached) and values of every layer
and KV head accumulate float64 moments; :func:`~kv_cache.codec.transform.fit_basis` gives the
mean, the basis and the variances. The default texts are the Gutenberg novels of
``shared/data`` other than *Moby Dick* (pg2701), on which held-out checks score.

``keys_before_rope=True`` (math dictionary §27.6): each window's keys are turned back by their
positions (the layer's :class:`~kv_cache.cache.rope_frame.RopeFrame`) before their moments are
taken, and the keys' query metric is the queries' second moment averaged over the rotations a
query meets a key at, ``s^2 E_p[R(p)^T E[q' q'^T] R(p)]`` (the logit ``q' . s R(p) k`` of a key
stored before RoPE); the basis file says so (``info["keys"] = "before_rope"``).
"""

from __future__ import annotations

import hashlib
from pathlib import Path
from typing import Any, Callable, Sequence

import torch

from ..cache.report import kv_geometry
from ..codec.transform import accumulate_moments, fit_basis, query_metric

DEFAULT_TEXTS = ("gutenberg/pg1342.txt", "gutenberg/pg345.txt", "gutenberg/pg98.txt")
"""Pride and Prejudice, Dracula, A Tale of Two Cities: never Moby Dick (pg2701) nor wikitext."""
HELD_OUT = ("pg2701",)


def rotation_averaged(second_moment: torch.Tensor, frame, window: int, samples: int = 128) -> torch.Tensor:
    """``s^2 mean_p R(p)^T C R(p)`` ``[d, d]`` float64 over ``samples`` positions ``p`` spread over
    ``[0, window)``: the second moment of the queries a key stored before RoPE meets (``C`` the
    post-RoPE queries' ``[d, d]`` second moment, ``s`` the frame's attention scaling)."""
    from ..compression.rope import rotate

    d = second_moment.shape[-1]
    pos = torch.linspace(0, window - 1, samples).round().long()
    eye = torch.eye(d, dtype=torch.float32).expand(samples, 1, d, d)
    rt = rotate(eye, pos[:, None, None], frame.inv_freq, 1.0, frame.layout).double()[:, 0]  # [P, d, d]: R(p)^T
    c = second_moment.double()
    return (rt @ c @ rt.transpose(-1, -2)).mean(0) * frame.scaling ** 2


def collect_moments(model: torch.nn.Module, token_windows: Sequence[torch.Tensor],
                    progress: Callable[[int, int], None] | None = None,
                    frames: list | None = None) -> dict[int, dict[str, list]]:
    """Per layer and kind (``"k"``/``"v"``), per KV head, the float64 moments of the cached vectors
    of every window (``[1, T]`` token ids each); ``"q"``: per KV head, the sum of ``q q^T`` over
    the post-RoPE queries of its group (read by a forward hook on the attention modules, removed
    after each window; absent where a module has no ``q_proj``). ``frames``: per layer, keys
    are turned back by their positions in the window first (None there: as they arrive)."""
    from ..cache import CompressedCache
    from ..context import prefill

    from ..cache.hooks import attention_modules, post_rope_queries

    moments: dict[int, dict[str, list]] = {}
    queries: dict[int, list] = {}  # layer -> per KV head [sum q q^T (float64), count]
    kv_heads = kv_geometry(model.config).kv_heads

    def hook(i: int):
        def run(module, args, kwargs, output):
            hidden = kwargs.get("hidden_states", args[0] if args else None)
            pos = kwargs.get("position_embeddings")
            if hidden is None or pos is None or not hasattr(module, "q_proj"):
                return
            q = post_rope_queries(module, hidden, pos, hidden.shape[1]).detach().double()  # [B, Hq, T, d]
            group = q.shape[1] // kv_heads
            acc = queries.setdefault(i, [[torch.zeros(q.shape[-1], q.shape[-1], dtype=torch.float64), 0]
                                         for _ in range(kv_heads)])
            for h in range(kv_heads):
                x = q[:, h * group:(h + 1) * group].reshape(-1, q.shape[-1])
                acc[h][0] += x.T @ x
                acc[h][1] += x.shape[0]
        return run

    for w, ids in enumerate(token_windows):
        cache = CompressedCache(model.config)
        handles = [m.register_forward_hook(hook(i), with_kwargs=True) for i, m in attention_modules(model).items()]
        try:
            with torch.no_grad():
                prefill(model, cache, ids, last_only=True)
        finally:
            for hnd in handles:
                hnd.remove()
        for i, layer in enumerate(cache.layers):
            st = layer.storage
            if st is None:
                continue
            keys, values = st.read()  # [1, H, T, d]
            if frames is not None and frames[i] is not None:  # the keys before RoPE (§27.6)
                keys = frames[i].remove(keys.float(), torch.arange(keys.shape[2]))
            rec = moments.setdefault(i, {"k": [None] * keys.shape[1], "v": [None] * keys.shape[1]})
            for kind, t in (("k", keys), ("v", values)):
                for h in range(t.shape[1]):
                    rec[kind][h] = accumulate_moments(t[0, h], rec[kind][h])
        if progress is not None:
            progress(w + 1, len(token_windows))
    for i, acc in queries.items():
        if i in moments:
            moments[i]["q"] = acc
    return moments


def fit_codec_basis(model: torch.nn.Module, tokenizer: Any, texts: Sequence[tuple[str, str]], *, tokens: int = 16384,
                    window: int = 2048, progress: Callable[[int, int], None] | None = None,
                    keys_before_rope: bool = False) -> tuple[dict[int, dict[str, torch.Tensor]], dict[str, Any]]:
    """Fit the bases on ``tokens`` tokens split evenly over ``texts`` (``(name, text)`` pairs),
    in windows of ``window`` tokens; ``keys_before_rope``: the key bases on keys turned back by
    their positions (§27.6; a model without RoPE, or with multimodal RoPE, is refused). Returns
    ``(layers, info)`` for :func:`~kv_cache.codec.basis_file.save_basis`."""
    if not isinstance(keys_before_rope, bool):
        raise TypeError(f"keys_before_rope must be True or False; got {keys_before_rope!r}")
    frames = None
    if keys_before_rope:
        from ..cache.rope_frame import rope_frames

        frames = rope_frames(model.config, kv_geometry(model.config).head_dim)
    if not texts:
        raise ValueError("fit_codec_basis: give at least one calibration text")
    for name, _ in texts:
        if any(h in name for h in HELD_OUT):
            raise ValueError(f"fit_codec_basis: {name!r} is held out (Moby Dick, pg2701: the held-out checks score "
                             "on it); calibrate on other texts")
    if tokens < 2 * window or window < 16:
        raise ValueError(f"fit_codec_basis: tokens must be >= 2 windows and window >= 16; got tokens={tokens}, "
                         f"window={window}")
    per_text = tokens // len(texts)
    windows, used = [], []
    for name, text in texts:
        ids = tokenizer(text, add_special_tokens=False)["input_ids"]
        bos = getattr(tokenizer, "bos_token_id", None)
        take = ids[: per_text]
        used.append({"text": name, "sha256": hashlib.sha256(text.encode()).hexdigest(), "tokens": len(take)})
        for s in range(0, len(take) - window + 1, window):
            chunk = take[s: s + window]
            if bos is not None:
                chunk = [bos] + chunk[:-1]
            windows.append(torch.tensor([chunk]))
    if not windows:
        raise ValueError(f"fit_codec_basis: the texts hold fewer than one window of {window} tokens")
    moments = collect_moments(model, windows, progress, frames)
    layers = {}
    for i, rec in moments.items():
        out = {}
        metrics = None
        if rec.get("q"):  # keys: PCA after the query metric (the logits' error), where queries were read
            if frames is not None and frames[i] is not None:  # what a key stored before RoPE meets
                metrics = [query_metric(rotation_averaged(ss, frames[i], window), n) for ss, n in rec["q"]]
            else:
                metrics = [query_metric(ss, n) for ss, n in rec["q"]]
            out["k_metric"] = torch.stack(metrics).float()
        for kind in ("k", "v"):
            fits = [fit_basis(m, metrics[h] if (kind == "k" and metrics) else None) for h, m in enumerate(rec[kind])]
            out[f"{kind}_mean"] = torch.stack([f[0] for f in fits])
            out[f"{kind}_basis"] = torch.stack([f[1] for f in fits])
            out[f"{kind}_var"] = torch.stack([f[2] for f in fits])
        layers[i] = out
    info = {"texts": used, "windows": len(windows), "window": window, "tokens": sum(u["tokens"] for u in used)}
    if keys_before_rope:
        info["keys"] = "before_rope"
    return layers, info


def default_texts() -> list[tuple[str, str]]:
    """The default calibration texts (:data:`DEFAULT_TEXTS`) from ``shared/data``."""
    from ..models import shared_data_dir

    out = []
    for rel in DEFAULT_TEXTS:
        p = Path(shared_data_dir()) / rel
        if not p.is_file():
            raise FileNotFoundError(f"calibration text {str(p)!r} not found (shared/data)")
        out.append((p.name, p.read_text(encoding="utf-8", errors="replace").replace("\r\n", "\n")))
    return out


__all__ = ["DEFAULT_TEXTS", "collect_moments", "default_texts", "fit_codec_basis"]
