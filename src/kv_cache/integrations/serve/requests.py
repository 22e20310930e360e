"""The bodies ``kvcache serve`` accepts, checked into plain dataclasses (pure functions, no model).

* :func:`parse_chat` checks a ``POST /v1/chat/completions`` body (OpenAI's fields, plus
  ``context_id``: the stored compressed context the answer starts from);
* :func:`parse_context` checks a ``POST /v1/contexts`` body: the document and how to compress it,
  as one of a ``method`` spec of ``kvcache eval`` (ours), a ``preset`` (a size: ``"4x"``,
  ``"8x"``, ``"16x"`` or any ``"<ratio>x"``, the preset plan of :func:`kv_cache.plan.preset_plan`
  sized for the document, as ``kvcache compress --ratio``) or a ``plan`` (the JSON object
  ``kvcache plan`` writes, :class:`kv_cache.plan.CachePlan`, as ``kvcache compress --plan``).

The shape of each body (types, bounds, the length of every parsed string) is declared in
:mod:`kv_cache.integrations.serve.schemas` (pydantic models, published in ``/openapi.json``); what
is left here is what those models cannot say. Every bad value is an
:class:`~kv_cache.integrations.serve.errors.ApiError` (400) naming the field, what is allowed and
what was received. Every check runs in time linear in the body (the messages' characters are a
running total). The server's :class:`~kv_cache.integrations.serve.limits.Limits` are checked
here, before any work: the document's characters and the messages' (``text_too_long``),
``max_tokens`` (at most ``--max-tokens``), each ``stop`` string's characters. A plan object that
names a file is refused here, before it is decoded (:mod:`kv_cache.integrations.serve.files`). Fields OpenAI
defines that this server does not implement are refused when they ask for something (``n`` > 1,
penalties, ``logit_bias``, ``logprobs``, ``tools``); others (``user``, ``metadata``, ...) are
ignored.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

from ...generation import SamplingParams
from .errors import ApiError, bad_param
from .files import ServedFiles
from .limits import Limits
from .schemas import MAX_STOPS, ROLES  # noqa: F401 (importable from here as before)
from .schemas import ChatCompletionRequest, ContextCreateRequest, TextPart, shown, validate

DEFAULT_METHOD = "kvzip@0.3"  # `kvcache compress`'s default
KEEP = ("head", "tail")


@dataclass(frozen=True)
class ChatRequest:
    model: str
    messages: tuple[tuple[str, str], ...]  # (role, text)
    sampling: SamplingParams
    max_tokens: int | None = None  # None: as many as fit, up to the server's default
    stop: tuple[str, ...] = ()
    stream: bool = False
    include_usage: bool = False
    context_id: str | None = None


@dataclass(frozen=True)
class ContextRequest:
    document: str
    method: str | None = None  # one of method / preset / plan
    preset: str | None = None  # "<ratio>x"
    plan: dict[str, Any] | None = field(default=None, hash=False)
    max_tokens: int | None = None
    keep: str | None = None


def _too_long(what: str, n: int, limit: int, param: str) -> ApiError:
    return ApiError("text_too_long", f"{what} is {n:,} characters; this server takes at most {limit:,} "
                                     "(kvcache serve --max-document-chars)", param=param)


def _text(content: str | list[TextPart]) -> str:
    """A message's content: a string, or its text parts joined."""
    return content if isinstance(content, str) else "".join(part.text for part in content)


def parse_chat(body: Any, served_model: str, limits: Limits | None = None) -> ChatRequest:
    """Check a chat completion body (:class:`~.schemas.ChatCompletionRequest`) against the model
    this server serves (``served_model``) and its ``limits`` (default
    :class:`~kv_cache.integrations.serve.limits.Limits`): the messages' characters as a running
    total, ``max_tokens`` and each ``stop`` string."""
    limits = limits or Limits()
    req = validate(ChatCompletionRequest, body)
    if req.model != served_model:
        raise ApiError("model_not_found", f"the model {shown(req.model)} is not served here; this server serves "
                                          f"{served_model!r}", param="model")
    messages, total = [], 0
    for i, m in enumerate(req.messages):
        text = _text(m.content)
        total += len(text)
        if total > limits.max_document_chars:
            raise _too_long("the messages' text", total, limits.max_document_chars, "messages")
        if "\x00" in text:
            raise bad_param(f"messages[{i}].content", f"messages[{i}].content holds a NUL character: binary data, "
                                                      "not text")
        messages.append((m.role, text))
    if not any(text.strip() for _, text in messages):
        raise bad_param("messages", "messages hold no text: every content is empty; got only empty contents")
    name, max_tokens = "max_completion_tokens", req.max_completion_tokens
    if max_tokens is None:
        name, max_tokens = "max_tokens", req.max_tokens
    if max_tokens is not None and max_tokens > limits.max_tokens:
        raise bad_param(name, f"{name} must be at most {limits.max_tokens:,} on this server (kvcache serve "
                              f"--max-tokens); got {max_tokens:,}")
    stops = () if req.stop is None else (req.stop,) if isinstance(req.stop, str) else tuple(req.stop)
    longest = max((len(s) for s in stops), default=0)
    if longest > limits.max_stop_chars:
        raise bad_param("stop", f"each stop string must be at most {limits.max_stop_chars} characters (kvcache serve "
                                f"--max-stop-chars); got one of {longest:,}")
    sampling = SamplingParams(1.0 if req.temperature is None else req.temperature,
                              1.0 if req.top_p is None else req.top_p, req.seed)
    include_usage = bool(req.stream_options and req.stream_options.include_usage)
    return ChatRequest(req.model, tuple(messages), sampling, max_tokens, stops, bool(req.stream), include_usage,
                       req.context_id)


def parse_context(body: Any, limits: Limits | None = None) -> ContextRequest:
    """Check a ``POST /v1/contexts`` body: ``document`` (text), at most one of ``method`` /
    ``preset`` / ``plan`` (default: ``method`` :data:`DEFAULT_METHOD`), and ``max_tokens`` /
    ``keep`` as ``kvcache compress --max-tokens / --keep``. A method's grammar and a plan's
    content are checked against the model before the job is queued; ``limits`` (default
    :class:`~kv_cache.integrations.serve.limits.Limits`) bound the document's characters."""
    limits = limits or Limits()
    req = validate(ContextCreateRequest, body)
    doc = req.document
    if not doc.strip():
        raise ApiError("invalid_document", "document is empty" + (f" ({len(doc)} whitespace characters)" if doc
                                                                  else ""), param="document")
    if len(doc) > limits.max_document_chars:
        raise _too_long("document", len(doc), limits.max_document_chars, "document")
    nul = doc.find("\x00")
    if nul >= 0:
        raise ApiError("invalid_document", f"document holds a NUL character at offset {nul}: binary data, not text",
                       param="document")
    method, preset, plan = req.method, req.preset, req.plan
    given = [k for k, v in (("method", method), ("preset", preset), ("plan", plan)) if v is not None]
    if len(given) > 1:
        raise ApiError("invalid_method", f"give one of method, preset or plan; got {' and '.join(given)}",
                       param=given[1])
    if method is None and preset is None and plan is None:
        method = DEFAULT_METHOD
    if method is not None and not method.strip():
        raise ApiError("invalid_method", f"method must be a method spec string (e.g. {DEFAULT_METHOD!r}); "
                                         f"got {shown(method)}", param="method")
    if preset is not None:
        from ...plan import PRESETS, parse_target

        try:
            preset = f"{parse_target(preset):g}x"
        except ValueError as exc:
            raise ApiError("invalid_method", f"preset: {exc} (presets: {list(PRESETS)})", param="preset") from None
    if plan is not None:
        ServedFiles.check_plan_object(plan)
    max_tokens, keep = req.max_tokens, req.keep
    if keep is not None and max_tokens is None:
        raise bad_param("keep", "keep says which tokens max_tokens keeps; give max_tokens as well")
    return ContextRequest(doc, method.strip() if method is not None else None, preset, plan, max_tokens, keep)
