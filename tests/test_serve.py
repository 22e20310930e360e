"""``kvcache serve`` on 127.0.0.1 with stories260K, driven by the real ``openai`` client and raw HTTP.

Round trip (answers equal :meth:`CompressedContext.ask` on the stored file, and plain chat equals
``model.generate``), streaming, stop strings, sampling, every error case and 8 concurrent
clients. Persistence, kills mid-write and the store's LRU: tests/test_serve_store.py.
"""

from __future__ import annotations

import json
import threading
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import pytest

pytest.importorskip("fastapi", reason="needs the serve extra: pip install 'kv_cache[serve]'")
httpx = pytest.importorskip("httpx")
openai = pytest.importorskip("openai", reason="the tests drive the server with the openai client")

from kv_cache import CompressedContext  # noqa: E402
from serve_support import AUTH, DOC, KEY, MODEL, QUESTION, ask, create, error, serving, sha  # noqa: E402


@pytest.fixture(scope="module")
def srv(stories, tmp_path_factory):
    model, tok = stories
    with serving(model, tok, tmp_path_factory.mktemp("store"), queue_size=16, request_timeout=60.0,
                 max_document_tokens=300) as server:
        yield server


@pytest.fixture
def http(srv):
    with httpx.Client(base_url=srv.base_url, headers=AUTH, timeout=60) as client:
        yield client


@pytest.fixture
def client(srv):
    return openai.OpenAI(base_url=srv.base_url + "/v1", api_key=KEY, max_retries=0, timeout=60)


# ------------------------------------------------------------------------------ round trip
def test_models_lists_the_served_model(client):
    assert [m.id for m in client.models.list().data] == [MODEL]


@pytest.mark.parametrize("method", ["q4+kvzip@0.5", "full", "q2d"])
def test_round_trip_answer_equals_the_library(srv, http, client, stories, method):
    model, tok = stories
    desc = create(http, method=method)
    assert desc["status"] == "ready" and desc["method"] == method and desc["model"] == MODEL
    assert desc["tokens"] == desc["document_tokens"] == len(tok(DOC).input_ids)
    assert desc["bytes"] > 0 and desc["prefill_seconds"] > 0 and desc["file_bytes"] > 0
    if method == "full":  # float32 model: the full cache holds 2x the fp16 bytes
        assert desc["ratio"] == pytest.approx(0.5)
    else:
        assert desc["bytes"] < desc["fp16_bytes"] and desc["ratio"] > 1
    if method.endswith("kvzip@0.5"):
        assert desc["reconstruction_seconds"] > 0
    assert http.get(f"/v1/contexts/{desc['id']}").json() == desc
    assert desc["id"] in [d["id"] for d in http.get("/v1/contexts").json()["data"]]

    path = Path(srv.service.store.directory) / f"{desc['id']}.kvc"
    before = sha(path)
    out = ask(client, desc["id"])
    expected = CompressedContext.load(path, model, tok).ask(QUESTION, max_new_tokens=12)
    assert out.choices[0].message.content == expected and expected
    q = len(tok.encode(QUESTION, add_special_tokens=False))
    assert out.usage.prompt_tokens == desc["tokens"] + q
    assert out.usage.prompt_tokens_details.cached_tokens == desc["tokens"]
    assert out.usage.completion_tokens == 12 and out.choices[0].finish_reason == "length"
    assert out.usage.total_tokens == out.usage.prompt_tokens + 12
    again = ask(client, desc["id"])  # the stored context never changes
    assert again.choices[0].message.content == expected
    assert sha(path) == before


def test_chat_without_context_equals_generate(client, stories):
    import torch

    model, tok = stories
    prompt = "Once upon a time, there was a dog"
    out = ask(client, None, prompt, max_tokens=10)
    ids = tok(prompt, return_tensors="pt").input_ids
    with torch.no_grad():
        ref = model.generate(ids, max_new_tokens=10, do_sample=False, pad_token_id=tok.pad_token_id)
    assert out.choices[0].message.content == tok.decode(ref[0, ids.shape[1]:], skip_special_tokens=True)
    assert out.usage.prompt_tokens == ids.shape[1] and out.usage.prompt_tokens_details.cached_tokens == 0


def test_streaming_openai_client_and_raw_sse(http, client):
    cid = create(http, method="q4d")["id"]
    whole = ask(client, cid, max_tokens=16).choices[0].message.content
    chunks = list(ask(client, cid, max_tokens=16, stream=True, stream_options={"include_usage": True}))
    text = "".join(c.choices[0].delta.content or "" for c in chunks if c.choices)
    assert text == whole
    assert chunks[0].choices[0].delta.role == "assistant"
    finals = [c.choices[0].finish_reason for c in chunks if c.choices and c.choices[0].finish_reason]
    assert finals == ["length"]
    assert chunks[-1].choices == [] and chunks[-1].usage.completion_tokens == 16
    assert sum(1 for c in chunks if c.choices and c.choices[0].delta.content) > 3  # really streamed

    body = {"model": MODEL, "messages": [{"role": "user", "content": QUESTION}], "temperature": 0,
            "max_tokens": 16, "stream": True, "context_id": cid}
    with http.stream("POST", "/v1/chat/completions", json=body) as r:
        assert r.status_code == 200 and r.headers["content-type"].startswith("text/event-stream")
        lines = [line for line in r.iter_lines() if line]
    assert all(line.startswith("data: ") for line in lines) and lines[-1] == "data: [DONE]"
    events = [json.loads(line[6:]) for line in lines[:-1]]
    assert {e["object"] for e in events} == {"chat.completion.chunk"}
    assert "".join(e["choices"][0]["delta"].get("content", "") for e in events) == whole


def test_stop_strings_cut_the_answer_streaming_or_not(http, client):
    cid = create(http, method="q4d")["id"]
    whole = ask(client, cid, max_tokens=20).choices[0].message.content
    words = whole.split()
    assert len(words) >= 3, whole
    stop = " " + words[2]  # the third word, with its space
    cut = whole[:whole.index(stop)]
    out = ask(client, cid, max_tokens=20, stop=[stop, "zzzz"])
    assert out.choices[0].message.content == cut and out.choices[0].finish_reason == "stop"
    streamed = "".join(c.choices[0].delta.content or "" for c in ask(client, cid, max_tokens=20, stop=stop,
                                                                       stream=True) if c.choices)
    assert streamed == cut


def test_sampling_seed_top_p_and_temperature(http, client):
    cid = create(http, method="q4d")["id"]
    greedy = ask(client, cid, max_tokens=20).choices[0].message.content
    a = ask(client, cid, max_tokens=20, temperature=1.5, seed=7).choices[0].message.content
    b = ask(client, cid, max_tokens=20, temperature=1.5, seed=7).choices[0].message.content
    c = ask(client, cid, max_tokens=20, temperature=1.5, seed=8).choices[0].message.content
    assert a == b and a != c and a != greedy
    # a nucleus of one token is the greedy answer, whatever the temperature
    assert ask(client, cid, max_tokens=20, temperature=1.5, top_p=1e-6, seed=3).choices[0].message.content == greedy


# ------------------------------------------------------------------------------ errors
def test_unknown_context_404(http, client):
    missing = "ctx-" + "0" * 24
    err = error(http.post("/v1/chat/completions", json={"model": MODEL, "context_id": missing,
                                                         "messages": [{"role": "user", "content": "hi"}]}),
                 404, "context_not_found")
    assert missing in err["message"] and err["param"] == "context_id"
    error(http.get(f"/v1/contexts/{missing}"), 404, "context_not_found")
    error(http.get("/v1/contexts/..secret"), 404, "context_not_found")  # ids are never paths
    assert http.get("/v1/contexts/..%2F..%2Fetc%2Fpasswd").status_code == 404
    error(http.delete(f"/v1/contexts/{missing}"), 404, "context_not_found")
    with pytest.raises(openai.NotFoundError):
        ask(client, missing)
    error(http.get("/v1/nothing-here"), 404, "not_found")


def test_bad_method_preset_plan_400(http):
    err = error(http.post("/v1/contexts", json={"document": DOC, "method": "q4+nope@0.5"}), 400, "invalid_method")
    assert "q4+nope@0.5" in err["message"] and "known forms" in err["message"]
    err = error(http.post("/v1/contexts", json={"document": DOC, "method": "hf-quanto-int4"}), 400, "invalid_method")
    assert "peer" in err["message"]
    err = error(http.post("/v1/contexts", json={"document": DOC, "preset": "1x"}), 400, "invalid_method")
    assert "'1x'" in err["message"]
    error(http.post("/v1/contexts", json={"document": DOC, "plan": {"format": "nope"}}), 400, "invalid_method")
    error(http.post("/v1/contexts", json={"document": DOC, "plan": "plan.json"}), 400, "invalid_method")
    err = error(http.post("/v1/contexts", json={"document": DOC, "method": "q4", "preset": "8x"}), 400,
                 "invalid_method")
    assert "method and preset" in err["message"]


def test_preset_sized_for_the_document(http):
    desc = create(http, preset="2x")  # a short document: the slots kept in full precision leave 2x in reach
    assert desc["method"] == "2x" and desc["ratio"] >= 1.9


def test_plan_object_as_kvcache_plan_writes_it(http, client, stories):
    from kv_cache import KVzip, QuantConfig
    from kv_cache.plan import CachePlan

    model, _ = stories
    plan = CachePlan.uniform(model.config, QuantConfig(bits=4), KVzip(budget=0.5), name="test-plan")
    desc = create(http, plan=json.loads(plan.to_json()))
    assert desc["method"] == f"plan test-plan ({plan.fingerprint})" and desc["ratio"] > 1
    assert ask(client, desc["id"]).choices[0].message.content
    other = CachePlan.from_json(plan.to_json())
    doc = json.loads(other.to_json())
    doc["layers"] = doc["layers"][:-1]  # edited by hand: its fingerprint no longer matches
    error(http.post("/v1/contexts", json={"document": DOC, "plan": doc}), 400, "invalid_method")


def test_document_too_long_or_not_text_400(http, stories):
    _, tok = stories
    long_doc = "Lily and Tom played in the park with the big red ball. " * 30
    assert len(tok(long_doc).input_ids) > 300
    err = error(http.post("/v1/contexts", json={"document": long_doc, "method": "q4d"}), 400, "document_too_long")
    assert "300" in err["message"] and "--max-document-tokens" in err["message"]
    mid = "Lily and Tom played in the park with the big red ball. " * 14  # fits 300, not KVzip's 242
    n = len(tok(mid).input_ids)
    assert 242 < n <= 300
    err = error(http.post("/v1/contexts", json={"document": mid, "method": "kvzip@0.5"}), 400, "document_too_long")
    assert f"{n:,} tokens" in err["message"] and "242" in err["message"]
    cut = create(http, document=mid, method="kvzip@0.5", max_tokens=200, keep="tail")
    assert cut["tokens"] == 200 and cut["document_tokens"] == n
    for bad in (123, None, "", "   ", "bin\x00ary", ["a"]):
        err = error(http.post("/v1/contexts", json={"document": bad}), 400, "invalid_document")
        assert err["param"] == "document"


@pytest.mark.parametrize("patch, param", [
    ({"temperature": 3}, "temperature"), ({"temperature": "hot"}, "temperature"), ({"top_p": 0}, "top_p"),
    ({"top_p": 1.5}, "top_p"), ({"max_tokens": 0}, "max_tokens"), ({"max_tokens": 2.5}, "max_tokens"),
    ({"n": 2}, "n"), ({"stop": ["a", "b", "c", "d", "e"]}, "stop"), ({"stop": [""]}, "stop"), ({"seed": "x"}, "seed"),
    ({"messages": []}, "messages"), ({"messages": [{"role": "robot", "content": "hi"}]}, "messages[0].role"),
    ({"messages": [{"role": "user", "content": [{"type": "image_url"}]}]}, "messages[0].content"),
    ({"logit_bias": {"5": 10}}, "logit_bias"), ({"stream": "yes"}, "stream"), ({"context_id": 5}, "context_id"),
    ({"model": ""}, "model"),
])
def test_bad_parameters_400(http, patch, param):
    body = {"model": MODEL, "messages": [{"role": "user", "content": "hi"}], **patch}
    err = error(http.post("/v1/chat/completions", json=body), 400, "invalid_parameter")
    assert err["param"] == param and "got" in err["message"]


def test_bad_bodies_and_context_length_400(http, client):
    error(http.post("/v1/chat/completions", content=b"{not json", headers={"content-type": "application/json"}),
           400, "invalid_json")
    error(http.post("/v1/chat/completions", json=[1, 2]), 400, "invalid_json")
    err = error(http.post("/v1/chat/completions", json={"model": "gpt-4o", "messages": [{"role": "user",
                                                                                          "content": "hi"}]}),
                 404, "model_not_found")
    assert MODEL in err["message"]
    cid = create(http, method="q4d")["id"]
    with pytest.raises(openai.BadRequestError) as exc:
        ask(client, cid, max_tokens=1_000)  # within --max-tokens (1024), past the model's 512 positions
    assert exc.value.body["code"] == "context_length_exceeded" and "512" in exc.value.body["message"]
    with pytest.raises(openai.BadRequestError) as exc:
        ask(client, cid, max_tokens=10_000)  # past --max-tokens: refused before any work
    assert exc.value.body["param"] == "max_tokens" and "--max-tokens" in exc.value.body["message"]


def test_wrong_api_key_401(srv, http):
    for headers in ({"Authorization": "Bearer nope"}, {}, {"Authorization": KEY}):
        with httpx.Client(base_url=srv.base_url, headers=headers) as bare:
            err = error(bare.get("/v1/models"), 401, "invalid_api_key")
            assert err["type"] == "authentication_error"
    bad = openai.OpenAI(base_url=srv.base_url + "/v1", api_key="nope", max_retries=0)
    with pytest.raises(openai.AuthenticationError):
        bad.models.list()
    assert httpx.get(srv.base_url + "/health").status_code == 200  # no key needed there
    assert http.get("/v1/models").status_code == 200


def test_queue_full_503_with_retry_after(srv, http, client):
    started, release = threading.Event(), threading.Event()

    def hold(job):
        started.set()
        release.wait(30)

    srv.engine.submit(hold)  # the worker is busy with it
    try:
        assert started.wait(30)
        for _ in range(srv.engine.queue_size):
            srv.engine.submit(lambda job: None)  # the queue is full now
        r = http.post("/v1/chat/completions", json={"model": MODEL, "messages": [{"role": "user", "content": "hi"}]})
        error(r, 503, "queue_full")
        assert r.headers["Retry-After"] == "1"
        with pytest.raises(openai.APIStatusError) as exc:
            ask(client, None, "hi")
        assert exc.value.status_code == 503
    finally:
        release.set()
    deadline = time.monotonic() + 30
    while srv.engine.waiting and time.monotonic() < deadline:  # the worker drains the queued jobs
        time.sleep(0.01)
    assert ask(client, None, "hi", max_tokens=2).choices[0].message.content  # serving again


def test_request_timeout_504(stories, tmp_path):
    model, tok = stories
    with serving(model, tok, tmp_path, request_timeout=1.0) as server:
        started, release = threading.Event(), threading.Event()
        server.engine.submit(lambda job: (started.set(), release.wait(30)))
        try:
            assert started.wait(30)
            r = httpx.post(server.base_url + "/v1/chat/completions", headers=AUTH, timeout=30,
                           json={"model": MODEL, "messages": [{"role": "user", "content": "hi"}]})
            error(r, 504, "request_timeout")
            assert server.engine.running == 1  # answered at its deadline while the worker is still held
        finally:
            release.set()
        r = httpx.post(server.base_url + "/v1/chat/completions", headers=AUTH, timeout=30,
                       json={"model": MODEL, "messages": [{"role": "user", "content": "hi"}], "max_tokens": 2})
        assert r.status_code == 200, r.text


def test_unexpected_failure_500_and_keeps_serving(srv, http, client, monkeypatch):
    def boom(req, job):
        raise RuntimeError("simulated failure")

    monkeypatch.setattr(srv.service, "chat", boom)
    err = error(http.post("/v1/chat/completions", json={"model": MODEL, "messages": [{"role": "user",
                                                                                         "content": "hi"}]}),
                 500, "server_error")
    # no exception text, class or traceback reaches the client: an incident id does
    assert "simulated" not in err["message"] and "RuntimeError" not in err["message"]
    assert "Traceback" not in err["message"] and "incident" in err["message"]
    monkeypatch.undo()
    assert ask(client, None, "hi", max_tokens=2).choices[0].message.content


def test_delete_removes_the_context(srv, http, client):
    cid = create(http, method="q4d")["id"]
    path = Path(srv.service.store.directory) / f"{cid}.kvc"
    assert path.exists()
    r = http.delete(f"/v1/contexts/{cid}")
    assert r.status_code == 200 and r.json() == {"id": cid, "object": "context.deleted", "deleted": True}
    assert not path.exists() and cid not in srv.service.store.cached_ids()
    error(http.get(f"/v1/contexts/{cid}"), 404, "context_not_found")
    with pytest.raises(openai.NotFoundError):
        ask(client, cid)


# ------------------------------------------------------------------------------ concurrency
def test_eight_concurrent_clients(srv, http):
    cids = [create(http, method=m)["id"] for m in ("q4+kvzip@0.5", "q2d")]
    questions = ["Lily went to the", "The big red ball", "One day, she saw", "She ran to the"]

    def one(client_no: int) -> list[tuple[str, str, str]]:
        c = openai.OpenAI(base_url=srv.base_url + "/v1", api_key=KEY, max_retries=0, timeout=120)
        out = []
        for k in range(2):
            cid, q = cids[(client_no + k) % 2], questions[(client_no + k) % 4]
            if client_no % 2:
                text = "".join(ch.choices[0].delta.content or "" for ch in ask(c, cid, q, max_tokens=10, stream=True)
                               if ch.choices)
            else:
                text = ask(c, cid, q, max_tokens=10).choices[0].message.content
            out.append((cid, q, text))
        return out

    with ThreadPoolExecutor(8) as pool:
        results = [r for rs in pool.map(one, range(8)) for r in rs]
    assert len(results) == 16
    # each answer is the one the same question gets alone
    with openai.OpenAI(base_url=srv.base_url + "/v1", api_key=KEY, max_retries=0) as c:
        alone = {(cid, q): ask(c, cid, q, max_tokens=10).choices[0].message.content for cid, q, _ in results}
    assert all(text == alone[(cid, q)] for cid, q, text in results)
    assert len(set(alone.values())) > 1




# ------------------------------------------------------------------------------ a chat template
@pytest.mark.slow
def test_chat_template_context_answers_as_compressed_context(tmp_path):
    """SmolLM2 has a chat template: the stored context is the template's head + the document, a
    question comes with the template's tail (kv_cache.chat), as CompressedContext.build does."""
    from kv_cache import QuantConfig
    from kv_cache.models import load_model

    model, tok = load_model("smollm2")
    with serving(model, tok, tmp_path) as server:
        with httpx.Client(base_url=server.base_url, headers=AUTH, timeout=120) as h:
            desc = create(h, method="q4d")
        c = openai.OpenAI(base_url=server.base_url + "/v1", api_key=KEY, max_retries=0, timeout=120)
        out = c.chat.completions.create(model=MODEL, messages=[{"role": "user", "content": "What did Lily find?"}],
                                        temperature=0, max_tokens=12, extra_body={"context_id": desc["id"]})
    ref = CompressedContext.build(model, tok, DOC, quant=QuantConfig(bits=4))
    assert ref.question_suffix and desc["tokens"] == ref.context_tokens
    stored = CompressedContext.load(tmp_path / f"{desc['id']}.kvc", model, tok)
    assert stored.question_suffix == ref.question_suffix
    assert out.choices[0].message.content == ref.ask("What did Lily find?", max_new_tokens=12)
    assert out.usage.prompt_tokens == ref.context_tokens + len(ref.question_ids("What did Lily find?", 12))
