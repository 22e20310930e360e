"""The model worker of ``kvcache serve``: one thread, one bounded queue, one lock.

``kv_cache.compress()`` switches the model's attention implementation for the duration of a
call, so two requests must never run the model at once. Every job that touches the model
(compressing a document, answering a chat) is queued here and run by the single worker thread
while it holds :attr:`Engine.model_lock`; anything else that wants the model (a benchmark, a
test) takes the same lock.

* The queue holds at most ``queue_size`` waiting jobs; :meth:`Engine.submit` past that raises
  :class:`~kv_cache.serve.errors.ApiError` ``queue_full`` (503 with ``Retry-After``).
* Each job has a deadline (``request_timeout`` seconds after it was submitted). A job still
  queued at its deadline is dropped; a running one checks it between tokens and stops with
  ``request_timeout`` (504). A job whose client went away (:meth:`Job.cancel`) is dropped or
  stopped the same way.
* A job talks to its request through events on an ``asyncio.Queue`` of the server's event loop
  (``("start", None)``, ``("delta", text)``, ``("done", result)``, ``("error", ApiError)``),
  put there thread-safely.
"""

from __future__ import annotations

import asyncio
import logging
import queue
import threading
import time
from typing import Any, Callable

from .errors import ApiError

log = logging.getLogger(__name__)


class Job:
    """One request's work: ``fn(job)`` runs on the worker thread and returns the result."""

    def __init__(self, fn: Callable[["Job"], Any], deadline: float, loop: asyncio.AbstractEventLoop | None):
        self.fn, self.deadline, self.loop = fn, deadline, loop
        self.events: asyncio.Queue = asyncio.Queue()
        self._cancelled = threading.Event()

    def cancel(self) -> None:
        self._cancelled.set()

    @property
    def cancelled(self) -> bool:
        return self._cancelled.is_set()

    def expired(self) -> bool:
        return time.monotonic() >= self.deadline

    def check(self) -> None:
        """Raise ``request_timeout`` past the deadline; called by the job between steps."""
        if self.expired():
            raise ApiError("request_timeout", "the request ran past the server's per-request timeout "
                                              "(kvcache serve --request-timeout)")

    def emit(self, kind: str, payload: Any = None) -> None:
        if self.loop is None:
            self.events.put_nowait((kind, payload))
            return
        try:
            self.loop.call_soon_threadsafe(self.events.put_nowait, (kind, payload))
        except RuntimeError:  # the server's loop is closed: nobody is listening any more
            self.cancel()


class Engine:
    """The single model worker (see the module docstring)."""

    def __init__(self, *, queue_size: int = 16, request_timeout: float = 120.0, retry_after: int = 1):
        if isinstance(queue_size, bool) or not isinstance(queue_size, int) or queue_size < 1:
            raise ValueError(f"queue_size must be an int >= 1; got {queue_size!r}")
        if not isinstance(request_timeout, (int, float)) or not request_timeout > 0:
            raise ValueError(f"request_timeout must be a number of seconds > 0; got {request_timeout!r}")
        self.queue_size, self.request_timeout, self.retry_after = queue_size, float(request_timeout), retry_after
        self.model_lock = threading.Lock()
        self._queue: queue.Queue = queue.Queue(maxsize=queue_size)
        self._thread: threading.Thread | None = None

    def start(self) -> None:
        if self._thread is None or not self._thread.is_alive():
            self._thread = threading.Thread(target=self._run, name="kv_cache-serve-worker", daemon=True)
            self._thread.start()

    def stop(self, timeout: float = 10.0) -> None:
        """Finish the running job, drop the queued ones (their clients get a timeout), stop."""
        if self._thread is None:
            return
        while True:
            try:
                job = self._queue.get_nowait()
            except queue.Empty:
                break
            if job is not None:
                job.emit("error", ApiError("server_error", "the server is shutting down"))
        self._queue.put(None)
        self._thread.join(timeout)
        self._thread = None

    def submit(self, fn: Callable[[Job], Any], loop: asyncio.AbstractEventLoop | None = None) -> Job:
        """Queue ``fn``; :class:`ApiError` ``queue_full`` when ``queue_size`` jobs already wait."""
        job = Job(fn, time.monotonic() + self.request_timeout, loop)
        try:
            self._queue.put_nowait(job)
        except queue.Full:
            raise ApiError("queue_full", f"the server is busy: {self.queue_size} requests are already waiting; "
                                         f"retry after {self.retry_after} s",
                           headers={"Retry-After": str(self.retry_after)}) from None
        return job

    @property
    def waiting(self) -> int:
        return self._queue.qsize()

    def _run(self) -> None:
        while True:
            job = self._queue.get()
            if job is None:
                return
            if job.cancelled:
                continue
            if job.expired():
                job.emit("error", ApiError("request_timeout", "the request waited in the queue past the server's "
                                                              "per-request timeout (kvcache serve --request-timeout)"))
                continue
            with self.model_lock:
                try:
                    job.emit("done", job.fn(job))
                except ApiError as exc:
                    log.info("request refused: %s (%s)", exc.message, exc.code)
                    job.emit("error", exc)
                except Exception as exc:  # logged with its traceback; the server keeps serving
                    log.exception("request failed")
                    job.emit("error", ApiError("server_error", f"the server failed on this request: "
                                                               f"{type(exc).__name__}: {exc}"))
