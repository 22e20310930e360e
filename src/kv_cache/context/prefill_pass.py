"""The prefill driver: :func:`prefill` prefills a context into a :class:`~kv_cache.CompressedCache`
and compresses it; for a policy scored by a pass of its own (:class:`~kv_cache.KVzip`)
:func:`reconstruct` runs that pass: the model reads a "repeat the previous context" prompt and
the context again, chunk by chunk, each chunk's attention scores the stored tokens it repeats,
and nothing of the pass stays in the cache or the positions. Then the cache evicts."""

from __future__ import annotations

import time
from contextlib import ExitStack, contextmanager
from dataclasses import dataclass
from typing import Any, Callable, Iterator

import torch

from ..attention import active_cache
from ..cache import CompressedCache, compress
from ..policies.kvzip import CONTINUE_PROMPT, REPEAT_PROMPT
from .fit import token_ids


@dataclass
class PrefillStats:
    """What :func:`prefill` measured: seconds of the context prefill and of the scoring pass."""

    context_tokens: int
    prefill_s: float
    reconstruction_s: float = 0.0
    reconstruction_tokens: int = 0

    @property
    def cost_ratio(self) -> float:
        """Total prefill time over the plain prefill's (1.0 without a reconstruction pass)."""
        return (self.prefill_s + self.reconstruction_s) / self.prefill_s if self.prefill_s > 0 else float("nan")


def prefill(
    model: torch.nn.Module,
    cache: CompressedCache,
    input_ids: torch.Tensor,
    *,
    tokenizer: Any = None,
    attention_mask: torch.Tensor | None = None,
    last_only: bool = False,
    check: Callable[[], None] | None = None,
) -> tuple[torch.Tensor, PrefillStats]:
    """Prefill ``input_ids`` ``[batch, T]`` into an empty ``cache`` and compress it.

    Runs inside ``kv_cache.compress(model, cache)`` (entered here unless it is already active
    for this cache). With :class:`~kv_cache.KVzip` the reconstruction pass follows (``tokenizer``
    required, batch 1), then every layer evicts. ``last_only``: form the last position's logits
    only (``logits_to_keep=1``, as ``model.generate``'s prefill does); the ``T x vocab`` logits
    of a long context are otherwise the prefill's largest tensor (800 MB at 4K tokens and a
    49K vocabulary).

    ``check``: called before each attention layer of the prefill and before each chunk of the
    reconstruction pass; whatever it raises stops the prefill there and propagates (the cache is
    then unusable: a server's deadline or cancellation, :mod:`kv_cache.integrations.serve.engine`).

    Returns
    -------
    ``(logits [batch, T, vocab] of the context, or [batch, 1, vocab] with last_only, PrefillStats)``

    Raises
    ------
    TypeError, ValueError
        Not a CompressedCache; ids not an integer ``[batch, T]`` tensor with ``T >= 1``; a cache
        that already holds tokens; KVzip without a tokenizer or on a batch of several rows.
    """
    if not isinstance(cache, CompressedCache):
        raise TypeError(f"cache must be a CompressedCache; got {type(cache).__name__}")
    if not isinstance(input_ids, torch.Tensor) or input_ids.dim() != 2 or input_ids.dtype not in (torch.int64,
                                                                                                  torch.int32):
        raise ValueError("input_ids must be an integer tensor [batch, tokens]; got "
                         f"{getattr(input_ids, 'dtype', type(input_ids).__name__)} "
                         f"{tuple(getattr(input_ids, 'shape', ()))}")
    if input_ids.shape[1] == 0:
        raise ValueError("input_ids holds no token: a context needs at least one")
    if cache.get_seq_length() != 0:
        raise ValueError(f"prefill needs an empty cache; this one has seen {cache.get_seq_length()} tokens")
    pol = cache.eviction
    scored = pol is not None and pol.needs_reconstruction
    if scored:
        if tokenizer is None:
            raise ValueError(f"{type(pol).__name__} reads a repeat prompt: pass tokenizer= to kv_cache.prefill")
        if input_ids.shape[0] != 1:
            raise ValueError(f"{type(pol).__name__} scores one context at a time (batch 1); got batch {input_ids.shape[0]}")
    with ExitStack() as stack:
        if active_cache() is not cache or not cache.native:
            stack.enter_context(compress(model, cache))
        if check is not None:
            check()
            stack.enter_context(between_layers(model, check))
        with torch.no_grad():
            t0 = time.perf_counter()
            extra = {"logits_to_keep": 1} if last_only else {}
            out = model(input_ids=input_ids, attention_mask=attention_mask, past_key_values=cache, use_cache=True,
                        **extra)
            stats = PrefillStats(int(input_ids.shape[1]), time.perf_counter() - t0)
            if scored:
                t0 = time.perf_counter()
                stats.reconstruction_tokens = reconstruct(model, cache, input_ids[0], tokenizer, check=check)
                stats.reconstruction_s = time.perf_counter() - t0
    return out.logits, stats


@contextmanager
def between_layers(model: torch.nn.Module, check: Callable[[], None]) -> Iterator[None]:
    """Call ``check()`` before each attention layer's forward while inside (forward pre-hooks on
    the modules with a ``layer_idx``, or on ``model`` itself when none has one; removed on exit)."""
    layers = [m for m in model.modules() if isinstance(getattr(m, "layer_idx", None), int)] or [model]
    handles = [m.register_forward_pre_hook(lambda *_: check()) for m in layers]
    try:
        yield
    finally:
        for h in handles:
            h.remove()


def reconstruct(model: torch.nn.Module, cache: CompressedCache, context_ids: torch.Tensor, tokenizer: Any, *,
                finish: bool = True, check: Callable[[], None] | None = None) -> int:
    """KVzip's scoring pass over a prefilled context ``context_ids`` ``[T]``; then evict
    (``finish=False``: leave the scores in each layer's ``state["kvzip"]`` ``[batch, kv_heads, T]``
    and evict nothing, for fitting a KVzap scorer).

    Chunk ``[s, e)`` of the context (``chunk_size`` tokens) is fed as
    ``REPEAT_PROMPT + context[s:e]`` (the first) or ``CONTINUE_PROMPT + context[s - overlap:s]
    + context[s:e]`` at the positions after the context; the cache stores none of it. A
    leading BOS token is not repeated. Returns the number of tokens fed.
    """
    pol = cache.eviction
    n = int(context_ids.shape[0])
    first = 1 if n > 1 and int(context_ids[0]) == getattr(tokenizer, "bos_token_id", None) else 0
    repeat, cont = token_ids(tokenizer, REPEAT_PROMPT), token_ids(tokenizer, CONTINUE_PROMPT)
    fed = 0
    try:
        for s in range(first, n, pol.chunk_size):
            if check is not None:
                check()
            e = min(n, s + pol.chunk_size)
            head = repeat if s == first else cont + context_ids[max(first, s - pol.overlap):s].tolist()
            ids = torch.tensor([head + context_ids[s:e].tolist()], device=context_ids.device)
            cache.begin_reconstruction(min(pol.sink_tokens, s), s, e)
            model(input_ids=ids, past_key_values=cache, use_cache=True, logits_to_keep=1)
            cache.end_reconstruction_chunk()
            fed += ids.shape[1]
    finally:
        cache.end_reconstruction_chunk()
    if finish:
        cache.finish_reconstruction()
    return fed
