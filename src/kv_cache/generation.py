"""A small generation loop over any cache: sampling, stop strings, tokens one at a time.

Shared by ``kvcache serve`` (:mod:`kv_cache.integrations.serve`) and the lm-eval model
(:mod:`kv_cache.lm_eval_model`). The pieces are pure where they can be:

* :class:`SamplingParams` holds and checks ``temperature`` / ``top_p`` / ``seed``;
* :func:`sample_token` picks the next token from logits ``[vocab]`` (greedy when
  ``temperature == 0``; otherwise softmax at that temperature, cut to the smallest set of tokens
  whose probability reaches ``top_p`` (nucleus sampling), drawn with a seeded generator);
* :func:`stop_scan` says how much of a generated text is final given stop strings (the part
  that cannot turn out to start a stop string);
* :class:`TextStream` turns tokens into text as they come, in work linear in the answer: each
  token is decoded within a window of a few tokens (the prefix / read offsets vLLM and TGI use)
  and stop strings are matched on the new tail only (what :func:`stop_scan` does to the whole
  text, done incrementally);
* :func:`generate_tokens` feeds each drawn token back through the model at the next absolute
  position (:func:`kv_cache.context.forward_at`), until an end-of-sequence token or
  ``max_new_tokens``; the caller stops it early (stop strings, timeouts) by closing it.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Any, Iterator, Sequence

import torch


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
                position_ids=torch.arange(pos, pos + q, device=ids.device).unsqueeze(0),
                cache_position=torch.arange(past, past + q, device=ids.device), **extra)
    return out.logits.float()


MAX_TEMPERATURE = 2.0  # OpenAI's range is [0, 2]


@dataclass(frozen=True)
class SamplingParams:
    """How the next token is drawn.

    Attributes
    ----------
    temperature : float in [0, 2]
        0 is greedy (arg-max); otherwise logits are divided by it before the softmax.
    top_p : float in (0, 1]
        Nucleus sampling: draw from the smallest set of most probable tokens whose total
        probability is at least ``top_p`` (1: the whole vocabulary).
    seed : int or None
        Seeds the generator of one answer (the same seed, prompt and settings give the same
        answer); None draws a seed from the OS.
    """

    temperature: float = 0.0
    top_p: float = 1.0
    seed: int | None = None

    def __post_init__(self) -> None:
        t, p = self.temperature, self.top_p
        if isinstance(t, bool) or not isinstance(t, (int, float)) or not math.isfinite(t) or not 0 <= t <= MAX_TEMPERATURE:
            raise ValueError(f"temperature must be a number in [0, {MAX_TEMPERATURE:g}]; got {t!r}")
        if isinstance(p, bool) or not isinstance(p, (int, float)) or not math.isfinite(p) or not 0 < p <= 1:
            raise ValueError(f"top_p must be a number in (0, 1]; got {p!r}")
        if self.seed is not None and (isinstance(self.seed, bool) or not isinstance(self.seed, int)):
            raise ValueError(f"seed must be an int or None; got {self.seed!r}")

    @property
    def greedy(self) -> bool:
        return self.temperature == 0

    def generator(self) -> torch.Generator:
        """A CPU generator seeded with :attr:`seed` (or from the OS when it is None)."""
        g = torch.Generator()
        if self.seed is None:
            g.seed()
        else:
            g.manual_seed(self.seed % (2 ** 64))
        return g


def sample_token(logits: torch.Tensor, params: SamplingParams, generator: torch.Generator | None = None) -> int:
    """The next token from logits ``[vocab]`` (any float dtype; computed in float32).

    Greedy when ``params.temperature == 0`` (``generator`` unused); otherwise
    ``softmax(logits / temperature)`` restricted to the nucleus of ``top_p`` (the most probable
    token is always in it), renormalized, and drawn with ``generator``.
    """
    if logits.dim() != 1:
        raise ValueError(f"logits must be [vocab]; got shape {tuple(logits.shape)}")
    if params.greedy:
        return int(logits.argmax())
    probs = torch.softmax(logits.float() / params.temperature, dim=-1)
    if params.top_p < 1.0:
        sorted_p, order = probs.sort(descending=True)
        before = sorted_p.cumsum(0) - sorted_p  # mass of the more probable tokens
        keep = before < params.top_p  # the first token always (before == 0)
        probs = torch.zeros_like(probs).scatter_(0, order[keep], sorted_p[keep])
    return int(torch.multinomial(probs, 1, generator=generator))


def stop_scan(text: str, stops: Sequence[str]) -> tuple[int, bool]:
    """How much of a generated ``text`` is final.

    Returns ``(end, stopped)``: with ``stopped`` True, a stop string occurs and ``end`` is where
    the earliest one starts (the answer is ``text[:end]``, the stop string excluded). Otherwise
    ``text[:end]`` cannot change any more: ``end`` leaves out a tail that could still grow into a
    stop string (the longest suffix that is a proper prefix of one) and a trailing U+FFFD (a
    character whose bytes are not all decoded yet).
    """
    hits = [i for i in (text.find(s) for s in stops if s) if i >= 0]
    if hits:
        return min(hits), True
    hold = 0
    for s in stops:
        for k in range(min(len(s) - 1, len(text)), hold, -1):
            if text.endswith(s[:k]):
                hold = k
                break
    end = len(text) - hold
    while end > 0 and text[end - 1] == "\ufffd":
        end -= 1
    return end, False


def generate_tokens(model: torch.nn.Module, cache: Any, logits: torch.Tensor, pos: int, *, max_new_tokens: int,
                    params: SamplingParams, eos: set[int] | frozenset[int] = frozenset(),
                    generator: torch.Generator | None = None) -> Iterator[int]:
    """Yield up to ``max_new_tokens`` tokens drawn after ``logits`` ``[vocab]`` (the prediction
    after the prompt), each fed back over ``cache`` at absolute position ``pos``, ``pos + 1``, ...

    Stops before an end-of-sequence token (``eos``; not yielded). The last token is not fed (it
    would only predict a token nobody reads). Run it inside ``torch.no_grad()`` and whatever
    context the cache needs (``kv_cache.compress``, ``cache.session()``); close the iterator to
    stop early.
    """
    if isinstance(max_new_tokens, bool) or not isinstance(max_new_tokens, int) or max_new_tokens < 1:
        raise ValueError(f"max_new_tokens must be an int >= 1; got {max_new_tokens!r}")
    if generator is None and not params.greedy:
        generator = params.generator()
    for i in range(max_new_tokens):
        token = sample_token(logits, params, generator)
        if token in eos:
            return
        yield token
        if i + 1 == max_new_tokens:
            return
        logits = forward_at(model, cache, torch.tensor([[token]]), pos)[0, -1]
        pos += 1


DETOKENIZE_WINDOW = 16
"""Tokens :class:`TextStream` lets wait undecoded at most (a character whose bytes span tokens,
runs of special tokens): past it the window is decoded as it is, so each token costs O(window)."""


class TextStream:
    """The text of generated tokens, decoded incrementally, with stop strings.

    :meth:`push` takes one token and returns the text that became final with it (possibly
    ``""``); :meth:`finish` returns the rest once no token follows. Joined, the pieces are
    ``tokenizer.decode(tokens, skip_special_tokens=True)`` cut before the earliest stop string,
    as :func:`stop_scan` gives it, for every tokenizer whose decoding of a token depends on at most
    the token before it (byte-level BPE, SentencePiece).

    Work is linear in the answer: each token decodes two windows (``tokens[prefix:read]`` and
    ``tokens[prefix:]``, a few tokens: a new piece is emitted once the longer decodes to more
    text not ending in U+FFFD, then ``prefix, read = read, len(tokens)``; at most
    :data:`DETOKENIZE_WINDOW` tokens wait), and the stop strings are searched in the new text plus
    a held tail shorter than the longest stop string (a released character can never belong to a
    stop string, :func:`stop_scan`'s invariant). :attr:`work` counts tokens decoded plus characters
    searched, for tests of that bound.

    Not thread-safe; ``tokenizer`` only needs ``decode(ids, skip_special_tokens=True)``.
    """

    def __init__(self, tokenizer: Any, stops: Sequence[str] = ()):
        self.tokenizer = tokenizer
        self.stops = tuple(s for s in stops if s)
        self.tokens: list[int] = []
        self.pieces: list[str] = []
        self.stopped = False
        self.work = 0
        self._prefix = self._read = 0
        self._held = ""  # decoded text that may still start a stop string

    @property
    def text(self) -> str:
        """The final text so far (the answer, once :meth:`finish` ran)."""
        return "".join(self.pieces)

    def _decode(self, ids: list[int]) -> str:
        self.work += len(ids)
        return self.tokenizer.decode(ids, skip_special_tokens=True) if ids else ""

    def _new_text(self, force: bool) -> str:
        """The text the tokens past ``read`` add ("" while it ends inside a character)."""
        before = self._decode(self.tokens[self._prefix:self._read])
        after = self._decode(self.tokens[self._prefix:])
        waiting = len(self.tokens) - self._read
        if (len(after) > len(before) and not after.endswith("\ufffd")) or force or waiting >= DETOKENIZE_WINDOW:
            self._prefix, self._read = self._read, len(self.tokens)
            return after[len(before):]
        return ""

    def _release(self, new: str, last: bool) -> str:
        """``new`` text after the held tail, less what may still start a stop string."""
        buf = self._held + new
        self.work += len(buf) * max(len(self.stops), 1)
        hits = [i for i in (buf.find(s) for s in self.stops) if i >= 0]
        if hits:
            self.stopped, self._held = True, ""
            out = buf[:min(hits)]
        elif last:
            out, self._held = buf, ""
        else:
            hold = 0
            for s in self.stops:
                for k in range(min(len(s) - 1, len(buf)), hold, -1):
                    if buf.endswith(s[:k]):
                        hold = k
                        break
            out, self._held = buf[:len(buf) - hold], buf[len(buf) - hold:]
        if out:
            self.pieces.append(out)
        return out

    def push(self, token: int) -> str:
        """Add ``token``; the text that became final with it ("" once :attr:`stopped`)."""
        if self.stopped:
            return ""
        self.tokens.append(int(token))
        new = self._new_text(False)
        return self._release(new, False) if new else ""

    def finish(self) -> str:
        """The rest of the text once no token follows: the tokens still waiting decoded as they
        are, the held tail released (or cut at a stop string)."""
        if self.stopped:
            return ""
        new = self._new_text(True) if self._read < len(self.tokens) else ""
        return self._release(new, True)


__all__ = ["DETOKENIZE_WINDOW", "MAX_TEMPERATURE", "SamplingParams", "TextStream", "generate_tokens", "sample_token",
           "stop_scan"]
