"""The model worker of ``kvcache serve``: one thread, one bounded queue, one lock.

``kv_cache.compress()`` switches the model's attention implementation for the duration of a
call, so two requests must never run the model at once. Every job that touches the model
(compressing a document, answering a chat) is queued here and run by the single worker thread
while it holds :attr:`Engine.model_lock`; anything else that wants the model (a benchmark, a
test) takes the same lock.

* The queue holds at most ``queue_size`` waiting jobs; :meth:`Engine.submit` past that raises
  :class:`~kv_cache.integrations.serve.errors.ApiError` ``queue_full`` (503 with ``Retry-After``).
* Each job has a deadline: the request's own (``request_timeout`` seconds after its first byte,
  so reading and tokenizing count), or ``request_timeout`` after it was submitted. A job still
  queued at its deadline is dropped; a running one checks it between tokens and stops with
  ``request_timeout`` (504). A job whose client went away (:meth:`Engine.cancel`) leaves the
  queue at once, or stops at its next check (one decoding step).
* A job with a ``batch_key`` (a chat: ``"plain"`` without a stored context, ``"context"`` on
  one) takes with it the queued jobs of the same key, up to ``max_batch`` in all, and they run
  as one batch (``batch_fn``; :mod:`kv_cache.integrations.serve.batch`, :mod:`kv_cache.integrations.serve.batch_context`).
  With ``batch_wait`` > 0 it first waits that long for more jobs of its key while fewer than
  ``max_batch`` are queued (clients whose answers a batch just sent ask again a moment later).
* Requests are admitted (:meth:`Engine.reserve`) before their tokenization, which runs outside the
  model lock: the jobs being prepared count against ``queue_size`` with the queued ones.
* **Fairness between keys.** A key (an owner id; requests without keys are one tenant and are not
  limited this way) may have at most ``max_queued_per_key`` requests being prepared or waiting
  (past it: 429 ``rate_limit_exceeded`` with ``Retry-After``, while other keys are still admitted),
  and a batch takes at most ``max_running_per_key`` jobs of one key while other keys' jobs of its
  kind wait (then the rest of the batch is filled in queue order: a key alone is not slowed), so
  one key can neither fill the queue nor crowd the others out of a batch.
* :meth:`Engine.begin_shutdown` (SIGTERM) refuses new jobs, answers the queued ones
  ``shutting_down`` (503) and the running one too, at once, unless it is writing its result
  (:meth:`Job.commit`: then it finishes); the running work stops at its next check (between
  tokens; a compression before it writes its file).
* A job talks to its request through events on an ``asyncio.Queue`` of the server's event loop
  (``("start", None)``, ``("delta", text)``, ``("done", result)``, ``("error", ApiError)``),
  put there thread-safely.
"""

from __future__ import annotations

import asyncio
import collections
import logging
import queue
import secrets
import threading
import time
from contextlib import contextmanager
from typing import Any, Callable, Iterator

from .errors import ApiError

log = logging.getLogger(__name__)


class Job:
    """One request's work: ``fn(job)`` runs on the worker thread and returns the result.

    A job with a ``batch_key`` may instead run together with other queued jobs of the same key:
    ``batch_fn(jobs)`` then answers each of them (its results emitted on each job's events);
    ``item`` is what ``batch_fn`` reads from each job."""

    def __init__(self, fn: Callable[["Job"], Any], deadline: float, loop: asyncio.AbstractEventLoop | None,
                 batch_key: Any = None, batch_fn: Callable[[list["Job"]], None] | None = None, item: Any = None,
                 owner: str | None = None):
        self.fn, self.deadline, self.loop, self.owner = fn, deadline, loop, owner
        self.batch_key, self.batch_fn, self.item = batch_key, batch_fn, item
        self.events: asyncio.Queue = asyncio.Queue()
        self._cancelled = threading.Event()
        self._why = ApiError("request_timeout", "the request was cancelled")
        self._state = threading.Lock()
        self._committing = False

    def cancel(self, why: ApiError | None = None) -> None:
        """Stop this job at its next :meth:`check` (which then raises ``why``)."""
        if why is not None and not self._cancelled.is_set():
            self._why = why
        self._cancelled.set()

    def commit(self) -> None:
        """Called by a job right before it writes its result (a stored context): from then on it
        is not stopped by a shutdown but finishes. Raises why it was cancelled, if it was."""
        with self._state:
            self.check()
            self._committing = True

    def interrupt(self, why: ApiError) -> bool:
        """Cancel the job and answer its request ``why`` now, unless it is committing (then it
        finishes, and False is returned)."""
        with self._state:
            if self._committing:
                return False
            self.cancel(why)
        self.emit("error", why)
        return True

    @property
    def cancelled(self) -> bool:
        return self._cancelled.is_set()

    def expired(self) -> bool:
        return time.monotonic() >= self.deadline

    def check(self) -> None:
        """Raise ``request_timeout`` past the deadline, or why it was cancelled; called by the job
        between steps."""
        if self._cancelled.is_set():
            raise self._why
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


def _put_all(items: list[tuple[Job, str, Any]]) -> None:
    for job, kind, payload in items:
        job.events.put_nowait((kind, payload))


def emit_many(events: list[tuple[Job, str, Any]]) -> None:
    """Put several jobs' events ``(job, kind, payload)`` at once, in order: one wake-up of each
    event loop for all of them instead of one per event (a batch's step streams a delta per row)."""
    by_loop: dict[Any, list] = {}
    for job, kind, payload in events:
        if job.loop is None:
            job.events.put_nowait((kind, payload))
        else:
            by_loop.setdefault(job.loop, []).append((job, kind, payload))
    for loop, items in by_loop.items():
        try:
            loop.call_soon_threadsafe(_put_all, items)
        except RuntimeError:  # the server's loop is closed: nobody is listening any more
            for job, _, _ in items:
                job.cancel()


class _JobQueue(queue.Queue):
    """A bounded FIFO of jobs from which the worker can also take the queued jobs of one batch key."""

    def take_matching(self, key: Any, n: int, per_owner: int | None = None,
                      taken: dict[Any, int] | None = None) -> list[Job]:
        """Remove and return up to ``n`` queued jobs whose ``batch_key`` is ``key``, oldest first.

        With ``per_owner``: first at most that many of one owner (not None), counting ``taken``
        (owner -> jobs already in the batch; updated); then, if room is left, the others in order
        (a key alone in the queue still fills the batch: the cap only makes room for other keys)."""
        taken = {} if taken is None else taken
        with self.mutex:
            found: list[Job] = []
            chosen: set[int] = set()
            for capped in ((True, False) if per_owner is not None else (False,)):
                for j in self.queue:
                    if len(found) >= n:
                        break
                    if j is None or j.batch_key != key or j.cancelled or id(j) in chosen:
                        continue
                    if capped and j.owner is not None and taken.get(j.owner, 0) >= per_owner:
                        continue
                    taken[j.owner] = taken.get(j.owner, 0) + 1
                    found.append(j)
                    chosen.add(id(j))
            for j in found:
                self.queue.remove(j)
            if found:
                self.not_full.notify(len(found))
        return found


class Engine:
    """The single model worker (see the module docstring).

    ``max_batch``: at most this many queued jobs of one batch key run together (1: one at a time).
    ``batch_wait``: seconds a job with a batch key waits for more jobs of its key when fewer than
    ``max_batch`` are queued (0: it starts with those queued now)."""

    def __init__(self, *, queue_size: int = 16, request_timeout: float = 120.0, retry_after: int = 1,
                 max_batch: int = 8, batch_wait: float = 0.0, max_queued_per_key: int | None = None,
                 max_running_per_key: int | None = 4, on_batch: Callable[[int], None] | None = None):
        if isinstance(queue_size, bool) or not isinstance(queue_size, int) or queue_size < 1:
            raise ValueError(f"queue_size must be an int >= 1; got {queue_size!r}")
        if isinstance(max_batch, bool) or not isinstance(max_batch, int) or max_batch < 1:
            raise ValueError(f"max_batch must be an int >= 1; got {max_batch!r}")
        if isinstance(batch_wait, bool) or not isinstance(batch_wait, (int, float)) or not 0 <= batch_wait <= 10:
            raise ValueError(f"batch_wait must be a number of seconds in [0, 10]; got {batch_wait!r}")
        for name, v in (("max_queued_per_key", max_queued_per_key), ("max_running_per_key", max_running_per_key)):
            if v is not None and (isinstance(v, bool) or not isinstance(v, int) or v < 1):
                raise ValueError(f"{name} must be an int >= 1 or None (no limit); got {v!r}")
        self.max_batch, self.batch_wait = max_batch, float(batch_wait)
        self.max_queued_per_key, self.max_running_per_key = max_queued_per_key, max_running_per_key
        self.on_batch = on_batch  # called with the size of every run (1: a job alone), on the worker
        # the size of each batch run (more than one job), the latest 1,024, in order
        self.batch_sizes: collections.deque[int] = collections.deque(maxlen=1024)
        if not isinstance(request_timeout, (int, float)) or not request_timeout > 0:
            raise ValueError(f"request_timeout must be a number of seconds > 0; got {request_timeout!r}")
        self.queue_size, self.request_timeout, self.retry_after = queue_size, float(request_timeout), retry_after
        self.model_lock = threading.Lock()
        self._queue: _JobQueue = _JobQueue(maxsize=queue_size)
        self._thread: threading.Thread | None = None
        self._admit_lock = threading.Lock()
        self._preparing = 0
        self._preparing_by: collections.Counter = collections.Counter()
        self._running: Job | None = None
        self._batch: list[Job] = []
        self._stopping = threading.Event()

    def _full(self) -> ApiError:
        return ApiError("queue_full", f"the server is busy: {self.queue_size} requests are already waiting; "
                                      f"retry after {self.retry_after} s",
                        headers={"Retry-After": str(self.retry_after)})

    def _refuse_if_stopping(self) -> None:
        if self._stopping.is_set():
            raise ApiError("shutting_down", "the server is shutting down; retry on another server or later",
                           headers={"Retry-After": str(self.retry_after)})

    def queued_by(self, owner: Any) -> int:
        """Jobs of ``owner`` waiting in the queue."""
        with self._queue.mutex:
            return sum(1 for j in self._queue.queue if j is not None and j.owner == owner and not j.cancelled)

    @contextmanager
    def reserve(self, owner: str | None = None) -> Iterator[None]:
        """Admit one request of ``owner`` for its preparation (tokenization, outside the model
        lock): 503 ``queue_full`` when ``queue_size`` requests are already being prepared or
        waiting; 429 ``rate_limit_exceeded`` when ``owner`` (not None) has ``max_queued_per_key``."""
        self._refuse_if_stopping()
        with self._admit_lock:
            if self._preparing + self._queue.qsize() >= self.queue_size:
                raise self._full()
            limit = self.max_queued_per_key
            if owner is not None and limit is not None and self._preparing_by[owner] + self.queued_by(owner) >= limit:
                raise ApiError("rate_limit_exceeded", f"this API key already has {limit} requests waiting (kvcache "
                                                      f"serve --max-queued-per-key); retry after {self.retry_after} s",
                               headers={"Retry-After": str(self.retry_after)})
            self._preparing += 1
            self._preparing_by[owner] += 1
        try:
            yield
        finally:
            with self._admit_lock:
                self._preparing -= 1
                self._preparing_by[owner] -= 1
                if self._preparing_by[owner] <= 0:
                    del self._preparing_by[owner]

    def begin_shutdown(self) -> None:
        """Stop taking jobs; answer the queued ones ``shutting_down``; cancel the running one."""
        self._stopping.set()
        self._drain("the server is shutting down before this request ran")
        running = [*self._batch] or ([self._running] if self._running is not None else [])
        for job in running:  # answered now; the work stops at its next check, or finishes its write
            job.interrupt(ApiError("shutting_down", "the server is shutting down; this request was stopped",
                                   headers={"Retry-After": str(self.retry_after)}))

    @property
    def stopping(self) -> bool:
        return self._stopping.is_set()

    def _drain(self, why: str) -> None:
        while True:
            try:
                job = self._queue.get_nowait()
            except queue.Empty:
                return
            if job is not None:
                job.emit("error", ApiError("shutting_down", why, headers={"Retry-After": str(self.retry_after)}))

    def start(self) -> None:
        if self._thread is None or not self._thread.is_alive():
            self._thread = threading.Thread(target=self._run, name="kv_cache-serve-worker", daemon=True)
            self._thread.start()

    def stop(self, timeout: float = 10.0) -> bool:
        """:meth:`begin_shutdown`, then wait at most ``timeout`` seconds for the worker to end.
        True when it ended (a job it could not interrupt may still be running otherwise)."""
        self.begin_shutdown()
        if self._thread is None:
            return True
        try:
            self._queue.put(None, timeout=max(timeout, 0.0))
        except queue.Full:
            pass
        self._thread.join(timeout)
        ended = not self._thread.is_alive()
        self._thread = None
        return ended

    def submit(self, fn: Callable[[Job], Any], loop: asyncio.AbstractEventLoop | None = None, *,
               batch_key: Any = None, batch_fn: Callable[[list[Job]], None] | None = None, item: Any = None,
               owner: str | None = None, deadline: float | None = None) -> Job:
        """Queue ``fn``; :class:`ApiError` ``queue_full`` when ``queue_size`` jobs already wait.
        ``batch_key`` / ``batch_fn`` / ``item`` / ``owner``: see :class:`Job`; ``deadline``: a
        ``time.monotonic()`` time (the request's, from its first byte), else ``request_timeout``
        from now."""
        self._refuse_if_stopping()
        if deadline is None:
            deadline = time.monotonic() + self.request_timeout
        job = Job(fn, deadline, loop, batch_key, batch_fn, item, owner)
        try:
            self._queue.put_nowait(job)
        except queue.Full:
            raise self._full() from None
        return job

    def cancel(self, job: Job, why: ApiError | None = None) -> None:
        """Cancel ``job`` (its client went away, its deadline passed): removed from the queue if it
        waits there (its place is free at once), else stopped at its next check."""
        job.cancel(why)
        with self._queue.mutex:
            try:
                self._queue.queue.remove(job)
            except ValueError:  # taken by the worker already, or never queued
                return
            self._queue.not_full.notify()

    @property
    def waiting(self) -> int:
        return self._queue.qsize()

    @property
    def preparing(self) -> int:
        """Requests admitted and being checked or tokenized, not yet queued."""
        return self._preparing

    @property
    def running(self) -> int:
        """Jobs running now (a batch's, or one)."""
        return len(self._batch) or (1 if self._running is not None else 0)

    def _run(self) -> None:
        while True:
            job = self._queue.get()
            if job is None:
                return
            if job.cancelled:
                continue
            if self._stopping.is_set():
                job.emit("error", ApiError("shutting_down", "the server is shutting down before this request ran",
                                           headers={"Retry-After": str(self.retry_after)}))
                continue
            if job.expired():
                job.emit("error", ApiError("request_timeout", "the request waited in the queue past the server's "
                                                              "per-request timeout (kvcache serve --request-timeout)"))
                continue
            mates = []
            if job.batch_key is not None and job.batch_fn is not None and self.max_batch > 1:
                mates = self._mates(job)
                if self._stopping.is_set():  # the shutdown began while they were gathered
                    why = ApiError("shutting_down", "the server is shutting down before this request ran",
                                   headers={"Retry-After": str(self.retry_after)})
                    for j in (job, *mates):
                        j.emit("error", why)
                    continue
            if mates:
                self._run_batch([job, *mates])
                continue
            self._observe(1)
            with self.model_lock:
                self._running = job
                try:
                    job.emit("done", job.fn(job))
                except ApiError as exc:
                    log.info("request refused: %s (%s)", exc.message, exc.code)
                    job.emit("error", exc)
                except Exception:  # logged with its traceback; the server keeps serving
                    job.emit("error", internal_error())
                finally:
                    self._running = None

    def _mates(self, job: Job) -> list[Job]:
        """The queued jobs of ``job``'s batch key, at most ``max_batch - 1``; while fewer are queued,
        more are awaited for ``batch_wait`` seconds (a shutdown ends the wait)."""
        want, cap = self.max_batch - 1, self.max_running_per_key
        taken = {job.owner: 1} if job.owner is not None else {}
        mates = self._queue.take_matching(job.batch_key, want, cap, taken)
        end = time.monotonic() + self.batch_wait
        while len(mates) < want and not self._stopping.is_set():
            left = end - time.monotonic()
            if left <= 0:
                break
            time.sleep(min(0.002, left))
            mates += self._queue.take_matching(job.batch_key, want - len(mates), cap, taken)
        return mates

    def _observe(self, size: int) -> None:
        if self.on_batch is not None:
            try:
                self.on_batch(size)
            except Exception:  # a metrics hook never stops the worker
                log.exception("the on_batch hook failed")

    def _run_batch(self, jobs: list[Job]) -> None:
        """Run ``jobs`` (one batch key) together: ``jobs[0].batch_fn(jobs)`` answers each one."""
        live = []
        for j in jobs:
            if j.expired():
                j.emit("error", ApiError("request_timeout", "the request waited in the queue past the server's "
                                                            "per-request timeout (kvcache serve --request-timeout)"))
            elif not j.cancelled:
                live.append(j)
        if not live:
            return
        self.batch_sizes.append(len(live))
        self._observe(len(live))
        with self.model_lock:
            self._running = live[0]
            self._batch = live
            try:
                live[0].batch_fn(live)
            except ApiError as exc:
                _batch_error(live, exc)
            except Exception:  # logged with its traceback; the server keeps serving
                _batch_error(live, internal_error())
            finally:
                self._running, self._batch = None, []


def _batch_error(jobs: list[Job], exc: ApiError) -> None:
    for j in jobs:
        j.emit("error", exc)


def internal_error() -> ApiError:
    """The answer to an unexpected failure: a generic message and an incident id; the exception,
    its class and traceback go to the log only (under that id). Call it inside ``except``."""
    incident = secrets.token_hex(6)
    log.exception("request failed (incident %s)", incident)
    return ApiError("server_error", f"the server failed on this request (incident {incident}; the server's log "
                                    "has the details)")
