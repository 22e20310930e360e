"""OpenAI-style errors of ``kvcache serve``: one exception type, one JSON body, one table of cases.

Every error the server answers is ``{"error": {"message", "type", "code", "param"}}`` with the
status of its case (:data:`ERROR_CASES`). The codes are the ones OpenAI uses where a case is
theirs (``invalid_api_key``, ``model_not_found``, ``context_length_exceeded``) and ours for the
compressed contexts.

Why 422 for a stored context that fails its checks: the request is well formed and the server
is healthy, but the resource it names cannot be used as it is (a truncated or corrupted file, or
one made for another model). It is not 409 or 5xx because the ``openai`` client retries those by
default, and no retry can help; the client can ``DELETE`` the context and compress it again.
Why 429 for a full store (``storage_quota_exceeded``): as OpenAI's ``insufficient_quota``, the
client has used what it is allowed; deleting contexts frees room. The store never evicts a
client's context to make room for another.

**What a client never sees.** No message names a file on the server, an exception class or a
traceback: unexpected failures are answered with a generic message and an incident id (the log
has the rest), and every message goes through :func:`redact`, which replaces the server's own
paths (the store, the model, the registered files) and anything shaped like an absolute path by
``<path>``.
"""

from __future__ import annotations

import os
import re
from typing import Any, Iterable, NamedTuple


class ErrorCase(NamedTuple):
    status: int
    type: str


ERROR_CASES: dict[str, ErrorCase] = {
    "invalid_parameter": ErrorCase(400, "invalid_request_error"),  # a bad value of a known field
    "invalid_json": ErrorCase(400, "invalid_request_error"),  # the body is not a JSON object
    "invalid_method": ErrorCase(400, "invalid_request_error"),  # an unknown method spec, preset or plan
    "invalid_document": ErrorCase(400, "invalid_request_error"),  # not text: not a str, empty, NUL characters
    "json_too_deep": ErrorCase(400, "invalid_request_error"),  # nested past --max-json-depth
    "text_too_long": ErrorCase(400, "invalid_request_error"),  # past --max-document-chars (document or messages)
    "document_too_long": ErrorCase(400, "invalid_request_error"),  # past --max-document-tokens or the positions
    "context_length_exceeded": ErrorCase(400, "invalid_request_error"),  # question + answer past the positions
    "invalid_api_key": ErrorCase(401, "authentication_error"),
    "forbidden_origin": ErrorCase(403, "permission_error"),  # no key: a browser page of another origin
    "request_body_timeout": ErrorCase(408, "invalid_request_error"),  # the body not sent within --body-timeout
    "context_not_found": ErrorCase(404, "not_found_error"),
    "model_not_found": ErrorCase(404, "not_found_error"),
    "not_found": ErrorCase(404, "not_found_error"),  # an unknown path
    "method_not_allowed": ErrorCase(405, "invalid_request_error"),
    "payload_too_large": ErrorCase(413, "invalid_request_error"),  # a body past --max-body-bytes
    "unsupported_media_type": ErrorCase(415, "invalid_request_error"),  # a POST body not application/json
    "misdirected_request": ErrorCase(421, "invalid_request_error"),  # no key: a Host that is not loopback
    "context_corrupted": ErrorCase(422, "invalid_request_error"),  # a stored file failing its checks
    "storage_quota_exceeded": ErrorCase(429, "insufficient_quota"),  # --max-contexts / --max-store-bytes
    "rate_limit_exceeded": ErrorCase(429, "rate_limit_error"),  # --max-queued-per-key, with Retry-After
    "server_error": ErrorCase(500, "server_error"),
    "queue_full": ErrorCase(503, "overloaded_error"),  # with Retry-After
    "body_memory_full": ErrorCase(503, "overloaded_error"),  # --max-body-memory, with Retry-After
    "shutting_down": ErrorCase(503, "overloaded_error"),  # SIGTERM: in flight or queued when the server stops
    "request_timeout": ErrorCase(504, "timeout_error"),  # past --request-timeout
    "client_closed_request": ErrorCase(499, "invalid_request_error"),  # the client left (logged; nobody reads it)
}


class ApiError(Exception):
    """An error answered to the client: ``code`` is a key of :data:`ERROR_CASES` (its status and
    type), ``message`` says what was wrong and what is allowed, ``param`` names the field."""

    def __init__(self, code: str, message: str, *, param: str | None = None, headers: dict[str, str] | None = None):
        if code not in ERROR_CASES:
            raise ValueError(f"code must be one of {sorted(ERROR_CASES)}; got {code!r}")
        super().__init__(message)
        self.code, self.message, self.param = code, message, param
        self.headers = headers or {}

    @property
    def status(self) -> int:
        return ERROR_CASES[self.code].status

    def body(self) -> dict[str, Any]:
        return {"error": {"message": self.message, "type": ERROR_CASES[self.code].type, "code": self.code,
                          "param": self.param}}


def bad_param(param: str, message: str) -> ApiError:
    return ApiError("invalid_parameter", message, param=param)


_ABSOLUTE = re.compile(r"(?<![\w.~/-])(?:~|/(?!v1/|health\b))(?:[^\s'\"\]\[(),;:/]*/)*[^\s'\"\]\[(),;:/]*")


def redact(text: str, paths: Iterable[str | os.PathLike] = ()) -> str:
    """``text`` without server paths: each of ``paths`` (longest first) and anything shaped like an
    absolute path (``/a/b``, ``~/x``; the server's own routes ``/v1/...`` kept) become ``<path>``."""
    for p in sorted({os.fspath(p) for p in paths if p}, key=len, reverse=True):
        if len(p) > 1:
            text = re.sub(re.escape(p) + r"[^\s'\"\]\[(),;:]*", "<path>", text)
    return _ABSOLUTE.sub(lambda m: "<path>" if len(m.group(0)) > 1 else m.group(0), text)
