"""The bodies ``kvcache serve`` accepts, checked into plain dataclasses (pure functions, no model).

* :func:`parse_chat` checks a ``POST /v1/chat/completions`` body (OpenAI's fields, plus
  ``context_id``: the stored compressed context the answer starts from);
* :func:`parse_context` checks a ``POST /v1/contexts`` body: the document and how to compress it,
  as one of a ``method`` spec of ``kvcache eval`` (ours), a ``preset`` (a size: ``"4x"``,
  ``"8x"``, ``"16x"`` or any ``"<ratio>x"``, the preset plan of :func:`kv_cache.plan.preset_plan`
  sized for the document, as ``kvcache compress --ratio``) or a ``plan`` (the JSON object
  ``kvcache plan`` writes, :class:`kv_cache.plan.CachePlan`, as ``kvcache compress --plan``).

Every bad value is an :class:`~kv_cache.integrations.serve.errors.ApiError` (400) naming the field, what is
allowed and what was received. The server's :class:`~kv_cache.integrations.serve.limits.Limits` are checked
here, before any work: the document's characters and the messages' (``text_too_long``),
``max_tokens`` (at most ``--max-tokens``), each ``stop`` string's characters. A plan object that
names a file is refused here, before it is decoded (:mod:`kv_cache.integrations.serve.files`). Fields OpenAI
defines that this server does not implement are refused when they ask for something (``n`` > 1,
penalties, ``logit_bias``, ``logprobs``, ``tools``); others (``user``, ``metadata``, ...) are
ignored.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field
from typing import Any

from ...generation import MAX_TEMPERATURE, SamplingParams
from .errors import ApiError, bad_param
from .files import ServedFiles
from .limits import Limits

ROLES = ("system", "developer", "user", "assistant")
MAX_STOPS = 4  # as OpenAI
DEFAULT_METHOD = "kvzip@0.3"  # `kvcache compress`'s default
KEEP = ("head", "tail")
UNSUPPORTED_CHAT = {  # field -> the value that asks for nothing
    "frequency_penalty": 0, "presence_penalty": 0, "logit_bias": None, "logprobs": False, "top_logprobs": None,
    "tools": None, "tool_choice": None, "functions": None, "function_call": None, "response_format": None,
}


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


def _shown(v: Any, width: int = 80) -> str:
    """``repr(v)``, cut to ``width`` characters: an error echoes what it received, never a body."""
    r = repr(v)
    return r if len(r) <= width else r[:width - 3] + "..."


def _require_object(body: Any) -> dict[str, Any]:
    if not isinstance(body, dict):
        raise ApiError("invalid_json", f"the request body must be a JSON object; got {type(body).__name__}")
    return body


def _int(body: dict, name: str, lo: int, default: int | None = None) -> int | None:
    v = body.get(name)
    if v is None:
        return default
    if isinstance(v, bool) or not isinstance(v, int) or v < lo:
        raise bad_param(name, f"{name} must be an integer >= {lo}; got {_shown(v)}")
    return v


def _number(body: dict, name: str, default: float, lo: float, hi: float, lo_open: bool = False) -> float:
    v = body.get(name)
    if v is None:
        return default
    ok = not isinstance(v, bool) and isinstance(v, (int, float)) and math.isfinite(v)
    if not ok or v > hi or v < lo or (lo_open and v == lo):
        span = f"({lo:g}, {hi:g}]" if lo_open else f"[{lo:g}, {hi:g}]"
        raise bad_param(name, f"{name} must be a number in {span}; got {_shown(v)}")
    return float(v)


def _text(content: Any, where: str) -> str:
    """A message's content: a string, or a list of ``{"type": "text", "text": ...}`` parts."""
    if isinstance(content, str):
        return content
    if isinstance(content, list):
        parts = []
        for i, part in enumerate(content):
            if not (isinstance(part, dict) and part.get("type") == "text" and isinstance(part.get("text"), str)):
                got = part.get("type") if isinstance(part, dict) else type(part).__name__
                raise bad_param(where, f"{where}[{i}] must be a text part {{\"type\": \"text\", \"text\": str}} "
                                       f"(this server reads text only); got {_shown(got)}")
            parts.append(part["text"])
        return "".join(parts)
    raise bad_param(where, f"{where} must be a string or a list of text parts; got {type(content).__name__}")


def _too_long(what: str, n: int, limit: int, param: str) -> ApiError:
    return ApiError("text_too_long", f"{what} is {n:,} characters; this server takes at most {limit:,} "
                                     "(kvcache serve --max-document-chars)", param=param)


def parse_chat(body: Any, served_model: str, limits: Limits | None = None) -> ChatRequest:
    """Check a chat completion body against the model this server serves (``served_model``)
    and its ``limits`` (default :class:`~kv_cache.integrations.serve.limits.Limits`)."""
    limits = limits or Limits()
    body = _require_object(body)
    model = body.get("model")
    if not isinstance(model, str) or not model:
        raise bad_param("model", f"model must be a non-empty string (this server serves {served_model!r}); "
                                 f"got {_shown(model)}")
    if model != served_model:
        raise ApiError("model_not_found", f"the model {_shown(model)} is not served here; this server serves "
                                          f"{served_model!r}", param="model")
    msgs = body.get("messages")
    if not isinstance(msgs, list) or not msgs:
        raise bad_param("messages", f"messages must be a non-empty list of {{role, content}}; got {_shown(msgs)}")
    messages = []
    for i, m in enumerate(msgs):
        where = f"messages[{i}]"
        if not isinstance(m, dict):
            raise bad_param(where, f"{where} must be an object {{role, content}}; got {type(m).__name__}")
        role = m.get("role")
        if role not in ROLES:
            raise bad_param(f"{where}.role", f"{where}.role must be one of {list(ROLES)}; got {_shown(role)}")
        text = _text(m.get("content"), f"{where}.content")
        if "\x00" in text:
            raise bad_param(f"{where}.content", f"{where}.content holds a NUL character: binary data, not text")
        messages.append((role, text))
        total = sum(len(t) for _, t in messages)
        if total > limits.max_document_chars:
            raise _too_long("the messages' text", total, limits.max_document_chars, "messages")
    if not any(text.strip() for _, text in messages):
        raise bad_param("messages", "messages hold no text: every content is empty")
    for name, idle in UNSUPPORTED_CHAT.items():
        v = body.get(name)
        if v is not None and v != idle and v != {} and v != []:
            if name == "response_format" and isinstance(v, dict) and v.get("type") == "text":
                continue
            raise bad_param(name, f"{name} is not supported by this server (allowed: omitted or {_shown(idle)}); "
                                  f"got {_shown(v)}")
    n = _int(body, "n", 1, 1)
    if n != 1:
        raise bad_param("n", f"n must be 1 (one answer per request); got {n}")
    max_tokens = _int(body, "max_completion_tokens", 1)
    name = "max_completion_tokens"
    if max_tokens is None:
        name, max_tokens = "max_tokens", _int(body, "max_tokens", 1)
    if max_tokens is not None and max_tokens > limits.max_tokens:
        raise bad_param(name, f"{name} must be at most {limits.max_tokens:,} on this server (kvcache serve "
                              f"--max-tokens); got {max_tokens:,}")
    temperature = _number(body, "temperature", 1.0, 0.0, MAX_TEMPERATURE)
    top_p = _number(body, "top_p", 1.0, 0.0, 1.0, lo_open=True)
    seed = body.get("seed")
    if seed is not None and (isinstance(seed, bool) or not isinstance(seed, int)):
        raise bad_param("seed", f"seed must be an integer; got {_shown(seed)}")
    stop = body.get("stop")
    if stop is None:
        stops: tuple[str, ...] = ()
    elif isinstance(stop, str):
        stops = (stop,)
    elif isinstance(stop, list) and all(isinstance(s, str) for s in stop) and len(stop) <= MAX_STOPS:
        stops = tuple(stop)
    else:
        raise bad_param("stop", f"stop must be a string or a list of at most {MAX_STOPS} strings; got {_shown(stop)}")
    if any(not s for s in stops):
        raise bad_param("stop", f"stop strings must not be empty; got {_shown(list(stops))}")
    longest = max((len(s) for s in stops), default=0)
    if longest > limits.max_stop_chars:
        raise bad_param("stop", f"each stop string must be at most {limits.max_stop_chars} characters (kvcache serve "
                                f"--max-stop-chars); got one of {longest:,}")
    stream = body.get("stream", False)
    if stream is None:
        stream = False
    if not isinstance(stream, bool):
        raise bad_param("stream", f"stream must be true or false; got {_shown(stream)}")
    opts = body.get("stream_options") or {}
    if not isinstance(opts, dict) or not isinstance(opts.get("include_usage", False), bool):
        raise bad_param("stream_options", f"stream_options must be {{\"include_usage\": bool}}; got {_shown(opts)}")
    context_id = body.get("context_id")
    if context_id is not None and (not isinstance(context_id, str) or not context_id):
        raise bad_param("context_id", "context_id must be the id of a stored context (a string); "
                                      f"got {_shown(context_id)}")
    return ChatRequest(model, tuple(messages), SamplingParams(temperature, top_p, seed), max_tokens, stops, stream,
                       bool(opts.get("include_usage", False)), context_id)


def parse_context(body: Any, limits: Limits | None = None) -> ContextRequest:
    """Check a ``POST /v1/contexts`` body: ``document`` (text), at most one of ``method`` /
    ``preset`` / ``plan`` (default: ``method`` :data:`DEFAULT_METHOD`), and ``max_tokens`` /
    ``keep`` as ``kvcache compress --max-tokens / --keep``. A method's grammar and a plan's
    content are checked against the model before the job is queued; ``limits`` (default
    :class:`~kv_cache.integrations.serve.limits.Limits`) bound the document's characters."""
    limits = limits or Limits()
    body = _require_object(body)
    doc = body.get("document")
    if not isinstance(doc, str):
        raise ApiError("invalid_document", f"document must be a string of text; got {type(doc).__name__}",
                       param="document")
    if not doc.strip():
        raise ApiError("invalid_document", "document is empty" + (f" ({len(doc)} whitespace characters)" if doc
                                                                  else ""), param="document")
    if len(doc) > limits.max_document_chars:
        raise _too_long("document", len(doc), limits.max_document_chars, "document")
    nul = doc.find("\x00")
    if nul >= 0:
        raise ApiError("invalid_document", f"document holds a NUL character at offset {nul}: binary data, not text",
                       param="document")
    method, preset, plan = body.get("method"), body.get("preset"), body.get("plan")
    given = [k for k, v in (("method", method), ("preset", preset), ("plan", plan)) if v is not None]
    if len(given) > 1:
        raise ApiError("invalid_method", f"give one of method, preset or plan; got {' and '.join(given)}",
                       param=given[1])
    if method is None and preset is None and plan is None:
        method = DEFAULT_METHOD
    if method is not None and (not isinstance(method, str) or not method.strip()):
        raise ApiError("invalid_method", f"method must be a method spec string (e.g. {DEFAULT_METHOD!r}); "
                                         f"got {_shown(method)}", param="method")
    if preset is not None:
        from ...plan import PRESETS, parse_target

        try:
            preset = f"{parse_target(preset):g}x"
        except ValueError as exc:
            raise ApiError("invalid_method", f"preset: {exc} (presets: {list(PRESETS)})", param="preset") from None
    if plan is not None and not isinstance(plan, dict):
        raise ApiError("invalid_method", "plan must be the JSON object `kvcache plan` writes (a kv_cache.cache_plan); "
                                         f"got {type(plan).__name__}", param="plan")
    if plan is not None:
        ServedFiles.check_plan_object(plan)
    max_tokens = _int(body, "max_tokens", 1)
    keep = body.get("keep")
    if keep is not None and keep not in KEEP:
        raise bad_param("keep", f"keep must be one of {list(KEEP)}; got {_shown(keep)}")
    if keep is not None and max_tokens is None:
        raise bad_param("keep", "keep says which tokens max_tokens keeps; give max_tokens as well")
    return ContextRequest(doc, method.strip() if method is not None else None, preset, plan, max_tokens, keep)
