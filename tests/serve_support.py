"""Helpers of the ``kvcache serve`` tests: a server on 127.0.0.1 in a thread, requests, checks."""

from __future__ import annotations

import hashlib
import socket
import subprocess
import sys
import threading
import time
from contextlib import contextmanager
from pathlib import Path

import uvicorn

from kv_cache.integrations.serve import build

MODEL = "stories260K"
KEY = "test-key"
AUTH = {"Authorization": f"Bearer {KEY}"}
DOC = ("Once upon a time, there was a little girl named Lily. She loved to play outside in the park. "
       "One day, she saw a big red ball near the tree. She ran to the ball and picked it up. ") * 2
QUESTION = "Lily went to the"
REPO = Path(__file__).resolve().parents[1]


@contextmanager
def serving(model, tok, store_dir, **kw):
    """``kvcache serve``'s app on 127.0.0.1 (a socket bound here, port chosen by the OS), in a thread."""
    app, service, engine = build(model, tok, str(store_dir), model_id=MODEL, api_key=kw.pop("api_key", KEY), **kw)
    sock = socket.socket()
    sock.bind(("127.0.0.1", 0))
    port = sock.getsockname()[1]
    server = uvicorn.Server(uvicorn.Config(app, log_level="warning", lifespan="on"))
    thread = threading.Thread(target=server.run, kwargs={"sockets": [sock]}, daemon=True)
    thread.start()
    deadline = time.monotonic() + 30
    while not server.started:
        if time.monotonic() > deadline or not thread.is_alive():
            raise RuntimeError("the test server did not start within 30 s")
        time.sleep(0.02)
    server.base_url, server.service, server.engine = f"http://127.0.0.1:{port}", service, engine
    server.thread = thread
    try:
        yield server
    finally:
        server.should_exit = True
        thread.join(timeout=30)
        sock.close()


def create(http, document=DOC, **body):
    r = http.post("/v1/contexts", json={"document": document, **body})
    assert r.status_code == 201, r.text
    return r.json()


def ask(client, cid, question=QUESTION, **kw):
    kw.setdefault("temperature", 0)
    kw.setdefault("max_tokens", 12)
    return client.chat.completions.create(model=MODEL, messages=[{"role": "user", "content": question}],
                                          extra_body={"context_id": cid} if cid else None, **kw)


def error(r, status, code):
    assert r.status_code == status, r.text
    err = r.json()["error"]
    assert err["code"] == code and isinstance(err["message"], str) and err["message"] and err["type"], err
    return err


def sha(path: Path) -> str:
    return hashlib.sha256(path.read_bytes()).hexdigest()




def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def start_child(store_dir, marker, port, pause="none", *extra, skip: int = 1):
    """``kvcache serve`` in a child process (tests/serve_child.py: it pauses its write number
    ``skip + 1`` at ``pause``), on 127.0.0.1:``port`` with one key and --shutdown-timeout 10 (the
    ``extra`` flags come last and win); ``(child, base url)`` once ``/health`` answers."""
    import httpx
    import pytest

    cmd = [sys.executable, str(REPO / "tests" / "serve_child.py"), pause, str(skip), str(marker), "--", "--model",
           MODEL, "--store", str(store_dir), "--port", str(port), "--api-key", KEY, "--log-level", "warning",
           "--shutdown-timeout", "10", "--no-access-log", *extra]
    child = subprocess.Popen(cmd, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE)
    base = f"http://127.0.0.1:{port}"
    deadline = time.monotonic() + 120
    while True:
        if child.poll() is not None:
            pytest.fail(f"the server child exited: {child.stderr.read().decode()[-2000:]}")
        try:
            if httpx.get(base + "/health", timeout=2).status_code == 200:
                return child, base
        except httpx.HTTPError:
            pass
        if time.monotonic() > deadline:
            child.kill()
            pytest.fail("the server child did not start within 120 s")
        time.sleep(0.2)
