"""The request bodies of ``kvcache serve`` as pydantic models: the declarative half of validation.

Each model says what a field may hold (its type, its bounds, its length) and why, in its
``description``; FastAPI publishes them in ``/openapi.json`` (each POST route's
``requestBody``), and :func:`validate` checks a parsed body against one, turning pydantic's first
error into the server's :class:`~kv_cache.integrations.serve.errors.ApiError`: 400 with the
field's path as ``param`` (``messages[0].role``) and the field's description as what is allowed.
What a model cannot say (the server's configured limits, the served model's name, the method
grammar) stays in :mod:`kv_cache.integrations.serve.requests`.

Every string a request may send that is *parsed* (a method spec, a preset, an id) has a length
cap here (:data:`MAX_SPEC_CHARS`, :data:`MAX_PRESET_CHARS`, :data:`MAX_ID_CHARS`), so no grammar
ever reads more than a few hundred characters; texts (a document, messages, stop strings) are
bounded by the server's :class:`~kv_cache.integrations.serve.limits.Limits`. Fields OpenAI defines
that this server does not implement are accepted only with the value that asks for nothing.
Unknown fields are ignored, as OpenAI's clients send some (``user``, ``metadata``).

All models are strict: ``true`` is not a number, ``2.0`` is not an integer, ``"1"`` is not a
number, and numbers are finite.
"""

from __future__ import annotations

from typing import Annotated, Any, Literal, Optional, Union

from pydantic import BaseModel, ConfigDict, Field, ValidationError

from ...generation import MAX_TEMPERATURE
from .errors import ApiError

ROLES = ("system", "developer", "user", "assistant")
MAX_STOPS = 4  # as OpenAI
MAX_SPEC_CHARS = 256
"""Characters of a ``method`` spec (the longest documented spec is under 40)."""
MAX_PRESET_CHARS = 32
"""Characters of a ``preset`` (``"16x"``)."""
MAX_ID_CHARS = 128
"""Characters of an id or a name a request sends (``model``, ``context_id``; a context id is 28)."""
MAX_MESSAGES = 4096
"""Messages of one chat request (checked before any message is validated)."""

_STRICT = ConfigDict(strict=True, extra="ignore")
NonEmpty = Annotated[str, Field(min_length=1)]


class TextPart(BaseModel):
    model_config = _STRICT
    type: Literal["text"] = Field(description='"text" (this server reads text only)')
    text: str = Field(description="the part's text")


class ChatMessage(BaseModel):
    model_config = _STRICT
    role: Literal[ROLES] = Field(description=f"one of {list(ROLES)}")
    content: Union[str, list[TextPart]] = Field(
        description='a string or a list of text parts {"type": "text", "text": str} (this server reads text only)')


class StreamOptions(BaseModel):
    model_config = _STRICT
    include_usage: bool = Field(False, description="send the usage counts in a last chunk")


class ResponseFormat(BaseModel):
    model_config = _STRICT
    type: Literal["text"] = Field(description='"text" (the only format this server writes)')


class ChatCompletionRequest(BaseModel):
    """``POST /v1/chat/completions``: OpenAI's chat completion, plus ``context_id``."""

    model_config = _STRICT
    model: str = Field(min_length=1, max_length=MAX_ID_CHARS,
                       description="the served model's name (GET /v1/models), a non-empty string")
    messages: list[ChatMessage] = Field(min_length=1, max_length=MAX_MESSAGES,
                                        description=f"a non-empty list of at most {MAX_MESSAGES:,} {{role, content}}")
    max_tokens: Optional[int] = Field(None, ge=1, description="an integer >= 1 (at most the server's --max-tokens)")
    max_completion_tokens: Optional[int] = Field(None, ge=1, description="an integer >= 1 (as max_tokens)")
    temperature: Optional[float] = Field(None, ge=0.0, le=MAX_TEMPERATURE, allow_inf_nan=False,
                                         description=f"a number in [0, {MAX_TEMPERATURE:g}]")
    top_p: Optional[float] = Field(None, gt=0.0, le=1.0, allow_inf_nan=False, description="a number in (0, 1]")
    seed: Optional[int] = Field(None, description="an integer")
    stop: Optional[Union[NonEmpty, Annotated[list[NonEmpty], Field(max_length=MAX_STOPS)]]] = Field(
        None, description=f"a non-empty string or a list of at most {MAX_STOPS} non-empty strings "
                          "(each at most the server's --max-stop-chars)")
    stream: Optional[bool] = Field(None, description="true or false")
    stream_options: Optional[StreamOptions] = Field(None, description='{"include_usage": bool}')
    n: Optional[int] = Field(None, ge=1, le=1, description="1 (one answer per request)")
    context_id: Optional[str] = Field(None, min_length=1, max_length=MAX_ID_CHARS,
                                      description="the id of a stored context of this key (POST /v1/contexts)")
    # OpenAI's fields this server does not implement: only the value that asks for nothing
    frequency_penalty: Optional[float] = Field(None, ge=0, le=0, description="not supported: omitted or 0")
    presence_penalty: Optional[float] = Field(None, ge=0, le=0, description="not supported: omitted or 0")
    logit_bias: Optional[dict[str, Any]] = Field(None, max_length=0, description="not supported: omitted or {}")
    logprobs: Optional[Literal[False]] = Field(None, description="not supported: omitted or false")
    top_logprobs: Optional[int] = Field(None, ge=0, le=0, description="not supported: omitted or 0")
    tools: Optional[list[Any]] = Field(None, max_length=0, description="not supported: omitted or []")
    functions: Optional[list[Any]] = Field(None, max_length=0, description="not supported: omitted or []")
    tool_choice: Optional[Literal["none"]] = Field(None, description='not supported: omitted or "none"')
    function_call: Optional[Literal["none"]] = Field(None, description='not supported: omitted or "none"')
    response_format: Optional[ResponseFormat] = Field(None, description='not supported: omitted or {"type": "text"}')


class ContextCreateRequest(BaseModel):
    """``POST /v1/contexts``: a document and how to compress it (one of method, preset, plan)."""

    model_config = _STRICT
    document: str = Field(description="the text to compress (at most the server's --max-document-chars)")
    method: Optional[str] = Field(None, min_length=1, max_length=MAX_SPEC_CHARS,
                                  description=f"a method spec of `kvcache eval` (e.g. 'kvzip@0.3'), at most "
                                              f"{MAX_SPEC_CHARS} characters")
    preset: Optional[Union[Annotated[str, Field(max_length=MAX_PRESET_CHARS)], float]] = Field(
        None, description="a ratio vs fp16: '4x', '8x', '16x' or any '<ratio>x' > 1 (or the number)")
    plan: Optional[dict[str, Any]] = Field(None, description="the JSON object `kvcache plan` writes "
                                                             "(a kv_cache.cache_plan)")
    max_tokens: Optional[int] = Field(None, ge=1, description="an integer >= 1: keep at most this many tokens")
    keep: Optional[Literal["head", "tail"]] = Field(None, description="'head' or 'tail': which tokens max_tokens "
                                                                      "keeps")


ERROR_CODES = {"document": "invalid_document", "method": "invalid_method", "preset": "invalid_method",
               "plan": "invalid_method"}
"""The error code of a bad value of these fields (every other field: ``invalid_parameter``)."""

_TYPE_TAGS = {"str", "int", "float", "bool", "list", "dict", "none"}


def shown(v: Any, width: int = 80) -> str:
    """``repr(v)``, cut to ``width`` characters: an error echoes what it received, never a body."""
    r = repr(v)
    return r if len(r) <= width else r[:width - 3] + "..."


def _field_path(model: type[BaseModel], loc: tuple[Any, ...]) -> tuple[str, str | None, str]:
    """``(param, description, top-level field)`` of a pydantic error location: list indices as
    ``[i]``, cut at a union member's tag (``str``, ``list[TextPart]``: the union field is what is
    wrong), the description of the deepest field named."""
    param, about, top = "", None, ""
    current: Any = model
    for part in loc:
        if isinstance(part, int):
            param += f"[{part}]"
            continue
        fields = getattr(current, "model_fields", {}) if isinstance(current, type) else {}
        if part in fields:
            info = fields[part]
            param = f"{param}.{part}" if param else part
            top = top or part
            about = info.description
            current = _model_of(info.annotation)
        elif part in _TYPE_TAGS or "[" in str(part) or "-" in str(part):
            break  # a union member's tag: the error is the union field's (what it may be is its description)
        else:
            param = f"{param}.{part}" if param else str(part)
    return param, about, top


def _model_of(annotation: Any) -> Any:
    """The pydantic model inside ``Optional[...]`` / ``list[...]`` / ``Union[...]``, if any."""
    if isinstance(annotation, type) and issubclass(annotation, BaseModel):
        return annotation
    for arg in getattr(annotation, "__args__", ()) or ():
        found = _model_of(arg)
        if found is not None:
            return found
    return None


def validate(model: type[BaseModel], body: Any) -> BaseModel:
    """``body`` (a parsed JSON object) as ``model``; :class:`ApiError` 400 for the first bad field,
    naming it (``param``), what it must be (its description) and what was received."""
    if not isinstance(body, dict):
        raise ApiError("invalid_json", f"the request body must be a JSON object; got {type(body).__name__}")
    for name, info in model.model_fields.items():  # a list's length first: before validating every item
        cap = next((m.max_length for m in info.metadata if isinstance(getattr(m, "max_length", None), int)), None)
        v = body.get(name)
        if cap is not None and isinstance(v, list) and len(v) > cap:
            raise ApiError(ERROR_CODES.get(name, "invalid_parameter"), f"{name} must be {info.description}; got a "
                                                                       f"list of {len(v):,}", param=name)
    try:
        return model.model_validate(body)
    except ValidationError as exc:
        err = exc.errors(include_url=False)[0]
        param, about, top = _field_path(model, tuple(err["loc"]))
        code = ERROR_CODES.get(top, "invalid_parameter")
        if err["type"] == "missing":
            raise ApiError(code, f"{param} is required: {about or err['msg']}", param=param) from None
        got = type(err["input"]).__name__ if top == "document" else shown(err["input"])
        raise ApiError(code, f"{param} must be {about or err['msg'].lower()}; got {got}", param=param) from None
