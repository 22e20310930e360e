"""``kvcache serve`` load and soak: many clients for a fixed time, hostile requests mixed in.

One ``kvcache serve`` process on 127.0.0.1 (stories260K by default, float32, CPU) with four API
keys, and ``--clients`` threads (64) for ``--seconds`` (60). Each client has a key and loops over
weighted actions:

* ``compress``: ``POST /v1/contexts`` of a short story with a method drawn from a few;
* ``ask`` / ``stream``: a greedy chat from one of its own stored contexts (non-streaming, or
  streaming read to ``[DONE]``), or without a context;
* ``delete``: one of its own contexts; ``list``: its contexts;
* ``hostile``: one of a set of bad requests (a spec naming ``/etc/passwd``, a plan object naming a
  file, 10,000-deep JSON, a body past ``--max-body-bytes``, an integer of 5,000 digits, invalid
  UTF-8, a wrong key, another key's context, a path as a context id, ``max_tokens`` past the
  limit).

Checked and reported: every status by action; **5xx other than 503/504 must be zero**; hostile
requests must get 4xx; the server's RSS sampled every 0.25 s (peak, and ``VmHWM``); after the
load the server gets SIGTERM (time to exit reported), then every stored context is opened and
loaded with its checksums verified (``ContextStore.get``), and the folder must hold no temporary
file. Bounded: every request has a timeout, the load stops at ``--seconds``. Loopback only.

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
ACTIONS = {"compress": 2, "ask": 4, "stream": 3, "delete": 1, "list": 1, "hostile": 3}
BODY_LIMIT = 256 << 10
MAX_TOKENS = 16


def _mem(pid: int) -> dict[str, float]:
    out = {}
    try:
        for line in Path(f"/proc/{pid}/status").read_text().splitlines():
            if line.startswith(("VmRSS:", "VmHWM:")):
                out[line.split(":")[0]] = int(line.split()[1]) / 1024
    except OSError:
        pass
    return out


def _hostile(rng: random.Random, key: str, other_ids: list[str]) -> tuple[str, str, dict, bytes | None]:
    """(name, route, headers, body) of one bad request."""
    auth = {"Authorization": f"Bearer {key}", "content-type": "application/json"}
    chat = {"model": "MODEL", "messages": [{"role": "user", "content": "hi"}]}
    cases = [
        ("path spec", "/v1/contexts", auth, json.dumps({"document": DOCS[0], "method": "plan[/etc/passwd]"})),
        ("scorer path", "/v1/contexts", auth, json.dumps({"document": DOCS[0], "method": "kvzap@0.25[/etc/hosts]"})),
        ("plan names a file", "/v1/contexts", auth, json.dumps({"document": DOCS[0], "plan": {
            "format": "kv_cache.cache_plan", "version": 1, "layout": {"rotation": "calibrated",
                                                                       "rotation_path": "/etc/passwd"}}})),
        ("deep json", "/v1/chat/completions", auth, "[" * 10_000 + "]" * 10_000),
        ("body too large", "/v1/contexts", auth, json.dumps({"document": "a" * (BODY_LIMIT + 1)})),
        ("huge int", "/v1/chat/completions", auth, "1" * 5000),
        ("invalid utf-8", "/v1/chat/completions", auth, b"\xff\xfe{"),
        ("wrong key", "/v1/contexts", {"Authorization": "Bearer nope"}, None),
        ("other key's context", "/v1/chat/completions", auth,
         json.dumps({**chat, "context_id": rng.choice(other_ids) if other_ids else "ctx-" + "0" * 24})),
        ("path as id", "/v1/chat/completions", auth, json.dumps({**chat, "context_id": "../../etc/passwd"})),
        ("max_tokens past the limit", "/v1/chat/completions", auth, json.dumps({**chat, "max_tokens": 10**6})),
    ]
    name, route, headers, body = rng.choice(cases)
    return name, route, headers, body.encode() if isinstance(body, str) else body


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
           "--max-body-bytes", str(BODY_LIMIT), "--max-tokens", "64", "--queue-size", str(args.queue_size),
           "--request-timeout", "30", "--max-contexts-per-key", "40", "--shutdown-timeout", "10"]
    server = subprocess.Popen(cmd, env=env, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE)
    base = f"http://127.0.0.1:{port}"
    deadline = time.monotonic() + 300
    while True:
        if server.poll() is not None:
            raise RuntimeError(f"the server exited: {server.stderr.read().decode()[-2000:]}")
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
    peak = {"rss": 0.0}
    stop = threading.Event()

    def sample() -> None:
        while not stop.is_set():
            peak["rss"] = max(peak["rss"], _mem(server.pid).get("VmRSS", 0.0))
            time.sleep(0.25)

    def record(action: str, status: int | str, t0: float, hostile: str | None = None) -> None:
        with lock:
            counts[action][status] += 1
            if isinstance(status, int) and status < 300:
                latencies[action].append(time.perf_counter() - t0)
            if isinstance(status, int) and status >= 500 and status not in (503, 504):
                bad.append(f"{action}: {status}")
            if hostile and (not isinstance(status, int) or not 400 <= status < 500):
                bad.append(f"hostile {hostile}: {status}")

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
                    elif action == "list":
                        r = h.get("/v1/contexts")
                    else:
                        with lock:
                            others = [c for k, ids in owned.items() if k != key for c in ids]
                        name, route, headers, body = _hostile(rng, key, others)
                        r = httpx.post(base + route, headers=headers, content=body, timeout=60)
                        record(action, r.status_code, t0, name)
                        continue
                    record(action, r.status_code, t0)
                except httpx.HTTPError as exc:
                    record(action, type(exc).__name__, t0)
                if r is not None and r.status_code == 503:
                    time.sleep(0.05 + rng.random() * 0.2)  # Retry-After, shortened

    sampler = threading.Thread(target=sample, daemon=True)
    sampler.start()
    t_start = time.perf_counter()
    end = time.monotonic() + args.seconds
    threads = [threading.Thread(target=client, args=(i,)) for i in range(args.clients)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(timeout=args.seconds + 120)
    wall = time.perf_counter() - t_start
    stop.set()
    mem = _mem(server.pid)
    t0 = time.perf_counter()
    server.send_signal(signal.SIGTERM)
    try:
        rc = server.wait(timeout=60)
    except subprocess.TimeoutExpired:
        server.kill()
        rc = "killed after 60 s"
    shutdown_s = time.perf_counter() - t0
    server.stderr.close()

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
    return {"model": args.model, "clients": args.clients, "seconds": args.seconds, "wall_s": wall,
            "requests": total, "requests_per_s": total / wall,
            "statuses": {a: dict(sorted(((str(k), v) for k, v in c.items()))) for a, c in counts.items()},
            "p50_s": {a: sorted(v)[len(v) // 2] for a, v in latencies.items() if v},
            "unexpected": bad, "peak_rss_mib": peak["rss"], "vm_hwm_mib": mem.get("VmHWM"),
            "shutdown_s": shutdown_s, "exit": rc, "stored": len(listed), "verified": verified,
            "verify_failures": failed, "temp_files_left": leftovers,
            "omp_num_threads": os.environ.get("OMP_NUM_THREADS", "unset"),
            "ok": not bad and not failed and not leftovers}


def table(r: dict) -> str:
    lines = [f"# kvcache serve soak: {r['clients']} clients x {r['seconds']} s, {r['model']}, 4 keys, hostile "
             f"requests mixed in, OMP_NUM_THREADS={r.get('omp_num_threads', 'unset')}", "",
             f"{r['requests']:,} requests in {r['wall_s']:.1f} s ({r['requests_per_s']:.1f}/s); "
             f"unexpected answers (5xx other than 503/504, hostile requests not 4xx): **{len(r['unexpected'])}**; "
             f"peak RSS {r['peak_rss_mib']:.0f} MiB (VmHWM {r['vm_hwm_mib'] or 0:.0f} MiB); SIGTERM to exit "
             f"{r['shutdown_s']:.1f} s (status {r['exit']}); stored contexts afterwards {r['stored']}, verified "
             f"{r['verified']}, temporary files left {len(r['temp_files_left'])}.", "",
             "| action | statuses (count) | p50 latency of the 2xx answers, s |", "|---|---|---|"]
    for action in ACTIONS:
        st = r["statuses"].get(action, {})
        shown = ", ".join(f"{k}: {v}" for k, v in st.items())
        p50 = r["p50_s"].get(action)
        lines.append(f"| {action} | {shown} | {'-' if p50 is None else f'{p50:.2f}'} |")
    lines += ["", "503 is the bounded queue answering `queue_full` (clients back off briefly and retry); 504 a "
              "request past `--request-timeout`; 429 a key's store quota (`--max-contexts-per-key 40`); 404 a "
              "context its owner deleted meanwhile, or another key's."]
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
