"""The model worker gathers a batch (:class:`kv_cache.integrations.serve.engine.Engine`, without a model): jobs
of one batch key run together, up to ``max_batch``; with ``batch_wait`` a job waits for more of
its key, and stops waiting once the batch is full or the server shuts down."""

from __future__ import annotations

import threading
import time

import pytest

from kv_cache.integrations.serve.engine import Engine


def _until(cond, what: str, limit: float = 30.0) -> None:
    deadline = time.monotonic() + limit
    while not cond():
        if time.monotonic() > deadline:
            raise AssertionError(f"{what} did not happen within {limit} s")
        time.sleep(0.005)


def _events(job) -> list:
    out = []
    while not job.events.empty():
        out.append(job.events.get_nowait())
    return out


def test_batch_wait_gathers_a_full_batch():
    engine = Engine(queue_size=8, max_batch=4, batch_wait=10.0)
    batches = []

    def run(jobs):
        batches.append([j.item for j in jobs])
        for j in jobs:
            j.emit("done", j.item)

    engine.start()
    try:
        jobs = [engine.submit(lambda j: None, batch_key="k", batch_fn=run, item=i) for i in range(4)]
        _until(lambda: all(not j.events.empty() for j in jobs), "the batch's answers")
    finally:
        assert engine.stop()
    assert batches == [[0, 1, 2, 3]]  # the first job waited for the others, then the batch was full
    assert list(engine.batch_sizes) == [4]


def test_a_shutdown_ends_the_wait_and_answers_the_job():
    engine = Engine(queue_size=8, max_batch=4, batch_wait=10.0)
    ran = threading.Event()
    engine.start()
    job = engine.submit(lambda j: ran.set(), batch_key="k", batch_fn=lambda jobs: ran.set(), item=0)
    _until(lambda: engine.waiting == 0, "the worker taking the job")
    engine.begin_shutdown()
    _until(lambda: not job.events.empty(), "the job's answer")
    kind, err = _events(job)[0]
    assert kind == "error" and err.code == "shutting_down"
    assert engine.stop() and not ran.is_set()


@pytest.mark.parametrize("bad", [-0.1, 11, "0.05", True])
def test_batch_wait_is_checked(bad):
    with pytest.raises(ValueError, match=rf"batch_wait must be a number of seconds in \[0, 10\]; got {bad!r}"):
        Engine(batch_wait=bad)
