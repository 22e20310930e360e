"""``kvcache serve`` safe to expose (issue 28): requests name no files, errors leak no server
detail, every input is bounded before work, keys are tenants.

The server runs on 127.0.0.1 in a thread (tests/serve_support.py) with small limits, so each
bound is reached with small bodies; one test sends 50 MB to the default 8 MiB limit.
"""

from __future__ import annotations

import builtins
import io
import json
import os
import threading
import time

import pytest

pytest.importorskip("fastapi", reason="needs the serve extra: pip install 'kv_cache[serve]'")
httpx = pytest.importorskip("httpx")
openai = pytest.importorskip("openai", reason="the tests drive the server with the openai client")

from kv_cache.integrations.serve.store import SALT_FILE  # noqa: E402
from kv_cache.integrations.serve.auth import ApiKeys, collect_keys, is_loopback, key_id, read_keys_file  # noqa: E402
from kv_cache.integrations.serve.errors import ApiError, redact  # noqa: E402
from kv_cache.integrations.serve.files import ServedFiles  # noqa: E402
from kv_cache.integrations.serve.limits import Limits, json_depth, parse_json  # noqa: E402
from serve_support import AUTH, DOC, KEY, MODEL, QUESTION, ask, create, error, serving  # noqa: E402

KEY2 = "second-key"
AUTH2 = {"Authorization": f"Bearer {KEY2}"}
SMALL = Limits(max_body_bytes=64 << 10, max_json_depth=16, max_document_chars=5_000, max_tokens=64,
               max_stop_chars=8, max_contexts=4, max_contexts_per_key=3)
HOSTILE_SPECS = ["plan[/etc/hostname]", "plan[/nope/x.json]", "kvzap@0.25[/etc/passwd]", "q4p[/etc/os-release]",
                 "q4+kvzap@0.25[../../x]", "q4u[/etc/hosts]+kvzip@0.5", "plan[plan.json]", "PLAN[/ETC/HOSTNAME]",
                 "q4+kvzip@0.5[/etc/passwd]", "plan[/etc/hostname", "kvzap@0.25[/etc/passwd]]",
                 "kvzap@0.25", "q4+kvzap@t-6"]  # no scorer is shipped for stories260K: a 400 before the queue


@pytest.fixture(scope="module")
def profile(tmp_path_factory, stories):
    from kv_cache.plan.bit_allocation import save_bit_profile

    model, _ = stories
    n = model.config.num_hidden_layers
    return save_bit_profile(tmp_path_factory.mktemp("files") / "profile.json", {i: (4, 2) for i in range(n)},
                            {"model": "stories260K"})


@pytest.fixture(scope="module")
def srv(stories, tmp_path_factory, profile):
    from kv_cache import KVzip, QuantConfig
    from kv_cache.plan import CachePlan

    model, tok = stories
    plan_path = tmp_path_factory.mktemp("files") / "plan.json"
    CachePlan.uniform(model.config, QuantConfig(bits=4), KVzip(budget=0.5), name="registered").save(plan_path)
    files = ServedFiles.register(plans=[f"half={plan_path}"], bit_profiles=[f"mixed={profile}"],
                                 model_config=model.config)
    with serving(model, tok, tmp_path_factory.mktemp("store"), api_key=None, api_keys=[KEY, KEY2], limits=SMALL,
                 files=files, request_timeout=60.0) as server:
        yield server


@pytest.fixture
def http(srv):
    with httpx.Client(base_url=srv.base_url, headers=AUTH, timeout=60) as client:
        yield client


@pytest.fixture
def http2(srv):
    with httpx.Client(base_url=srv.base_url, headers=AUTH2, timeout=60) as client:
        yield client


def _clean(http):
    for d in http.get("/v1/contexts").json()["data"]:
        http.delete(f"/v1/contexts/{d['id']}")


# ------------------------------------------------------------------------------ requests are data
@pytest.fixture
def file_probe(monkeypatch, tmp_path):
    """Records every open / stat of a path under ``tmp_path`` (the probe files) from any thread."""
    seen: list[str] = []
    root = str(tmp_path)

    def watch(fn):
        def wrapper(path, *a, **kw):
            if isinstance(path, (str, os.PathLike)) and root in os.fspath(path):
                seen.append(os.fspath(path))
            return fn(path, *a, **kw)
        return wrapper

    for mod, name in ((builtins, "open"), (io, "open"), (os, "open"), (os, "stat"), (os, "lstat")):
        monkeypatch.setattr(mod, name, watch(getattr(mod, name)))
    return tmp_path, seen


def test_a_spec_naming_a_path_is_refused_without_touching_it(http, file_probe):
    tmp, seen = file_probe
    real = tmp / "real.json"
    real.write_text(json.dumps({"format": "kv_cache.cache_plan"}))
    seen.clear()  # the test's own write
    answers = {}
    for template in ("plan[{}]", "kvzap@0.25[{}]", "q4p[{}]", "q4+h2o@0.5[{}]"):
        for path in (real, tmp / "missing.json"):
            r = http.post("/v1/contexts", json={"document": DOC, "method": template.format(path)})
            err = error(r, 400, "invalid_method")
            assert "names a file" in err["message"] and str(tmp) not in err["message"], err
            answers.setdefault(template, []).append(r.json())
        assert answers[template][0] == answers[template][1]  # the same whether the file exists or not
    assert seen == []  # nothing under the probe folder was opened or looked up


@pytest.mark.parametrize("spec", HOSTILE_SPECS)
def test_hostile_specs_400_never_500(http, spec):
    err = error(http.post("/v1/contexts", json={"document": DOC, "method": spec}), 400, "invalid_method")
    assert "/etc" not in err["message"] and "Error" not in err["message"], err


@pytest.mark.parametrize("patch", [
    {"layout": {"rotation": "calibrated", "rotation_path": "/etc/passwd"}},
    {"policy": {"class": "KVzap", "fields": {"budget": 0.5, "scorer": "/etc/passwd"}}},
])
def test_a_plan_object_naming_a_file_is_refused(http, stories, patch, file_probe):
    from kv_cache import KVzip, QuantConfig
    from kv_cache.plan import CachePlan

    tmp, seen = file_probe
    model, _ = stories
    doc = json.loads(CachePlan.uniform(model.config, QuantConfig(bits=4), KVzip(budget=0.5)).to_json())
    for key, value in patch.items():
        doc[key] = {**(doc[key] or {}), **value}
        if key == "policy":
            doc[key]["fields"] = {**value["fields"]}
    err = error(http.post("/v1/contexts", json={"document": DOC, "plan": doc}), 400, "invalid_method")
    assert "names a file" in err["message"] and "/etc/passwd" not in err["message"]
    assert seen == []


def test_registered_files_are_asked_by_name(http, client_factory):
    desc = create(http, method="plan[half]")
    assert desc["method"].startswith("plan[half] (") and desc["ratio"] > 1
    mixed = create(http, method="q4p[mixed]+kvzip@0.5")
    assert mixed["method"] == "q4p[mixed]+kvzip@0.5"  # the name, never the file
    assert mixed["bytes"] < create(http, method="q4+kvzip@0.5")["bytes"]  # the profile's 2-bit values
    assert ask(client_factory(KEY), mixed["id"]).choices[0].message.content
    err = error(http.post("/v1/contexts", json={"document": DOC, "method": "plan[other]"}), 400, "invalid_method")
    assert "['half']" in err["message"] and "--plan NAME=PATH" in err["message"]
    _clean(http)


def test_served_files_resolve_names_only():
    widths = {0: (4, 2), 1: (2, 2)}
    files = ServedFiles(scorers={"s1": "/srv/s1.safetensors"}, bit_profiles={"b": widths})
    assert files.resolve_spec("kvzap@0.25[s1]") == ("kvzap@0.25[/srv/s1.safetensors]", None, {})
    assert files.resolve_spec("q4p[b]+kvzap@0.5[s1]") == ("q4+kvzap@0.5[/srv/s1.safetensors]", None,
                                                          {"layer_bits": widths})
    assert files.resolve_spec("q4o2u[b]+kvzip@0.5") == ("q4o2+kvzip@0.5", None, {"evicted_layer_bits": widths})
    assert files.resolve_spec("q4+kvzip@0.3") == ("q4+kvzip@0.3", None, {})
    for bad in ("kvzap@0.25[b]", "q4p[s1]", "kvzap@0.25[/srv/s1.safetensors]", "plan[s1]", "q4p[b", "q4g[b]"):
        with pytest.raises(ApiError) as exc:
            files.resolve_spec(bad)
        assert exc.value.code == "invalid_method"
    with pytest.raises(ValueError, match="a name is letters"):
        ServedFiles.register(plans=["../x=/etc/passwd"])


def test_a_bit_profile_in_a_folder_with_capitals_and_spaces(stories, tmp_path):
    """Its path never goes through the (lower-casing) spec parser: loaded at start-up."""
    from kv_cache.plan.bit_allocation import save_bit_profile

    model, tok = stories
    path = save_bit_profile(tmp_path / "My Profiles" / "Mixed.json",
                            {i: (4, 2) for i in range(model.config.num_hidden_layers)}, {"model": MODEL})
    files = ServedFiles.register(bit_profiles=[f"mixed={path}"])
    with serving(model, tok, tmp_path / "store", files=files) as server:
        with httpx.Client(base_url=server.base_url, headers=AUTH, timeout=60) as h:
            desc = create(h, method="q4p[mixed]")
            plain = create(h, method="q4")
    assert desc["method"] == "q4p[mixed]" and desc["bytes"] < plain["bytes"]  # values at 2 bits


# ------------------------------------------------------------------------------ errors leak nothing
def test_models_lists_a_name_and_errors_name_no_server_path(srv, http, stories):
    assert [m["id"] for m in http.get("/v1/models").json()["data"]] == [MODEL]
    store = str(srv.service.store.directory.resolve())
    bodies = [http.post("/v1/contexts", json={"document": DOC, "method": s}).text for s in HOSTILE_SPECS]
    bodies.append(http.post("/v1/contexts", json={"document": DOC, "plan": {"format": "kv_cache.cache_plan",
                                                                          "version": 1, "layers": 3}}).text)
    for text in bodies:
        assert store not in text and "Traceback" not in text and "TypeError" not in text, text


def test_redact_replaces_server_paths_keeps_routes():
    assert redact("no file '/srv/a/b.json' (GET /v1/contexts lists them)") == \
        "no file '<path>' (GET /v1/contexts lists them)"
    assert redact("at srv/store/ctx.kvc", ["srv/store"]) == "at <path>"
    assert redact("K3/V2 and 1/2") == "K3/V2 and 1/2"


def test_served_model_name_defaults_to_the_folder_name():
    from kv_cache.cli.serve import served_model_name

    assert served_model_name("/models/SmolLM2-135M/") == "SmolLM2-135M"
    assert served_model_name("stories260K") == "stories260K"


# ------------------------------------------------------------------------------ limits
def test_body_past_the_limit_413_while_sending(srv):
    body = b'{"document": "' + b"a" * (SMALL.max_body_bytes + 10) + b'"}'
    r = httpx.post(srv.base_url + "/v1/contexts", content=body, headers={**AUTH, "content-type": "application/json"})
    err = error(r, 413, "payload_too_large")
    assert f"{SMALL.max_body_bytes:,}" in err["message"] and "--max-body-bytes" in err["message"]

    def chunks():  # no Content-Length: the limit is checked as the body is read
        for _ in range(8):
            yield b" " * (16 << 10)

    r = httpx.post(srv.base_url + "/v1/chat/completions", content=chunks(),
                   headers={**AUTH, "content-type": "application/json"})
    error(r, 413, "payload_too_large")


def _rss() -> int:
    with open("/proc/self/status") as f:
        return next(int(line.split()[1]) * 1024 for line in f if line.startswith("VmRSS:"))


@pytest.mark.skipif(not os.path.exists("/proc/self/status"), reason="reads the RSS from /proc")
def test_fifty_megabytes_413_and_deep_json_400_at_the_default_limits(stories, tmp_path):
    model, tok = stories
    with serving(model, tok, tmp_path) as server:
        assert server.service.limits.max_body_bytes == 8 << 20

        def chunks():
            for _ in range(50):
                yield b"x" * (1 << 20)

        before = _rss()
        r = httpx.post(server.base_url + "/v1/contexts", content=chunks(),
                       headers={**AUTH, "content-type": "application/json"}, timeout=60)
        error(r, 413, "payload_too_large")
        assert _rss() - before < 48 << 20  # the 8 MiB read, the rest dropped chunk by chunk
        r = httpx.post(server.base_url + "/v1/contexts", content=b"x" * (50 << 20),
                       headers={**AUTH, "content-type": "application/json"}, timeout=60)
        error(r, 413, "payload_too_large")  # a declared Content-Length past it: the same answer, no reset
        deep = b"[" * 100_000 + b"]" * 100_000  # the body: a RecursionError (500) before
        r = httpx.post(server.base_url + "/v1/chat/completions", content=deep,
                       headers={**AUTH, "content-type": "application/json"}, timeout=60)
        error(r, 400, "json_too_deep")


def test_deep_json_400_before_parsing(http):
    deep = b"[" * 30_000 + b"]" * 30_000  # within the body limit (64 KiB here)
    for route in ("/v1/contexts", "/v1/chat/completions"):
        err = error(http.post(route, content=deep, headers={"content-type": "application/json"}), 400,
                    "json_too_deep")
        assert "30,000 levels" in err["message"] and "--max-json-depth" in err["message"]
    assert json_depth(b'{"a": "[[[[[[", "b": [[1]]}') == 3 and json_depth(b'"\\"[["') == 0
    with pytest.raises(ApiError, match="not JSON"):
        parse_json(b"1" * 5000, 32)  # an integer of too many digits: 400, not a 500


def test_document_and_messages_characters_400(http):
    err = error(http.post("/v1/contexts", json={"document": "a " * 3000}), 400, "text_too_long")
    assert "6,000 characters" in err["message"] and "--max-document-chars" in err["message"]
    body = {"model": MODEL, "messages": [{"role": "user", "content": "b" * 3000}] * 2}
    error(http.post("/v1/chat/completions", json=body), 400, "text_too_long")


def test_max_tokens_and_stop_strings_400(http):
    base = {"model": MODEL, "messages": [{"role": "user", "content": "hi"}]}
    err = error(http.post("/v1/chat/completions", json={**base, "max_tokens": 65}), 400, "invalid_parameter")
    assert err["param"] == "max_tokens" and "at most 64" in err["message"]
    err = error(http.post("/v1/chat/completions", json={**base, "stop": ["123456789"]}), 400, "invalid_parameter")
    assert err["param"] == "stop" and "--max-stop-chars" in err["message"]


def test_tokens_checked_outside_the_model_lock(srv, stories):
    """A document past the token limit is refused while the worker is busy: before the queue."""
    model, tok = stories
    started, release = threading.Event(), threading.Event()
    srv.engine.submit(lambda job: (started.set(), release.wait(30)))
    try:
        assert started.wait(30)
        srv.service.max_document_tokens = 50
        long_doc = "Lily and Tom played in the park. " * 30
        assert len(tok(long_doc).input_ids) > 50
        r = httpx.post(srv.base_url + "/v1/contexts", json={"document": long_doc}, headers=AUTH, timeout=30)
        error(r, 400, "document_too_long")
        assert srv.engine.running == 1 and not release.is_set()  # refused while the worker is still held
    finally:
        srv.service.max_document_tokens = None
        release.set()


def test_store_quotas_per_key_and_in_all_429(srv, http, http2):
    _clean(http), _clean(http2)
    folder = srv.service.store.directory
    try:
        ids = [create(http, method="q4d")["id"] for _ in range(3)]
        err = error(http.post("/v1/contexts", json={"document": DOC, "method": "q4d"}), 429, "storage_quota_exceeded")
        assert "for this API key" in err["message"] and "3" in err["message"]
        create(http2, method="q4d")  # the other key still has room, until the total (4)
        err = error(http2.post("/v1/contexts", json={"document": DOC, "method": "q4d"}), 429,
                    "storage_quota_exceeded")
        assert "in all" in err["message"]
        assert len([p for p in folder.iterdir() if p.suffix == ".kvc"]) == 4
        http.delete(f"/v1/contexts/{ids[0]}")
        create(http2, method="q4d")  # room again
    finally:
        _clean(http), _clean(http2)


def test_store_bytes_per_key_refused_and_nothing_left(stories, tmp_path):
    model, tok = stories
    with serving(model, tok, tmp_path, limits=Limits(max_store_bytes_per_key=1000)) as server:
        r = httpx.post(server.base_url + "/v1/contexts", json={"document": DOC, "method": "q4d"}, headers=AUTH,
                       timeout=60)
        err = error(r, 429, "storage_quota_exceeded")
        assert "1,000" in err["message"]
        assert [p.name for p in tmp_path.iterdir()] == [SALT_FILE]  # the store's salt, no context


# ------------------------------------------------------------------------------ tenancy
@pytest.fixture
def client_factory(srv):
    def make(key):
        return openai.OpenAI(base_url=srv.base_url + "/v1", api_key=key, max_retries=0, timeout=60)
    return make


def test_each_key_sees_only_its_own_contexts(srv, http, http2, client_factory):
    mine = create(http, method="q4d")
    other = create(http2, method="q4d")
    assert [d["id"] for d in http.get("/v1/contexts").json()["data"]] == [mine["id"]]
    assert [d["id"] for d in http2.get("/v1/contexts").json()["data"]] == [other["id"]]
    missing = "ctx-" + "0" * 24
    for method in ("GET", "DELETE"):
        theirs = http2.request(method, f"/v1/contexts/{mine['id']}")
        absent = http2.request(method, f"/v1/contexts/{missing}")
        assert theirs.status_code == absent.status_code == 404
        assert theirs.json() == json.loads(absent.text.replace(missing, mine["id"]))  # exactly like a missing one
    with pytest.raises(openai.NotFoundError):
        ask(client_factory(KEY2), mine["id"])
    assert ask(client_factory(KEY), mine["id"]).choices[0].message.content  # still there for its owner
    _clean(http), _clean(http2)


def test_every_route_but_health_needs_a_key(srv):
    for path in ("/docs", "/openapi.json", "/redoc", "/v1/models", "/v1/contexts", "/nothing-here"):
        for headers in ({}, {"Authorization": "Bearer wrong"}, {"Authorization": "Bearer"}, {"Authorization": KEY}):
            error(httpx.get(srv.base_url + path, headers=headers), 401, "invalid_api_key")
    assert httpx.get(srv.base_url + "/health").status_code == 200
    assert httpx.get(srv.base_url + "/openapi.json", headers=AUTH2).status_code == 200


def test_keys_files_and_empty_keys(tmp_path):
    f = tmp_path / "keys.txt"
    f.write_text("# the team's keys\n\n  alpha  \nbeta\n# beta was rotated\n\n")
    assert read_keys_file(f) == ["alpha", "beta"]
    assert collect_keys(["gamma"], f) == ["gamma", "alpha", "beta"]
    assert collect_keys(None, None, env={"KVCACHE_API_KEY": "delta"}) == ["delta"]
    assert collect_keys(None, None, env={"KVCACHE_API_KEY": ""}) == []
    with pytest.raises(ValueError, match="non-empty key"):
        collect_keys([""])
    (tmp_path / "empty.txt").write_text("# nothing\n\n")
    with pytest.raises(ValueError, match="no key in it"):
        read_keys_file(tmp_path / "empty.txt")
    keys = ApiKeys(["alpha", "beta"])
    assert keys.owner("Bearer beta") == key_id("beta") != keys.owner("Bearer alpha")
    for header in (None, "", "Bearer ", "Bearer alph", "Basic alpha", "alpha"):
        with pytest.raises(ApiError):
            keys.owner(header)
    assert ApiKeys().owner(None) is None


def test_cli_refuses_an_empty_key_and_an_exposed_host_without_one(tmp_path, capsys):
    from kv_cache.cli import main

    assert main(["serve", "--store", str(tmp_path), "--api-key", ""]) == 2
    assert "non-empty key" in capsys.readouterr().err
    assert main(["serve", "--store", str(tmp_path), "--host", "0.0.0.0"]) == 2
    assert "--insecure" in capsys.readouterr().err
    assert is_loopback("127.0.0.1") and is_loopback("::1") and is_loopback("localhost")
    assert not is_loopback("0.0.0.0") and not is_loopback("10.1.2.3") and not is_loopback("example.com")


def test_contexts_stored_without_keys_belong_to_none_until_assigned(stories, tmp_path, capsys):
    from kv_cache.cli import main

    model, tok = stories
    with serving(model, tok, tmp_path, api_key=None) as plain:  # no keys: owner None
        with httpx.Client(base_url=plain.base_url, timeout=60) as h:
            cid = create(h, method="q4d")["id"]
    with serving(model, tok, tmp_path, api_key=None, api_keys=[KEY, KEY2]) as keyed:
        for auth in (AUTH, AUTH2):
            assert httpx.get(keyed.base_url + "/v1/contexts", headers=auth).json()["data"] == []
            error(httpx.get(keyed.base_url + f"/v1/contexts/{cid}", headers=auth), 404, "context_not_found")
    assert main(["contexts", "--store", str(tmp_path), "--model", MODEL, "list"]) == 0
    listed = [json.loads(line) for line in capsys.readouterr().out.splitlines() if line.startswith("{")]
    assert [(d["id"], d["owner"]) for d in listed] == [(cid, None)]
    assert main(["contexts", "--store", str(tmp_path), "--model", MODEL, "assign", cid, "--key", KEY]) == 0
    with serving(model, tok, tmp_path, api_key=None, api_keys=[KEY, KEY2]) as keyed:
        assert [d["id"] for d in httpx.get(keyed.base_url + "/v1/contexts", headers=AUTH).json()["data"]] == [cid]
        assert httpx.get(keyed.base_url + "/v1/contexts", headers=AUTH2).json()["data"] == []
        c = openai.OpenAI(base_url=keyed.base_url + "/v1", api_key=KEY, max_retries=0, timeout=60)
        assert ask(c, cid, QUESTION).choices[0].message.content
    assert main(["contexts", "--store", str(tmp_path), "--model", MODEL, "delete", cid]) == 0
    assert not (tmp_path / f"{cid}.kvc").exists()


def test_admission_comes_before_the_body_and_refusals_after_it(srv, http, http2):
    """With the worker busy and the queue full, every POST that does work is 503 ``queue_full``
    with ``Retry-After`` before its body is read (issue 60: admission before reading), whatever
    the body holds; with room again, a spec naming a file is 400 and another key's context 404."""
    mine = create(http, method="q4d")["id"]
    started, release = threading.Event(), threading.Event()
    srv.engine.submit(lambda job: (started.set(), release.wait(30)))
    bad_spec = {"document": DOC, "method": "plan[/etc/passwd]"}
    other_key = {"model": MODEL, "context_id": mine, "messages": [{"role": "user", "content": "hi"}]}
    try:
        assert started.wait(30)
        for _ in range(srv.engine.queue_size):
            srv.engine.submit(lambda job: None)
        for client, route, body in ((http2, "/v1/contexts", bad_spec), (http2, "/v1/chat/completions", other_key),
                                    (http, "/v1/chat/completions", other_key)):
            r = client.post(route, json=body)
            error(r, 503, "queue_full")
            assert r.headers["retry-after"]
    finally:
        release.set()
    deadline = time.monotonic() + 30
    while srv.engine.waiting and time.monotonic() < deadline:
        time.sleep(0.01)
    error(http2.post("/v1/contexts", json=bad_spec), 400, "invalid_method")
    error(http2.post("/v1/chat/completions", json=other_key), 404, "context_not_found")
    _clean(http)


@pytest.mark.parametrize("patch", [{"layers": [5]}, {"layers": [{}]}, {"layers": "x"}, {"policy": [1]},
                                   {"policy": {"class": "KVzip", "fields": [1]}}, {"layout": {"bits": "four"}},
                                   {"layout": {"nope": 1}}, {"model": 3}])
def test_malformed_plan_objects_400_without_exception_names(http, stories, patch):
    from kv_cache import KVzip, QuantConfig
    from kv_cache.plan import CachePlan

    model, _ = stories
    doc = {**json.loads(CachePlan.uniform(model.config, QuantConfig(bits=4), KVzip(budget=0.5)).to_json()), **patch}
    err = error(http.post("/v1/contexts", json={"document": DOC, "plan": doc}), 400, "invalid_method")
    assert err["param"] == "plan" and "Error" not in err["message"] and "Traceback" not in err["message"], err
