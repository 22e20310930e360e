"""Concurrent chats of ``kvcache serve`` without a stored context, decoded together in one batch.

When the worker takes a chat without a stored context and more such chats wait in the queue, it
runs up to ``--max-batch`` of them as one batch (:meth:`kv_cache.integrations.serve.engine.Engine._run_batch`):
their prompts are left-padded into one ``[batch, longest]`` tensor with an attention mask, prefilled
together into one ``DynamicCache``, then each step feeds every row's last token at the row's own
position. Each row keeps its own sampling (its seed's generator), stop strings, ``max_tokens``,
end of sequence, stream and deadline (:class:`~kv_cache.integrations.serve.rows.Row`), exactly as
:meth:`Service.chat` does one at a time; a row that is done is fed a padding token until the batch
ends, and its answer is sent when it is done.

Chats on stored contexts are batched by :mod:`kv_cache.integrations.serve.batch_context`.
"""

from __future__ import annotations

from typing import Any

import torch

from .engine import Job
from .rows import Row, decode_rows, pad_token


def chat_batch(service: Any, jobs: list[Job]) -> None:
    """Answer the plain chats ``jobs`` (each ``job.item`` a :class:`~kv_cache.integrations.serve.service.PreparedChat`
    without a context) together; each job's events get its own answer."""
    from transformers import DynamicCache

    from .service import _eos

    model, tok = service.model, service.tokenizer
    rows = [Row(service, j, len(j.item.ids)) for j in jobs]
    for r in rows:
        r.job.emit("start")
    pad = pad_token(tok)
    longest = max(r.prompt for r in rows)
    ids = torch.tensor([[pad] * (longest - len(j.item.ids)) + list(j.item.ids) for j in jobs])
    mask = torch.tensor([[0] * (longest - len(j.item.ids)) + [1] * len(j.item.ids) for j in jobs])
    positions = (mask.cumsum(-1) - 1).clamp(min=0)
    cache = DynamicCache()
    state = {"mask": mask, "pos": positions[:, -1:]}

    def feed(tokens: torch.Tensor) -> torch.Tensor:
        state["mask"] = torch.cat([state["mask"], torch.ones(len(rows), 1, dtype=mask.dtype)], dim=1)
        state["pos"] = state["pos"] + 1
        out = model(input_ids=tokens, attention_mask=state["mask"], position_ids=state["pos"], past_key_values=cache,
                    use_cache=True)
        return out.logits[:, -1].float()

    with torch.no_grad():
        out = model(input_ids=ids, attention_mask=mask, position_ids=positions, past_key_values=cache, use_cache=True,
                    logits_to_keep=1)
        decode_rows(rows, out.logits[:, -1].float(), feed, _eos(tok, model), pad)
