"""``kvcache serve`` for an operator (issue 43): what reaches the server, fairness between keys,
deadlines that free the worker, a bounded shutdown, TLS, and what an operator can watch.

* 415 for a POST that is not ``application/json``; with no key, 421 for a Host and 403 for an
  Origin that is not loopback (a web page cannot post to it or read it by DNS rebinding);
* per-key limits: a key past ``max_queued_per_key`` gets 429 while another key is admitted; a
  batch takes at most ``max_running_per_key`` of one key while others wait, and fills up with
  one key's jobs when no other waits;
* a compression past its deadline stops between the prefill's layers (and KVzip's chunks);
* ``/health`` 503 while draining; SIGTERM ends a process whose worker is stuck by the
  ``--shutdown-timeout`` watchdog, a second SIGTERM before it;
* ``/metrics`` (Prometheus), ``/version``, one JSON access-log line per request, never a key;
* TLS through uvicorn, and the exposure rules of the CLI; a random owner-id salt per store.
"""

from __future__ import annotations

import json
import logging
import re
import os
import signal
import subprocess
import sys
import threading
import time

import pytest

pytest.importorskip("fastapi", reason="needs the serve extra: pip install 'kv_cache[serve]'")
httpx = pytest.importorskip("httpx")
openai = pytest.importorskip("openai")

from kv_cache.integrations.serve.auth import LEGACY_SALT, ApiKeys, host_allowed, key_id, origin_allowed  # noqa: E402
from kv_cache.integrations.serve.engine import Engine  # noqa: E402
from kv_cache.integrations.serve.errors import ApiError  # noqa: E402
from kv_cache.integrations.serve.metrics import ACCESS_LOG  # noqa: E402
from kv_cache.integrations.serve.store import SALT_FILE, ContextStore  # noqa: E402
from serve_support import AUTH, DOC, KEY, MODEL, REPO, create, error, free_port, serving, start_child  # noqa: E402

KEY2 = "second-key"
AUTH2 = {"Authorization": f"Bearer {KEY2}"}
CHAT = {"model": MODEL, "messages": [{"role": "user", "content": "Once upon"}], "max_tokens": 4, "temperature": 0}


@pytest.fixture(scope="module")
def keyed(stories, tmp_path_factory):
    model, tok = stories
    with serving(model, tok, tmp_path_factory.mktemp("store"), api_key=None, api_keys=[KEY, KEY2]) as server:
        yield server


@pytest.fixture(scope="module")
def open_server(stories, tmp_path_factory):
    """No key: loopback only."""
    model, tok = stories
    with serving(model, tok, tmp_path_factory.mktemp("store"), api_key=None) as server:
        yield server


# ------------------------------------------------------------------------------ what reaches it
def test_a_post_that_is_not_json_is_415(keyed):
    for ctype in (None, "text/plain", "application/x-www-form-urlencoded", "multipart/form-data; boundary=x"):
        headers = {**AUTH, **({"content-type": ctype} if ctype else {})}
        r = httpx.post(keyed.base_url + "/v1/chat/completions", content=json.dumps(CHAT).encode(), headers=headers)
        err = error(r, 415, "unsupported_media_type")
        assert "application/json" in err["message"]
    r = httpx.post(keyed.base_url + "/v1/chat/completions", content=json.dumps(CHAT).encode(),
                   headers={**AUTH, "content-type": "application/json; charset=utf-8"}, timeout=60)
    assert r.status_code == 200, r.text


def test_without_keys_only_loopback_hosts_and_origins_are_answered(open_server):
    base = open_server.base_url
    for host in ("evil.example", "evil.example:80", "10.0.0.5", "[2001:db8::1]:8000"):
        err = error(httpx.get(base + "/v1/models", headers={"host": host}), 421, "misdirected_request")
        assert "--allowed-host" in err["message"]
        error(httpx.post(base + "/v1/chat/completions", json=CHAT, headers={"host": host}), 421, "misdirected_request")
    for origin in ("http://evil.example", "https://attacker.test:8443", "null"):
        error(httpx.post(base + "/v1/chat/completions", json=CHAT, headers={"origin": origin}), 403,
              "forbidden_origin")
    for host in ("localhost", f"localhost:{base.rsplit(':', 1)[1]}", "127.0.0.1", "127.0.0.2:1", "[::1]:8000"):
        assert httpx.get(base + "/v1/models", headers={"host": host}).status_code == 200, host
    r = httpx.post(base + "/v1/chat/completions", json=CHAT, headers={"origin": "http://localhost:3000"}, timeout=60)
    assert r.status_code == 200, r.text


def test_keys_or_allowed_hosts_open_other_hosts(keyed, stories, tmp_path):
    assert httpx.get(keyed.base_url + "/v1/models", headers={**AUTH, "host": "api.example"}).status_code == 200
    model, tok = stories
    with serving(model, tok, tmp_path, api_key=None, allowed_hosts=["api.internal"]) as server:
        assert httpx.get(server.base_url + "/v1/models", headers={"host": "api.internal:8000"}).status_code == 200
        error(httpx.get(server.base_url + "/v1/models", headers={"host": "api.other"}), 421, "misdirected_request")
    assert host_allowed("anything", ["*"]) and origin_allowed("null", ["*"]) and origin_allowed(None)
    assert not host_allowed(None) and not origin_allowed("ftp://127.0.0.1")


def test_a_body_sent_too_slowly_is_408(stories, tmp_path):
    from kv_cache.integrations.serve.limits import Limits

    model, tok = stories
    with serving(model, tok, tmp_path, limits=Limits(body_timeout=1)) as server:
        def trickle():
            yield b'{"model": '
            time.sleep(2.5)
            yield b'"x"}'

        r = httpx.post(server.base_url + "/v1/chat/completions", content=trickle(),
                       headers={**AUTH, "content-type": "application/json"}, timeout=30)
        err = error(r, 408, "request_body_timeout")
        assert "--body-timeout" in err["message"]
        assert httpx.get(server.base_url + "/health").status_code == 200


# ------------------------------------------------------------------------------ fairness
def _job(owner, key="plain"):
    return {"batch_key": key, "batch_fn": lambda jobs: None, "owner": owner}


def test_a_key_past_its_queue_share_is_429_while_another_is_admitted():
    engine = Engine(queue_size=8, max_queued_per_key=3)
    for _ in range(3):
        engine.submit(lambda j: None, owner="a")
    with pytest.raises(ApiError) as exc:
        with engine.reserve("a"):
            pass
    assert exc.value.code == "rate_limit_exceeded" and exc.value.status == 429
    assert exc.value.headers["Retry-After"] and "--max-queued-per-key" in exc.value.message
    with engine.reserve("b"):  # another key still gets in
        engine.submit(lambda j: None, owner="b")
    with engine.reserve(None):  # no key: one tenant, not limited per key
        pass
    with pytest.raises(ValueError, match="max_queued_per_key"):
        Engine(max_queued_per_key=0)


def test_a_batch_makes_room_for_other_keys_and_fills_up_when_alone():
    engine = Engine(queue_size=16, max_batch=4, max_running_per_key=2)
    for owner in ("a", "a", "a", "a", "a", "b", "b"):
        engine.submit(lambda j: None, **_job(owner))
    head = engine._queue.get_nowait()
    mates = engine._mates(head)
    assert [j.owner for j in [head, *mates]] == ["a", "a", "b", "b"]
    alone = Engine(queue_size=16, max_batch=4, max_running_per_key=2)
    for _ in range(5):
        alone.submit(lambda j: None, **_job("a"))
    head = alone._queue.get_nowait()
    assert len(alone._mates(head)) == 3  # nobody else waits: the key fills the batch


def test_over_http_a_key_cannot_fill_the_queue(stories, tmp_path):
    model, tok = stories
    with serving(model, tok, tmp_path, api_key=None, api_keys=[KEY, KEY2], queue_size=4) as server:
        started, release = threading.Event(), threading.Event()
        server.engine.submit(lambda job: (started.set(), release.wait(60)))  # the worker is busy
        assert started.wait(30)
        codes: list[int] = []

        def send(auth):
            r = httpx.post(server.base_url + "/v1/chat/completions", json=CHAT, headers=auth, timeout=60)
            codes.append(r.status_code)
            return r

        threads = [threading.Thread(target=send, args=(AUTH,)) for _ in range(2)]
        for t in threads:
            t.start()
        deadline = time.monotonic() + 30
        while server.engine.waiting < 2:
            assert time.monotonic() < deadline
            time.sleep(0.01)
        error(send(AUTH), 429, "rate_limit_exceeded")  # half of the queue (2) is this key's share
        other = threading.Thread(target=send, args=(AUTH2,))
        other.start()
        while server.engine.waiting < 3:
            assert time.monotonic() < deadline, "the other key was not admitted"
            time.sleep(0.01)
        release.set()
        for t in [*threads, other]:
            t.join(60)
        assert sorted(codes) == [200, 200, 200, 429], codes


# ------------------------------------------------------------------------------ deadlines
def test_a_compression_stops_between_layers_at_its_check(stories):
    from kv_cache import CompressedContext, KVzip, QuantConfig

    model, tok = stories
    calls = {"n": 0}

    def check():
        calls["n"] += 1

    CompressedContext.build(model, tok, DOC, quant=QuantConfig(bits=4), check=check)
    layers = model.config.num_hidden_layers
    assert calls["n"] >= layers + 1  # before the prefill and before every layer's attention
    plain = calls["n"]
    calls["n"] = 0
    CompressedContext.build(model, tok, DOC, quant=QuantConfig(bits=4), eviction=KVzip(budget=0.5), check=check)
    assert calls["n"] > plain  # KVzip's repeat pass: its chunks and their layers too

    class Late(Exception):
        pass

    seen = {"n": 0}

    def deadline():
        seen["n"] += 1
        if seen["n"] == 3:
            raise Late()

    with pytest.raises(Late):
        CompressedContext.build(model, tok, DOC, quant=QuantConfig(bits=4), check=deadline)
    assert seen["n"] == 3  # stopped there, not at the end
    out = CompressedContext.build(model, tok, DOC, quant=QuantConfig(bits=4))  # the model is left as it was
    assert out.ask("Lily", max_new_tokens=2)


def test_a_compression_past_its_deadline_frees_the_worker(stories, tmp_path):
    """The request times out (504) mid-compression: the compression stops at the check its
    deadline passed (no layer runs after it, nothing is stored) and the worker takes the next job.
    The deadline passes inside the compression whatever the machine's speed: its second check
    (after the first layer's) waits until the job's deadline is past."""
    from kv_cache.integrations.serve.store import ANY_OWNER

    model, tok = stories
    full = model.config.num_hidden_layers + 1  # the checks of a whole compression at least
    # the deadline: long enough for the request to reach the compression on a loaded machine
    with serving(model, tok, tmp_path, request_timeout=5.0) as server:
        orig = server.service.compress
        stalled = threading.Event()
        calls = {"checks": 0, "stopped_at": None, "after": 0}

        def slow_compress(prep, job):
            def check():  # a prefill whose layer takes long: the deadline passes inside it
                calls["checks"] += 1
                if calls["stopped_at"] is not None:
                    calls["after"] += 1
                if calls["checks"] == 2:
                    waited = time.monotonic() + 60
                    while not job.expired() and time.monotonic() < waited:
                        time.sleep(0.01)
                try:
                    job.check()
                except BaseException:
                    calls["stopped_at"] = calls["checks"]
                    raise

            stalled.set()
            return orig.__func__(server.service, prep, type("J", (), {"check": staticmethod(check),
                                                                      "commit": job.commit})())

        server.service.compress = slow_compress
        try:
            r = httpx.post(server.base_url + "/v1/contexts", json={"document": DOC, "method": "q4d"}, headers=AUTH,
                           timeout=60)
            error(r, 504, "request_timeout")
            deadline = time.monotonic() + 60  # a bounded wait: the worker freed (it stops at its check)
            while server.engine.running:
                assert time.monotonic() < deadline, "the worker is still busy with the late compression"
                time.sleep(0.01)
        finally:
            server.service.compress = orig
        assert stalled.is_set()
        # stopped at the check its deadline passed (the second: after the first layer's, or the
        # first on a machine slow enough to pass the deadline before it), never past it
        assert calls["stopped_at"] in (1, 2) and calls["after"] == 0 and calls["checks"] < full, calls
        assert server.service.store.list(ANY_OWNER) == []  # nothing written
        r = httpx.post(server.base_url + "/v1/chat/completions", json=CHAT, headers=AUTH, timeout=60)
        assert r.status_code == 200, r.text


# ------------------------------------------------------------------------------ draining, shutdown
def test_health_is_503_while_draining(stories, tmp_path):
    model, tok = stories
    with serving(model, tok, tmp_path) as server:
        assert httpx.get(server.base_url + "/health").json()["status"] == "ok"
        server.engine.begin_shutdown()
        r = httpx.get(server.base_url + "/health")
        assert r.status_code == 503 and r.json()["status"] == "draining" and r.headers["retry-after"]


def test_shutdown_forces_the_exit_at_the_timeout_or_a_second_signal():
    from kv_cache.cli.serve import Shutdown

    exits, begun = [], threading.Event()
    s = Shutdown(begun.set, timeout=0.2, grace=0.0, exit_fn=exits.append)
    s()
    assert begun.wait(30)
    deadline = time.monotonic() + 30  # a bounded wait on the watchdog (0.2 s), not a time measured
    while not exits:
        assert time.monotonic() < deadline, "the watchdog never fired"
        time.sleep(0.01)
    assert exits == [1]
    exits2: list = []
    s2 = Shutdown(lambda: None, timeout=60, exit_fn=exits2.append)
    s2()
    assert exits2 == []
    s2()  # the second signal
    assert exits2 == [1]


@pytest.mark.parametrize("signals", [1, 2])
def test_sigterm_ends_a_process_whose_worker_is_stuck(tmp_path, signals):
    """The worker hangs inside a write (paused for 600 s). One SIGTERM: the --shutdown-timeout
    watchdog (2 s here) ends the process. Two: the second ends it at once; --shutdown-timeout is
    120 s there, so within the wait (60 s) only the second signal can explain the exit. Either way
    the exit is forced (status 1) and the log says why. Bounded waits, far below the 600 s the
    worker would take; no time is measured."""
    marker = tmp_path / "paused"
    timeout = "2" if signals == 1 else "120"
    child, base = start_child(tmp_path / "store", marker, free_port(), "open", "--shutdown-timeout", timeout, skip=0)
    try:
        def write():
            try:
                httpx.post(base + "/v1/contexts", json={"document": DOC}, headers=AUTH, timeout=60)
            except httpx.HTTPError:  # the process ends before it answers
                pass

        pending = threading.Thread(target=write, daemon=True)
        pending.start()
        deadline = time.monotonic() + 60
        while not marker.exists():
            assert time.monotonic() < deadline, "the write never started"
            time.sleep(0.05)
        child.send_signal(signal.SIGTERM)
        if signals == 2:  # once the first signal is handled (/health no longer 200), the second
            deadline = time.monotonic() + 60
            while True:
                try:
                    if httpx.get(base + "/health", timeout=10).status_code != 200:
                        break
                except httpx.HTTPError:  # the server no longer accepts connections
                    break
                assert time.monotonic() < deadline, "the first SIGTERM was never handled"
                time.sleep(0.05)
            child.send_signal(signal.SIGTERM)
        code = child.wait(timeout=60)
        assert code == 1, code  # forced
        why = child.stderr.read().decode(errors="replace")
        assert ("a second signal" if signals == 2 else "--shutdown-timeout (2 s) passed") in why, why[-2000:]
    finally:
        if child.poll() is None:
            child.kill()
            child.wait(30)
        child.stderr.close()


# ------------------------------------------------------------------------------ watching it
def test_metrics_version_and_one_access_line_per_request(keyed, caplog):
    base = keyed.base_url
    v = httpx.get(base + "/version").json()  # no key: the model and the version, no library versions
    assert v["model"] == MODEL and v["version"] and "torch" not in v
    v = httpx.get(base + "/version", headers=AUTH).json()  # with a key, the libraries' too
    assert v["model"] == MODEL and v["torch"] and v["transformers"] and v["version"]
    error(httpx.get(base + "/metrics"), 401, "invalid_api_key")  # behind the keys
    with caplog.at_level(logging.INFO, logger=ACCESS_LOG):
        with httpx.Client(base_url=base, headers=AUTH, timeout=60) as h:
            ctx = create(h, method="q4d")
            r = h.post("/v1/chat/completions", json={**CHAT, "context_id": ctx["id"]})
            assert r.status_code == 200
            rid = r.headers["x-request-id"]
            usage = r.json()["usage"]
            with h.stream("POST", "/v1/chat/completions", json={**CHAT, "stream": True}) as s:
                assert s.status_code == 200 and list(s.iter_lines())
            h.post("/v1/chat/completions", json={**CHAT, "temperature": 9})
        # the access lines are written once each answer has been sent: wait for them (bounded)
        deadline = time.monotonic() + 30
        while True:
            lines = [json.loads(rec.getMessage()) for rec in caplog.records if rec.name == ACCESS_LOG]
            routes = [d["route"] for d in lines]
            if (rid in {d["id"] for d in lines} and routes.count("/v1/chat/completions") >= 3
                    and "/v1/contexts" in routes):
                break
            assert time.monotonic() < deadline, f"the access lines never came: {lines}"
            time.sleep(0.02)
    by_id = {d["id"]: d for d in lines}
    chat = by_id[rid]
    owner = key_id(KEY, keyed.service.store.owner_salt)
    assert chat["key"] == owner and chat["route"] == "/v1/chat/completions" and chat["status"] == 200
    assert chat["prompt_tokens"] == usage["prompt_tokens"] and chat["completion_tokens"] == usage["completion_tokens"]
    assert chat["latency_ms"] >= chat["ttft_ms"] > 0
    assert sorted(d["status"] for d in lines if d["route"] == "/v1/chat/completions") == [200, 200, 400]
    assert [d["status"] for d in lines if d["route"] == "/v1/contexts"] == [201]
    assert all(KEY not in rec.getMessage() and KEY2 not in rec.getMessage() for rec in caplog.records)
    text = httpx.get(base + "/metrics", headers=AUTH).text
    for name in ("kvcache_requests_total", "kvcache_request_duration_seconds_bucket",
                 "kvcache_time_to_first_token_seconds_count", "kvcache_batch_size_count", "kvcache_queue_depth",
                 "kvcache_prompt_tokens_total", "kvcache_completion_tokens_total", "kvcache_contexts",
                 "kvcache_store_bytes", "kvcache_running_jobs", "kvcache_cache_bytes", "kvcache_draining"):
        assert name in text, name
    assert 'route="/v1/chat/completions",status="400"' in text
    n, nbytes = keyed.service.store.usage(owner)
    assert f'kvcache_store_bytes{{key="{owner}"}} {float(nbytes)}' in text
    assert KEY not in text


def test_openapi_publishes_the_request_schemas(keyed):
    spec = httpx.get(keyed.base_url + "/openapi.json", headers=AUTH).json()
    components = spec["components"]["schemas"]
    refs = set(re.findall(r'"\$ref": "#/components/schemas/([^"]+)"', json.dumps(spec)))
    assert refs and refs <= set(components), refs - set(components)  # every reference resolves

    def body(path):
        ref = spec["paths"][path]["post"]["requestBody"]["content"]["application/json"]["schema"]["$ref"]
        return components[ref.rsplit("/", 1)[1]]

    chat, ctx = body("/v1/chat/completions"), body("/v1/contexts")
    assert {"model", "messages", "context_id", "stop"} <= set(chat["properties"]) and "messages" in chat["required"]
    assert {"document", "method", "preset", "plan"} <= set(ctx["properties"])
    assert ctx["properties"]["method"]["anyOf"][0]["maxLength"] == 256


# ------------------------------------------------------------------------------ TLS, exposure
def test_cli_exposure_rules():
    from kv_cache.cli.serve import check_exposure, check_tls

    check_exposure("127.0.0.1", [], insecure=False)
    with pytest.raises(ValueError, match="no API key"):
        check_exposure("0.0.0.0", [], insecure=False)
    with pytest.raises(ValueError, match="--ssl-keyfile"):
        check_exposure("0.0.0.0", ["k"], insecure=False)
    check_exposure("0.0.0.0", ["k"], insecure=False, tls=True)
    check_exposure("0.0.0.0", ["k"], insecure=False, tls_proxy=True)
    check_exposure("0.0.0.0", [], insecure=True)
    with pytest.raises(ValueError, match="both"):
        check_tls("key.pem", None)
    with pytest.raises(ValueError, match="readable file"):
        check_tls("/nonexistent/key.pem", "/nonexistent/cert.pem")
    assert check_tls(None, None) is False


def test_tls_and_the_connection_limit_are_served_through_uvicorn(tmp_path):
    """--ssl-keyfile / --ssl-certfile: HTTPS only; --limit-concurrency 3: with three connections
    open, a fourth request is answered 503 by uvicorn."""
    import socket
    import ssl

    key, cert = tmp_path / "key.pem", tmp_path / "cert.pem"
    made = subprocess.run(["openssl", "req", "-x509", "-newkey", "rsa:2048", "-nodes", "-keyout", str(key), "-out",
                           str(cert), "-days", "1", "-subj", "/CN=127.0.0.1", "-addext", "subjectAltName=IP:127.0.0.1"],
                          capture_output=True)
    if made.returncode != 0:
        pytest.skip(f"openssl could not make a certificate: {made.stderr.decode()[-200:]}")
    port = free_port()
    cmd = [sys.executable, "-m", "kv_cache.cli", "serve", "--model", MODEL, "--store", str(tmp_path / "s"), "--port",
           str(port), "--api-key", KEY, "--ssl-keyfile", str(key), "--ssl-certfile", str(cert), "--log-level",
           "warning", "--no-access-log", "--limit-concurrency", "3"]
    child = subprocess.Popen(cmd, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE)
    try:
        deadline = time.monotonic() + 120
        while True:
            assert child.poll() is None, child.stderr.read().decode()[-2000:]
            try:
                r = httpx.get(f"https://127.0.0.1:{port}/health", verify=str(cert), timeout=2)
                break
            except httpx.HTTPError:
                assert time.monotonic() < deadline, "the TLS server did not start"
                time.sleep(0.2)
        assert r.status_code == 200
        with pytest.raises(httpx.HTTPError):
            httpx.get(f"http://127.0.0.1:{port}/health", timeout=5)  # plain HTTP is not served
        tls = ssl.create_default_context(cafile=str(cert))
        held = [tls.wrap_socket(socket.create_connection(("127.0.0.1", port), timeout=10), server_hostname="127.0.0.1")
                for _ in range(3)]
        try:  # the three held connections counted by uvicorn (a bounded wait), then a fourth is 503
            deadline = time.monotonic() + 30
            while (r := httpx.get(f"https://127.0.0.1:{port}/health", verify=str(cert), timeout=10)).status_code != 503:
                assert r.status_code == 200, r.text
                assert time.monotonic() < deadline, "a fourth connection was never refused"
                time.sleep(0.05)
        finally:
            for sock in held:
                sock.close()
        deadline = time.monotonic() + 30
        while httpx.get(f"https://127.0.0.1:{port}/health", verify=str(cert), timeout=10).status_code != 200:
            assert time.monotonic() < deadline, "the limit did not free its places"
            time.sleep(0.1)
    finally:
        child.send_signal(signal.SIGTERM)
        try:
            child.wait(30)
        except subprocess.TimeoutExpired:
            child.kill()
        child.stderr.close()


# ------------------------------------------------------------------------------ salt
def test_each_store_has_its_own_salt_and_old_stores_keep_theirs(stories, tmp_path):
    model, tok = stories
    a, b = ContextStore(tmp_path / "a", model, tok), ContextStore(tmp_path / "b", model, tok)
    assert a.owner_salt != b.owner_salt and len(a.owner_salt) == 32
    assert key_id(KEY, a.owner_salt) != key_id(KEY, b.owner_salt)
    assert ContextStore(tmp_path / "a", model, tok).owner_salt == a.owner_salt  # kept across restarts
    assert (os.stat(tmp_path / "a" / SALT_FILE).st_mode & 0o777) == 0o600
    assert ApiKeys([KEY], salt=a.owner_salt).owner(f"Bearer {KEY}") == key_id(KEY, a.owner_salt)
    # a store made before per-store salts: owned contexts and no salt file -> the old salt, so the
    # keys still see their contexts
    old = tmp_path / "old"
    old.mkdir()
    (old / SALT_FILE).write_text(LEGACY_SALT.hex() + "\n")
    with serving(model, tok, old) as server:
        with httpx.Client(base_url=server.base_url, headers=AUTH, timeout=60) as h:
            cid = create(h, method="q4d")["id"]
    (old / SALT_FILE).unlink()
    reopened = ContextStore(old, model, tok)
    assert reopened.owner_salt == LEGACY_SALT and (old / SALT_FILE).exists()
    assert [d["id"] for d in reopened.list(key_id(KEY, LEGACY_SALT))] == [cid]
    (old / SALT_FILE).write_text("not hex\n")
    with pytest.raises(ValueError, match="salt"):
        ContextStore(old, model, tok)
