"""The limits of ``kvcache serve``: every input is bounded, and checked before any work.

:class:`Limits` holds them (each is a ``kvcache serve`` flag with the same default). In the order
a request meets them:

=============================  =========  =============================================================
limit (flag)                   default    past it
=============================  =========  =============================================================
``--queue-size``               16         503 ``queue_full`` with ``Retry-After``, before the body is read
``--max-body-memory``          4 bodies   503 ``body_memory_full`` with ``Retry-After`` (the memory of
                                          every body being read or parsed, server-wide)
``--max-body-bytes``           8 MiB      413 ``payload_too_large``, while reading, before parsing
``--body-timeout``             30 s       408 ``request_body_timeout`` (a body sent too slowly)
``--request-timeout``          120 s      504 ``request_timeout``: from the request's first byte, over
                                          reading, tokenizing, queueing and generating
``--max-json-depth``           32         400 ``json_too_deep``, before parsing
``--max-document-chars``       1,000,000  400 ``text_too_long`` (the document; a chat's messages)
``--max-tokens``               1024       400 ``invalid_parameter`` (a chat's ``max_tokens``)
``--max-stop-chars``           256        400 ``invalid_parameter`` (each ``stop`` string; 4 at most)
``--max-contexts``             10,000     429 ``storage_quota_exceeded`` (all keys together)
``--max-contexts-per-key``     1,000      429 ``storage_quota_exceeded``
``--max-store-bytes``          16 GiB     429 ``storage_quota_exceeded`` (``.kvc`` bytes on disk)
``--max-store-bytes-per-key``  2 GiB      429 ``storage_quota_exceeded``
``--max-document-tokens``      positions  400 ``document_too_long``, after tokenizing, before the queue
=============================  =========  =============================================================

**Admission before reading.** A POST that does work (a compression, a chat) takes its place in
the queue (``--queue-size``, ``--max-queued-per-key``) before a byte of its body is read, so at
most ``--queue-size`` bodies are read at once; the memory they take is bounded by one
server-wide :class:`BodyBudget` (``--max-body-memory``, default four bodies at the limit). Each
byte of a body counts :data:`BODY_MEMORY_PER_BYTE` (7) bytes: the byte itself, held while the
body is read, and what parsing it holds at its peak (the decoded text, the parsed value, the
schema's copy: at most 5.2 bytes a body byte, measured on raw astral-plane UTF-8, the worst
case; 2 for ASCII), so the budget bounds the memory, not only the bytes read. A declared ``Content-Length`` is taken from the budget before
reading, a chunked body as it grows, and given back once the body is parsed. Past it: 503
``body_memory_full`` with ``Retry-After``, the body unread.

A body past ``--max-body-bytes`` is read to its end and dropped chunk by chunk (memory does not
grow with it) before the 413 is sent, so a client still sending gets the status rather than a
reset; past :data:`DRAIN_BYTES` more the server stops reading and closes the connection after
the answer. The nesting depth is measured on the raw bytes (:func:`json_depth`) before
``json.loads`` runs, so a deeply nested body never reaches the recursive parser.
"""

from __future__ import annotations

import asyncio
import json
import threading
import time
from contextlib import contextmanager
from dataclasses import dataclass, fields
from typing import Any, Iterator

from .errors import ApiError

MiB = 1 << 20
DRAIN_BYTES = 64 * MiB
"""Bytes of an oversized body the server still reads (and drops) before answering 413."""

BODY_MEMORY_PER_BYTE = 7
"""Bytes of memory a body's byte may take while it is read and parsed: the byte, and the parse's
peak (measured at most 5.2 on any text; ``tests/test_serve_bounds.py`` checks the bound)."""

SCAN_BLOCK = 1 << 16
"""Bytes :func:`json_depth` scans at a time (its int32 temporaries: a few times this, per body)."""


@dataclass(frozen=True)
class Limits:
    """The bounds of every input (see the module docstring for the flags and the status codes).

    Parameters
    ----------
    max_body_bytes : int, default 8 MiB
    body_timeout : int, default 30
        Seconds a client has to send a request body (a slow sender holds no handler longer).
    max_json_depth : int, default 32
        Nesting of arrays and objects in a body (``{"a": [1]}`` is 2).
    max_document_chars : int, default 1,000,000
        Characters of a ``POST /v1/contexts`` document, and of a chat's messages together.
    max_document_tokens : int or None, default None
        Tokens of a document; None: what the model's positions allow.
    max_tokens : int, default 1024
        The most tokens a chat answer may ask for (``max_tokens`` / ``max_completion_tokens``).
    max_stop_chars : int, default 256
        Characters of each ``stop`` string.
    max_contexts, max_contexts_per_key : int or None, default 10,000 and 1,000
        Stored contexts, in all and per API key (None: no limit).
    max_store_bytes, max_store_bytes_per_key : int or None, default 16 GiB and 2 GiB
        Bytes of ``.kvc`` files on disk, in all and per API key (None: no limit).
    max_body_memory : int or None, default None
        Bytes of memory of all request bodies being read or parsed at once, each body byte
        counted :data:`BODY_MEMORY_PER_BYTE` times (None: four bodies at ``max_body_bytes``); at
        least one body at the limit.
    """

    max_body_bytes: int = 8 * MiB
    body_timeout: int = 30
    max_json_depth: int = 32
    max_document_chars: int = 1_000_000
    max_document_tokens: int | None = None
    max_tokens: int = 1024
    max_stop_chars: int = 256
    max_contexts: int | None = 10_000
    max_contexts_per_key: int | None = 1_000
    max_store_bytes: int | None = 16 << 30
    max_store_bytes_per_key: int | None = 2 << 30
    max_body_memory: int | None = None

    def __post_init__(self) -> None:
        optional = {"max_document_tokens", "max_contexts", "max_contexts_per_key", "max_store_bytes",
                    "max_store_bytes_per_key", "max_body_memory"}
        for f in fields(self):
            v = getattr(self, f.name)
            if v is None and f.name in optional:
                continue
            if isinstance(v, bool) or not isinstance(v, int) or v < 1:
                allowed = "an int >= 1 or None" if f.name in optional else "an int >= 1"
                raise ValueError(f"Limits.{f.name} must be {allowed}; got {v!r}")
        one = BODY_MEMORY_PER_BYTE * self.max_body_bytes
        if self.max_body_memory is not None and self.max_body_memory < one:
            raise ValueError(f"Limits.max_body_memory must be at least {one:,} ({BODY_MEMORY_PER_BYTE} x max_body_bytes: "
                             f"one body at the limit, read and parsed) or no such body could ever be read; got "
                             f"{self.max_body_memory:,}")

    @property
    def body_budget(self) -> int:
        """Bytes of memory for the bodies in flight, server-wide (``max_body_memory``, or four
        bodies at the limit)."""
        return self.max_body_memory or 4 * BODY_MEMORY_PER_BYTE * self.max_body_bytes


class BodyBudget:
    """The memory of the request bodies held at once, server-wide (thread-safe).

    Each request reads its body within a :meth:`lease`, which takes memory as the body grows
    (:meth:`Lease.need`: :data:`BODY_MEMORY_PER_BYTE` bytes a body byte) and gives it all back
    when it ends; past the budget a request is refused ``body_memory_full`` (503,
    ``Retry-After``) rather than waiting, so a slow sender never holds others' memory."""

    def __init__(self, max_bytes: int, retry_after: int = 1):
        if isinstance(max_bytes, bool) or not isinstance(max_bytes, int) or max_bytes < 1:
            raise ValueError(f"max_bytes must be an int >= 1; got {max_bytes!r}")
        self.max_bytes, self.retry_after = max_bytes, retry_after
        self.held = 0
        self.peak = 0  # the most bytes held at once since start-up
        self._lock = threading.Lock()

    def _take(self, n: int) -> bool:
        with self._lock:
            if self.held + n > self.max_bytes:
                return False
            self.held += n
            self.peak = max(self.peak, self.held)
            return True

    def _give(self, n: int) -> None:
        with self._lock:
            self.held -= n

    @contextmanager
    def lease(self) -> Iterator["Lease"]:
        lease = Lease(self)
        try:
            yield lease
        finally:
            self._give(lease.bytes)
            lease.bytes = 0


class Lease:
    """The bytes one request holds of a :class:`BodyBudget`."""

    def __init__(self, budget: BodyBudget):
        self.budget, self.bytes = budget, 0

    def need(self, body_bytes: int) -> None:
        """Hold the memory of a body of ``body_bytes`` bytes in all (more is taken when needed);
        ``body_memory_full`` (503) when the budget cannot give it."""
        total = BODY_MEMORY_PER_BYTE * body_bytes
        more = total - self.bytes
        if more <= 0:
            return
        if not self.budget._take(more):
            b = self.budget
            raise ApiError("body_memory_full", f"the server holds {b.held:,} bytes of memory for request bodies, of the "
                           f"{b.max_bytes:,} it allows at once (kvcache serve --max-body-memory); retry after "
                           f"{b.retry_after} s", headers={"Retry-After": str(b.retry_after), "Connection": "close"})
        self.bytes = total


def json_depth(raw: bytes | bytearray) -> int:
    """The deepest nesting of arrays and objects in the JSON text ``raw`` (brackets inside strings
    skipped), in one pass over the bytes: time and memory linear in ``len(raw)``, whatever it holds.

    A quote is a string's delimiter unless an odd run of backslashes precedes it; a bracket counts
    when an even number of delimiters precede it. The bytes are read in blocks of
    :data:`SCAN_BLOCK` (numpy), carrying the backslash run, the quote parity and the depth from one
    block to the next, so the scan never holds more than a few blocks' worth of arrays. Brackets
    of malformed text are counted as they come (a parser stops at the first error anyway, before
    any nesting past it)."""
    import numpy as np

    data = np.frombuffer(raw, dtype=np.uint8)
    run, parity, depth, deepest = 0, 0, 0, 0  # carried: backslashes ending the block, quotes mod 2, depth
    for start in range(0, data.size, SCAN_BLOCK):
        a = data[start:start + SCAN_BLOCK]
        n = a.size
        quote = a == 0x22
        backslash = a == 0x5C
        if run or backslash.any():  # a quote after an odd run of backslashes is escaped
            idx = np.arange(n, dtype=np.int32)
            last = np.where(backslash, np.int32(-run - 1), idx)  # the last non-backslash at or before i
            np.maximum.accumulate(last, out=last)
            before = np.empty(n, dtype=np.int32)  # backslashes right before i
            before[0] = run
            np.subtract(idx[:-1], last[:-1], out=before[1:])
            quote &= (before & 1) == 0
            run = int(n - 1 - last[-1])
        seen = np.cumsum(quote, dtype=np.int32)
        seen += parity
        outside = (seen & 1) == 0
        parity = int(seen[-1] & 1)
        step = (((a == 0x5B) | (a == 0x7B)) & outside).astype(np.int8)
        step -= (((a == 0x5D) | (a == 0x7D)) & outside).astype(np.int8)
        level = np.cumsum(step, dtype=np.int32)
        level += depth
        deepest = max(deepest, int(level.max()))
        depth = int(level[-1])
    return deepest


def parse_json(raw: bytes | bytearray, max_depth: int) -> Any:
    """The JSON value of a request body: ``json_too_deep`` past ``max_depth`` (checked first),
    ``invalid_json`` for anything that is not JSON text in UTF-8."""
    depth = json_depth(raw)
    if depth > max_depth:
        raise ApiError("json_too_deep", f"the request body nests {depth:,} levels of arrays and objects; this "
                                        f"server takes at most {max_depth} (kvcache serve --max-json-depth)")
    try:
        return json.loads(raw or b"null")
    except RecursionError:  # not reached below --max-json-depth; kept so that no body is a 500
        raise ApiError("json_too_deep", "the request body nests too deeply to parse") from None
    except (ValueError, UnicodeDecodeError) as exc:  # ValueError: also an integer of too many digits
        msg = exc.msg if isinstance(exc, json.JSONDecodeError) else "not UTF-8 text or a number out of range"
        where = f" at offset {exc.pos}" if isinstance(exc, json.JSONDecodeError) else ""
        raise ApiError("invalid_json", f"the request body is not JSON: {msg}{where}") from None


def too_large(limit: int, what: str = "") -> ApiError:
    return ApiError("payload_too_large", f"the request body is larger than {limit:,} bytes{what}; this server "
                                         f"takes at most {limit:,} (kvcache serve --max-body-bytes)")


async def read_body(request: Any, limit: int, timeout: float | None = None, *, lease: Lease | None = None,
                    deadline: float | None = None) -> bytearray:
    """The body of ``request`` (a Starlette request), at most ``limit`` bytes, read chunk by chunk
    within ``timeout`` seconds in all (None: no limit; past it ``request_body_timeout``, 408, and
    the connection is closed) and before ``deadline`` (a ``time.monotonic()`` time: the request's
    own, from its first byte; past it ``request_timeout``, 504).

    ``lease`` (of the server's :class:`BodyBudget`): the memory of the bytes kept is taken from it,
    for a declared ``Content-Length`` before the first byte is read, for a chunked body as it grows
    (``body_memory_full``, 503, when the budget has no room). Past ``limit`` (as declared by
    ``Content-Length`` or as read) the rest is read and dropped, up to :data:`DRAIN_BYTES`, then
    ``payload_too_large`` (413) is raised; the server closes the connection after answering when
    it stopped reading before the end."""
    declared = request.headers.get("content-length")
    if declared is not None:
        if not declared.strip().isdigit() or len(declared.strip()) > 20:
            raise ApiError("invalid_json", f"Content-Length must be a byte count; got {declared[:40]!r}")
    over = declared is not None and int(declared) > limit
    if lease is not None and declared is not None and not over:
        lease.need(int(declared))
    buf, drained, complete = bytearray(), 0, False
    now = time.monotonic()
    ends = [(now + timeout, "body")] if timeout is not None else []
    if deadline is not None:
        ends.append((deadline, "request"))
    end, which = min(ends) if ends else (None, None)
    stream = request.stream().__aiter__()
    try:
        while True:
            try:
                if end is None:
                    chunk = await stream.__anext__()
                else:
                    chunk = await asyncio.wait_for(stream.__anext__(), max(end - time.monotonic(), 0))
            except StopAsyncIteration:
                complete = True
                break
            except asyncio.TimeoutError:
                if which == "request":
                    raise ApiError("request_timeout", "the request ran past the server's per-request timeout while "
                                   "its body was read (kvcache serve --request-timeout)",
                                   headers={"Connection": "close"}) from None
                raise ApiError("request_body_timeout", f"the request body was not sent within {timeout:g} s (kvcache "
                               "serve --body-timeout)", headers={"Connection": "close"}) from None
            if not over and len(buf) + len(chunk) <= limit:
                if lease is not None:
                    lease.need(len(buf) + len(chunk))
                buf += chunk
                continue
            if not over:
                over, buf = True, bytearray()  # dropped: memory does not grow with the body
            drained += len(chunk)
            if drained > DRAIN_BYTES:
                break
    except ApiError:
        raise
    except Exception:  # the client went away (ClientDisconnect): nobody reads the answer
        complete = False
    if not over:
        if not complete:
            raise ApiError("client_closed_request", "the request body ended early (the client disconnected)")
        return buf  # not copied to bytes: a body is held once
    exc = too_large(limit)
    if not complete:
        exc.headers["Connection"] = "close"
    raise exc
