"""What an operator of ``kvcache serve`` can watch: ``/metrics`` (Prometheus) and the access log.

:class:`ServerMetrics` holds one application's metrics in a registry of its own
(``prometheus_client.CollectorRegistry``: nothing process-wide, two servers in one process do
not mix). ``GET /metrics`` answers them in Prometheus' text format:

==========================================  =========  ==============================================
metric                                      type       labels / what
==========================================  =========  ==============================================
``kvcache_requests_total``                  counter    ``route`` (the route's template), ``method``,
                                                       ``status``
``kvcache_request_duration_seconds``        histogram  ``route``: from the request's first byte to
                                                       its response's last (a stream included)
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
                                                       (the owner id; ``none`` without a key)
``kvcache_cache_bytes``                     gauge      bytes of contexts held loaded in memory
``kvcache_draining``                        gauge      1 once SIGTERM began the shutdown
==========================================  =========  ==============================================

The access log (:func:`access_line`) is one JSON object a line on the logger
``kv_cache.serve.access`` per request: ``id`` (also sent as the ``X-Request-Id`` header),
``key`` (the key's owner id, a salted hash, never the key), ``method``, ``route``, ``path``,
``status``, ``prompt_tokens``, ``completion_tokens``, ``latency_ms``, ``ttft_ms``.
"""

from __future__ import annotations

import json
import logging
from typing import Any

ACCESS_LOG = "kv_cache.serve.access"
LATENCY_BUCKETS = (0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 30.0, 60.0, 120.0, 300.0)
BATCH_BUCKETS = (1, 2, 4, 8, 16, 32, 64)

access_log = logging.getLogger(ACCESS_LOG)


class ServerMetrics:
    """One application's metrics (see the module docstring); ``store`` and ``engine`` are read at
    each scrape for the gauges."""

    def __init__(self, store: Any, engine: Any):
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
                g = GaugeMetricFamily("kvcache_store_bytes", "Bytes of stored context files per key hash",
                                      labels=["key"])
                for owner, (_, nbytes) in sorted(by_key.items(), key=lambda kv: str(kv[0])):
                    g.add_metric(["none" if owner is None else owner], nbytes)
                yield g
                yield GaugeMetricFamily("kvcache_cache_bytes", "Bytes of contexts held loaded in memory",
                                        value=store.cache_bytes_held)

        r.register(_Live())

    def render(self) -> tuple[bytes, str]:
        """``(body, content type)`` of ``GET /metrics``."""
        from prometheus_client import CONTENT_TYPE_LATEST, generate_latest

        return generate_latest(self.registry), CONTENT_TYPE_LATEST

    def observe(self, entry: dict[str, Any]) -> None:
        """Count one answered request (an :func:`access_line` entry)."""
        route = entry["route"]
        self.requests.labels(route, entry["method"], str(entry["status"])).inc()
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
