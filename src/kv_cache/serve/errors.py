"""OpenAI-style errors of ``kvcache serve``: one exception type, one JSON body, one table of cases.

Every error the server answers is ``{"error": {"message", "type", "code", "param"}}`` with the
status of its case (:data:`ERROR_CASES`). The codes are the ones OpenAI uses where a case is
theirs (``invalid_api_key``, ``model_not_found``, ``context_length_exceeded``) and ours for the
compressed contexts.

Why 422 for a stored context that fails its checks: the request is well formed and the server
is healthy, but the resource it names cannot be used as it is (a truncated or corrupted file, or
one made for another model). It is not 409 or 5xx because the ``openai`` client retries those by
default, and no retry can help; the client can ``DELETE`` the context and compress it again.
"""

from __future__ import annotations

from typing import Any, NamedTuple


class ErrorCase(NamedTuple):
    status: int
    type: str


ERROR_CASES: dict[str, ErrorCase] = {
    "invalid_parameter": ErrorCase(400, "invalid_request_error"),  # a bad value of a known field
    "invalid_json": ErrorCase(400, "invalid_request_error"),  # the body is not a JSON object
    "invalid_method": ErrorCase(400, "invalid_request_error"),  # an unknown method spec, preset or plan
    "invalid_document": ErrorCase(400, "invalid_request_error"),  # not text: not a str, empty, NUL characters
    "document_too_long": ErrorCase(400, "invalid_request_error"),  # past --max-document-tokens or the positions
    "context_length_exceeded": ErrorCase(400, "invalid_request_error"),  # question + answer past the positions
    "invalid_api_key": ErrorCase(401, "authentication_error"),
    "context_not_found": ErrorCase(404, "not_found_error"),
    "model_not_found": ErrorCase(404, "not_found_error"),
    "not_found": ErrorCase(404, "not_found_error"),  # an unknown path
    "method_not_allowed": ErrorCase(405, "invalid_request_error"),
    "context_corrupted": ErrorCase(422, "invalid_request_error"),  # a stored file failing its checks
    "server_error": ErrorCase(500, "server_error"),
    "queue_full": ErrorCase(503, "overloaded_error"),  # with Retry-After
    "request_timeout": ErrorCase(504, "timeout_error"),  # past --request-timeout
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
