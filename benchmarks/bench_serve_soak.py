"""``kvcache serve`` load and soak: many clients for a fixed time, a tenth of them hostile.

One ``kvcache serve`` process on 127.0.0.1 (stories260K by default, float32, CPU) with four API
keys at the server's default body limit (8 MiB), ``--body-timeout 5``, and ``--clients`` threads
(64) for ``--seconds`` (60). A tenth of the clients are hostile (issue 43); each loops over:

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
  another key's context, ``max_tokens`` past the limit, invalid UTF-8, a non-JSON content type).

The others are ordinary clients, each with a key, looping over weighted actions: ``compress``
(``POST /v1/contexts`` of a short story with a method drawn from a few), ``ask`` / ``stream`` (a
greedy chat from one of its own stored contexts or without one), ``delete`` and ``list``.

Checked and reported: every status by action; **5xx other than 503/504 must be zero**; hostile
requests get 4xx (or their connection closed: slowloris, cancelled); ``/health`` polled every
0.1 s from a process of its own (p50 / p99 / max latency and any non-200: **p99 under 200 ms**); the
server's RSS sampled every 0.25 s (peak, last, ``VmHWM``); after the load the server gets
SIGTERM (time to exit reported), then every stored context is opened and loaded with its
checksums verified (``ContextStore.get``), and the folder must hold no temporary file. Bounded:
every request has a timeout, the load stops at ``--seconds``. Loopback only.

Run: ``python benchmarks/bench_serve_soak.py [--clients 64] [--seconds 60] [--model stories260K]
[--out benchmarks/results/]``; the results are written as
``bench_serve_soak_<model>_c<clients>_t<seconds>.{json,md}``.
"""

from __future__ import annotations

import argparse
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
HOSTILE = {"fuzz": 3, "oversized": 1, "deep": 1, "slowloris": 1, "cancelled": 2, "bad": 2}
BODY_LIMIT = 8 << 20  # the server's default --max-body-bytes
BODY_TIMEOUT = 5
MAX_TOKENS = 16
HEALTH_P99_S = 0.2


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


def run(args: argparse.Namespace) -> dict:
    import httpx

    from kv_cache.models import load_model
    from kv_cache.integrations.serve.store import ANY_OWNER, ContextStore

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    work = Path(tempfile.mkdtemp(prefix="kvcache-soak-"))
    store, keys_file = work / "store", work / "keys.txt"
    keys_file.write_text("# soak keys\n" + "\n".join(KEYS) + "\n")
    env = {**os.environ, "MALLOC_MMAP_THRESHOLD_": os.environ.get("MALLOC_MMAP_THRESHOLD_", str(1 << 20))}
    cmd = [sys.executable, "-m", "kv_cache.cli", "serve", "--model", args.model, "--store", str(store),
           "--port", str(port), "--api-keys-file", str(keys_file), "--log-level", "error",
           "--body-timeout", str(BODY_TIMEOUT), "--max-tokens", "64", "--queue-size", str(args.queue_size),
           "--request-timeout", "30", "--max-contexts-per-key", "40", "--shutdown-timeout", "10"]
    log_path = work / "server.log"  # the access log (one JSON line a request) and errors
    log_file = open(log_path, "wb")
    server = subprocess.Popen(cmd, env=env, stdout=subprocess.DEVNULL, stderr=log_file)
    base = f"http://127.0.0.1:{port}"
    deadline = time.monotonic() + 300
    while True:
        if server.poll() is not None:
            raise RuntimeError(f"the server exited: {log_path.read_text()[-2000:]}")
        try:
            if httpx.get(base + "/health", timeout=2).status_code == 200:
                break
        except httpx.HTTPError:
            pass
        if time.monotonic() > deadline:
            server.kill()
            raise RuntimeError("the server did not start in 300 s")
        time.sleep(0.3)
    model_name = httpx.get(base + "/v1/models", headers={"Authorization": f"Bearer {KEYS[0]}"}).json()["data"][0]["id"]

    lock = threading.Lock()
    counts: dict[str, collections.Counter] = collections.defaultdict(collections.Counter)
    latencies: dict[str, list[float]] = collections.defaultdict(list)
    bad: list[str] = []
    owned: dict[str, list[str]] = {k: [] for k in KEYS}
    peak = {"rss": 0.0, "first": None, "last": 0.0}
    stop = threading.Event()
    fuzz = fuzz_bodies(model_name)

    def sample() -> None:
        while not stop.is_set():
            rss = _mem(server.pid).get("VmRSS", 0.0)
            peak["rss"] = max(peak["rss"], rss)
            peak["first"] = rss if peak["first"] is None else peak["first"]
            peak["last"] = rss
            time.sleep(0.25)

    # /health is polled from a process of its own: in this one, 64 client threads would queue the
    # poller behind their own GIL and the figure would be the load generator's, not the server's
    health_file = work / "health.jsonl"
    poller_src = (
        "import json, sys, time, httpx\n"
        "base, out, end = sys.argv[1], open(sys.argv[2], 'w'), time.monotonic() + float(sys.argv[3])\n"
        "with httpx.Client(base_url=base, timeout=10) as h:\n"
        "    while time.monotonic() < end:\n"
        "        t0 = time.perf_counter()\n"
        "        try:\n"
        "            code = h.get('/health').status_code\n"
        "        except httpx.HTTPError as exc:\n"
        "            code = type(exc).__name__\n"
        "        out.write(json.dumps([code, time.perf_counter() - t0]) + '\\n')\n"
        "        time.sleep(0.1)\n")

    def record(action: str, status: int | str, t0: float, hostile: str | None = None) -> None:
        with lock:
            counts[action][status] += 1
            if isinstance(status, int) and status < 300:
                latencies[action].append(time.perf_counter() - t0)
            if isinstance(status, int) and status >= 500 and status not in (503, 504):
                bad.append(f"{action}: {status}")
            if hostile and not (isinstance(status, int) and 400 <= status < 500) and status != "closed":
                bad.append(f"hostile {hostile}: {status}")

    def hostile(i: int) -> None:
        rng = random.Random(1000 + i)
        key = KEYS[i % len(KEYS)]
        auth = {"Authorization": f"Bearer {key}", "content-type": "application/json"}
        names, weights = zip(*HOSTILE.items())
        while time.monotonic() < end:
            action = rng.choices(names, weights)[0]
            t0 = time.perf_counter()
            try:
                if action == "fuzz":
                    name, route, body = rng.choice(fuzz)
                    r = httpx.post(base + route, headers=auth, content=body, timeout=60)
                    record(action, r.status_code, t0, name)
                elif action == "oversized":
                    if rng.random() < 0.5:
                        r = httpx.post(base + "/v1/contexts", headers=auth, content=b" " * (BODY_LIMIT + 1), timeout=60)
                    else:  # no Content-Length: counted as it is read
                        r = httpx.post(base + "/v1/contexts", headers=auth, timeout=60,
                                       content=(b" " * (1 << 20) for _ in range(BODY_LIMIT // (1 << 20) + 2)))
                    record(action, r.status_code, t0, "oversized")
                elif action == "deep":
                    r = httpx.post(base + "/v1/chat/completions", headers=auth, timeout=60,
                                   content=b"[" * 100_000 + b"]" * 100_000)
                    record(action, r.status_code, t0, "deep")
                elif action == "slowloris":
                    line = _slowloris(port, rng, key)
                    status = int(line.split()[1]) if line.startswith("HTTP/") else line
                    record(action, status, t0, "slowloris")
                elif action == "cancelled":
                    if rng.random() < 0.5:
                        body = {"model": model_name, "max_tokens": 64, "stream": True,
                                "messages": [{"role": "user", "content": rng.choice(QUESTIONS)}]}
                        with httpx.Client(base_url=base, headers=auth, timeout=60) as h:
                            with h.stream("POST", "/v1/chat/completions", json=body) as r:
                                next(r.iter_lines(), None)  # the first chunk, then the client goes away
                        record(action, "closed", t0, "cancelled stream")
                    else:
                        try:
                            httpx.post(base + "/v1/contexts", headers=auth, timeout=0.05,
                                       json={"document": rng.choice(DOCS) * 3, "method": "q4+kvzip@0.5"})
                            record(action, "answered", t0)
                        except httpx.TimeoutException:
                            record(action, "closed", t0, "cancelled compression")
                else:
                    with lock:
                        others = [c for k, ids in owned.items() if k != key for c in ids]
                    name, route, headers, body = _bad(rng, key, others, model_name)
                    r = httpx.post(base + route, headers=headers, content=body, timeout=60)
                    record(action, r.status_code, t0, name)
            except httpx.HTTPError as exc:
                record(action, type(exc).__name__, t0, action)

    def client(i: int) -> None:
        rng = random.Random(i)
        key = KEYS[i % len(KEYS)]
        auth = {"Authorization": f"Bearer {key}"}
        names, weights = zip(*ACTIONS.items())
        with httpx.Client(base_url=base, headers=auth, timeout=60) as h:
            while time.monotonic() < end:
                action = rng.choices(names, weights)[0]
                t0, r = time.perf_counter(), None
                try:
                    if action == "compress":
                        r = h.post("/v1/contexts", json={"document": rng.choice(DOCS) * rng.randint(1, 3),
                                                         "method": rng.choice(METHODS)})
                        if r.status_code == 201:
                            with lock:
                                owned[key].append(r.json()["id"])
                    elif action in ("ask", "stream"):
                        with lock:
                            mine = list(owned[key])
                        body = {"model": model_name, "temperature": 0, "max_tokens": MAX_TOKENS,
                                "messages": [{"role": "user", "content": rng.choice(QUESTIONS)}],
                                "stream": action == "stream"}
                        if mine and rng.random() < 0.8:
                            body["context_id"] = rng.choice(mine)
                        if action == "stream":
                            with h.stream("POST", "/v1/chat/completions", json=body) as r:
                                for _ in r.iter_lines():
                                    pass
                        else:
                            r = h.post("/v1/chat/completions", json=body)
                    elif action == "delete":
                        with lock:
                            cid = owned[key].pop(rng.randrange(len(owned[key]))) if owned[key] else None
                        r = h.delete(f"/v1/contexts/{cid or 'ctx-' + '0' * 24}")
                    else:
                        r = h.get("/v1/contexts")
                    record(action, r.status_code, t0)
                except httpx.HTTPError as exc:
                    record(action, type(exc).__name__, t0)
                if r is not None and r.status_code == 503:
                    time.sleep(0.05 + rng.random() * 0.2)  # Retry-After, shortened

    sampler = threading.Thread(target=sample, daemon=True)
    sampler.start()
    poller = subprocess.Popen([sys.executable, "-c", poller_src, base, str(health_file), str(args.seconds)])
    t_start = time.perf_counter()
    end = time.monotonic() + args.seconds
    n_hostile = max(1, args.clients // 10)
    threads = [threading.Thread(target=hostile if i < n_hostile else client, args=(i,)) for i in range(args.clients)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(timeout=args.seconds + 120)
    wall = time.perf_counter() - t_start
    stop.set()
    try:
        poller.wait(timeout=30)
    except subprocess.TimeoutExpired:
        poller.kill()
    health = [tuple(json.loads(line)) for line in health_file.read_text().splitlines() if line.strip()]
    mem = _mem(server.pid)
    t0 = time.perf_counter()
    server.send_signal(signal.SIGTERM)
    try:
        rc = server.wait(timeout=60)
    except subprocess.TimeoutExpired:
        server.kill()
        rc = "killed after 60 s"
    shutdown_s = time.perf_counter() - t0
    log_file.close()
    access = [line for line in log_path.read_text(errors="replace").splitlines() if line.startswith('{"id":"req-')]
    secrets_logged = sum(1 for line in access if any(k in line for k in KEYS))

    model, tok = load_model(args.model)
    st = ContextStore(store, model, tok, cache_bytes=0)
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
    health_summary = {"polls": len(times), "non_200": len(non_ok), "p50_s": pct(0.5), "p99_s": pct(0.99),
                      "max_s": times[-1] if times else None}
    return {"model": args.model, "clients": args.clients, "hostile_clients": n_hostile, "seconds": args.seconds,
            "wall_s": wall, "health": health_summary, "first_rss_mib": peak["first"], "last_rss_mib": peak["last"],
            "access_log_lines": len(access), "access_lines_with_a_key": secrets_logged,
            "requests": total, "requests_per_s": total / wall,
            "statuses": {a: dict(sorted(((str(k), v) for k, v in c.items()))) for a, c in counts.items()},
            "p50_s": {a: sorted(v)[len(v) // 2] for a, v in latencies.items() if v},
            "unexpected": bad, "peak_rss_mib": peak["rss"], "vm_hwm_mib": mem.get("VmHWM"),
            "shutdown_s": shutdown_s, "exit": rc, "stored": len(listed), "verified": verified,
            "verify_failures": failed, "temp_files_left": leftovers,
            "omp_num_threads": os.environ.get("OMP_NUM_THREADS", "unset"),
            "ok": (not bad and not failed and not leftovers and not non_ok and secrets_logged == 0
                   and health_summary["p99_s"] is not None and health_summary["p99_s"] < HEALTH_P99_S)}


def table(r: dict) -> str:
    h = r["health"]
    lines = [f"# kvcache serve soak: {r['clients']} clients ({r['hostile_clients']} hostile) x {r['seconds']:g} s, "
             f"{r['model']}, 4 keys, default limits (8 MiB bodies), OMP_NUM_THREADS={r.get('omp_num_threads', 'unset')}",
             "", f"{r['requests']:,} requests in {r['wall_s']:.1f} s ({r['requests_per_s']:.1f}/s); unexpected answers "
             f"(5xx other than 503/504, hostile requests not 4xx or closed): **{len(r['unexpected'])}**.", "",
             f"`/health` polled every 0.1 s from a process of its own: {h['polls']:,} answers, {h['non_200']} not 200, p50 "
             f"{h['p50_s'] * 1000:.1f} ms, **p99 {h['p99_s'] * 1000:.1f} ms**, max {h['max_s'] * 1000:.0f} ms.", "",
             f"Server RSS: first sample {r['first_rss_mib']:.0f} MiB, peak {r['peak_rss_mib']:.0f} MiB, last "
             f"{r['last_rss_mib']:.0f} MiB (VmHWM {r['vm_hwm_mib'] or 0:.0f} MiB). SIGTERM to exit {r['shutdown_s']:.1f} s "
             f"(status {r['exit']}). Stored contexts afterwards {r['stored']}, verified {r['verified']}, temporary "
             f"files left {len(r['temp_files_left'])}. Access-log lines {r['access_log_lines']:,}, lines holding a "
             f"key {r['access_lines_with_a_key']}.", "",
             "| client | action | statuses (count) | p50 latency of the 2xx answers, s |", "|---|---|---|---|"]
    for kind, actions in (("ordinary", ACTIONS), ("hostile", HOSTILE)):
        for action in actions:
            st = r["statuses"].get(action, {})
            shown = ", ".join(f"{k}: {v}" for k, v in st.items())
            p50 = r["p50_s"].get(action)
            lines.append(f"| {kind} | {action} | {shown} | {'-' if p50 is None else f'{p50:.2f}'} |")
    lines += ["", "503 is the bounded queue answering `queue_full` (clients back off briefly and retry); 504 a "
              "request past `--request-timeout`; 429 a key's store quota (`--max-contexts-per-key 40`) or its "
              "queue share; 404 a context its owner deleted meanwhile, or another key's. Hostile: 400 / 401 / 404 / "
              "413 / 415 as each case asks, 408 a body that trickled past `--body-timeout`, `closed` a connection "
              "the client gave up (slow headers, a cancelled stream or compression)."]
    return "\n".join(lines) + "\n"


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--model", default="stories260K")
    ap.add_argument("--clients", type=int, default=64)
    ap.add_argument("--seconds", type=float, default=60.0)
    ap.add_argument("--queue-size", type=int, default=32, help="the server's --queue-size [32]")
    ap.add_argument("--out", default=str(Path(__file__).parent / "results"))
    args = ap.parse_args()
    result = run(args)
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
