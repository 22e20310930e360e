"""What each request of ``kvcache serve`` runs: compress a document, answer a chat.

Each request runs in two steps. :meth:`Service.prepare_compress` / :meth:`Service.prepare_chat`
run *outside* the model lock (in the server's tokenizer thread): they check what can be checked
without the model (the owner's context and quota, the method, the tokens against the limits and
the model's positions) and tokenize, under a tokenizer lock of their own. Only then is the job
queued; :meth:`Service.compress` / :meth:`Service.chat` run on the worker thread of
:class:`~kv_cache.integrations.serve.engine.Engine`, under its model lock.

**Prompts.** Without a context, the messages are rendered with the tokenizer's chat template
when it has one (SmolLM2; the generation prompt added), or else as their texts joined by
newlines (stories260K, BOS added). A stored context follows :class:`kv_cache.CompressedContext`
(:mod:`kv_cache.chat`, kvpress' split): with a chat template, the template's head and the
document are compressed (``<|im_start|>user`` + document) and the template's tail is saved
with the file; a chat request's messages (their texts joined by newlines) are the question,
appended as ``"\n" + question + tail`` (:meth:`~kv_cache.CompressedContext.question_ids`) at the
positions after the context, inside ``cache.session()``: the question and answer go to a tail
that is dropped after, so the stored context never changes. Without a template the document
and the question are raw text.

**Usage.** ``prompt_tokens`` counts every token the answer attends to: the stored context's
tokens plus the rendered messages (``prompt_tokens_details.cached_tokens``: the context's part).
"""

from __future__ import annotations

import dataclasses
import json
import logging
import threading
from dataclasses import dataclass, field
from typing import Any

import torch

from ...cache import FidelityError, compress
from ...context import CompressedContext, fit_context, forward_at, max_positions, text_token_ids, token_ids
from ...generation import TextStream, generate_tokens
from .engine import Job
from .errors import ApiError
from .files import ServedFiles
from .limits import Limits
from .requests import ChatRequest, ContextRequest
from .store import ContextCorrupted, ContextNotFound, ContextStore, StoreClosed, StoreFull

log = logging.getLogger(__name__)

DEFAULT_MAX_TOKENS = 256  # an answer's tokens when the request does not say (and they fit)


def render_messages(tokenizer: Any, messages: tuple[tuple[str, str], ...]) -> str:
    """The prompt text of ``messages`` ((role, text) pairs): the chat template, or the texts."""
    if getattr(tokenizer, "chat_template", None):
        chat = [{"role": "system" if role == "developer" else role, "content": text} for role, text in messages]
        return tokenizer.apply_chat_template(chat, add_generation_prompt=True, tokenize=False)
    return "\n".join(text for _, text in messages)


def _eos(tokenizer: Any, model: Any) -> set[int]:
    ids = [getattr(tokenizer, "eos_token_id", None), getattr(getattr(model, "generation_config", None),
                                                             "eos_token_id", None)]
    out: set[int] = set()
    for i in ids:
        out.update(i if isinstance(i, (list, tuple)) else [i])
    return {i for i in out if isinstance(i, int)}


@dataclass
class PreparedContext:
    """A ``POST /v1/contexts`` request, checked and tokenized (outside the model lock)."""

    req: ContextRequest
    owner: str | None
    document_tokens: int
    kept: list[int]
    suffix: str | None
    quant: Any
    eviction: Any
    plan: Any
    spec: str


@dataclass
class PreparedChat:
    """A chat request, checked and tokenized (outside the model lock)."""

    req: ChatRequest
    owner: str | None
    ids: list[int]
    n_new: int
    cached: int


def _longest_token(tokenizer: Any) -> int:
    """Characters of the tokenizer's longest token (0: unknown, no bound)."""
    try:
        pieces = tokenizer.convert_ids_to_tokens(list(range(len(tokenizer))))
        return max([len(p) for p in pieces if isinstance(p, str)] or [0])
    except Exception:  # a tokenizer without a vocabulary listing: no bound
        return 0


def _decoder_copy(tokenizer: Any) -> Any:
    """A copy of ``tokenizer`` for decoding on the worker thread (the tokenizer itself when it
    cannot be copied: then decoding shares it, as HF tokenizers allow for reads)."""
    import copy

    try:
        return copy.deepcopy(tokenizer)
    except Exception:  # a tokenizer that cannot be copied
        log.warning("the tokenizer cannot be copied; answers are decoded with the one that tokenizes requests")
        return tokenizer


def _store_error(exc: Exception, cid: str, param: str | None = None) -> ApiError:
    if isinstance(exc, ContextNotFound):
        return ApiError("context_not_found", f"no context with id {cid!r} (GET /v1/contexts lists them)", param=param)
    return ApiError("context_corrupted", f"the stored context {cid!r} fails its checks: {exc}; delete it "
                                         "(DELETE /v1/contexts/{id}) and compress the document again", param=param)


@dataclass
class Service:
    """The model, its tokenizer, the context store and the server's limits."""

    model: Any
    tokenizer: Any
    store: ContextStore
    model_id: str
    max_document_tokens: int | None = None  # None: what the model's positions allow
    files: ServedFiles = field(default_factory=ServedFiles)  # the operator's registered files
    limits: Limits = field(default_factory=Limits)
    tokenizer_lock: Any = field(default_factory=threading.Lock, repr=False)  # the tokenizer thread's, around encoding
    strict: bool = False  # refuse a context whose cache fails the fidelity or eviction check (§26) instead of warning

    def __post_init__(self) -> None:
        if self.max_document_tokens is None:
            self.max_document_tokens = self.limits.max_document_tokens
        self._longest = _longest_token(self.tokenizer)  # at start-up: never under the lock on the event loop
        # the worker's own copy for decoding answers: it never waits for (nor races) the tokenizer
        # thread, which may hold the tokenizer for seconds on a document at --max-document-chars
        self.decoder = _decoder_copy(self.tokenizer)

    def chars_past(self, tokens: int | None) -> int | None:
        """Characters of text past which it surely takes more than ``tokens`` tokens (None: no
        bound): ``tokens`` times the longest token's characters, so a text that long is refused
        without being tokenized (the tokenizer is linear, but not free: a 1M-character document
        takes seconds)."""
        if tokens is None or self._longest <= 0:
            return None
        return tokens * self._longest

    def check_characters(self, req: ContextRequest | ChatRequest) -> None:
        """Refuse a text that cannot fit by its characters alone (:meth:`chars_past`), before it
        is tokenized or queued: a document (without ``max_tokens``) past the server's document
        tokens, a chat's messages past the model's positions."""
        limit = max_positions(self.model.config)
        if isinstance(req, ContextRequest):
            fits = [n for n in (self.max_document_tokens, limit) if n is not None]
            bound = self.chars_past(min(fits)) if fits and req.max_tokens is None else None
            if bound is not None and len(req.document) > bound:
                raise ApiError("document_too_long", f"the document is {len(req.document):,} characters: more tokens "
                                                    f"than this server takes ({min(fits):,}; --max-document-tokens or "
                                                    "the model's positions); give max_tokens (and keep) to compress "
                                                    "a part of it", param="document")
            return
        bound = self.chars_past(limit)
        chars = sum(len(text) for _, text in req.messages)
        if bound is not None and chars > bound:
            raise ApiError("context_length_exceeded", f"the messages hold {chars:,} characters: more tokens than the "
                                                      f"model's {limit:,} positions", param="messages")

    # ----------------------------------------------------------------- POST /v1/contexts
    def settings(self, req: ContextRequest, tokens: int) -> tuple[Any, Any, Any, str]:
        """``(quant, eviction, plan, name)`` of the request's method, or preset (sized for
        ``tokens``) or plan (then ``plan`` is the :class:`~kv_cache.plan.CachePlan` and ``quant``
        None); ``invalid_method`` when it does not parse or does not fit this model."""
        from ...spec import method_settings
        from ...plan import CachePlan, model_preset_plan

        try:
            if req.preset is not None:
                limit = max_positions(self.model.config) or tokens
                plan = model_preset_plan(self.model, req.preset, context_tokens=min(tokens, limit))
                return None, plan.eviction(), plan, req.preset
            if req.plan is not None:
                self.files.check_plan_object(req.plan)  # names no file: decoding it opens none
                plan = CachePlan.from_json(json.dumps(req.plan), "plan")
                plan.check_model(self.model.config)
                return None, plan.eviction(), plan, f"plan {plan.name} ({plan.fingerprint})"
            spec, plan, overrides = self.files.resolve_spec(req.method)  # registered names only: no path is read
            if plan is not None:
                plan.check_model(self.model.config)
                return None, plan.eviction(), plan, f"{req.method} ({plan.fingerprint})"
            quant, eviction, _ = method_settings(spec, None, self.model)
            if overrides:  # a registered bit profile: its widths, loaded at start-up
                if quant is None:
                    raise ValueError(f"method {req.method!r}: a bit profile p[NAME] / u[NAME] needs a quantization "
                                     "part (e.g. q4p[NAME])")
                quant = dataclasses.replace(quant, **overrides)
            return quant, eviction, None, req.method  # as the client gave it: names, never the files
        except ApiError:
            raise
        except (ValueError, TypeError, RuntimeError, KeyError, AttributeError, OverflowError) as exc:
            # RuntimeError: a peer whose package is missing; the others: a plan object of the wrong shape
            param = "preset" if req.preset is not None else "plan" if req.plan is not None else "method"
            raise ApiError("invalid_method", str(exc), param=param) from None

    def prepare_compress(self, req: ContextRequest, owner: str | None = None) -> PreparedContext:
        """Check and tokenize ``req`` for ``owner``, outside the model lock: the quota (429), the
        document's tokens (``--max-document-tokens``, the positions), the method. The server
        calls :meth:`check_characters` first, before the queue."""
        from ...chat import has_chat_template, split_chat

        try:
            self.store.check_room(owner)
        except StoreFull as exc:
            raise ApiError("storage_quota_exceeded", str(exc)) from None
        suffix = None
        with self.tokenizer_lock:
            if has_chat_template(self.tokenizer):
                try:
                    head, suffix = split_chat(self.tokenizer, req.document)
                except ValueError:  # a template that splits the user's text: raw text, as build(chat=False)
                    suffix = None
            ids = token_ids(self.tokenizer, head) if suffix is not None else text_token_ids(self.tokenizer, req.document)
        limit = self.max_document_tokens
        if limit is not None and len(ids) > limit:
            raise ApiError("document_too_long", f"the document is {len(ids):,} tokens; this server takes at most "
                                                f"{limit:,} (kvcache serve --max-document-tokens)", param="document")
        quant, eviction, plan, spec = self.settings(req, len(ids))
        try:
            kept = fit_context(ids, self.model.config, self.tokenizer, eviction, max_tokens=req.max_tokens,
                               keep=req.keep)
        except ValueError as exc:
            raise ApiError("document_too_long", str(exc), param="max_tokens" if req.max_tokens else "document"
                           ) from None
        if req.preset is not None and len(kept) < len(ids):  # a preset is sized for what is compressed
            quant, eviction, plan, spec = self.settings(req, len(kept))
        if hasattr(eviction, "bind") and hasattr(eviction, "scorer"):  # KVzap: its scorer exists and fits the model
            try:
                eviction.bind(self.model)
            except (ValueError, FileNotFoundError, RuntimeError) as exc:
                raise ApiError("invalid_method", str(exc), param="method" if req.method else "plan") from None
        return PreparedContext(req, owner, len(ids), kept, suffix, quant, eviction, plan, spec)

    def compress(self, prep: PreparedContext, job: Job) -> dict[str, Any]:
        """Compress and store a prepared document (on the worker, under the model lock). The job's
        deadline and cancellation are checked between the prefill's layers and KVzip's chunks: a
        compression past its deadline stops there and frees the worker."""
        job.check()
        try:
            if prep.plan is not None:
                ctx = CompressedContext.build(self.model, self.tokenizer, prep.kept, plan=prep.plan,
                                              strict=self.strict, check=job.check)
            else:
                ctx = CompressedContext.build(self.model, self.tokenizer, prep.kept, quant=prep.quant,
                                              eviction=prep.eviction, strict=self.strict, check=job.check)
        except FidelityError as exc:  # --strict: this method wrecks this model's attention; nothing is stored
            raise ApiError("invalid_method", str(exc), param="method" if prep.req.method else "plan") from None
        except ValueError as exc:  # settings this model cannot take that only the prefill finds: the request's
            log.warning("compression refused: %s", exc, exc_info=True)
            raise ApiError("invalid_method", f"this method cannot compress this document on this model: {exc}",
                           param="method" if prep.req.method else "plan" if prep.req.plan else "preset") from None
        ctx.document_tokens, ctx.question_suffix = prep.document_tokens, prep.suffix
        job.commit()  # cancelled (the client left, a timeout, a shutdown): keep nothing; else finish the write
        st = ctx.stats
        try:
            return self.store.add(ctx, {"model": self.model_id, "method": prep.spec,
                                        "prefill_seconds": st.prefill_s + st.reconstruction_s,
                                        "reconstruction_seconds": st.reconstruction_s}, owner=prep.owner)
        except StoreFull as exc:
            raise ApiError("storage_quota_exceeded", str(exc)) from None
        except StoreClosed:
            raise ApiError("shutting_down", "the server is shutting down; the context was not stored") from None

    # ----------------------------------------------------------------- POST /v1/chat/completions
    def _budget(self, req: ChatRequest, used: int, prompt: int) -> int:
        """Tokens the answer may take: ``max_tokens``, checked against the positions left after
        ``used`` tokens (context + prompt), or the default capped to what fits."""
        limit = max_positions(self.model.config)
        room = None if limit is None else limit - used + 1  # the last token is not fed
        if room is not None and room < 1:
            raise ApiError("context_length_exceeded", f"the prompt takes {used:,} positions (messages: {prompt:,}) "
                                                      f"but the model has {limit:,} (max_position_embeddings)",
                           param="messages")
        if req.max_tokens is None:
            return DEFAULT_MAX_TOKENS if room is None else min(DEFAULT_MAX_TOKENS, room)
        if room is not None and req.max_tokens > room:
            raise ApiError("context_length_exceeded", f"max_tokens={req.max_tokens} does not fit: the prompt takes "
                                                      f"{used:,} of the model's {limit:,} positions, so at most "
                                                      f"{room:,} tokens can be generated", param="max_tokens")
        return req.max_tokens

    def prepare_chat(self, req: ChatRequest, owner: str | None = None) -> PreparedChat:
        """Check and tokenize ``req`` for ``owner``, outside the model lock: the context (404,
        422), the prompt's tokens and ``max_tokens`` against the positions. The server calls
        :meth:`check_characters` first, before the queue."""
        if req.context_id is not None:
            try:
                desc = self.store.describe(req.context_id, owner)
                suffix = self.store.question_suffix(req.context_id, owner)
            except (ContextNotFound, ContextCorrupted) as exc:
                raise _store_error(exc, req.context_id, "context_id") from None
            question = "\n".join(text for _, text in req.messages)
            if suffix is not None:
                from ...chat import question_text

                question = question_text(question, suffix)
            with self.tokenizer_lock:
                ids = token_ids(self.tokenizer, question)
            cached = int(desc["tokens"])
        else:
            with self.tokenizer_lock:
                ids = text_token_ids(self.tokenizer, render_messages(self.tokenizer, req.messages))
            cached = 0
        if not ids:
            raise ApiError("context_length_exceeded", "the question is empty", param="messages")
        return PreparedChat(req, owner, ids, self._budget(req, cached + len(ids), len(ids)), cached)

    def chat(self, prep: PreparedChat, job: Job) -> dict[str, Any]:
        """Answer a prepared chat (on the worker, under the model lock)."""
        req, model, ids, n_new = prep.req, self.model, prep.ids, prep.n_new
        job.check()
        with torch.no_grad():
            if req.context_id is not None:
                try:
                    ctx = self.store.get(req.context_id, prep.owner)
                except (ContextNotFound, ContextCorrupted) as exc:
                    raise _store_error(exc, req.context_id, "context_id") from None
                try:  # the positions, checked again against the loaded context
                    ids = ctx.question_ids(ids, 1)
                except ValueError as exc:
                    raise ApiError("context_length_exceeded", str(exc), param="messages") from None
                cached = ctx.context_tokens
                with compress(model, ctx.cache), ctx.cache.session():
                    logits = forward_at(model, ctx.cache, torch.tensor([ids]), cached, last_only=True)[0, -1]
                    return self._generate(req, job, ctx.cache, logits, cached + len(ids), n_new, cached, len(ids))
            from transformers import DynamicCache

            cache = DynamicCache()
            logits = forward_at(model, cache, torch.tensor([ids]), 0, last_only=True)[0, -1]
            return self._generate(req, job, cache, logits, len(ids), n_new, 0, len(ids))

    def _generate(self, req: ChatRequest, job: Job, cache: Any, logits: torch.Tensor, pos: int, n_new: int,
                  cached: int, prompt: int) -> dict[str, Any]:
        job.emit("start")
        stream = TextStream(self.decoder, req.stop)  # on the worker thread: decoder is its own
        gen = generate_tokens(self.model, cache, logits, pos, max_new_tokens=n_new, params=req.sampling,
                              eos=_eos(self.tokenizer, self.model))
        try:
            for token in gen:
                piece = stream.push(token)
                if req.stream and piece:
                    job.emit("delta", piece)
                if stream.stopped:
                    break
                job.check()  # the deadline, a client that left, a shutdown
        finally:
            gen.close()
        piece = stream.finish()
        if req.stream and piece:
            job.emit("delta", piece)
        out, stopped, text = stream.tokens, stream.stopped, stream.text
        finish = "stop" if stopped or len(out) < n_new else "length"
        return {"text": text, "finish_reason": finish,
                "usage": {"prompt_tokens": cached + prompt, "completion_tokens": len(out),
                          "total_tokens": cached + prompt + len(out),
                          "prompt_tokens_details": {"cached_tokens": cached}}}
