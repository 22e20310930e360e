"""What an operator of ``kvcache serve`` can watch: ``/metrics`` (Prometheus) and the access log
(:class:`AccessLog`, the ASGI middleware that writes both at each response's last byte).

:class:`ServerMetrics` holds one application's metrics in a registry of its own
(``prometheus_client.CollectorRegistry``: nothing process-wide, two servers in one process do
not mix). ``GET /metrics`` answers them in Prometheus' text format:

==========================================  =========  ==============================================
metric                                      type       labels / what
==========================================  =========  ==============================================
``kvcache_requests_total``                  counter    ``route`` (the route's template), ``method``,
                                                       ``status``: requests that passed the key check
``kvcache_request_duration_seconds``        histogram  ``route``: from the request's first byte to
                                                       its response's last (a stream included)
``kvcache_refused_total``                   counter    ``reason``: requests refused before the key
                                                       check (``invalid_api_key``,
                                                       ``misdirected_request``, ``forbidden_origin``)
``kvcache_time_to_first_token_seconds``     histogram  chats: from the request to the first token
``kvcache_batch_size``                      histogram  jobs the worker ran together (1: alone)
``kvcache_prompt_tokens_total``             counter    ``route``: tokens read (a chat's prompt and
                                                       stored context, a document compressed)
``kvcache_completion_tokens_total``         counter    tokens generated
``kvcache_queue_depth``                     gauge      requests admitted and not running: being
                                                       prepared or waiting for the worker
``kvcache_running_jobs``                    gauge      jobs the worker runs now
``kvcache_contexts``                        gauge      stored contexts (every key)
``kvcache_store_bytes``                     gauge      ``key``: bytes of ``.kvc`` files per key hash
                                                       (the owner id; ``none`` without a key): a key
                                                       sees its own series only, an admin key every
                                                       one
``kvcache_cache_bytes``                     gauge      bytes of contexts held loaded in memory
``kvcache_draining``                        gauge      1 once SIGTERM began the shutdown
==========================================  =========  ==============================================

**Every label value comes from a closed set**, never from what a client sends: ``route`` is one of
the application's route templates or ``other``; ``method`` one of :data:`METHODS` or ``other``;
``status`` a status the server chose; ``reason`` one of :data:`REFUSALS`, every series made at
start-up; ``key`` an owner id of a configured key. A request refused before its key is checked
adds no series (one of the ``kvcache_refused_total`` series counts it), so a client without a key
cannot grow the process, whatever methods and paths it sends.

The access log (:func:`access_line`) is one JSON object a line on the logger
``kv_cache.serve.access`` per request: ``id`` (also sent as the ``X-Request-Id`` header),
``key`` (the key's owner id, a salted hash, never the key), ``method`` and ``route`` (closed sets,
as the labels), ``path`` (its first 200 characters, where a route matched; null for an unknown
path or a request refused before its key was checked), ``status``, ``prompt_tokens``, ``completion_tokens``, ``latency_ms``, ``ttft_ms``.
"""

from __future__ import annotations

import json
import logging
import secrets
import time
from typing import Any

ACCESS_LOG = "kv_cache.serve.access"
LATENCY_BUCKETS = (0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 30.0, 60.0, 120.0, 300.0)
BATCH_BUCKETS = (1, 2, 4, 8, 16, 32, 64)

METHODS = frozenset({"GET", "HEAD", "POST", "PUT", "DELETE", "PATCH", "OPTIONS"})
"""HTTP methods counted by name; any other is ``other``."""
REFUSALS = ("invalid_api_key", "misdirected_request", "forbidden_origin")
"""Why a request is refused before its key is checked: ``kvcache_refused_total``'s ``reason``."""
OTHER = "other"

access_log = logging.getLogger(ACCESS_LOG)
log = logging.getLogger(__name__)


def method_label(method: Any) -> str:
    """``method`` when it is one of :data:`METHODS`, else ``other``."""
    return method if method in METHODS else OTHER


class ServerMetrics:
    """One application's metrics (see the module docstring); ``store`` and ``engine`` are read at
    each scrape for the gauges; ``routes``: the application's route templates (the ``route``
    label's values besides ``other``)."""

    def __init__(self, store: Any, engine: Any, routes: Any = ()):
        from prometheus_client import CollectorRegistry, Counter, Histogram
        from prometheus_client.core import GaugeMetricFamily

        self.registry = CollectorRegistry(auto_describe=True)
        r = self.registry
        self.requests = Counter("kvcache_requests", "HTTP requests answered", ["route", "method", "status"],
                                registry=r)
        self.latency = Histogram("kvcache_request_duration_seconds", "Seconds from a request's first byte to its "
                                 "response's last", ["route"], buckets=LATENCY_BUCKETS, registry=r)
        self.ttft = Histogram("kvcache_time_to_first_token_seconds", "Seconds from a chat request to its first "
                              "token", buckets=LATENCY_BUCKETS, registry=r)
        self.batch = Histogram("kvcache_batch_size", "Jobs the model worker ran together", buckets=BATCH_BUCKETS,
                               registry=r)
        self.prompt_tokens = Counter("kvcache_prompt_tokens", "Tokens read (prompts, stored contexts, documents)",
                                     ["route"], registry=r)
        self.completion_tokens = Counter("kvcache_completion_tokens", "Tokens generated", registry=r)
        self.refused = Counter("kvcache_refused", "Requests refused before their key was checked", ["reason"],
                               registry=r)
        for reason in REFUSALS:  # every series exists from the start: a refusal never adds one
            self.refused.labels(reason)
        self.routes = frozenset(routes)
        self.store = store

        class _Live:
            """The gauges read at scrape time from the engine and the store."""

            def collect(self_inner):
                yield GaugeMetricFamily("kvcache_queue_depth", "Requests admitted and not running (being prepared "
                                        "or waiting for the worker)", value=engine.waiting + engine.preparing)
                yield GaugeMetricFamily("kvcache_running_jobs", "Jobs the model worker runs now", value=engine.running)
                yield GaugeMetricFamily("kvcache_draining", "1 once the shutdown began", value=int(engine.stopping))
                by_key = store.usage_by_owner()
                yield GaugeMetricFamily("kvcache_contexts", "Stored contexts (every key)",
                                        value=sum(n for n, _ in by_key.values()))
                yield GaugeMetricFamily("kvcache_cache_bytes", "Bytes of contexts held loaded in memory",
                                        value=store.cache_bytes_held)

        r.register(_Live())

    def render(self, viewer: Any = None, everyone: bool = True) -> tuple[bytes, str]:
        """``(body, content type)`` of ``GET /metrics``; ``kvcache_store_bytes`` holds every key's
        series when ``everyone`` (an admin key, or a server without keys), else ``viewer``'s only
        (the owner id of the key that asked)."""
        from prometheus_client import CONTENT_TYPE_LATEST, CollectorRegistry, generate_latest
        from prometheus_client.core import GaugeMetricFamily

        by_key = self.store.usage_by_owner()
        g = GaugeMetricFamily("kvcache_store_bytes", "Bytes of stored context files per key hash", labels=["key"])
        for owner, (_, nbytes) in sorted(by_key.items(), key=lambda kv: str(kv[0])):
            if everyone or owner == viewer:
                g.add_metric(["none" if owner is None else owner], nbytes)

        class _One:
            def collect(self_inner):
                yield g

        mine = CollectorRegistry(auto_describe=False)
        mine.register(_One())
        return generate_latest(self.registry) + generate_latest(mine), CONTENT_TYPE_LATEST

    def route_label(self, route: Any) -> str:
        """``route`` when it is one of the application's templates, else ``other``."""
        return route if route in self.routes else OTHER

    def observe(self, entry: dict[str, Any]) -> None:
        """Count one answered request (an :func:`access_line` entry); one refused before its key
        was checked (``entry["refused"]``, one of :data:`REFUSALS`) only in ``kvcache_refused_total``."""
        refused = entry.get("refused")
        if refused is not None:
            self.refused.labels(refused if refused in REFUSALS else REFUSALS[0]).inc()
            return
        route = self.route_label(entry["route"])
        self.requests.labels(route, method_label(entry["method"]), str(int(entry["status"]))).inc()
        self.latency.labels(route).observe(entry["latency_ms"] / 1000.0)
        if entry.get("ttft_ms") is not None:
            self.ttft.observe(entry["ttft_ms"] / 1000.0)
        if entry.get("prompt_tokens"):
            self.prompt_tokens.labels(route).inc(entry["prompt_tokens"])
        if entry.get("completion_tokens"):
            self.completion_tokens.inc(entry["completion_tokens"])


def access_line(entry: dict[str, Any]) -> str:
    """The access log's line for ``entry``: compact JSON, keys in a fixed order."""
    order = ("id", "key", "method", "route", "path", "status", "prompt_tokens", "completion_tokens", "latency_ms",
             "ttft_ms")
    return json.dumps({k: entry.get(k) for k in order}, separators=(",", ":"), ensure_ascii=True)


class AccessLog:
    """Pure ASGI middleware: an ``X-Request-Id`` on every response, and at the response's last
    byte (a stream's included) one access-log line and the request's metrics."""

    def __init__(self, app: Any, metrics: ServerMetrics, request_timeout: float):
        self.app, self.metrics, self.request_timeout = app, metrics, request_timeout

    async def __call__(self, scope, receive, send):
        if scope["type"] != "http":
            return await self.app(scope, receive, send)
        rid = "req-" + secrets.token_hex(8)
        state = scope.setdefault("state", {})
        state["request_id"], state["started"] = rid, time.monotonic()
        state["deadline"] = state["started"] + self.request_timeout  # from the first byte: reading counts
        status = {"code": 500, "done": False}

        async def send_logged(message):
            if message["type"] == "http.response.start":
                status["code"] = message["status"]
                message = dict(message, headers=[*message.get("headers", []), (b"x-request-id", rid.encode())])
            await send(message)
            if message["type"] == "http.response.body" and not message.get("more_body", False) and not status["done"]:
                status["done"] = True
                self._log(scope, state, status["code"])

        try:
            await self.app(scope, receive, send_logged)
        finally:
            if not status["done"]:  # the client went away, or nothing was sent
                status["done"] = True
                self._log(scope, state, status["code"] if status["code"] != 500 else 499)

    def _log(self, scope, state, code: int) -> None:
        route = scope.get("route")
        usage = state.get("usage") or {}
        ttft = state.get("first_token")
        refused = state.get("refused")
        label = self.metrics.route_label(getattr(route, "path", None))
        entry = {"id": state["request_id"], "key": state.get("owner"), "method": method_label(scope.get("method")),
                 "route": label,  # the path only where a route matched and the key was checked: no junk logged
                 "path": None if refused or label == "other" else scope.get("path", "")[:200], "refused": refused,
                 "status": code, "prompt_tokens": usage.get("prompt_tokens"),
                 "completion_tokens": usage.get("completion_tokens"),
                 "latency_ms": round((time.monotonic() - state["started"]) * 1000.0, 2),
                 "ttft_ms": None if ttft is None else round((ttft - state["started"]) * 1000.0, 2)}
        try:
            self.metrics.observe(entry)
            access_log.info(access_line(entry))
        except Exception:  # observability never fails a request
            log.exception("the access log failed")
