"""The FastAPI application of ``kvcache serve``: OpenAI's chat endpoints and compressed contexts.

Routes (every one but ``GET /health`` behind ``Authorization: Bearer <api key>`` when the server
has keys, ``/docs`` and ``/openapi.json`` included; :mod:`kv_cache.integrations.serve.auth`):

* ``GET /v1/models``: the one model served;
* ``POST /v1/chat/completions``: OpenAI's chat completion, non-streaming or streaming
  (server-sent events in OpenAI's ``chat.completion.chunk`` format, ending with
  ``data: [DONE]``), with ``max_tokens``, ``temperature``, ``top_p``, ``stop``, ``seed`` and
  usage counts; ``context_id`` (``extra_body`` in the ``openai`` client) starts from a stored
  compressed context of the same key;
* ``POST /v1/contexts`` compresses a document and stores it for the key; ``GET /v1/contexts``
  lists the key's contexts, ``GET /v1/contexts/{id}`` describes, ``DELETE /v1/contexts/{id}``
  removes one (another key's context answers 404, as a missing one).

Concurrent chats are decoded together, up to ``--max-batch`` at once: chats without a stored
context (:mod:`kv_cache.integrations.serve.batch`) and chats on stored contexts, the same or different ones
(:mod:`kv_cache.integrations.serve.batch_context`).

Open routes (no key): ``GET /health`` answers ``{"status": "ok"}``, or 503 ``{"status":
"draining"}`` once SIGTERM began the shutdown (a load balancer stops sending); ``GET /version``
the package's version and the model served (torch's, transformers' and Python's versions too for
a request with a valid key, or on a server without keys). ``GET /metrics`` (behind a key when the
server has keys) answers Prometheus' text format (:mod:`kv_cache.integrations.serve.metrics`;
every label from a closed set; a key sees its own stored bytes, an admin key every tenant's), and
every request writes one JSON line to the access log and carries an ``X-Request-Id``.

Before any body is read: with no key configured, a request whose ``Host`` is not loopback (or
named by ``--allowed-host``) is answered 421 and a browser's cross-origin request (an ``Origin``
that is not loopback) 403, so that a web page the user visits can neither post to the server nor
read it through DNS rebinding; a POST whose ``Content-Type`` is not ``application/json`` is
answered 415. A POST that does work is then admitted (its place in the queue, or 503 with
``Retry-After``) before a byte of its body is read; the body is read up to ``--max-body-bytes``
within ``--body-timeout`` seconds, its bytes taken from the server-wide budget of bodies in flight
(``--max-body-memory``), and its depth checked in one linear pass before it is parsed
(:mod:`kv_cache.integrations.serve.limits`), checked against its schema
(:mod:`kv_cache.integrations.serve.schemas`, published in ``/openapi.json``), tokenized outside
the model lock, in a thread of its own, and only then queued for the worker. The request's
deadline (``--request-timeout``) runs from its first byte: reading, tokenizing, queueing and
generating all count. A client that disconnects cancels its work, streaming or not: a queued job
leaves the queue, a running one stops at its next decoding step. Every error is OpenAI's JSON body
with the status of its case (:mod:`kv_cache.integrations.serve.errors`), its message free of server paths; an
unexpected failure is logged with its traceback and answered 500 with an incident id, and the
server keeps serving.
"""

from __future__ import annotations

import asyncio
import functools
import json
import logging
import secrets
import time
from concurrent.futures import ThreadPoolExecutor
from typing import Any, AsyncIterator, Iterable

from fastapi import FastAPI, Request
from fastapi.responses import JSONResponse, Response, StreamingResponse
from starlette.datastructures import Headers
from starlette.exceptions import HTTPException as StarletteHTTPException

from .auth import ApiKeys, host_allowed, origin_allowed
from .batch import chat_batch
from .batch_context import context_batch
from .engine import Engine, Job, internal_error
from .errors import ApiError, redact
from .limits import BodyBudget, parse_json, read_body
from .metrics import REFUSALS, AccessLog, ServerMetrics
from .requests import parse_chat, parse_context
from .schemas import ChatCompletionRequest, ContextCreateRequest
from .service import Service, _store_error
from .store import ContextCorrupted, ContextNotFound

log = logging.getLogger(__name__)

OPEN_PATHS = ("/health", "/version")
"""The routes that answer without a key."""
JSON_TYPES = ("application/json",)
"""The ``Content-Type`` a POST body must have (parameters such as ``charset=utf-8`` allowed)."""


BODY_MODELS = (ChatCompletionRequest, ContextCreateRequest)
"""The request bodies the routes read themselves (published in ``/openapi.json``)."""


def _body_schema(model: type) -> dict[str, Any]:
    """``openapi_extra`` of a route that reads its body itself: a reference to ``model``'s schema
    (added to the document's components by :func:`_body_components`)."""
    return {"requestBody": {"required": True, "content": {"application/json": {
        "schema": {"$ref": f"#/components/schemas/{model.__name__}"}}}}}


def _body_components() -> dict[str, Any]:
    """The schemas of :data:`BODY_MODELS` and of the models they nest, by name, their references
    pointing into the document's ``components``."""
    out: dict[str, Any] = {}
    for model in BODY_MODELS:
        schema = model.model_json_schema(ref_template="#/components/schemas/{model}")
        out.update(schema.pop("$defs", {}))
        out[model.__name__] = schema
    return out


async def _next_event(job: Job, engine: Engine, state: Any = None) -> tuple[str, Any]:
    """The job's next event, or ``request_timeout`` at its deadline (the job is then cancelled:
    out of ``engine``'s queue, or stopped at its next check). ``state`` (a request's): the time of
    the first ``start`` / ``delta`` event is recorded there."""
    try:
        event = await asyncio.wait_for(job.events.get(), timeout=max(job.deadline - time.monotonic(), 0.0))
    except asyncio.TimeoutError:
        engine.cancel(job)
        raise ApiError("request_timeout", "the request ran past the server's per-request timeout "
                                          "(kvcache serve --request-timeout)") from None
    if state is not None and event[0] in ("start", "delta") and getattr(state, "first_token", None) is None:
        state.first_token = time.monotonic()
    return event


async def _result(job: Job, engine: Engine, state: Any = None) -> Any:
    while True:
        kind, payload = await _next_event(job, engine, state)
        if kind == "done":
            return payload
        if kind == "error":
            raise payload


async def _disconnected(request: Request) -> None:
    """Returns once the client of ``request`` (its body read already) has gone away."""
    while True:
        message = await request.receive()
        if message["type"] == "http.disconnect":
            return


async def _answer(job: Job, request: Request, engine: Engine, state: Any = None) -> Any:
    """:func:`_result`, or, once the client disconnects, the job cancelled (out of the queue at
    once, or stopped at its next check) and ``client_closed_request`` raised (nobody reads it)."""
    result = asyncio.ensure_future(_result(job, engine, state))
    gone = asyncio.ensure_future(_disconnected(request))
    try:
        await asyncio.wait({result, gone}, return_when=asyncio.FIRST_COMPLETED)
        if result.done():
            return result.result()
        why = ApiError("client_closed_request", "the client disconnected before the answer")
        engine.cancel(job, why)
        raise why
    finally:
        for task in (result, gone):
            if not task.done():
                task.cancel()


def create_app(service: Service, engine: Engine, *, api_key: str | None = None, api_keys: Iterable[str] = (),
               shutdown_timeout: float = 10.0, allowed_hosts: Iterable[str] = (),
               admin_keys: Iterable[str] = ()) -> FastAPI:
    """The application over ``service`` (model, tokenizer, store, limits) and ``engine`` (the worker).

    ``api_key`` and ``api_keys``: the keys (none: no authentication); ``admin_keys``: keys that
    also read every tenant's figures on ``/metrics``. ``allowed_hosts``: with no
    key, the ``Host`` / ``Origin`` names answered besides loopback ones (``"*"``: any; the CLI's
    ``--insecure`` gives that). The engine's worker and the tokenizer thread are started and
    stopped with the application (its lifespan); at the end the store is closed after any write
    in progress (at most ``shutdown_timeout`` seconds)."""
    from contextlib import asynccontextmanager

    keys = ApiKeys([*([api_key] if api_key is not None else []), *api_keys], salt=service.store.owner_salt,
                   admin=admin_keys)
    allowed_hosts = tuple(allowed_hosts)
    limits = service.limits
    bodies = BodyBudget(limits.body_budget, engine.retry_after)  # memory of request bodies in flight, server-wide
    hidden = [str(service.store.directory.resolve()), *service.files.paths]
    name_or_path = getattr(getattr(service.model, "config", None), "_name_or_path", None)
    if isinstance(name_or_path, str) and name_or_path != service.model_id:
        hidden.append(name_or_path)
    pool = ThreadPoolExecutor(max_workers=1, thread_name_prefix="kv_cache-serve-tokenize")
    # the depth scan, the JSON parse and the schema check of a body (up to --max-body-bytes): off the
    # event loop, so /health and streams keep answering while an 8 MiB body is checked
    parsers = ThreadPoolExecutor(max_workers=2, thread_name_prefix="kv_cache-serve-parse")

    def error_response(exc: ApiError) -> JSONResponse:
        body = exc.body()
        body["error"]["message"] = redact(body["error"]["message"], hidden)
        return JSONResponse(body, status_code=exc.status, headers=exc.headers)

    @asynccontextmanager
    async def lifespan(_app: FastAPI):
        engine.start()
        try:
            yield
        finally:  # within about shutdown_timeout: jobs cancelled, a write in progress finished, no new one
            # the running job was answered and cancelled (a compression stops before its write):
            # wait briefly for the worker, fully for a write in progress
            engine.stop(min(shutdown_timeout, 2.0))
            if not service.store.close(shutdown_timeout):
                log.error("a context was still being written at shutdown; its temporary file is removed at the "
                          "next start")
            pool.shutdown(wait=False, cancel_futures=True)
            parsers.shutdown(wait=False, cancel_futures=True)

    app = FastAPI(title="kv_cache", summary="OpenAI-compatible chat over compressed KV-cache contexts",
                  lifespan=lifespan, version=_version())
    app.state.bodies = bodies
    created = int(time.time())

    @app.exception_handler(ApiError)
    async def _api_error(_request: Request, exc: ApiError) -> JSONResponse:
        return error_response(exc)

    @app.exception_handler(StarletteHTTPException)
    async def _http_error(_request: Request, exc: StarletteHTTPException) -> JSONResponse:
        code = {404: "not_found", 405: "method_not_allowed"}.get(exc.status_code, "invalid_parameter")
        return error_response(ApiError(code, str(exc.detail)))

    @app.exception_handler(Exception)
    async def _unexpected(_request: Request, exc: Exception) -> JSONResponse:
        try:
            raise exc
        except Exception:
            return error_response(internal_error())

    def guard(scope: dict) -> ApiError | None:
        """Host and Origin (no key), the key, the Content-Type: checked before any body is read;
        the request's owner goes to its state."""
        headers = Headers(scope=scope)
        state = scope.setdefault("state", {})
        if not keys.enabled:
            if not host_allowed(headers.get("host"), allowed_hosts):
                return ApiError("misdirected_request", "this server has no API key, so it answers only requests "
                                                       "addressed to a loopback host (localhost, 127.0.0.1, [::1]); "
                                                       "give it keys, or name the host with kvcache serve "
                                                       "--allowed-host")
            if not origin_allowed(headers.get("origin"), allowed_hosts):
                return ApiError("forbidden_origin", "this server has no API key and does not answer pages of other "
                                                    "origins (a browser's cross-origin request); give it keys, or "
                                                    "name the origin's host with kvcache serve --allowed-host")
        if scope["path"] not in OPEN_PATHS:
            try:
                state["owner"] = keys.owner(headers.get("authorization"))
            except ApiError as exc:
                return exc
        elif headers.get("authorization") is not None:  # an open route: a valid key may see more (/version)
            try:
                state["owner"], state["authenticated"] = keys.owner(headers.get("authorization")), True
            except ApiError:
                pass
        if scope["method"] == "POST":
            ctype = headers.get("content-type", "").split(";", 1)[0].strip().lower()
            if ctype not in JSON_TYPES:
                return ApiError("unsupported_media_type", "a request body must be JSON sent as 'Content-Type: "
                                f"application/json'; got {ctype[:60]!r}" if ctype else
                                "a request body must be JSON sent as 'Content-Type: application/json'; got no "
                                "Content-Type")
        return None

    def health_answer() -> JSONResponse:
        if engine.stopping:
            return JSONResponse({"status": "draining", "waiting": engine.waiting}, status_code=503,
                                headers={"Retry-After": str(engine.retry_after)})
        return JSONResponse({"status": "ok", "waiting": engine.waiting})

    class Guard:
        """Pure ASGI middleware (no task or stream per request): :func:`guard`'s refusals, and
        ``GET /health`` answered here, before routing, so that it stays cheap under load."""

        def __init__(self, inner: Any):
            self.inner = inner

        async def __call__(self, scope, receive, send):
            if scope["type"] != "http":
                return await self.inner(scope, receive, send)
            refused = guard(scope)
            if refused is not None:
                if refused.code in REFUSALS:  # before the key: counted without a series of its own
                    scope["state"]["refused"] = refused.code
                return await error_response(refused)(scope, receive, send)
            if scope["path"] == "/health" and scope["method"] == "GET":
                return await health_answer()(scope, receive, send)
            return await self.inner(scope, receive, send)

    async def before_deadline(request: Request, future: Any) -> Any:
        """``future``'s result, or ``request_timeout`` (504) at the request's deadline."""
        try:
            return await asyncio.wait_for(future, max(request.state.deadline - time.monotonic(), 0.0))
        except asyncio.TimeoutError:
            raise ApiError("request_timeout", "the request ran past the server's per-request timeout before it was "
                                              "queued (kvcache serve --request-timeout)") from None

    async def checked(request: Request, parse, *args) -> Any:
        """The request's body read (within its limits and the budget of bodies in flight), parsed
        and checked by ``parse`` in a parser thread: ``parse(json_value, *args)``. The body's bytes
        are given back to the budget once it is parsed."""
        with bodies.lease() as lease:
            raw = await read_body(request, limits.max_body_bytes, limits.body_timeout, lease=lease,
                                  deadline=request.state.deadline)
            return await before_deadline(request, asyncio.get_running_loop().run_in_executor(
                parsers, lambda: parse(parse_json(raw, limits.max_json_depth), *args)))

    async def prepare(request: Request, fn, *args) -> Any:
        """``fn(*args)`` in the tokenizer thread: outside the model lock, off the event loop, within
        the request's deadline."""
        return await before_deadline(request, asyncio.get_running_loop().run_in_executor(pool, fn, *args))

    @app.get("/health")
    async def health() -> JSONResponse:  # answered by Guard before routing; here for /openapi.json
        return health_answer()

    @app.get("/version")
    async def version(request: Request) -> dict[str, Any]:
        out = {"version": _version(), "model": service.model_id}
        if not keys.enabled or getattr(request.state, "authenticated", False):  # no key: nothing to fingerprint
            out.update(_library_versions())
        return out

    @app.get("/metrics")
    async def prometheus_metrics(request: Request) -> Response:
        owner = request.state.owner
        body, ctype = metrics.render(owner, everyone=not keys.enabled or keys.is_admin(owner))
        return Response(body, media_type=ctype)

    @app.get("/v1/models")
    async def models() -> dict[str, Any]:
        return {"object": "list", "data": [{"id": service.model_id, "object": "model", "created": created,
                                            "owned_by": "kv_cache"}]}

    # --------------------------------------------------------------------- contexts
    @app.post("/v1/contexts", status_code=201, openapi_extra=_body_schema(ContextCreateRequest))
    async def create_context(request: Request) -> JSONResponse:
        owner = request.state.owner
        with engine.reserve(owner):  # admitted before a byte of the body is read
            req = await checked(request, parse_context, limits)
            if req.method is not None:  # a spec naming a file
                service.files.resolve_spec(req.method)  # the result is used in the tokenizer thread
            service.check_characters(req)  # a text that cannot fit: 400 before it is tokenized
            prep = await prepare(request, service.prepare_compress, req, owner)
            job = engine.submit(lambda j: service.compress(prep, j), asyncio.get_running_loop(), owner=owner,
                                deadline=request.state.deadline)
        request.state.usage = {"prompt_tokens": len(prep.kept), "completion_tokens": 0}
        return JSONResponse(await _answer(job, request, engine), status_code=201)

    @app.get("/v1/contexts")
    async def list_contexts(request: Request) -> dict[str, Any]:
        return {"object": "list", "data": service.store.list(request.state.owner)}

    @app.get("/v1/contexts/{cid}")
    async def get_context(request: Request, cid: str) -> dict[str, Any]:
        try:
            return service.store.describe(cid, request.state.owner)
        except (ContextNotFound, ContextCorrupted) as exc:
            raise _store_error(exc, cid[:64]) from None

    @app.delete("/v1/contexts/{cid}")
    async def delete_context(request: Request, cid: str) -> dict[str, Any]:
        try:
            service.store.delete(cid, request.state.owner)
        except ContextNotFound as exc:
            raise _store_error(exc, cid[:64]) from None
        return {"id": cid, "object": "context.deleted", "deleted": True}

    # --------------------------------------------------------------------- chat
    @app.post("/v1/chat/completions", openapi_extra=_body_schema(ChatCompletionRequest))
    async def chat(request: Request) -> Response:
        owner = request.state.owner
        with engine.reserve(owner):  # admitted before a byte of the body is read
            req = await checked(request, parse_chat, service.model_id, limits)
            service.check_characters(req)  # messages that cannot fit: 400 before they are tokenized
            if req.context_id is not None:  # another key's or a missing context: 404
                try:
                    service.store.describe(req.context_id, owner)
                except (ContextNotFound, ContextCorrupted) as exc:
                    raise _store_error(exc, req.context_id[:64], "context_id") from None
            prep = await prepare(request, service.prepare_chat, req, owner)
            # chats may run together with others of their kind waiting: without a stored context
            # (kv_cache.integrations.serve.batch), on stored contexts (kv_cache.integrations.serve.batch_context)
            batch = ({"batch_key": "plain", "item": prep, "batch_fn": functools.partial(chat_batch, service)}
                     if req.context_id is None else
                     {"batch_key": "context", "item": prep, "batch_fn": functools.partial(context_batch, service)})
            job = engine.submit(lambda j: service.chat(prep, j), asyncio.get_running_loop(), owner=owner,
                                deadline=request.state.deadline, **batch)
        cid, now = "chatcmpl-" + secrets.token_hex(12), int(time.time())
        state = request.state
        if not req.stream:
            result = await _answer(job, request, engine, state)
            state.usage = result["usage"]
            return JSONResponse({
                "id": cid, "object": "chat.completion", "created": now, "model": service.model_id,
                "choices": [{"index": 0, "message": {"role": "assistant", "content": result["text"]},
                             "finish_reason": result["finish_reason"], "logprobs": None}],
                "usage": result["usage"], "context_id": req.context_id})
        try:  # errors before the first token are answered with their status, not inside a stream
            kind, payload = await _next_event(job, engine, state)
        except BaseException:
            engine.cancel(job)
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
                        kind, payload = await _next_event(job, engine, state)
                    except ApiError as exc:
                        kind, payload = "error", exc
                    if kind == "delta":
                        yield chunk({"content": payload})
                    elif kind == "done":
                        state.usage = payload["usage"]
                        yield chunk({}, payload["finish_reason"])
                        if req.include_usage:
                            body = {"id": cid, "object": "chat.completion.chunk", "created": now,
                                    "model": service.model_id, "choices": [], "usage": payload["usage"]}
                            yield f"data: {json.dumps(body)}\n\n"
                        break
                    elif kind == "error":  # mid-stream: the status is sent already
                        err = payload.body()
                        err["error"]["message"] = redact(err["error"]["message"], hidden)
                        yield f"data: {json.dumps(err)}\n\n"
                        break
                yield "data: [DONE]\n\n"
            finally:
                engine.cancel(job)  # a client that went away stops the generation (or leaves the queue)

        return StreamingResponse(events(), media_type="text/event-stream",
                                 headers={"Cache-Control": "no-cache"})

    generated = app.openapi

    def openapi() -> dict[str, Any]:
        """FastAPI's document, with the request bodies' schemas among its components."""
        if app.openapi_schema is None:
            generated().setdefault("components", {}).setdefault("schemas", {}).update(_body_components())
        return app.openapi_schema

    app.openapi = openapi
    # the route label's values: these templates (closed), anything else "other"
    metrics = ServerMetrics(service.store, engine, routes=[getattr(r, "path", None) for r in app.routes])
    engine.on_batch = metrics.batch.observe
    app.state.metrics = metrics
    app.add_middleware(Guard)
    app.add_middleware(AccessLog, metrics=metrics, request_timeout=engine.request_timeout)  # added last: the outermost, so every answer is logged
    return app


def _version() -> str:
    from importlib.metadata import PackageNotFoundError, version

    try:
        return version("kv_cache")
    except PackageNotFoundError:  # a source tree on sys.path, not installed
        return "unknown"


def _library_versions() -> dict[str, str]:
    import platform

    import torch
    import transformers

    return {"torch": torch.__version__, "transformers": transformers.__version__,
            "python": platform.python_version()}
