"""Concurrent chats of ``kvcache serve`` on stored contexts, decoded together in one batch.

When the worker takes a chat on a stored context and more such chats wait in the queue, it runs
up to ``--max-batch`` of them together (:meth:`kv_cache.integrations.serve.engine.Engine._run_batch`),
whether they ask the same context or different ones:

1. **Each question is prefilled on its own** context, exactly as one at a time: inside the
   context's :meth:`~kv_cache.CompressedCache.session`, the question's tokens are fed after the
   context (batch 1). That gives the row's first token, sent at once (before the next row's
   prefill), and the question's keys and values (:func:`kv_cache.cache.stack.session_states`);
   the stored context never changes.
2. **The rows are stacked** into one batch cache (:func:`kv_cache.cache.stack.stack_sessions`):
   every layer holds row ``b`` = context ``b`` as stored (sinks, packed codes with their own
   scale tables, residual) + question ``b``, rows of different lengths in one packed ragged
   buffer, each read at its own offset. A context asked by several rows is copied into each of
   them, never prefilled or quantized again; different contexts share the batch as they are,
   without padding (left padding could not sit between a context and its question, nor shift
   packed per-channel key groups).
3. **The answers are decoded together**: each step feeds every row's last token at the row's own
   absolute position (``position_ids`` per row), inside the batch cache's session, and each row
   keeps its own sampling, stops, ``max_tokens``, stream and deadline
   (:class:`~kv_cache.integrations.serve.rows.Row`).

Chats whose contexts cannot be stacked with the others (:func:`~kv_cache.cache.stack.layout_key`:
another quantization or layout) form a batch of their own, one after the other. A context whose
cache cannot be a row at all (:func:`~kv_cache.cache.stack.stack_reason`: layers whose heads hold
different numbers of tokens, as KVzip's model-wide budget leaves them; a precision tier's
demoted tokens; sliding-window layers) is answered one at a time, as without batching.
A request that fails (its context deleted meanwhile, its deadline, a client that left) is
answered its error alone; the others go on.
"""

from __future__ import annotations

from typing import Any

import torch

from ...cache import compress
from ...cache.stack import layout_key, session_states, stack_reason, stack_sessions
from ...generation import forward_at
from .engine import Job, internal_error
from .errors import ApiError
from .rows import Row, decode_rows, flush, pad_token


def _load(service: Any, job: Job) -> tuple[Any, list[int]]:
    """``(context, question ids)`` of a chat job, checked as :meth:`Service.chat` checks them."""
    from .service import _store_error
    from .store import ContextCorrupted, ContextNotFound

    prep = job.item
    cid = prep.req.context_id
    try:
        ctx = service.store.get(cid, prep.owner)
    except (ContextNotFound, ContextCorrupted) as exc:
        raise _store_error(exc, cid, "context_id") from None
    try:  # the positions, checked again against the loaded context
        ids = ctx.question_ids(prep.ids, 1)
    except ValueError as exc:
        raise ApiError("context_length_exceeded", str(exc), param="messages") from None
    return ctx, ids


def _alone(service: Any, job: Job) -> None:
    """Answer ``job`` one at a time (:meth:`Service.chat`), as the engine does without batching."""
    try:
        job.emit("done", service.chat(job.item, job))
    except ApiError as exc:
        job.emit("error", exc)
    except Exception:  # logged with its traceback; the other rows go on
        job.emit("error", internal_error())


def plan_groups(items: list[tuple[Job, Any, list[int]]]) -> tuple[list[list[tuple[Job, Any, list[int]]]], list[Job]]:
    """Split loaded chats ``(job, context, question ids)`` into batches of stackable contexts of
    one layout (in queue order; the first chat's batch first) and the jobs to answer alone."""
    groups: dict[tuple, list] = {}
    alone = []
    for job, ctx, ids in items:
        if stack_reason(ctx.cache) is not None:
            alone.append(job)
        else:
            groups.setdefault(layout_key(ctx.cache), []).append((job, ctx, ids))
    return list(groups.values()), alone


def _prefill(service: Any, job: Job, ctx: Any, ids: list[int]) -> tuple[torch.Tensor, list]:
    """The question's logits ``[vocab]`` after the context and its states per layer (one at a time)."""
    model = service.model
    with compress(model, ctx.cache), ctx.cache.session():
        logits = forward_at(model, ctx.cache, torch.tensor([ids]), ctx.context_tokens, last_only=True)[0, -1]
        states = session_states(ctx.cache)
    return logits, states


def _decode_group(service: Any, group: list[tuple[Job, Any, list[int]]]) -> None:
    """Prefill each chat of ``group`` on its context, stack the rows, decode them together."""
    from .service import _eos

    model, tok = service.model, service.tokenizer
    eos = _eos(tok, model)
    rows, caches, states, positions = [], [], [], []
    for job, ctx, ids in group:
        try:
            job.check()
            first, st = _prefill(service, job, ctx, ids)
        except ApiError as exc:
            job.emit("error", exc)
            continue
        except Exception:
            job.emit("error", internal_error())
            continue
        job.emit("start")
        row = Row(service, job, len(ids), ctx.context_tokens)
        row.step(first, eos)  # its first token now, before the other rows' prefills
        if row.done:
            row.finish()
        flush([row])
        if row.done:
            continue
        rows.append(row)
        caches.append(ctx.cache)
        states.append(st)
        positions.append(ctx.context_tokens + len(ids))
    if not rows:
        return
    batch = stack_sessions(caches, states, model.config)
    device = next(model.parameters()).device
    pos = torch.tensor(positions, device=device).unsqueeze(1)  # [batch, 1]: each row's next position

    def feed(tokens: torch.Tensor) -> torch.Tensor:
        nonlocal pos
        out = model(input_ids=tokens.to(device), position_ids=pos, past_key_values=batch, use_cache=True)
        pos = pos + 1
        return out.logits[:, -1].float()

    with compress(model, batch), batch.session():
        decode_rows(rows, None, feed, eos, pad_token(tok))


def context_batch(service: Any, jobs: list[Job]) -> None:
    """Answer the chats ``jobs`` on stored contexts (each ``job.item`` a
    :class:`~kv_cache.integrations.serve.service.PreparedChat` with a ``context_id``) together; see the module
    docstring. Each job's events get its own answer."""
    items = []
    for job in jobs:
        try:
            job.check()
            ctx, ids = _load(service, job)
        except ApiError as exc:
            job.emit("error", exc)
            continue
        items.append((job, ctx, ids))
    groups, alone = plan_groups(items)
    for group in groups:
        try:
            with torch.no_grad():
                _decode_group(service, group)
        except ApiError as exc:  # this group's requests are answered; the other groups still run
            _group_error(group, exc)
        except Exception:  # logged with its traceback
            _group_error(group, internal_error())
    for job in alone:
        _alone(service, job)


def _group_error(group: list[tuple[Job, Any, list[int]]], exc: ApiError) -> None:
    """Answer ``exc`` to the requests of a failed group (one answered already ignores it)."""
    for job, _, _ in group:
        job.emit("error", exc)
