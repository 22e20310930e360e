"""Compress a context once, ask it anything: the prefill driver and :class:`CompressedContext`.

* :func:`prefill` prefills a context into a :class:`~kv_cache.CompressedCache` and compresses
  it; for a policy scored by a pass of its own (:class:`~kv_cache.KVzip`) it runs that pass:
  the model reads a "repeat the previous context" prompt and the context again, chunk by
  chunk, each chunk's attention scores the stored tokens it repeats, and nothing of the pass
  stays in the cache or the positions. Then the cache evicts.
* :class:`CompressedContext` holds one compressed context and answers any number of
  questions from it (:meth:`CompressedCache.session`: each question starts from the same
  compressed context at its original positions; the question and answer are dropped after),
  and saves / loads it (:mod:`kv_cache.cache.serialize`).
"""

from __future__ import annotations

import time
from contextlib import ExitStack
from dataclasses import dataclass
from typing import Any, Sequence

import torch

from .attention import active_cache
from .cache import CompressedCache, compress
from .policies.kvzip import CONTINUE_PROMPT, REPEAT_PROMPT


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


def forward_at(model: torch.nn.Module, cache: Any, ids: torch.Tensor, pos: int, *,
               last_only: bool = False) -> torch.Tensor:
    """Forward ``ids`` ``[batch, q]`` at absolute positions ``pos, pos + 1, ...`` over ``cache``
    (its ``cache_position`` continues from the tokens it has seen); float32 logits ``[batch, q, V]``,
    or ``[batch, 1, V]`` with ``last_only`` (the model forms only the last position's logits, as
    ``model.generate``'s prefill does: a ``q x V`` matrix is not allocated)."""
    q = ids.shape[1]
    past = cache.get_seq_length()
    extra = {"logits_to_keep": 1} if last_only else {}
    out = model(input_ids=ids, past_key_values=cache, use_cache=True,
                position_ids=torch.arange(pos, pos + q).unsqueeze(0),
                cache_position=torch.arange(past, past + q), **extra)
    return out.logits.float()


def _ids(tokenizer: Any, text: str) -> list[int]:
    if hasattr(tokenizer, "encode"):
        try:
            return list(tokenizer.encode(text, add_special_tokens=False))
        except TypeError:
            return list(tokenizer.encode(text))
    raise TypeError(f"tokenizer must have an encode() method; got {type(tokenizer).__name__}")


def prefill(
    model: torch.nn.Module,
    cache: CompressedCache,
    input_ids: torch.Tensor,
    *,
    tokenizer: Any = None,
    attention_mask: torch.Tensor | None = None,
    last_only: bool = False,
) -> tuple[torch.Tensor, PrefillStats]:
    """Prefill ``input_ids`` ``[batch, T]`` into an empty ``cache`` and compress it.

    Runs inside ``kv_cache.compress(model, cache)`` (entered here unless it is already active
    for this cache). With :class:`~kv_cache.KVzip` the reconstruction pass follows (``tokenizer``
    required, batch 1), then every layer evicts. ``last_only``: form the last position's logits
    only (``logits_to_keep=1``, as ``model.generate``'s prefill does); the ``T x vocab`` logits
    of a long context are otherwise the prefill's largest tensor (800 MB at 4K tokens and a
    49K vocabulary).

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
        with torch.no_grad():
            t0 = time.perf_counter()
            extra = {"logits_to_keep": 1} if last_only else {}
            out = model(input_ids=input_ids, attention_mask=attention_mask, past_key_values=cache, use_cache=True,
                        **extra)
            stats = PrefillStats(int(input_ids.shape[1]), time.perf_counter() - t0)
            if scored:
                t0 = time.perf_counter()
                stats.reconstruction_tokens = reconstruct(model, cache, input_ids[0], tokenizer)
                stats.reconstruction_s = time.perf_counter() - t0
    return out.logits, stats


def reconstruct(model: torch.nn.Module, cache: CompressedCache, context_ids: torch.Tensor, tokenizer: Any) -> int:
    """KVzip's scoring pass over a prefilled context ``context_ids`` ``[T]``; then evict.

    Chunk ``[s, e)`` of the context (``chunk_size`` tokens) is fed as
    ``REPEAT_PROMPT + context[s:e]`` (the first) or ``CONTINUE_PROMPT + context[s - overlap:s]
    + context[s:e]`` at the positions after the context; the cache stores none of it. A
    leading BOS token is not repeated. Returns the number of tokens fed.
    """
    pol = cache.eviction
    n = int(context_ids.shape[0])
    first = 1 if n > 1 and int(context_ids[0]) == getattr(tokenizer, "bos_token_id", None) else 0
    repeat, cont = _ids(tokenizer, REPEAT_PROMPT), _ids(tokenizer, CONTINUE_PROMPT)
    fed = 0
    try:
        for s in range(first, n, pol.chunk_size):
            e = min(n, s + pol.chunk_size)
            head = repeat if s == first else cont + context_ids[max(first, s - pol.overlap):s].tolist()
            ids = torch.tensor([head + context_ids[s:e].tolist()], device=context_ids.device)
            cache.begin_reconstruction(min(pol.sink_tokens, s), s, e)
            model(input_ids=ids, past_key_values=cache, use_cache=True, logits_to_keep=1)
            cache.end_reconstruction_chunk()
            fed += ids.shape[1]
    finally:
        cache.end_reconstruction_chunk()
    cache.finish_reconstruction()
    return fed


class CompressedContext:
    """One compressed context, asked many questions.

    >>> ctx = CompressedContext.build(model, tokenizer, document, quant=QuantConfig(bits=4),      # doctest: +SKIP
    ...                               eviction=KVzip(budget=0.3))
    >>> ctx.ask("Who signed the contract?")                                                      # doctest: +SKIP
    >>> ctx.save("doc.kvc"); CompressedContext.load("doc.kvc", model, tokenizer).ask("...")      # doctest: +SKIP
    """

    def __init__(self, model: torch.nn.Module, tokenizer: Any, cache: CompressedCache, context_tokens: int,
                 last_logits: torch.Tensor | None = None, stats: PrefillStats | None = None):
        self.model, self.tokenizer, self.cache = model, tokenizer, cache
        self.context_tokens = context_tokens
        self.last_logits = last_logits  # [vocab] float32: the next-token logits after the context
        self.stats = stats

    @classmethod
    def build(cls, model: torch.nn.Module, tokenizer: Any, text_or_ids: str | Sequence[int] | torch.Tensor, *,
              quant=None, eviction=None) -> "CompressedContext":
        """Prefill and compress a document (text, or token ids with their BOS if the model wants one)."""
        if isinstance(text_or_ids, str):
            if not text_or_ids:
                raise ValueError("the context text is empty")
            ids = torch.tensor([tokenizer(text_or_ids).input_ids if callable(tokenizer) else _ids(tokenizer, text_or_ids)])
        else:
            ids = torch.as_tensor(text_or_ids).reshape(1, -1).long()
        cache = CompressedCache(model.config, quant=quant, eviction=eviction)
        logits, stats = prefill(model, cache, ids, tokenizer=tokenizer, last_only=True)
        return cls(model, tokenizer, cache, int(ids.shape[1]), logits[0, -1].float(), stats)

    def ask(self, question: str | Sequence[int], *, max_new_tokens: int = 64, eos_token_ids: Sequence[int] | None = None
            ) -> str:
        """Greedy answer to ``question`` (text appended after the context, or token ids)."""
        ids = _ids(self.tokenizer, question) if isinstance(question, str) else list(question)
        if not ids:
            raise ValueError("the question is empty")
        if isinstance(max_new_tokens, bool) or not isinstance(max_new_tokens, int) or max_new_tokens < 1:
            raise ValueError(f"max_new_tokens must be an int >= 1; got {max_new_tokens!r}")
        eos = set(eos_token_ids if eos_token_ids is not None else
                  [t for t in [getattr(self.tokenizer, "eos_token_id", None)] if isinstance(t, int)])
        out: list[int] = []
        with compress(self.model, self.cache), self.cache.session(), torch.no_grad():
            pos = self.context_tokens
            logits = forward_at(self.model, self.cache, torch.tensor([ids]), pos)
            pos += len(ids)
            for _ in range(max_new_tokens):
                nxt = int(logits[0, -1].argmax())
                if nxt in eos:
                    break
                out.append(nxt)
                logits = forward_at(self.model, self.cache, torch.tensor([[nxt]]), pos)
                pos += 1
        return self.tokenizer.decode(out, skip_special_tokens=True)

    def save(self, path) -> int:
        """Write the compressed context to ``path`` (:mod:`kv_cache.cache.serialize`); returns bytes written."""
        from .cache.serialize import save_cache

        return save_cache(self.cache, path, model_config=self.model.config,
                          extra={"context_tokens": self.context_tokens})

    @classmethod
    def load(cls, path, model: torch.nn.Module, tokenizer: Any) -> "CompressedContext":
        """Read a file written by :meth:`save`; refuses a different model or a damaged file."""
        from .cache.serialize import load_cache

        device = next(model.parameters()).device  # the cache's tensors go where the model is
        cache, extra = load_cache(path, model_config=model.config, device=device)
        return cls(model, tokenizer, cache, int(extra["context_tokens"]))
