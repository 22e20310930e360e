"""A method's cache after prefilling a context (:class:`Prefilled`), as every evaluation task and
the lm-eval model start from it: :func:`prefill_method` prefills with a parsed method spec
(through its file for ``file<R>``), :func:`sample_cost` gives a sample's prefill-cost fields."""

from __future__ import annotations

import contextlib
import os
import time
from dataclasses import dataclass, field
from typing import Any

import torch

from ..cache import compress
from ..cache.report import fp16_kv_bytes
from ..context import prefill
from ..generation import forward_at
from ..spec import Method
from .accounting import held_nbytes
from .prefill_cost import prefill_cost


@dataclass
class Prefilled:
    """A method's cache after prefilling a context, and the scope to keep running in."""

    cache: Any
    logits: torch.Tensor
    kv_bytes: int
    scope: Any = field(repr=False)
    prefill_cost: float | None = None  # KVzip: its in-run prefill + reconstruction over its context prefill
    prefill_s: float | None = None  # seconds of the whole prefill
    codec_s: tuple[float, float] | None = None  # file<R>: seconds to encode (save) and decode (load)

    def checks(self) -> dict[str, float | None]:
        """``attention_error``: the fidelity check's largest per-layer error (§26);
        ``evicted_attention``: the eviction check's mean dropped share of attention (§26.1); both
        from one ``memory_report()``, None for caches that do not measure them. Read after the
        prefill, before decoding grows the cache."""
        report = getattr(self.cache, "memory_report", None)
        r = None if report is None else report()
        return {"attention_error": getattr(r, "max_attention_error", None),
                "evicted_attention": getattr(r, "mean_evicted_attention", None)}


def _through_file(model, pre: Prefilled, method: Method) -> Prefilled:
    """``file<R>``: save ``pre``'s cache transform-coded at ratio R (:mod:`kv_cache.codec`, the
    model's shipped or ``$KV_CACHE_HOME`` basis), load it back (into ``method.load_quant``'s
    layout when the spec has a quantization part) and go on from the loaded cache; its
    ``kv_bytes`` are the file's bytes, ``codec_s`` the encode and decode seconds."""
    import tempfile

    from ..cache.serialize import load_cache, save_cache
    from ..codec import basis_for_model

    basis = basis_for_model(model)
    if basis is None:
        pre.scope.close()
        raise ValueError(f"method {method.spec!r}: no codec basis for this model; fit one with "
                         "`kvcache calibrate-codec --model M -o $KV_CACHE_HOME/codecs/M.safetensors`")
    target = int(fp16_kv_bytes(model.config, pre.cache.get_seq_length()) / method.file_ratio)
    with tempfile.TemporaryDirectory() as tmp:
        path = os.path.join(tmp, "ctx.kvc")
        t0 = time.perf_counter()
        try:
            size = save_cache(pre.cache, path, model_config=model.config, codec=basis, file_bytes=target)
        finally:
            pre.scope.close()
        t1 = time.perf_counter()
        cache, _ = load_cache(path, model_config=model.config, codec=basis, quant=method.load_quant)
        t2 = time.perf_counter()
    scope = contextlib.ExitStack()
    scope.enter_context(compress(model, cache))
    out = Prefilled(cache, pre.logits, size, scope, pre.prefill_cost, pre.prefill_s)
    out.codec_s = (t1 - t0, t2 - t1)
    return out


def prefill_method(model, method: Method, ids: torch.Tensor, tokenizer=None, last_only: bool = False) -> Prefilled:
    """Prefill ``ids`` with ``method`` (:func:`_prefill_cache`), then, for ``file<R>``, through its file."""
    pre = _prefill_cache(model, method, ids, tokenizer, last_only)
    return _through_file(model, pre, method) if method.file_ratio is not None else pre


def _prefill_cache(model, method: Method, ids: torch.Tensor, tokenizer=None, last_only: bool = False) -> Prefilled:
    """Prefill ``ids`` into a fresh cache of ``method``; ``scope`` stays open for what follows
    (ours: the ``compress`` hooks; kvpress presses only wrap the prefill). A method scored by a
    reconstruction pass (KVzip) prefills through :func:`kv_cache.prefill`, which runs it.
    ``last_only``: logits of the last position only (:func:`forward_at`), as ``generate`` does."""
    cache, ctx = method.build(model, ids.shape[1])  # a preset chooses its scorer for this length
    scope = contextlib.ExitStack()
    if method.needs_tokenizer:
        if tokenizer is None:
            raise ValueError(f"method {method.spec!r} needs the tokenizer for its reconstruction pass")
        scope.enter_context(ctx())
        try:
            logits, stats = prefill(model, cache, ids, tokenizer=tokenizer, last_only=last_only)
        except BaseException:
            scope.close()
            raise
        # KVzip's ratio is its own (its pass over its prefill); with no pass (a plan evicting with
        # KVzap) the ratio would be 1 by construction: the caller times a plain prefill instead
        ratio = stats.cost_ratio if stats.reconstruction_s > 0 else None
        return Prefilled(cache, logits.float(), held_nbytes(cache), scope, ratio,
                         stats.prefill_s + stats.reconstruction_s)
    t0 = time.perf_counter()
    if method.prefill_only_context:
        with ctx():
            logits = forward_at(model, cache, ids, 0, last_only=last_only)
    else:
        scope.enter_context(ctx())
        try:
            logits = forward_at(model, cache, ids, 0, last_only=last_only)
        except BaseException:
            scope.close()
            raise
    return Prefilled(cache, logits, held_nbytes(cache), scope, prefill_s=time.perf_counter() - t0)


def sample_cost(pre: Prefilled, plain_s: float | None = None) -> dict:
    """The prefill cost fields of a sample: KVzip's own in-run ratio, else ``pre``'s time over
    ``plain_s`` (a plain prefill of the same ids); nothing when neither was measured. ``file<R>``:
    also the encode and decode seconds."""
    out = {"prefill_cost": pre.prefill_cost} if pre.prefill_cost is not None else prefill_cost(pre.prefill_s, plain_s)
    if pre.codec_s is not None:
        out = {**out, "encode_s": pre.codec_s[0], "decode_s": pre.codec_s[1], "prefill_s": pre.prefill_s}
    return out
