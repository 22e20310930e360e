"""Concurrent chats of ``kvcache serve`` decoded together, in one batch.

When the worker takes a chat without a stored context and more such chats wait in the queue, it
runs up to ``--max-batch`` of them as one batch (:meth:`kv_cache.serve.engine.Engine._run_batch`):
their prompts are left-padded into one ``[batch, longest]`` tensor with an attention mask, prefilled
together into one ``DynamicCache``, then each step feeds every row's last token at the row's own
position. Each row keeps its own sampling (its seed's generator), stop strings, ``max_tokens``,
end of sequence, stream and deadline, exactly as :meth:`Service.chat` does one at a time; a row
that is done is fed a padding token until the batch ends, and its answer is sent when it is done.

Chats from a stored context still run one at a time (their compressed caches are not batched).
"""

from __future__ import annotations

from typing import Any

import torch

from ..generation import sample_token, stop_scan
from .engine import Job
from .errors import ApiError


class _Row:
    """One chat of a batch: its tokens, text, stream position and end."""

    def __init__(self, service: Any, job: Job):
        prep = job.item
        self.service, self.job, self.req, self.n_new = service, job, prep.req, prep.n_new
        self.prompt = len(prep.ids)
        self.out: list[int] = []
        self.text, self.sent, self.stopped, self.done = "", 0, False, False
        self.gen = None if prep.req.sampling.greedy else prep.req.sampling.generator()
        self.error: ApiError | None = None

    def step(self, logits: torch.Tensor, eos: set[int]) -> None:
        """Draw this row's next token from its logits ``[vocab]`` (as Service._generate does)."""
        token = sample_token(logits, self.req.sampling, self.gen)
        if token in eos:
            self.done = True
            return
        self.out.append(token)
        with self.service.tokenizer_lock:
            self.text = self.service.tokenizer.decode(self.out, skip_special_tokens=True)
        end, self.stopped = stop_scan(self.text, self.req.stop)
        if self.req.stream and end > self.sent:
            self.job.emit("delta", self.text[self.sent:end])
            self.sent = end
        if self.stopped:
            self.text = self.text[:end]
            self.done = True
            return
        try:
            self.job.check()  # the deadline, a client that left, a shutdown
        except ApiError as exc:
            self.error, self.done = exc, True
            return
        if len(self.out) == self.n_new:
            self.done = True

    def finish(self) -> None:
        if self.error is not None:
            self.job.emit("error", self.error)
            return
        if self.req.stream and len(self.text) > self.sent:
            self.job.emit("delta", self.text[self.sent:])
        finish = "stop" if self.stopped or len(self.out) < self.n_new else "length"
        self.job.emit("done", {"text": self.text, "finish_reason": finish,
                               "usage": {"prompt_tokens": self.prompt, "completion_tokens": len(self.out),
                                         "total_tokens": self.prompt + len(self.out),
                                         "prompt_tokens_details": {"cached_tokens": 0}}})


def chat_batch(service: Any, jobs: list[Job]) -> None:
    """Answer the plain chats ``jobs`` (each ``job.item`` a :class:`~kv_cache.serve.service.PreparedChat`
    without a context) together; each job's events get its own answer."""
    from transformers import DynamicCache

    from .service import _eos

    model, tok = service.model, service.tokenizer
    rows = [_Row(service, j) for j in jobs]
    for r in rows:
        r.job.emit("start")
    eos = _eos(tok, model)
    pad = tok.pad_token_id if isinstance(getattr(tok, "pad_token_id", None), int) else 0
    longest = max(r.prompt for r in rows)
    ids = torch.tensor([[pad] * (longest - len(j.item.ids)) + list(j.item.ids) for j in jobs])
    mask = torch.tensor([[0] * (longest - len(j.item.ids)) + [1] * len(j.item.ids) for j in jobs])
    positions = (mask.cumsum(-1) - 1).clamp(min=0)
    cache = DynamicCache()
    with torch.no_grad():
        out = model(input_ids=ids, attention_mask=mask, position_ids=positions, past_key_values=cache, use_cache=True,
                    logits_to_keep=1)
        logits = out.logits[:, -1].float()
        pos = positions[:, -1:]
        while True:
            for i, r in enumerate(rows):
                if not r.done:
                    r.step(logits[i], eos)
                    if r.done:
                        r.finish()  # its client gets the answer now, not when the batch ends
            if all(r.done for r in rows):
                return
            nxt = torch.tensor([[r.out[-1] if r.out and not r.done else pad] for r in rows])
            mask = torch.cat([mask, torch.ones(len(rows), 1, dtype=mask.dtype)], dim=1)
            pos = pos + 1
            out = model(input_ids=nxt, attention_mask=mask, position_ids=pos, past_key_values=cache, use_cache=True)
            logits = out.logits[:, -1].float()
