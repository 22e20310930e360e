"""``kvcache serve`` load and soak: many clients for a fixed time, some of them hostile.

One ``kvcache serve`` process on 127.0.0.1 (stories260K by default, float32, CPU) with four API
keys at the server's default body limit (8 MiB), ``--body-timeout 5``, and ``--clients`` threads
(64) for ``--seconds`` (60). A tenth of the clients, and at least one of each kind below, are
hostile (issue 43); each hostile client keeps to one kind (:func:`hostile_kinds`: every kind
once, then more of the weighted ones) and loops over it:

* ``fuzz``: a body up to the 8 MiB limit built to hit one parser's worst case (escaped quotes,
  backslashes, brackets in and out of strings, runs of digits in numbers, a method spec and a
  preset, the most messages, long unicode, a long stop string or id);
* ``oversized``: a body past the limit (413), sent with and without ``Content-Length``;
* ``deep``: 100,000-deep JSON (400);
* ``slowloris``: headers sent a byte at a time, or a body that trickles past ``--body-timeout``
  (408), on raw sockets;
* ``cancelled``: a streaming chat closed after its first chunk, or a compression whose client
  disconnects before the answer;
* ``bad``: the hand-written bad requests (paths in specs, a plan naming a file, a wrong key,
  another key's context, ``max_tokens`` past the limit, invalid UTF-8, a non-JSON content type);
* ``unknown_key``: every route behind the keys asked with a key the server does not have (a
  random one, a real key cut short, extended or upper-cased, another scheme, Basic auth, no key,
  ``Bearer`` alone, a 4,000-character key, a Latin-1 one): 401 each time.

The others are ordinary clients, each with a key, looping over weighted actions: ``compress``
(``POST /v1/contexts`` of a short story with a method drawn from a few), ``ask`` / ``stream`` (a
greedy chat from one of the contexts this client stored, or without one), ``delete`` (one of its
contexts, or, when it holds none, a missing id: 404) and ``list``. Each ordinary client deletes
only what it stored, so every well-formed request has one right answer.

Checked and reported: every status by action; **5xx other than 503/504 must be zero**; hostile
requests get 4xx (or their connection closed: slowloris, cancelled; or 503 when the server is
busy, its queue or its budget of bodies in flight full), an unknown key 401 always; every
ordinary answer is right (``malformed``: 201 / 200 with a well-formed body, a non-empty answer
and, for a stream, chunks ending in ``[DONE]``; or 503 / 429 with an error body when busy; 404
only for the missing id; no other status, no connection error); ``/health`` polled every 0.1 s
from a process of its own (every answer 200; p50 / p99 / max latency reported: **p99 under
200 ms** for ``ok``); the server's RSS just before the load (``start_rss_mib``), sampled every
0.25 s (peak, last) and its ``VmHWM``; after the load the server gets SIGTERM (exit status and
time to exit reported), then every stored context is opened and loaded with its checksums
verified (``ContextStore.get``), and the folder must hold no temporary file; no access-log line
holds a key, a real one or an unknown one. Bounded: every request has a timeout, the load stops
at ``--seconds``. Loopback only.

:func:`run` takes the configuration as keywords and returns the result (tests/test_serve_soak.py
runs a short one: 16 clients for 20 s). Run: ``python benchmarks/bench_serve_soak.py [--clients
64] [--seconds 60] [--model stories260K] [--out benchmarks/results/]`` (``make soak``); the
results are written as ``bench_serve_soak_<model>_c<clients>_t<seconds>.{json,md}``.
"""

from __future__ import annotations

import argparse
import base64
import collections
import json
import os
import random
import signal
import socket
import subprocess
import sys
import tempfile
import threading
import time
from pathlib import Path

KEYS = ["soak-a", "soak-b", "soak-c", "soak-d"]
DOCS = ["Once upon a time, there was a little girl named Lily. She loved to play outside in the park. ",
        "Tom had a big red ball. He played with his dog in the garden every day after school. ",
        "The sun was hot and the sky was blue. Sue and her mom went to the beach to see the fish. "]
METHODS = ["q4d", "q4+kvzip@0.5", "q2d", "full", "4x"]
QUESTIONS = ["Lily went to the", "The ball was", "One day, she saw", "They played with"]
ACTIONS = {"compress": 2, "ask": 4, "stream": 3, "delete": 1, "list": 1}
HOSTILE = {"fuzz": 3, "oversized": 1, "deep": 1, "slowloris": 1, "cancelled": 2, "bad": 2, "unknown_key": 1}
BODY_LIMIT = 8 << 20  # the server's default --max-body-bytes
BODY_TIMEOUT = 5
MAX_TOKENS = 16
HEALTH_P99_S = 0.2
BUSY = (429, 503)  # a well-formed request's answer when the queue, a key's share or its quota is full


def hostile_kinds(n: int) -> list[str]:
    """The kinds of ``n`` hostile clients: each kind of :data:`HOSTILE` once (for ``n`` at least
    as many as the kinds), then in turn by weight."""
    by_weight = [k for w in range(max(HOSTILE.values())) for k, kw in HOSTILE.items() if kw > w]
    return [by_weight[i % len(by_weight)] for i in range(n)]


def _mem(pid: int) -> dict[str, float]:
    out = {}
    try:
        for line in Path(f"/proc/{pid}/status").read_text().splitlines():
            if line.startswith(("VmRSS:", "VmHWM:")):
                out[line.split(":")[0]] = int(line.split()[1]) / 1024
    except OSError:
        pass
    return out


def fuzz_bodies(model: str, limit: int = BODY_LIMIT) -> list[tuple[str, str, bytes]]:
    """``(name, route, body)``: bodies up to ``limit`` bytes built to hit each parser's worst case
    (as tests/test_serve_linear.py sends them)."""
    n = limit - 256
    msg = b'{"role":"user","content":"a"},'
    chat = {"model": model, "messages": [{"role": "user", "content": "hi"}]}
    out = [
        ("escaped quotes", "/v1/contexts", b'{"document": "' + b'\\"' * (n // 2) + b'"}'),
        ("backslashes", "/v1/contexts", b'{"document": "' + b"\\\\" * (n // 2) + b'"}'),
        ("bare quotes", "/v1/contexts", b'"' * n),
        ("open brackets", "/v1/chat/completions", b"[" * n),
        ("brackets in a string", "/v1/contexts", b'{"document": "' + b"[{" * (n // 2) + b'"}'),
        ("integer digits", "/v1/chat/completions", b'{"max_tokens": ' + b"1" * n + b"}"),
        ("fraction digits", "/v1/chat/completions", b'{"max_tokens": 1.' + b"1" * n + b"}"),
        ("method digits", "/v1/contexts", b'{"document": "hi", "method": "kvpress-snapkv@' + b"1" * n + b'x"}'),
        ("preset digits", "/v1/contexts", b'{"document": "hi", "preset": "' + b"1" * n + b'y"}'),
        ("many messages", "/v1/chat/completions", b'{"model": "%s", "messages": [' % model.encode()
         + msg * (n // len(msg) - 1) + msg[:-1] + b"]}"),
        ("long unicode", "/v1/contexts", json.dumps({"document": "\u00e9\u6f22" * 499_000},
                                                    ensure_ascii=False).encode()),
        ("astral escapes", "/v1/contexts", json.dumps({"document": "\U0001F600" * 249_000}).encode()),
        ("long stop", "/v1/chat/completions", json.dumps({**chat, "stop": ["x" * (n - 200)]}).encode()),
        ("long context id", "/v1/chat/completions", json.dumps({**chat, "context_id": "c" * (n - 200)}).encode()),
    ]
    return [(name, route, body) for name, route, body in out if len(body) <= limit]


def _bad(rng: random.Random, key: str, other_ids: list[str], model: str) -> tuple[str, str, dict, bytes | None]:
    """(name, route, headers, body) of one hand-written bad request."""
    auth = {"Authorization": f"Bearer {key}", "content-type": "application/json"}
    chat = {"model": model, "messages": [{"role": "user", "content": "hi"}]}
    cases = [
        ("path spec", "/v1/contexts", auth, json.dumps({"document": DOCS[0], "method": "plan[/etc/passwd]"})),
        ("scorer path", "/v1/contexts", auth, json.dumps({"document": DOCS[0], "method": "kvzap@0.25[/etc/hosts]"})),
        ("plan names a file", "/v1/contexts", auth, json.dumps({"document": DOCS[0], "plan": {
            "format": "kv_cache.cache_plan", "version": 1, "layout": {"rotation": "calibrated",
                                                                       "rotation_path": "/etc/passwd"}}})),
        ("huge int", "/v1/chat/completions", auth, "1" * 5000),
        ("invalid utf-8", "/v1/chat/completions", auth, b"\xff\xfe{"),
        ("not json", "/v1/chat/completions", {**auth, "content-type": "text/plain"}, json.dumps(chat)),
        ("wrong key", "/v1/contexts", {"Authorization": "Bearer nope"}, None),
        ("other key's context", "/v1/chat/completions", auth,
         json.dumps({**chat, "context_id": rng.choice(other_ids) if other_ids else "ctx-" + "0" * 24})),
        ("path as id", "/v1/chat/completions", auth, json.dumps({**chat, "context_id": "../../etc/passwd"})),
        ("max_tokens past the limit", "/v1/chat/completions", auth, json.dumps({**chat, "max_tokens": 10**6})),
    ]
    name, route, headers, body = rng.choice(cases)
    return name, route, headers, body.encode() if isinstance(body, str) else body


def _slowloris(port: int, rng: random.Random, key: str) -> str:
    """Headers a byte at a time for about 3 s, or a body that trickles past --body-timeout; the
    status line the server sent, or how the connection ended."""
    import socket as socketlib

    with socketlib.create_connection(("127.0.0.1", port), timeout=BODY_TIMEOUT + 10) as sock:
        if rng.random() < 0.5:  # slow headers, then give up
            head = f"POST /v1/contexts HTTP/1.1\r\nHost: 127.0.0.1\r\nAuthorization: Bearer {key}\r\n".encode()
            for i in range(len(head)):
                sock.sendall(head[i:i + 1])
                time.sleep(3.0 / len(head))
            return "closed"
        head = (f"POST /v1/contexts HTTP/1.1\r\nHost: 127.0.0.1\r\nAuthorization: Bearer {key}\r\n"
                "Content-Type: application/json\r\nContent-Length: 100000\r\n\r\n").encode()
        sock.sendall(head + b'{"document": "')
        end = time.monotonic() + BODY_TIMEOUT + 5
        try:
            while time.monotonic() < end:
                sock.sendall(b"a")
                sock.settimeout(0.5)
                try:
                    got = sock.recv(200)
                except socketlib.timeout:
                    continue
                if got:
                    return got.split(b"\r\n", 1)[0].decode(errors="replace")
                return "closed"
        except OSError:
            return "closed"
    return "no answer"


def _unknown_key(rng: random.Random, wrong: str, model: str) -> tuple[str, str, str, dict, bytes | None]:
    """(name, method, route, headers, body) of one request with a key the server does not have."""
    real = rng.choice(KEYS)
    auths = [("random key", f"Bearer {wrong}"), ("a key cut short", f"Bearer {real[:-1]}"),
             ("a key extended", f"Bearer {real}x"), ("a key upper-cased", f"Bearer {real.upper()}"),
             ("another scheme", f"Token {real}"),
             ("basic auth", "Basic " + base64.b64encode(f"{real}:".encode()).decode()),
             ("no key", None), ("Bearer alone", "Bearer"), ("a long key", "Bearer " + wrong + "k" * 4000),
             ("a latin-1 key", b"Bearer " + real.encode() + b"\xe9")]
    chat = {"model": model, "max_tokens": 4, "messages": [{"role": "user", "content": "hi"}]}
    routes = [("GET", "/v1/contexts", None), ("GET", "/v1/contexts/ctx-" + "0" * 24, None),
              ("DELETE", "/v1/contexts/ctx-" + "0" * 24, None), ("GET", "/v1/models", None), ("GET", "/metrics", None),
              ("POST", "/v1/contexts", json.dumps({"document": DOCS[0], "method": "q4d"}).encode()),
              ("POST", "/v1/chat/completions", json.dumps(chat).encode())]
    name, auth = rng.choice(auths)
    method, route, body = rng.choice(routes)
    headers = {"content-type": "application/json"} if body is not None else {}
    if auth is not None:
        headers["Authorization"] = auth
    return f"{name}, {method} {route}", method, route, headers, body


def _error_body(payload) -> bool:
    err = payload.get("error") if isinstance(payload, dict) else None
    return isinstance(err, dict) and bool(err.get("code")) and bool(err.get("message"))


def answer_problem(action: str, status: int, payload, sent: dict | None = None) -> str | None:
    """None when an ordinary client's answer is right, else what is wrong with it. ``payload``:
    the JSON body (a stream's: the list of its ``data:`` events, ``[DONE]`` as the string);
    ``sent``: the request's JSON body."""
    if status in BUSY:
        return None if _error_body(payload) else f"{status} without an error body"
    expected = {"compress": 201, "delete_missing": 404}.get(action, 200)
    if status != expected:
        return f"status {status} (expected {expected} or {BUSY}): {str(payload)[:200]}"
    try:
        if action == "compress":
            ok = payload["id"].startswith("ctx-") and payload["object"] == "context" and payload["status"] == "ready"
        elif action == "ask":
            choice = payload["choices"][0]
            ok = (payload["object"] == "chat.completion" and isinstance(choice["message"]["content"], str)
                  and choice["message"]["content"].strip() != "" and choice["finish_reason"] in ("stop", "length")
                  and payload["usage"]["completion_tokens"] >= 1
                  and payload.get("context_id") == (sent or {}).get("context_id"))
        elif action == "stream":
            *chunks, done = payload
            text = "".join(c["choices"][0]["delta"].get("content") or "" for c in chunks if c["choices"])
            ok = (done == "[DONE]" and chunks and all(c["object"] == "chat.completion.chunk" and "error" not in c
                                                      for c in chunks)
                  and text.strip() != "" and chunks[-1]["choices"][0]["finish_reason"] in ("stop", "length"))
        elif action == "delete":
            ok = payload["deleted"] is True and payload["object"] == "context.deleted"
        elif action == "delete_missing":
            ok = _error_body(payload)
        else:  # list
            ok = payload["object"] == "list" and all(d["id"].startswith("ctx-") for d in payload["data"])
    except (KeyError, IndexError, TypeError, AttributeError, ValueError):
        ok = False
    return None if ok else f"malformed {status} body: {str(payload)[:200]}"


def _stream_events(r) -> list:
    """The ``data:`` events of a streamed answer, JSON-decoded (``[DONE]`` kept as the string)."""
    out = []
    for line in r.iter_lines():
        if line.startswith("data: "):
            data = line[len("data: "):]
            out.append(data if data == "[DONE]" else json.loads(data))
    return out


def run(*, model: str = "stories260K", clients: int = 64, seconds: float = 60.0, queue_size: int = 32,
        hostile: int | None = None, request_timeout: float = 30.0, health_timeout: float = 10.0,
        shutdown_timeout: float = 10.0, work_dir: str | os.PathLike | None = None) -> dict:
    """One soak; the result as a dict (:func:`table` renders it).

    ``clients`` threads for ``seconds``, ``hostile`` of them hostile (default: a tenth, at least
    one of each kind: :func:`hostile_kinds`), against ``kvcache serve --model model --queue-size
    queue_size --request-timeout request_timeout --shutdown-timeout shutdown_timeout``;
    ``/health`` polled with a ``health_timeout`` per poll. The server's store, keys file and log
    go to ``work_dir`` (default: a new temporary folder; kept, its path in the result)."""
    import httpx

    from kv_cache.models import load_model
    from kv_cache.integrations.serve.store import ANY_OWNER, ContextStore

    n_hostile = max(len(HOSTILE), clients // 10) if hostile is None else hostile
    if not 0 <= n_hostile < clients:
        raise ValueError(f"hostile clients must be >= 0 and fewer than the clients ({clients}); got {n_hostile}")
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    work = Path(work_dir) if work_dir is not None else Path(tempfile.mkdtemp(prefix="kvcache-soak-"))
    work.mkdir(parents=True, exist_ok=True)
    store, keys_file = work / "store", work / "keys.txt"
    keys_file.write_text("# soak keys\n" + "\n".join(KEYS) + "\n")
    env = {**os.environ, "MALLOC_MMAP_THRESHOLD_": os.environ.get("MALLOC_MMAP_THRESHOLD_", str(1 << 20))}
    cmd = [sys.executable, "-m", "kv_cache.cli", "serve", "--model", model, "--store", str(store),
           "--port", str(port), "--api-keys-file", str(keys_file), "--log-level", "error",
           "--body-timeout", str(BODY_TIMEOUT), "--max-tokens", "64", "--queue-size", str(queue_size),
           "--request-timeout", str(request_timeout), "--max-contexts-per-key", "40",
           "--shutdown-timeout", str(shutdown_timeout)]
    log_path = work / "server.log"  # the access log (one JSON line a request) and errors
    log_file = open(log_path, "wb")
    server = subprocess.Popen(cmd, env=env, stdout=subprocess.DEVNULL, stderr=log_file)
    base = f"http://127.0.0.1:{port}"
    deadline = time.monotonic() + 300
    while True:
        if server.poll() is not None:
            log_file.close()
            raise RuntimeError(f"the server exited: {log_path.read_text(errors='replace')[-2000:]}")
        try:
            if httpx.get(base + "/health", timeout=2).status_code == 200:
                break
        except httpx.HTTPError:
            pass
        if time.monotonic() > deadline:
            server.kill()
            server.wait(30)
            log_file.close()
            raise RuntimeError("the server did not start in 300 s")
        time.sleep(0.3)
    model_name = httpx.get(base + "/v1/models", headers={"Authorization": f"Bearer {KEYS[0]}"}).json()["data"][0]["id"]

    lock = threading.Lock()
    counts: dict[str, collections.Counter] = collections.defaultdict(collections.Counter)
    latencies: dict[str, list[float]] = collections.defaultdict(list)
    bad: list[str] = []  # 5xx other than 503/504; hostile requests not 4xx (or closed, or busy: 503)
    malformed: list[str] = []  # ordinary clients' wrong answers (status, body, a connection error)
    owned: dict[int, list[str]] = {i: [] for i in range(n_hostile, clients)}  # an ordinary client's stored
    # contexts (it alone deletes them)
    wrong_keys: list[str] = []  # the unknown keys sent: no log line may hold one
    peak = {"rss": 0.0, "first": None, "last": 0.0}
    stop = threading.Event()
    fuzz = fuzz_bodies(model_name)
    kinds = hostile_kinds(n_hostile)

    def sample() -> None:
        while not stop.is_set():
            rss = _mem(server.pid).get("VmRSS", 0.0)
            peak["rss"] = max(peak["rss"], rss)
            peak["first"] = rss if peak["first"] is None else peak["first"]
            peak["last"] = rss
            time.sleep(0.25)

    # /health is polled from a process of its own: in this one, 64 client threads would queue the
    # poller behind their own GIL and the figure would be the load generator's, not the server's.
    # It polls until the load has ended (the stop file), at most seconds + 600.
    health_file, stop_file = work / "health.jsonl", work / "health.stop"
    poller_src = (
        "import json, os, sys, time, httpx\n"
        "base, out, stop = sys.argv[1], open(sys.argv[2], 'w'), sys.argv[3]\n"
        "end = time.monotonic() + float(sys.argv[4])\n"
        "with httpx.Client(base_url=base, timeout=float(sys.argv[5])) as h:\n"
        "    while time.monotonic() < end:\n"
        "        done = os.path.exists(stop)\n"
        "        t0 = time.perf_counter()\n"
        "        try:\n"
        "            code = h.get('/health').status_code\n"
        "        except httpx.HTTPError as exc:\n"
        "            code = type(exc).__name__\n"
        "        out.write(json.dumps([code, time.perf_counter() - t0]) + '\\n')\n"
        "        out.flush()\n"
        "        if done:\n"
        "            break\n"
        "        time.sleep(0.1)\n")

    def record(action: str, status: int | str, t0: float, hostile: str | None = None, expect: int | None = None,
               problem: str | None = None) -> None:
        with lock:
            counts[action][status] += 1
            if isinstance(status, int) and status < 300:
                latencies[action].append(time.perf_counter() - t0)
            if isinstance(status, int) and status >= 500 and status not in (503, 504):
                bad.append(f"{action}: {status}")
            elif hostile and status != "closed" and not (isinstance(status, int) and 400 <= status < 500
                                                         and (expect is None or status == expect)) \
                    and not (status == 503 and expect != 401):  # busy (the queue, the bodies in flight)
                bad.append(f"hostile {hostile}: {status}")
            if problem:
                malformed.append(f"{action}: {problem}")

    def hostile_client(i: int, kind: str) -> None:
        rng = random.Random(1000 + i)
        key = KEYS[i % len(KEYS)]
        auth = {"Authorization": f"Bearer {key}", "content-type": "application/json"}
        wrong = f"wrong-{rng.getrandbits(64):016x}"
        with lock:
            wrong_keys.append(wrong)
        while time.monotonic() < end:
            t0 = time.perf_counter()
            try:
                if kind == "fuzz":
                    name, route, body = rng.choice(fuzz)
                    r = httpx.post(base + route, headers=auth, content=body, timeout=60)
                    record(kind, r.status_code, t0, name)
                elif kind == "oversized":
                    if rng.random() < 0.5:
                        r = httpx.post(base + "/v1/contexts", headers=auth, content=b" " * (BODY_LIMIT + 1), timeout=60)
                    else:  # no Content-Length: counted as it is read
                        r = httpx.post(base + "/v1/contexts", headers=auth, timeout=60,
                                       content=(b" " * (1 << 20) for _ in range(BODY_LIMIT // (1 << 20) + 2)))
                    record(kind, r.status_code, t0, "oversized", 413)
                elif kind == "deep":
                    r = httpx.post(base + "/v1/chat/completions", headers=auth, timeout=60,
                                   content=b"[" * 100_000 + b"]" * 100_000)
                    record(kind, r.status_code, t0, "deep", 400)
                elif kind == "slowloris":
                    line = _slowloris(port, rng, key)
                    status = int(line.split()[1]) if line.startswith("HTTP/") else line
                    record(kind, status, t0, "slowloris")
                elif kind == "cancelled":
                    if rng.random() < 0.5:
                        body = {"model": model_name, "max_tokens": 64, "stream": True,
                                "messages": [{"role": "user", "content": rng.choice(QUESTIONS)}]}
                        with httpx.Client(base_url=base, headers=auth, timeout=60) as h:
                            with h.stream("POST", "/v1/chat/completions", json=body) as r:
                                next(r.iter_lines(), None)  # the first chunk, then the client goes away
                                status = "closed" if r.status_code == 200 else r.status_code
                        record(kind, status, t0)  # a well-formed request: 503 / 429 when busy
                    else:
                        try:
                            r = httpx.post(base + "/v1/contexts", headers=auth, timeout=0.05,
                                           json={"document": rng.choice(DOCS) * 3, "method": "q4+kvzip@0.5"})
                            record(kind, r.status_code, t0)  # answered within 0.05 s: busy, most likely
                        except httpx.TimeoutException:
                            record(kind, "closed", t0, "cancelled compression")
                elif kind == "unknown_key":
                    name, method, route, headers, body = _unknown_key(rng, wrong, model_name)
                    r = httpx.request(method, base + route, headers=headers, content=body, timeout=60)
                    record(kind, r.status_code, t0, name, 401)
                else:
                    with lock:
                        others = [c for j, ids in owned.items() if KEYS[j % len(KEYS)] != key for c in ids]
                    name, route, headers, body = _bad(rng, key, others, model_name)
                    r = httpx.post(base + route, headers=headers, content=body, timeout=60)
                    record(kind, r.status_code, t0, name)
            except httpx.HTTPError as exc:
                record(kind, type(exc).__name__, t0, kind)

    def client(i: int) -> None:
        rng = random.Random(i)
        key = KEYS[i % len(KEYS)]
        mine = owned[i]
        names, weights = zip(*ACTIONS.items())
        with httpx.Client(base_url=base, headers={"Authorization": f"Bearer {key}"}, timeout=60) as h:
            while time.monotonic() < end:
                action = rng.choices(names, weights)[0]
                t0, status, payload, sent = time.perf_counter(), None, None, None
                try:
                    if action == "compress":
                        sent = {"document": rng.choice(DOCS) * rng.randint(1, 3), "method": rng.choice(METHODS)}
                        r = h.post("/v1/contexts", json=sent)
                        status, payload = r.status_code, r.json()
                        if status == 201 and isinstance(payload, dict) and isinstance(payload.get("id"), str):
                            with lock:
                                mine.append(payload["id"])
                    elif action in ("ask", "stream"):
                        sent = {"model": model_name, "temperature": 0, "max_tokens": MAX_TOKENS,
                                "messages": [{"role": "user", "content": rng.choice(QUESTIONS)}],
                                "stream": action == "stream"}
                        with lock:
                            ids = list(mine)
                        if ids and rng.random() < 0.8:
                            sent["context_id"] = rng.choice(ids)
                        if action == "stream":
                            with h.stream("POST", "/v1/chat/completions", json=sent) as r:
                                status = r.status_code
                                payload = _stream_events(r) if status == 200 else json.loads(r.read())
                        else:
                            r = h.post("/v1/chat/completions", json=sent)
                            status, payload = r.status_code, r.json()
                    elif action == "delete":
                        with lock:
                            cid = mine.pop(rng.randrange(len(mine))) if mine else None
                        if cid is None:
                            action = "delete_missing"
                        r = h.delete(f"/v1/contexts/{cid or 'ctx-' + '0' * 24}")
                        status, payload = r.status_code, r.json()
                        if status in BUSY and cid is not None:
                            with lock:
                                mine.append(cid)
                    else:
                        r = h.get("/v1/contexts")
                        status, payload = r.status_code, r.json()
                    record(action, status, t0, problem=answer_problem(action, status, payload, sent))
                except httpx.HTTPError as exc:
                    record(action, type(exc).__name__, t0, problem=f"{type(exc).__name__}: {exc}")
                except ValueError as exc:  # a body that is not JSON
                    record(action, status if status is not None else "ValueError", t0, problem=f"not JSON: {exc}")
                if status == 503:
                    time.sleep(0.05 + rng.random() * 0.2)  # Retry-After, shortened

    sampler = threading.Thread(target=sample, daemon=True)
    sampler.start()
    start_mem = _mem(server.pid)  # the server idle, just before the load
    poller = subprocess.Popen([sys.executable, "-c", poller_src, base, str(health_file), str(stop_file),
                               str(seconds + 600), str(health_timeout)])
    t_start = time.perf_counter()
    end = time.monotonic() + seconds
    threads = [threading.Thread(target=hostile_client, args=(i, kinds[i]), daemon=True) if i < n_hostile else
               threading.Thread(target=client, args=(i,), daemon=True) for i in range(clients)]
    for t in threads:
        t.start()
    join_by = time.monotonic() + seconds + 180
    for t in threads:
        t.join(timeout=max(0.0, join_by - time.monotonic()))
    stuck = sum(t.is_alive() for t in threads)
    wall = time.perf_counter() - t_start
    stop_file.write_text("stop\n")  # the poller's last poll comes after the load
    try:
        poller.wait(timeout=health_timeout + 30)
    except subprocess.TimeoutExpired:
        poller.kill()
        poller.wait(30)
    stop.set()
    sampler.join(5)
    health = [tuple(json.loads(line)) for line in health_file.read_text().splitlines() if line.strip()]
    mem = _mem(server.pid)
    t0 = time.perf_counter()
    server.send_signal(signal.SIGTERM)
    try:
        rc = server.wait(timeout=60)
    except subprocess.TimeoutExpired:
        server.kill()
        server.wait(30)
        rc = "killed after 60 s"
    shutdown_s = time.perf_counter() - t0
    log_file.close()
    access = [line for line in log_path.read_text(errors="replace").splitlines() if line.startswith('{"id":"req-')]
    secrets_logged = sum(1 for line in access if any(k in line for k in [*KEYS, *wrong_keys]))

    loaded, tok = load_model(model)
    st = ContextStore(store, loaded, tok, cache_bytes=0)
    listed = st.list(ANY_OWNER)
    verified, failed = 0, []
    for d in listed:
        try:
            st.get(d["id"], ANY_OWNER)  # every tensor's sha256 checked
            verified += 1
        except Exception as exc:  # noqa: BLE001 - reported, not raised
            failed.append(f"{d['id']}: {exc}")
    leftovers = [p.name for p in store.iterdir() if p.name.startswith(".tmp-")]
    total = sum(sum(c.values()) for c in counts.values())
    times = sorted(t for _, t in health)
    non_ok = [code for code, _ in health if code != 200]
    pct = (lambda q: times[min(len(times) - 1, int(q * len(times)))] if times else None)
    health_summary = {"polls": len(times), "non_200": len(non_ok), "non_200_answers": non_ok[:20], "p50_s": pct(0.5),
                      "p99_s": pct(0.99), "max_s": times[-1] if times else None, "timeout_s": health_timeout}
    return {"model": model, "clients": clients, "hostile_clients": n_hostile,
            "hostile_kinds": dict(collections.Counter(kinds)), "seconds": seconds, "queue_size": queue_size,
            "request_timeout_s": request_timeout, "body_limit_bytes": BODY_LIMIT, "wall_s": wall,
            "threads_stuck": stuck, "health": health_summary, "start_rss_mib": start_mem.get("VmRSS"),
            "start_vm_hwm_mib": start_mem.get("VmHWM"), "first_rss_mib": peak["first"], "last_rss_mib": peak["last"],
            "access_log_lines": len(access), "access_lines_with_a_key": secrets_logged,
            "requests": total, "requests_per_s": total / wall,
            "statuses": {a: dict(sorted(((str(k), v) for k, v in c.items()))) for a, c in counts.items()},
            "p50_s": {a: sorted(v)[len(v) // 2] for a, v in latencies.items() if v},
            "unexpected": bad, "malformed": malformed, "peak_rss_mib": peak["rss"], "vm_hwm_mib": mem.get("VmHWM"),
            "shutdown_s": shutdown_s, "exit": rc, "stored": len(listed), "verified": verified,
            "verify_failures": failed, "temp_files_left": leftovers, "work_dir": str(work),
            "omp_num_threads": os.environ.get("OMP_NUM_THREADS", "unset"),
            "ok": (not bad and not malformed and not failed and not leftovers and not non_ok and not stuck
                   and secrets_logged == 0 and rc in (0, -signal.SIGTERM)
                   and health_summary["p99_s"] is not None and health_summary["p99_s"] < HEALTH_P99_S)}


def table(r: dict) -> str:
    h = r["health"]
    ms = (lambda v: "-" if v is None else f"{v * 1000:.1f}")
    lines = [f"# kvcache serve soak: {r['clients']} clients ({r['hostile_clients']} hostile) x {r['seconds']:g} s, "
             f"{r['model']}, 4 keys, default limits (8 MiB bodies), OMP_NUM_THREADS={r.get('omp_num_threads', 'unset')}",
             "", f"{r['requests']:,} requests in {r['wall_s']:.1f} s ({r['requests_per_s']:.1f}/s); unexpected answers "
             f"(5xx other than 503/504, hostile requests not 4xx, closed or busy, an unknown key not 401): "
             f"**{len(r['unexpected'])}**; ordinary answers not right (status, body, connection): "
             f"**{len(r.get('malformed', []))}**.", "",
             f"`/health` polled every 0.1 s from a process of its own: {h['polls']:,} answers, {h['non_200']} not 200, p50 "
             f"{ms(h['p50_s'])} ms, **p99 {ms(h['p99_s'])} ms**, max {ms(h['max_s'])} ms.", "",
             f"Server RSS: {r.get('start_rss_mib') or 0:.0f} MiB before the load, first sample "
             f"{r['first_rss_mib'] or 0:.0f} MiB, peak {r['peak_rss_mib']:.0f} MiB, last {r['last_rss_mib']:.0f} MiB "
             f"(VmHWM {r['vm_hwm_mib'] or 0:.0f} MiB). SIGTERM to exit {r['shutdown_s']:.1f} s (status {r['exit']}). Stored contexts afterwards "
             f"{r['stored']}, verified {r['verified']}, temporary files left {len(r['temp_files_left'])}. Access-log lines "
             f"{r['access_log_lines']:,}, lines holding a key {r['access_lines_with_a_key']}.", "",
             "| client | action | statuses (count) | p50 latency of the 2xx answers, s |", "|---|---|---|---|"]
    for kind, actions in (("ordinary", [*ACTIONS, "delete_missing"]), ("hostile", HOSTILE)):
        for action in actions:
            st = r["statuses"].get(action, {})
            shown = ", ".join(f"{k}: {v}" for k, v in st.items())
            p50 = r["p50_s"].get(action)
            lines.append(f"| {kind} | {action} | {shown} | {'-' if p50 is None else f'{p50:.2f}'} |")
    lines += ["", "503 is the bounded queue answering `queue_full`, or the memory budget of bodies in flight "
              "`body_memory_full` (clients back off briefly and retry); 504 a "
              "request past `--request-timeout`; 429 a key's store quota (`--max-contexts-per-key 40`) or its "
              "queue share; `delete_missing` a delete sent by a client that held no context (404). Hostile: 400 / "
              "401 / 404 / 413 / 415 as each case asks (401 for every unknown key), 408 a body that trickled past "
              "`--body-timeout`, `closed` a connection the client gave up (slow headers, a cancelled stream or "
              "compression)."]
    return "\n".join(lines) + "\n"


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--model", default="stories260K")
    ap.add_argument("--clients", type=int, default=64)
    ap.add_argument("--seconds", type=float, default=60.0)
    ap.add_argument("--queue-size", type=int, default=32, help="the server's --queue-size [32]")
    ap.add_argument("--hostile", type=int, default=None,
                    help=f"hostile clients [a tenth of --clients, at least {len(HOSTILE)}: one of each kind]")
    ap.add_argument("--request-timeout", type=float, default=30.0, help="the server's --request-timeout [30]")
    ap.add_argument("--out", default=str(Path(__file__).parent / "results"))
    args = ap.parse_args()
    config = {k: v for k, v in vars(args).items() if k != "out"}
    result = run(**config)
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    stem = f"bench_serve_soak_{args.model}_c{args.clients}_t{args.seconds:g}"
    (out / f"{stem}.json").write_text(json.dumps({"args": vars(args), **result}, indent=1))
    md = table(result)
    (out / f"{stem}.md").write_text(md)
    print(md)
    sys.exit(0 if result["ok"] else 1)


if __name__ == "__main__":
    main()
