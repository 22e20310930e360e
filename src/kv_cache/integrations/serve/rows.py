"""The rows of a batch of chats: each row's sampling, stops and events, and the decoding loop.

Shared by the two kinds of batch of ``kvcache serve`` (:mod:`.batch`: chats without a stored
context; :mod:`.batch_context`: chats on stored contexts). A :class:`Row` is one chat of a batch:
it draws its own tokens (its seed's generator), scans its own stop strings, counts its own
``max_tokens``, streams its own deltas, checks its own deadline and answers its own request the
moment it is done, exactly as :meth:`~kv_cache.integrations.serve.service.Service.chat` does one at a time.
:func:`decode_rows` runs the steps: every row not done draws from its logits, the step's events
of every row go to the server's event loop at once (:func:`flush`), then ``feed`` runs the model
once for the whole batch (a row that is done is fed a padding token, never read).
"""

from __future__ import annotations

from typing import Any, Callable

import torch

from ...generation import TextStream, sample_token
from .engine import Job, emit_many
from .errors import ApiError


class Row:
    """One chat of a batch: ``job.item`` is its :class:`~kv_cache.integrations.serve.service.PreparedChat`;
    ``prompt`` the tokens it fed (its messages, or its question after the context), ``cached`` the
    stored context's tokens it attends (0 without one)."""

    def __init__(self, service: Any, job: Job, prompt: int, cached: int = 0):
        prep = job.item
        self.service, self.job, self.req, self.n_new = service, job, prep.req, prep.n_new
        self.prompt, self.cached = prompt, cached
        self.stream = TextStream(service.decoder, prep.req.stop)  # decoded and stop-matched incrementally
        self.done = False
        self.gen = None if prep.req.sampling.greedy else prep.req.sampling.generator()
        self.error: ApiError | None = None
        self.pending: list[tuple[str, Any]] = []  # events not sent yet (:func:`flush`)

    def emit(self, kind: str, payload: Any = None) -> None:
        self.pending.append((kind, payload))

    def step(self, logits: torch.Tensor, eos: set[int]) -> None:
        """Draw this row's next token from its logits ``[vocab]`` (as Service._generate does);
        its events wait in :attr:`pending` until :func:`flush`."""
        token = sample_token(logits, self.req.sampling, self.gen)
        if token in eos:
            self.done = True
            return
        piece = self.stream.push(token)
        if self.req.stream and piece:
            self.emit("delta", piece)
        if self.stream.stopped:
            self.done = True
            return
        try:
            self.job.check()  # the deadline, a client that left, a shutdown
        except ApiError as exc:
            self.error, self.done = exc, True
            return
        if len(self.out) == self.n_new:
            self.done = True

    @property
    def out(self) -> list[int]:
        """The tokens drawn so far (an end-of-sequence token is never among them)."""
        return self.stream.tokens

    @property
    def text(self) -> str:
        return self.stream.text

    def finish(self) -> None:
        """Answer the request: its error, or its text, finish reason and usage."""
        if self.error is not None:
            self.emit("error", self.error)
            return
        piece = self.stream.finish()
        if self.req.stream and piece:
            self.emit("delta", piece)
        finish = "stop" if self.stream.stopped or len(self.out) < self.n_new else "length"
        prompt = self.cached + self.prompt
        self.emit("done", {"text": self.text, "finish_reason": finish,
                               "usage": {"prompt_tokens": prompt, "completion_tokens": len(self.out),
                                         "total_tokens": prompt + len(self.out),
                                         "prompt_tokens_details": {"cached_tokens": self.cached}}})


def flush(rows: list[Row]) -> None:
    """Send the rows' pending events, all of them in one wake-up of the server's event loop."""
    events = [(r.job, kind, payload) for r in rows for kind, payload in r.pending]
    for r in rows:
        r.pending = []
    if events:
        emit_many(events)


def decode_rows(rows: list[Row], logits: torch.Tensor | None, feed: Callable[[torch.Tensor], torch.Tensor],
                eos: set[int], pad: int) -> None:
    """Decode ``rows`` together until every one is done.

    ``logits`` ``[batch, vocab]``: each row's prediction after its prompt, or None when every row
    has drawn its first token already (:meth:`Row.step` on its own prefill's logits, not done);
    ``feed(tokens)`` runs the model on ``tokens`` ``[batch, 1]`` (each row's last token, ``pad``
    for a row that is done) at each row's next position and returns the next logits
    ``[batch, vocab]``. Each row is answered (:meth:`Row.finish`) as soon as it is done, not when
    the batch ends; the last token of a row is not fed (it would only predict a token nobody reads)."""
    if logits is None and not all(r.out and not r.done for r in rows):
        raise ValueError("logits=None needs every row to have drawn its first token and not be done")
    if logits is not None and (logits.dim() != 2 or logits.shape[0] != len(rows)):
        raise ValueError(f"logits must be [batch={len(rows)}, vocab]; got shape {tuple(logits.shape)}")
    while True:
        if logits is not None:
            for i, r in enumerate(rows):
                if not r.done:
                    r.step(logits[i], eos)
                    if r.done:
                        r.finish()  # its client gets the answer now, not when the batch ends
            flush(rows)
        if all(r.done for r in rows):
            return
        logits = feed(torch.tensor([[r.out[-1] if r.out and not r.done else pad] for r in rows]))


def pad_token(tokenizer: Any) -> int:
    """The token fed to rows that are done (and to left padding): the tokenizer's pad token, or 0."""
    return tokenizer.pad_token_id if isinstance(getattr(tokenizer, "pad_token_id", None), int) else 0
