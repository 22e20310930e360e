"""``kvcache serve`` against a hostile client (issue 28): generated bodies never get a 5xx nor
change another key's contexts; stored files that are header-valid but hold fields of the wrong
type are marked corrupted and never stop the server from starting.

The hand-written hostile cases (paths in specs, 50 MB and deeply nested bodies, other keys'
contexts) are in tests/test_serve_security.py; these are the generated ones.
"""

from __future__ import annotations

import hashlib
import json

import pytest

pytest.importorskip("fastapi", reason="needs the serve extra: pip install 'kv_cache[serve]'")
httpx = pytest.importorskip("httpx")
hypothesis = pytest.importorskip("hypothesis")
from hypothesis import HealthCheck, given, settings, strategies as st  # noqa: E402

from kv_cache import CompressedContext  # noqa: E402
from kv_cache.integrations.serve.limits import Limits  # noqa: E402
from kv_cache.integrations.serve.store import ContextStore  # noqa: E402
from serve_support import AUTH, DOC, KEY, MODEL, QUESTION, create, error, serving, sha  # noqa: E402

VICTIM = "victim-key"
VICTIM_AUTH = {"Authorization": f"Bearer {VICTIM}"}
LIMITS = Limits(max_body_bytes=32 << 10, max_json_depth=8, max_document_chars=2_000, max_tokens=8,
                max_stop_chars=8, max_contexts_per_key=4)
SPECS = ["q4d", "full", "kvzip@0.5", "kvzap@0.25", "q4+kvzap@t-6", "q2+snapkv@0.5", "4x", "plan[/etc/hostname]",
         "kvzap@0.25[/etc/passwd]",
         "q4p[/etc/os-release]", "plan[x]", "q4+q4", "hf-quanto-int4", "kvpress-snapkv@0.5", "h2o@-1", "q99",
         "snapkv@0.5:nope", "../../etc/passwd", "[", "]", "q4p[", "kvzap@t-1e999"]
EXAMPLES = 80

json_leaf = st.one_of(st.none(), st.booleans(), st.integers(-2**70, 2**70), st.floats(allow_nan=False),
                      st.text(max_size=30))
json_value = st.recursive(json_leaf, lambda inner: st.one_of(st.lists(inner, max_size=4),
                                                             st.dictionaries(st.text(max_size=10), inner, max_size=4)),
                          max_leaves=12)


@pytest.fixture(scope="module")
def world(stories, tmp_path_factory):
    model, tok = stories
    store = tmp_path_factory.mktemp("store")
    with serving(model, tok, store, api_key=None, api_keys=[KEY, VICTIM], limits=LIMITS,
                 request_timeout=60.0) as server:
        with httpx.Client(base_url=server.base_url, headers=VICTIM_AUTH, timeout=60) as v:
            victim = create(v, method="q4d")
            listed = v.get("/v1/contexts").json()
        path = store / f"{victim['id']}.kvc"
        with httpx.Client(base_url=server.base_url, headers=AUTH, timeout=60) as attacker:
            yield server, attacker, victim, listed, path, sha(path)


def _send(attacker, route: str, body) -> httpx.Response:
    if isinstance(body, bytes):
        r = attacker.post(route, content=body, headers={"content-type": "application/json"})
    else:
        r = attacker.post(route, content=json.dumps(body).encode(), headers={"content-type": "application/json"})
    assert r.status_code < 500, (body, r.text)
    if r.status_code >= 400:
        err = r.json()["error"]
        assert err["code"] and err["message"] and "Traceback" not in r.text and "/tmp" not in r.text, r.text
    return r


context_bodies = st.one_of(
    st.fixed_dictionaries({}, optional={
        "document": st.one_of(st.text(max_size=300), st.just(DOC), json_value),
        "method": st.one_of(st.sampled_from(SPECS), st.text(max_size=20), json_value),
        "preset": st.one_of(st.sampled_from(["4x", "8x", "1x", "0x", "nanx", "1e9x"]), json_value),
        "plan": st.one_of(json_value, st.fixed_dictionaries({"format": st.just("kv_cache.cache_plan"),
                                                             "version": st.just(1), "layers": json_value,
                                                             "layout": json_value, "policy": json_value,
                                                             "model": json_value, "fingerprint": json_value})),
        "max_tokens": st.one_of(st.integers(-3, 600), json_value),
        "keep": st.one_of(st.sampled_from(["head", "tail"]), json_value),
    }),
    json_value,
    st.binary(max_size=200),
)


@settings(max_examples=EXAMPLES, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(body=context_bodies)
def test_generated_context_bodies_never_5xx(world, body):
    server, attacker, *_ = world
    r = _send(attacker, "/v1/contexts", body)
    if r.status_code == 201:
        attacker.delete(f"/v1/contexts/{r.json()['id']}")


message = st.one_of(st.fixed_dictionaries({"role": st.sampled_from(["user", "system", "assistant", "robot"]),
                                           "content": st.one_of(st.text(max_size=60), st.just(QUESTION),
                                                                json_value)}),
                    json_value)


def chat_bodies(victim_id: str):
    return st.one_of(
        st.fixed_dictionaries({"model": st.one_of(st.just(MODEL), json_value),
                               "messages": st.one_of(st.lists(message, min_size=1, max_size=3), json_value)},
                              optional={
            "max_tokens": st.one_of(st.integers(-2, 12), json_value),
            "temperature": st.one_of(st.floats(-1, 3), json_value), "top_p": st.one_of(st.floats(-1, 2), json_value),
            "seed": st.one_of(st.integers(-2**70, 2**70), json_value),
            "stop": st.one_of(st.text(max_size=10), st.lists(st.text(max_size=10), max_size=6), json_value),
            "stream": st.one_of(st.booleans(), json_value), "n": st.one_of(st.integers(-1, 3), json_value),
            "stream_options": json_value,
            "context_id": st.one_of(st.just(victim_id), st.just("ctx-" + "0" * 24), st.just("../../etc/passwd"),
                                    json_value),
        }),
        json_value,
        st.binary(max_size=200),
    )


@settings(max_examples=EXAMPLES, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(data=st.data())
def test_generated_chat_bodies_never_5xx(world, data):
    server, attacker, victim, *_ = world
    body = data.draw(chat_bodies(victim["id"]))
    r = _send(attacker, "/v1/chat/completions", body)
    if isinstance(body, dict) and body.get("context_id") == victim["id"]:
        assert r.status_code in (400, 404), r.text  # another key's context: never answered from


spec_strings = st.from_regex(r"q[0-9]{1,2}d?(g[0-9]{1,3})?(r[0-9]{1,3})?(s[0-9]{1,2})?(k[0-9])?(v[0-9])?h?t?"
                             r"(c[0-9]{1,3})?l?(o[0-9])?(\+(h2o|snapkv|kvzip|streaming|kvzap|tova)@(t-?)?[0-9]{1,3}(\.[0-9]{1,2})?"
                             r"(w[0-9]{1,3})?(e[0-9]{1,2})?(:(layer|head|model|nope))?)?", fullmatch=True)


@settings(max_examples=EXAMPLES, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(spec=spec_strings)
def test_generated_method_specs_never_5xx(world, spec):
    """Specs from the grammar's letters with any numbers: compressed (201) or refused (400 / 429)."""
    server, attacker, *_ = world
    r = _send(attacker, "/v1/contexts", {"document": DOC, "method": spec})
    assert r.status_code in (201, 400, 429), r.text
    if r.status_code == 201:
        attacker.delete(f"/v1/contexts/{r.json()['id']}")


def test_the_victims_context_is_unchanged(world):
    """Runs after the generated requests (same module, in order)."""
    server, attacker, victim, listed, path, digest = world
    assert sha(path) == digest
    with httpx.Client(base_url=server.base_url, headers=VICTIM_AUTH, timeout=60) as v:
        assert v.get("/v1/contexts").json() == listed
        r = v.post("/v1/chat/completions", json={"model": MODEL, "context_id": victim["id"], "max_tokens": 4,
                                                 "temperature": 0, "messages": [{"role": "user", "content": QUESTION}]})
        assert r.status_code == 200 and r.json()["choices"][0]["message"]["content"]
    assert victim["id"] not in [d["id"] for d in attacker.get("/v1/contexts").json()["data"]]


# ------------------------------------------------------------------------------ hostile files
def _tamper(path, change) -> None:
    """Rewrite the kv_cache header of ``path`` with ``change(header)``, its checksum made valid again."""
    from safetensors.torch import load, save

    from kv_cache.cache.serialize import FORMAT, FORMAT_VERSION, _read_file

    data, header, _ = _read_file(path)
    change(header)
    text = json.dumps(header, sort_keys=True, separators=(",", ":"))
    meta = {"format": FORMAT, "format_version": str(FORMAT_VERSION), "kv_cache": text,
            "kv_cache_sha256": hashlib.sha256(text.encode()).hexdigest()}
    path.write_bytes(save(load(data), metadata=meta))


def _set(*keys_value):
    *keys, value = keys_value

    def change(header):
        node = header
        for k in keys[:-1]:
            node = node[k]
        node[keys[-1]] = value
    return change


HOSTILE_HEADERS = {
    "tokens a string": _set("extra", "context_tokens", "many"),
    "bytes a list": _set("extra", "kv_bytes", [1]),
    "owner a number": _set("extra", "owner", 5),
    "created a dict": _set("extra", "created", {"t": 1}),
    "extra a list": _set("extra", [1, 2]),
    "model a list": _set("model", [1]),
    "layers a string": _set("layers", "x"),
    "tensors wrong": _set("tensors", {"x": 5}),
    "quant bits a word": _set("quant", {"bits": "four"}),
    "eviction budget a list": _set("eviction", {"class": "KVzip", "fields": {"budget": [1]}}),
    "eviction a list": _set("eviction", [1]),
    "prefill seconds a string": _set("extra", "prefill_seconds", "slow"),
}


def test_header_valid_files_with_wrong_types_are_corrupted_never_fatal(stories, tmp_path):
    model, tok = stories
    store = ContextStore(tmp_path, model, tok)
    good = store.add(CompressedContext.build(model, tok, DOC), {"model": MODEL, "method": "full"})["id"]
    bad = {}
    for name, change in HOSTILE_HEADERS.items():
        cid = store.add(CompressedContext.build(model, tok, DOC), {"model": MODEL, "method": "full"})["id"]
        _tamper(tmp_path / f"{cid}.kvc", change)
        bad[cid] = name
    reopened = ContextStore(tmp_path, model, tok)  # start-up: every file read, none fatal
    listed = {d["id"]: d for d in reopened.list()}
    assert listed[good]["status"] == "ready" and set(listed) == {good, *bad}
    with serving(model, tok, tmp_path, api_key=None) as server:  # stored without keys: owner None
        with httpx.Client(base_url=server.base_url, timeout=60) as h:
            for cid, name in bad.items():
                r = h.post("/v1/chat/completions", json={"model": MODEL, "context_id": cid, "max_tokens": 2,
                                                         "messages": [{"role": "user", "content": "hi"}]})
                assert r.status_code in (404, 422), (name, r.text)
                if r.status_code == 422:
                    assert r.json()["error"]["code"] == "context_corrupted" and str(tmp_path) not in r.text
                    error(h.get(f"/v1/contexts/{cid}"), 422, "context_corrupted")
                    assert h.get("/v1/contexts").status_code == 200
            statuses = {d["id"]: d["status"] for d in h.get("/v1/contexts").json()["data"]}
            assert statuses[good] == "ready"
            assert all(statuses.get(cid) in (None, "corrupted") for cid in bad), statuses
            r = h.post("/v1/chat/completions", json={"model": MODEL, "context_id": good, "max_tokens": 2,
                                                     "messages": [{"role": "user", "content": QUESTION}]})
            assert r.status_code == 200, r.text
            for cid in bad:  # deletable, whatever they hold
                assert h.delete(f"/v1/contexts/{cid}").status_code in (200, 404)

