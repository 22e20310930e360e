"""``kvcache serve``'s store: restart with persistence, a corrupted or truncated file (422), a
SIGKILL in the middle of a write (child process, three points), SIGTERM while a write is in
progress or an answer streams (bounded time, no partial file), the LRU capped in bytes."""

from __future__ import annotations

import signal
import subprocess
import sys
import threading
import time
from concurrent.futures import ThreadPoolExecutor
import pytest

pytest.importorskip("fastapi", reason="needs the serve extra: pip install 'kv_cache[serve]'")
httpx = pytest.importorskip("httpx")
openai = pytest.importorskip("openai", reason="the tests drive the server with the openai client")

from kv_cache import CompressedContext  # noqa: E402
from kv_cache.integrations.serve.store import ANY_OWNER, SALT_FILE  # noqa: E402
from kv_cache.integrations.serve.auth import key_id  # noqa: E402
from kv_cache.integrations.serve.store import ContextStore  # noqa: E402
from serve_support import (AUTH, DOC, KEY, MODEL, QUESTION, REPO, ask, create, error, free_port, serving,  # noqa: E402
                           start_child)


# ------------------------------------------------------------------------------ persistence
def test_restart_keeps_contexts_and_flags_a_corrupted_file(stories, tmp_path):
    model, tok = stories
    with serving(model, tok, tmp_path) as a:
        with httpx.Client(base_url=a.base_url, headers=AUTH, timeout=60) as h:
            kept = create(h, method="q4+kvzip@0.5")
            broken = create(h, method="q4d")
            listed = h.get("/v1/contexts").json()["data"]
        oc = openai.OpenAI(base_url=a.base_url + "/v1", api_key=KEY, max_retries=0)
        answer = ask(oc, kept["id"]).choices[0].message.content
    path = tmp_path / f"{broken['id']}.kvc"
    data = bytearray(path.read_bytes())
    data[-10] ^= 0xFF  # a tensor byte: the header still reads, its sha256 no longer matches
    path.write_bytes(bytes(data))

    with serving(model, tok, tmp_path) as b:  # a new server on the same folder
        with httpx.Client(base_url=b.base_url, headers=AUTH, timeout=60) as h:
            again = {d["id"]: d for d in h.get("/v1/contexts").json()["data"]}
            assert again[kept["id"]] == next(d for d in listed if d["id"] == kept["id"])
            assert b.service.store.cached_ids() == []  # loaded lazily
            oc = openai.OpenAI(base_url=b.base_url + "/v1", api_key=KEY, max_retries=0)
            assert ask(oc, kept["id"]).choices[0].message.content == answer
            assert b.service.store.cached_ids() == [kept["id"]]
            # the corrupted file: listed (header fine), refused on use with 422, deletable
            err = error(h.post("/v1/chat/completions", json={"model": MODEL, "context_id": broken["id"],
                                                              "messages": [{"role": "user", "content": "hi"}]}),
                         422, "context_corrupted")
            assert "sha256" in err["message"] and broken["id"] in err["message"]
            listed_now = {d["id"]: d for d in h.get("/v1/contexts").json()["data"]}
            assert listed_now[broken["id"]]["status"] == "corrupted"
            error(h.get(f"/v1/contexts/{broken['id']}"), 422, "context_corrupted")
            assert h.delete(f"/v1/contexts/{broken['id']}").status_code == 200
            assert ask(oc, kept["id"]).choices[0].message.content == answer  # still serving


def test_truncated_file_is_listed_corrupted_at_start(stories, tmp_path):
    model, tok = stories
    store = ContextStore(tmp_path, model, tok)
    ctx = CompressedContext.build(model, tok, DOC)
    cid = store.add(ctx, {"model": MODEL, "method": "full"})["id"]
    path = tmp_path / f"{cid}.kvc"
    path.write_bytes(path.read_bytes()[:-100])
    # stored without a key: seen by a server without keys (owner None), by no key of one with keys
    with serving(model, tok, tmp_path, api_key=None) as server:
        r = httpx.get(server.base_url + f"/v1/contexts/{cid}")
        err = error(r, 422, "context_corrupted")
        assert "truncated" in err["message"]


def test_a_stored_context_is_held_in_the_layout_its_file_records(stories, tmp_path):
    """A full-precision file that records ``into`` (`kvcache compress --into q4d`,
    ``CompressedContext.save(into=...)``) is held in that layout by the server's store once loaded."""
    from kv_cache import KVzip, QuantConfig
    from kv_cache.cache.serialize_state import _encode_quant

    model, tok = stories
    ctx = CompressedContext.build(model, tok, DOC, eviction=KVzip(budget=0.5))
    cid = ContextStore(tmp_path, model, tok).add(ctx, {"model": MODEL, "method": "kvzip@0.5",
                                                       "into": _encode_quant(QuantConfig(bits=4, pre_rope=False))})["id"]
    loaded = ContextStore(tmp_path, model, tok).get(cid)  # what a restarted server reads
    assert ctx.cache.quant is None and loaded.cache.quant == QuantConfig(bits=4, pre_rope=False)
    assert loaded.cache.memory_report().codes_bytes > 0


@pytest.mark.parametrize("pause", ["open", "inner", "rename"])
def test_kill_during_compression_leaves_no_partial_entry(stories, tmp_path, pause):
    """SIGKILL a server child while it writes a compressed context (half a temporary file, or a
    complete one at either rename); the folder then holds the earlier context only."""
    model, tok = stories
    store_dir, marker, port = tmp_path / "store", tmp_path / "paused", free_port()
    child, base = start_child(store_dir, marker, port, pause)
    try:
        with httpx.Client(base_url=base, headers=AUTH, timeout=60) as h:
            first = create(h, method="q4d")  # written before the pause
            pool = ThreadPoolExecutor(1)
            pending = pool.submit(h.post, "/v1/contexts", json={"document": DOC, "method": "q4+kvzip@0.5"})
            deadline = time.monotonic() + 120
            while not marker.exists():
                if time.monotonic() > deadline or child.poll() is not None:
                    pytest.fail("the child never reached the write")
                time.sleep(0.05)
            partial = sorted(p.name for p in store_dir.iterdir() if p.name.startswith(".tmp-"))
            assert partial, "the kill must come in the middle of a write"
            child.kill()  # SIGKILL
            child.wait(timeout=30)
            with pytest.raises(httpx.HTTPError):
                pending.result(timeout=30)
            pool.shutdown()
    finally:
        if child.poll() is None:
            child.kill()
            child.wait(timeout=30)
        child.stderr.close()

    store = ContextStore(store_dir, model, tok)  # what a restarted server sees
    listed = store.list(key_id(KEY, store.owner_salt))
    assert [d["id"] for d in listed] == [first["id"]] and listed[0]["status"] == "ready"
    assert not [p.name for p in store_dir.iterdir() if p.name.startswith(".tmp-")]
    assert sorted(p.name for p in store_dir.iterdir()) == [SALT_FILE, f"{first['id']}.kvc"]
    assert store.get(first["id"], key_id(KEY, store.owner_salt)).ask(QUESTION, max_new_tokens=4)


# ------------------------------------------------------------------------------ the store
def test_lru_capped_in_bytes_and_temp_files_removed(stories, tmp_path):
    model, tok = stories
    (tmp_path / ".tmp-ctx-0123456789abcdef01234567.kvc").write_bytes(b"half a file")
    a = CompressedContext.build(model, tok, DOC)
    size = a.cache.memory_report().total_bytes
    store = ContextStore(tmp_path, model, tok, cache_bytes=size + size // 2)
    assert not [p for p in tmp_path.iterdir() if p.name.startswith(".tmp-")] and store.list() == []
    ida = store.add(a, {"model": MODEL, "method": "full"})["id"]
    idb = store.add(CompressedContext.build(model, tok, DOC), {"model": MODEL, "method": "full"})["id"]
    assert store.cached_ids() == [idb] and store.held_bytes == size <= store.cache_bytes
    loaded = store.get(ida)  # read from its file; b goes
    assert store.cached_ids() == [ida] and store.get(ida) is loaded
    nothing = ContextStore(tmp_path, model, tok, cache_bytes=0)
    assert nothing.get(ida) is not nothing.get(ida) and nothing.cached_ids() == [] and nothing.held_bytes == 0
    with pytest.raises(ValueError, match="cache_bytes must be an int >= 0; got -1"):
        ContextStore(tmp_path, model, tok, cache_bytes=-1)


# ------------------------------------------------------------------------------ SIGTERM
def _start_child(store_dir, marker, port, pause="none", *extra):
    return start_child(store_dir, marker, port, pause, *extra)


def _stop(child):
    if child.poll() is None:
        child.kill()
        child.wait(timeout=30)
    child.stderr.close()


def test_sigterm_during_a_write_finishes_it_and_exits(stories, tmp_path):
    """SIGTERM while a context is being written (paused 3 s at its rename): the write completes,
    the request is answered, the process exits 0 within the shutdown timeout, no partial file."""
    model, tok = stories
    store_dir, marker = tmp_path / "store", tmp_path / "paused"
    child, base = _start_child(store_dir, marker, free_port(), "sleep-rename")
    try:
        with httpx.Client(base_url=base, headers=AUTH, timeout=60) as h:
            first = create(h, method="q4d")
            pool = ThreadPoolExecutor(1)
            pending = pool.submit(h.post, "/v1/contexts", json={"document": DOC, "method": "q4d"})
            deadline = time.monotonic() + 60
            while not marker.exists():
                assert time.monotonic() < deadline and child.poll() is None, "the child never reached the write"
                time.sleep(0.02)
            child.send_signal(signal.SIGTERM)
            # ended by itself (uvicorn re-raises the signal once stopped), not by the watchdog that
            # ends a process still there at --shutdown-timeout (10 s) + 0.5 s with status 1
            assert child.wait(timeout=30) in (0, -signal.SIGTERM)
            second = pending.result(timeout=30)
            pool.shutdown()
    finally:
        _stop(child)
    assert second.status_code == 201, second.text
    store = ContextStore(store_dir, model, tok)
    assert sorted(d["id"] for d in store.list(ANY_OWNER)) == sorted([first["id"], second.json()["id"]])
    assert all(d["status"] == "ready" for d in store.list(ANY_OWNER))
    assert not [p.name for p in store_dir.iterdir() if p.name != SALT_FILE and (not p.name.endswith(".kvc")
                                                                              or p.name.startswith("."))]


def test_sigterm_while_answering_stops_within_bounded_time(tmp_path):
    """SIGTERM while one answer streams and others wait: the stream ends, the waiting requests
    are answered 503 ``shutting_down``, the process exits within seconds."""
    store_dir, port = tmp_path / "store", free_port()
    child, base = _start_child(store_dir, tmp_path / "unused", port, "none", "--queue-size", "8",
                               "--shutdown-timeout", "6")
    results: list = []
    try:
        oc = openai.OpenAI(base_url=base + "/v1", api_key=KEY, max_retries=0, timeout=60)
        first_chunk = threading.Event()

        def stream():
            got = []
            try:
                for c in oc.chat.completions.create(model=MODEL, messages=[{"role": "user", "content": "Once"}],
                                                    max_tokens=500, temperature=1.0, stream=True):
                    got.append(c)
                    first_chunk.set()
            except Exception as exc:  # the connection closed mid-stream
                got.append(exc)
            results.append(("stream", got))

        def waiting():
            try:
                r = httpx.post(base + "/v1/chat/completions", headers=AUTH, timeout=60,
                               json={"model": MODEL, "messages": [{"role": "user", "content": "Once"}],
                                     "max_tokens": 500})
                results.append(("wait", r.status_code))
            except httpx.HTTPError as exc:
                results.append(("wait", exc))

        threads = [threading.Thread(target=stream)] + [threading.Thread(target=waiting) for _ in range(4)]
        threads[0].start()
        assert first_chunk.wait(60)
        for t in threads[1:]:  # queued behind the stream
            t.start()
        # the four requests queue behind the stream: watch /health's queue depth rather than sleep
        # (a fixed sleep was too short on a loaded machine and, at 2 s, longer than the whole
        # stream on a fast one)
        deadline = time.monotonic() + 30
        while httpx.get(base + "/health", timeout=5).json()["waiting"] < 4:
            assert time.monotonic() < deadline, "the four requests never queued"
            time.sleep(0.01)
        assert not any(kind == "stream" for kind, _ in results), "the stream ended before the signal"
        child.send_signal(signal.SIGTERM)
        # ended by itself within --shutdown-timeout (6 s here): the watchdog would have ended it
        # with status 1 at 6.5 s
        assert child.wait(timeout=30) in (0, -signal.SIGTERM)
        for t in threads:
            t.join(timeout=30)
    finally:
        _stop(child)
    streamed = next(r for kind, r in results if kind == "stream")
    assert len(streamed) < 400, "the stream was stopped, not run to its end"
    statuses = [r for kind, r in results if kind == "wait"]
    assert statuses == [503] * 4, statuses  # queued when the signal came: answered shutting_down
    assert not [p for p in store_dir.iterdir() if p.name.startswith(".tmp-")]


def test_shutdown_during_a_long_compression_answers_at_once_and_writes_nothing(stories, tmp_path, monkeypatch):
    """What SIGTERM does (uvicorn's handle_exit: Engine.begin_shutdown, then should_exit) while a
    compression runs for a long time: its request is answered 503 at once, the server stops
    without waiting for the work, and the compression, when it ends, writes nothing. The build is
    held (a large document) until the server has stopped: no race with the clock."""
    import kv_cache.integrations.serve.service as service_module

    model, tok = stories
    building, built, release = threading.Event(), threading.Event(), threading.Event()
    real = CompressedContext.build

    class SlowContext(CompressedContext):
        @classmethod
        def build(cls, *a, **kw):
            building.set()
            release.wait(120)  # a large document: it builds until the test lets it go
            try:
                return real(*a, **kw)
            finally:
                built.set()

    monkeypatch.setattr(service_module, "CompressedContext", SlowContext)
    store_dir = tmp_path / "store"
    try:
        with serving(model, tok, store_dir, shutdown_timeout=10) as server:
            orig, ended = server.service.compress, threading.Event()

            def compress(prep, job):  # the whole job, its write (refused) included
                try:
                    return orig(prep, job)
                finally:
                    ended.set()

            server.service.compress = compress
            pool = ThreadPoolExecutor(1)
            pending = pool.submit(httpx.post, server.base_url + "/v1/contexts", headers=AUTH, timeout=60,
                                  json={"document": DOC, "method": "q4d"})
            assert building.wait(60)
            server.engine.begin_shutdown()  # what the CLI's Server.handle_exit starts on SIGTERM
            server.should_exit = True
            r = pending.result(timeout=60)
            error(r, 503, "shutting_down")
            assert not built.is_set()  # answered while the build still runs
            pool.shutdown()
            server.thread.join(timeout=60)
            assert not server.thread.is_alive() and not built.is_set()  # stopped without waiting for the build
        release.set()
        assert built.wait(60) and ended.wait(60)  # the compression ended after the shutdown
    finally:
        release.set()
    assert [p.name for p in store_dir.iterdir()] == [SALT_FILE]  # nothing written
