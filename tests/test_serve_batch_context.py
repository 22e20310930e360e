"""``kvcache serve`` decodes concurrent chats on stored contexts together (issue 28, batching):
chats on the same context and on different contexts share one batch, and their greedy answers
equal the answers of a server that runs one at a time (``--max-batch 1``). Which chats share a
batch, and which are answered alone: :func:`kv_cache.integrations.serve.batch_context.plan_groups`."""

from __future__ import annotations

import threading
import time
from concurrent.futures import ThreadPoolExecutor

import pytest

pytest.importorskip("fastapi", reason="needs the serve extra: pip install 'kv_cache[serve]'")
httpx = pytest.importorskip("httpx")
openai = pytest.importorskip("openai", reason="the tests drive the server with the openai client")

from kv_cache import CompressedContext, KVzip, QuantConfig  # noqa: E402
from kv_cache.integrations.serve.batch_context import plan_groups  # noqa: E402
from serve_support import AUTH, DOC, KEY, MODEL, create, serving  # noqa: E402

DOC2 = "Tom had a big dog named Max. Max liked to run and jump in the garden. One day Max found a bone. " * 3
# (document, method): two contexts of one layout (q4d), one of another (full), one whose heads hold
# different numbers of tokens (KVzip's model-wide budget)
CONTEXTS = [(DOC, "q4d"), (DOC2, "q4d"), (DOC, "full"), (DOC2, "q4+kvzip@0.5")]
# (context, question, options): the same context asked several times, different contexts, streaming
# and not, different max_tokens, a stop string, a sampled row with a seed, a one-token answer
CHATS = [(0, "Lily went to the", {"max_tokens": 12}),
         (0, "The ball was", {"max_tokens": 20, "stream": True}),
         (1, "Max", {"max_tokens": 7}),
         (1, "Tom and Max went to the big park and", {"max_tokens": 16, "stream": True, "stop": [" Max"]}),
         (0, "She", {"max_tokens": 9, "temperature": 1.1, "seed": 5}),
         (2, "Lily went to the", {"max_tokens": 14, "stream": True}),
         (2, "One day", {"max_tokens": 10}),
         (3, "Tom", {"max_tokens": 11}),
         (1, "Tom was", {"max_tokens": 1, "stream": True})]  # done at its first token: never stacked


def _ask(client, cid: str, question: str, opts: dict) -> tuple:
    kw = {"temperature": 0, **opts}
    stream = kw.pop("stream", False)
    messages = [{"role": "user", "content": question}]
    extra = {"context_id": cid}
    if stream:
        chunks = list(client.chat.completions.create(model=MODEL, messages=messages, stream=True, extra_body=extra,
                                                     stream_options={"include_usage": True}, **kw))
        text = "".join(c.choices[0].delta.content or "" for c in chunks if c.choices)
        finish = next(c.choices[0].finish_reason for c in chunks if c.choices and c.choices[0].finish_reason)
        usage = chunks[-1].usage
    else:
        out = client.chat.completions.create(model=MODEL, messages=messages, extra_body=extra, **kw)
        text, finish, usage = out.choices[0].message.content, out.choices[0].finish_reason, out.usage
    return text, finish, usage.prompt_tokens, usage.completion_tokens, usage.prompt_tokens_details.cached_tokens


def _queued_answers(server, cids: list[str], extra: list[tuple] = (), while_queued=None) -> list:
    """Every chat of CHATS (and ``extra`` ``(cid, question, options)``), queued behind a busy worker
    and released at once (``while_queued()`` runs before); the answers (or the exception a request
    raised), in order."""
    client = openai.OpenAI(base_url=server.base_url + "/v1", api_key=KEY, max_retries=0, timeout=120)
    chats = [(cids[i], q, o) for i, q, o in CHATS] + list(extra)
    started, release = threading.Event(), threading.Event()
    server.engine.submit(lambda job: (started.set(), release.wait(60)))  # the worker is busy: they queue
    assert started.wait(30)

    def one(chat):
        try:
            return _ask(client, *chat)
        except openai.APIStatusError as exc:
            return exc

    with ThreadPoolExecutor(len(chats)) as pool:
        futures = [pool.submit(one, c) for c in chats]
        deadline = time.monotonic() + 60
        while server.engine.waiting < len(chats):
            assert time.monotonic() < deadline, "the requests did not all queue"
            time.sleep(0.01)
        if while_queued is not None:
            while_queued()
        release.set()
        return [f.result(timeout=120) for f in futures]


def test_batched_context_chats_answer_as_one_at_a_time(stories, tmp_path):
    model, tok = stories
    store = tmp_path / "store"
    with serving(model, tok, store, queue_size=16, max_batch=1) as server:
        with httpx.Client(base_url=server.base_url, headers=AUTH, timeout=60) as http:
            cids = [create(http, document=d, method=m)["id"] for d, m in CONTEXTS]
        alone = _queued_answers(server, cids)
        assert list(server.engine.batch_sizes) == []  # --max-batch 1: no batch was formed
    with serving(model, tok, store, queue_size=16, max_batch=len(CHATS) + 1) as server:
        with httpx.Client(base_url=server.base_url, headers=AUTH, timeout=60) as http:
            doomed = create(http, document=DOC2, method="q4d")["id"]
            # a context deleted while its chat waits: that chat alone is answered 404
            together = _queued_answers(server, cids, [(doomed, "Max", {"max_tokens": 5})],
                                       lambda: http.delete(f"/v1/contexts/{doomed}").raise_for_status())
        assert list(server.engine.batch_sizes) == [len(CHATS) + 1]  # every chat was taken in one batch
    *together, gone = together
    assert isinstance(gone, openai.NotFoundError) and gone.body["code"] == "context_not_found"
    assert together == alone
    assert all(not isinstance(a, Exception) and a[0] for a in alone)
    assert len({a[0] for a in alone}) == len(CHATS)  # different contexts and questions, different answers
    assert alone[3][1] == "stop" and alone[0][1] == "length"
    assert all(a[4] > 0 and a[2] > a[4] for a in alone)  # the context's tokens counted as cached


@pytest.mark.filterwarnings("ignore::kv_cache.FidelityWarning")
def test_plan_groups_batches_by_layout_and_leaves_the_rest_alone(stories):
    model, tok = stories
    q4, q4_kvzip, full = QuantConfig(bits=4), KVzip(budget=0.5), None
    a = CompressedContext.build(model, tok, DOC, quant=q4)
    b = CompressedContext.build(model, tok, DOC2, quant=q4, eviction=q4_kvzip)  # heads of different lengths
    c = CompressedContext.build(model, tok, DOC, quant=full)
    tiered = CompressedContext.build(model, tok, DOC, quant=QuantConfig(bits=4, evicted_bits=2),
                                     eviction=KVzip(budget=0.25))  # a precision tier: not a batch row
    jobs = [f"job{i}" for i in range(5)]
    items = list(zip(jobs, [a, c, tiered, b, a], [[1]] * 5))
    groups, alone = plan_groups(items)
    assert [[job for job, *_ in g] for g in groups] == [["job0", "job3", "job4"], ["job1"]]
    assert alone == ["job2"]
