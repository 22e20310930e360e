"""``kvcache serve``'s store: restart with persistence, a corrupted or truncated file (422), a
SIGKILL in the middle of a write (child process, three points), the LRU capped in bytes."""

from __future__ import annotations

import subprocess
import sys
import time
from concurrent.futures import ThreadPoolExecutor
import pytest

pytest.importorskip("fastapi", reason="needs the serve extra: pip install 'kv_cache[serve]'")
httpx = pytest.importorskip("httpx")
openai = pytest.importorskip("openai", reason="the tests drive the server with the openai client")

from kv_cache import CompressedContext  # noqa: E402
from kv_cache.serve.auth import key_id  # noqa: E402
from kv_cache.serve.store import ContextStore  # noqa: E402
from serve_support import AUTH, DOC, KEY, MODEL, QUESTION, REPO, ask, create, error, free_port, serving  # noqa: E402


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


@pytest.mark.parametrize("pause", ["open", "inner", "rename"])
def test_kill_during_compression_leaves_no_partial_entry(stories, tmp_path, pause):
    """SIGKILL a server child while it writes a compressed context (half a temporary file, or a
    complete one at either rename); the folder then holds the earlier context only."""
    model, tok = stories
    store_dir, marker, port = tmp_path / "store", tmp_path / "paused", free_port()
    cmd = [sys.executable, str(REPO / "tests" / "serve_child.py"), pause, "1", str(marker), "--", "--model", MODEL,
           "--store", str(store_dir), "--port", str(port), "--api-key", KEY, "--log-level", "warning"]
    child = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.PIPE)
    base = f"http://127.0.0.1:{port}"
    try:
        deadline = time.monotonic() + 120
        while True:
            if child.poll() is not None:
                pytest.fail(f"the server child exited: {child.stderr.read().decode()[-2000:]}")
            try:
                if httpx.get(base + "/health", timeout=2).status_code == 200:
                    break
            except httpx.HTTPError:
                pass
            if time.monotonic() > deadline:
                pytest.fail("the server child did not start within 120 s")
            time.sleep(0.2)
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
        child.stdout.close()
        child.stderr.close()

    store = ContextStore(store_dir, model, tok)  # what a restarted server sees
    listed = store.list(key_id(KEY))
    assert [d["id"] for d in listed] == [first["id"]] and listed[0]["status"] == "ready"
    assert not [p.name for p in store_dir.iterdir() if p.name.startswith(".tmp-")]
    assert sorted(p.name for p in store_dir.iterdir()) == [f"{first['id']}.kvc"]
    assert store.get(first["id"], key_id(KEY)).ask(QUESTION, max_new_tokens=4)


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
