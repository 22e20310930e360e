"""The FastAPI application of ``kvcache serve``: OpenAI's chat endpoints and compressed contexts.

Routes (all under ``/v1``, behind ``Authorization: Bearer <api key>`` when the server has one):

* ``GET /v1/models``: the one model served;
* ``POST /v1/chat/completions``: OpenAI's chat completion, non-streaming or streaming
  (server-sent events in OpenAI's ``chat.completion.chunk`` format, ending with
  ``data: [DONE]``), with ``max_tokens``, ``temperature``, ``top_p``, ``stop``, ``seed`` and
  usage counts; ``context_id`` (``extra_body`` in the ``openai`` client) starts from a stored
  compressed context;
* ``POST /v1/contexts`` compresses a document and stores it; ``GET /v1/contexts`` lists,
  ``GET /v1/contexts/{id}`` describes, ``DELETE /v1/contexts/{id}`` removes one.

``GET /health`` answers ``{"status": "ok"}`` without a key. Every error is OpenAI's JSON body
with the status of its case (:mod:`kv_cache.serve.errors`); an unexpected failure is logged with
its traceback and answered 500, and the server keeps serving.
"""

from __future__ import annotations

import asyncio
import hmac
import json
import logging
import secrets
import time
from typing import Any, AsyncIterator

from fastapi import FastAPI, Request
from fastapi.responses import JSONResponse, Response, StreamingResponse
from starlette.exceptions import HTTPException as StarletteHTTPException

from .engine import Engine, Job
from .errors import ApiError
from .requests import parse_chat, parse_context
from .service import Service
from .store import ContextCorrupted, ContextNotFound

log = logging.getLogger(__name__)


def _error_response(exc: ApiError) -> JSONResponse:
    return JSONResponse(exc.body(), status_code=exc.status, headers=exc.headers)


async def _json(request: Request) -> Any:
    raw = await request.body()
    try:
        return json.loads(raw or b"null")
    except (json.JSONDecodeError, UnicodeDecodeError) as exc:
        raise ApiError("invalid_json", f"the request body is not JSON: {exc}") from None


async def _next_event(job: Job) -> tuple[str, Any]:
    """The job's next event, or ``request_timeout`` at its deadline (the job is then cancelled)."""
    try:
        return await asyncio.wait_for(job.events.get(), timeout=max(job.deadline - time.monotonic(), 0.0))
    except asyncio.TimeoutError:
        job.cancel()
        raise ApiError("request_timeout", "the request ran past the server's per-request timeout "
                                          "(kvcache serve --request-timeout)") from None


async def _result(job: Job) -> Any:
    while True:
        kind, payload = await _next_event(job)
        if kind == "done":
            return payload
        if kind == "error":
            raise payload


def create_app(service: Service, engine: Engine, *, api_key: str | None = None) -> FastAPI:
    """The application over ``service`` (model, tokenizer, store) and ``engine`` (the worker).

    The engine's worker is started and stopped with the application (its lifespan)."""
    from contextlib import asynccontextmanager

    @asynccontextmanager
    async def lifespan(_app: FastAPI):
        engine.start()
        try:
            yield
        finally:
            engine.stop()

    app = FastAPI(title="kv_cache", summary="OpenAI-compatible chat over compressed KV-cache contexts",
                  lifespan=lifespan)
    created = int(time.time())

    @app.exception_handler(ApiError)
    async def _api_error(_request: Request, exc: ApiError) -> JSONResponse:
        return _error_response(exc)

    @app.exception_handler(StarletteHTTPException)
    async def _http_error(_request: Request, exc: StarletteHTTPException) -> JSONResponse:
        code = {404: "not_found", 405: "method_not_allowed"}.get(exc.status_code, "invalid_parameter")
        return JSONResponse(ApiError(code, str(exc.detail)).body(), status_code=exc.status_code)

    @app.exception_handler(Exception)
    async def _unexpected(_request: Request, exc: Exception) -> JSONResponse:
        log.error("request failed", exc_info=exc)
        return _error_response(ApiError("server_error", f"the server failed on this request: "
                                                        f"{type(exc).__name__}: {exc}"))

    @app.middleware("http")
    async def _auth(request: Request, call_next):
        if api_key is not None and request.url.path.startswith("/v1"):
            header = request.headers.get("authorization", "")
            scheme, _, given = header.partition(" ")
            if scheme.lower() != "bearer" or not hmac.compare_digest(given.strip().encode(), api_key.encode()):
                what = "no API key" if not header else "an incorrect API key"
                return _error_response(ApiError("invalid_api_key", f"{what} was provided: send the server's key as "
                                                                   "'Authorization: Bearer <key>'"))
        return await call_next(request)

    @app.get("/health")
    async def health() -> dict[str, Any]:
        return {"status": "ok", "waiting": engine.waiting}

    @app.get("/v1/models")
    async def models() -> dict[str, Any]:
        return {"object": "list", "data": [{"id": service.model_id, "object": "model", "created": created,
                                            "owned_by": "kv_cache"}]}

    # --------------------------------------------------------------------- contexts
    @app.post("/v1/contexts")
    async def create_context(request: Request) -> JSONResponse:
        req = parse_context(await _json(request))
        job = engine.submit(lambda j: service.compress(req, j), asyncio.get_running_loop())
        return JSONResponse(await _result(job), status_code=201)

    @app.get("/v1/contexts")
    async def list_contexts() -> dict[str, Any]:
        return {"object": "list", "data": service.store.list()}

    def _lookup(cid: str) -> dict[str, Any]:
        try:
            return service.store.describe(cid)
        except ContextNotFound:
            raise ApiError("context_not_found", f"no context with id {cid!r} (GET /v1/contexts lists them)") from None
        except ContextCorrupted as exc:
            raise ApiError("context_corrupted", f"the stored context {cid!r} fails its checks: {exc}; delete it "
                                                "and compress the document again") from None

    @app.get("/v1/contexts/{cid}")
    async def get_context(cid: str) -> dict[str, Any]:
        return _lookup(cid)

    @app.delete("/v1/contexts/{cid}")
    async def delete_context(cid: str) -> dict[str, Any]:
        try:
            service.store.delete(cid)
        except ContextNotFound:
            raise ApiError("context_not_found", f"no context with id {cid!r} (GET /v1/contexts lists them)") from None
        return {"id": cid, "object": "context.deleted", "deleted": True}

    # --------------------------------------------------------------------- chat
    @app.post("/v1/chat/completions")
    async def chat(request: Request) -> Response:
        req = parse_chat(await _json(request), service.model_id)
        job = engine.submit(lambda j: service.chat(req, j), asyncio.get_running_loop())
        cid, now = "chatcmpl-" + secrets.token_hex(12), int(time.time())
        if not req.stream:
            result = await _result(job)
            return JSONResponse({
                "id": cid, "object": "chat.completion", "created": now, "model": service.model_id,
                "choices": [{"index": 0, "message": {"role": "assistant", "content": result["text"]},
                             "finish_reason": result["finish_reason"], "logprobs": None}],
                "usage": result["usage"], "context_id": req.context_id})
        try:  # errors before the first token are answered with their status, not inside a stream
            kind, payload = await _next_event(job)
        except BaseException:
            job.cancel()
            raise
        if kind == "error":
            raise payload

        def chunk(delta: dict[str, Any], finish: str | None = None, **extra: Any) -> str:
            body = {"id": cid, "object": "chat.completion.chunk", "created": now, "model": service.model_id,
                    "choices": [{"index": 0, "delta": delta, "finish_reason": finish, "logprobs": None}], **extra}
            return f"data: {json.dumps(body)}\n\n"

        async def events() -> AsyncIterator[str]:
            try:
                yield chunk({"role": "assistant", "content": ""})
                while True:
                    try:
                        kind, payload = await _next_event(job)
                    except ApiError as exc:
                        kind, payload = "error", exc
                    if kind == "delta":
                        yield chunk({"content": payload})
                    elif kind == "done":
                        yield chunk({}, payload["finish_reason"])
                        if req.include_usage:
                            body = {"id": cid, "object": "chat.completion.chunk", "created": now,
                                    "model": service.model_id, "choices": [], "usage": payload["usage"]}
                            yield f"data: {json.dumps(body)}\n\n"
                        break
                    elif kind == "error":  # mid-stream: the status is sent already
                        yield f"data: {json.dumps(payload.body())}\n\n"
                        break
                yield "data: [DONE]\n\n"
            finally:
                job.cancel()  # a client that went away stops the generation

        return StreamingResponse(events(), media_type="text/event-stream",
                                 headers={"Cache-Control": "no-cache"})

    return app
