"""``kvcache serve`` decodes concurrent chats together (issue 28, part 7, for chats without a
stored context): the answers of a batch equal the answers each request gets alone."""

from __future__ import annotations

import threading
import time
from concurrent.futures import ThreadPoolExecutor

import pytest

pytest.importorskip("fastapi", reason="needs the serve extra: pip install 'kv_cache[serve]'")
openai = pytest.importorskip("openai", reason="the tests drive the server with the openai client")

from serve_support import KEY, MODEL, serving  # noqa: E402

PROMPTS = ["Once upon a time, there was a dog", "Lily went to the park", "The big red ball",
           "One day, a little girl named Sue saw a bird in the tree. She", "Tom was sad", "The sun"]


def _ask(client, i: int) -> tuple[str, str, int, int]:
    kw = {"temperature": 0, "max_tokens": 8 + 3 * i}
    if i == 4:  # a sampled row: its seed gives the same draws in a batch as alone
        kw.update(temperature=1.2, seed=11)
    if i == 2:
        kw["stop"] = [" big"]
    messages = [{"role": "user", "content": PROMPTS[i]}]
    if i % 2:
        chunks = list(client.chat.completions.create(model=MODEL, messages=messages, stream=True,
                                                     stream_options={"include_usage": True}, **kw))
        text = "".join(c.choices[0].delta.content or "" for c in chunks if c.choices)
        finish = next(c.choices[0].finish_reason for c in chunks if c.choices and c.choices[0].finish_reason)
        usage = chunks[-1].usage
    else:
        out = client.chat.completions.create(model=MODEL, messages=messages, **kw)
        text, finish, usage = out.choices[0].message.content, out.choices[0].finish_reason, out.usage
    return text, finish, usage.prompt_tokens, usage.completion_tokens


def test_a_batch_answers_as_one_at_a_time(stories, tmp_path):
    model, tok = stories
    with serving(model, tok, tmp_path, queue_size=16, max_batch=8) as server:
        client = openai.OpenAI(base_url=server.base_url + "/v1", api_key=KEY, max_retries=0, timeout=120)
        alone = [_ask(client, i) for i in range(len(PROMPTS))]
        assert list(server.engine.batch_sizes) == []  # one at a time: no batch was formed
        started, release = threading.Event(), threading.Event()
        server.engine.submit(lambda job: (started.set(), release.wait(60)))  # the worker is busy: they queue
        assert started.wait(30)
        with ThreadPoolExecutor(len(PROMPTS)) as pool:
            futures = [pool.submit(_ask, client, i) for i in range(len(PROMPTS))]
            deadline = time.monotonic() + 60
            while server.engine.waiting < len(PROMPTS):
                assert time.monotonic() < deadline, "the requests did not all queue"
                time.sleep(0.01)
            release.set()
            together = [f.result(timeout=120) for f in futures]
        assert list(server.engine.batch_sizes) == [len(PROMPTS)]
        assert together == alone
        assert len({t for t, *_ in alone}) == len(PROMPTS) and all(t for t, *_ in alone)
        assert alone[2][1] == "stop" and alone[0][1] == "length"
