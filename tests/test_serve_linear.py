"""Every input of ``kvcache serve`` is handled in time linear in its size (issue 43).

Model-free: the JSON depth scan against a recursive reference (block boundaries included), each
parser and grammar pattern on its worst case far past the size a request may send (a quadratic
one would take hours there; each must finish within a bounded wait), and the request schemas'
caps. Over HTTP: bodies up to the default 8 MiB limit built to hit each parser's worst case, each
answered 4xx, its parse off the event loop (``/health`` answers while the parse is held), and
``/health`` answering all the while. No wall-clock bound: a bounded wait on each behaviour.
"""

from __future__ import annotations

import json
import re
import threading
import time
from concurrent.futures import ThreadPoolExecutor

import pytest

pytest.importorskip("fastapi", reason="needs the serve extra: pip install 'kv_cache[serve]'")
httpx = pytest.importorskip("httpx")
from hypothesis import given, settings, strategies as st  # noqa: E402

from kv_cache.integrations.serve import limits as limits_module  # noqa: E402
from kv_cache.integrations.serve.errors import ApiError  # noqa: E402
from kv_cache.integrations.serve.limits import Limits, json_depth, parse_json  # noqa: E402
from kv_cache.integrations.serve.requests import parse_chat, parse_context  # noqa: E402
from kv_cache.integrations.serve.schemas import MAX_MESSAGES, MAX_SPEC_CHARS  # noqa: E402
from serve_support import AUTH, MODEL, serving  # noqa: E402

MiB = 1 << 20
HTTP_TIMEOUT_S = 60.0  # generous: a request must be answered, the clock is not what is checked
FAR = 200_000  # characters: far past every cap, where a quadratic pattern takes hours


def finishes(fn, seconds: float = 10.0) -> None:
    """Run ``fn()`` in a forked process and fail if it is still running after ``seconds`` (a
    bounded wait: the worst cases below take milliseconds when linear and hours when quadratic;
    a process, since a regex or a C parser holds the GIL and cannot be timed out from a thread)."""
    import multiprocessing
    import traceback

    def run():
        try:
            fn()
        except BaseException:  # noqa: BLE001 - reported by the exit code
            traceback.print_exc()
            raise SystemExit(1)
        raise SystemExit(0)

    proc = multiprocessing.get_context("fork").Process(target=run, daemon=True)
    proc.start()
    proc.join(seconds)
    if proc.is_alive():
        proc.kill()
        proc.join(10)
        pytest.fail(f"still running after {seconds} s: not linear")
    assert proc.exitcode == 0, "the call raised (its traceback is above)"


def _depth(v) -> int:
    if isinstance(v, list):
        return 1 + max((_depth(x) for x in v), default=0)
    if isinstance(v, dict):
        return 1 + max((_depth(x) for x in v.values()), default=0)
    return 0


tricky = st.sampled_from(['"', "\\", "[", "]", "{", "}", '\\"', "\\\\", "a", "é", "\x00"])
json_text = st.lists(tricky, max_size=12).map("".join)
json_values = st.recursive(st.one_of(st.none(), st.integers(), json_text),
                           lambda inner: st.one_of(st.lists(inner, max_size=4),
                                                   st.dictionaries(json_text, inner, max_size=4)), max_leaves=20)


@settings(max_examples=300, deadline=None)
@given(json_values, st.sampled_from([1, 2, 3, 7, 1 << 20]))
def test_json_depth_equals_the_nesting_across_block_boundaries(value, block):
    """The scan's depth is the value's nesting, for strings full of quotes, backslashes and
    brackets, whatever the block size (so runs of backslashes and strings cross blocks)."""
    raw = json.dumps(value, ensure_ascii=False).encode()
    old = limits_module.SCAN_BLOCK
    limits_module.SCAN_BLOCK = block
    try:
        assert json_depth(raw) == _depth(value), raw
    finally:
        limits_module.SCAN_BLOCK = old


def test_json_depth_on_a_backslash_run_across_a_block_boundary(monkeypatch):
    monkeypatch.setattr(limits_module, "SCAN_BLOCK", 8)
    for run in range(0, 12):  # an even run leaves the next quote a delimiter, an odd one escapes it
        raw = ('["' + "\\" * (2 * (run // 2)) + ('\\"[[' if run % 2 else "") + '", [[1]]]').encode()
        assert json_depth(raw) == _depth(json.loads(raw)), raw


WORST_BODIES = {
    "escaped quotes": lambda n: b'{"document": "' + b'\\"' * (n // 2) + b'"}',
    "backslashes": lambda n: b'{"document": "' + b"\\\\" * (n // 2) + b'"}',
    "bare quotes": lambda n: b'"' * n,
    "open brackets": lambda n: b"[" * n,
    "brackets in a string": lambda n: b'{"document": "' + b"[" * n + b'"}',
    "integer digits": lambda n: b'{"max_tokens": ' + b"1" * n + b"}",
    "fraction digits": lambda n: b'{"max_tokens": 1.' + b"1" * n + b"}",
    "unicode escapes": lambda n: b'{"document": "' + b"\\u00e9" * (n // 6) + b'"}',
}


@pytest.mark.parametrize("name", sorted(WORST_BODIES))
def test_depth_scan_and_parse_are_linear_at_the_body_limit(name):
    """Each worst case at the default body limit (8 MiB): the depth scan and the parse finish
    (the regex scan this replaced took 12.6 s at 64 KB of escaped quotes, x4 per doubling)."""
    raw = WORST_BODIES[name](Limits().max_body_bytes - 32)

    def run():
        try:
            return parse_json(raw, Limits().max_json_depth)
        except ApiError as exc:
            return exc.code

    finishes(run)


def _grammar_patterns():
    from kv_cache.spec import grammar as methods
    from kv_cache.integrations.serve import errors, files

    pats = [form.pattern for form in methods.METHOD_GRAMMAR if form.pattern is not None]
    pats += [methods._QUANT, methods._POLICY, methods._FILE, files.NAME_RE, files._GROUP, errors._ABSOLUTE]
    return pats


def _adversarial(n: int) -> list[str]:
    """Strings that make a backtracking regex with overlapping quantifiers explode: long runs of
    digits, dots, letters and brackets, each ending in a character that fails the match."""
    runs = ["1" * n + "x", "1." * (n // 2) + "x", "." * n + "1x", "q4" + "1" * n + "!", "kvpress-snapkv@" + "1" * n + "x",
            "h2o@" + "1" * n + "w" + "1" * n + "!", "a" * n + "@", "plan[" + "[" * n, "/" * n + "\x00", "/a" * (n // 2),
            "xk0." + "0" * n + "!", "kvzip@t-" + "1" * n + ".!", "1" * n + ".1" * 3 + "y", "[" + "a" * n]
    return runs


def test_every_grammar_pattern_is_linear_far_past_the_caps():
    """Every pattern a request's string meets (the method grammar, file names, the redaction of
    paths) on inputs of 200,000 characters: no backtracking blow-up (the kvpress form's
    ``\\d*\\.?\\d+`` was quadratic in a run of digits)."""
    pats = _grammar_patterns()

    def run():
        for p in pats:
            for s in _adversarial(FAR):
                (p.match(s), p.search(s)) if p.pattern.startswith("^") else p.sub("", s)

    finishes(run, 20.0)


def test_method_parsers_are_linear_far_past_the_caps():
    from kv_cache.spec.grammar import parse_method
    from kv_cache.plan import parse_target

    def run():
        for s in _adversarial(FAR):
            for fn in (parse_method, parse_target):
                try:
                    fn(s)
                except (ValueError, TypeError):
                    pass

    finishes(run, 20.0)


def test_the_schemas_cap_every_parsed_string_and_the_messages():
    doc = {"document": "a text"}
    for field, n in (("method", MAX_SPEC_CHARS + 1), ("preset", 33)):
        with pytest.raises(ApiError) as exc:
            parse_context({**doc, field: "1" * n})
        assert exc.value.code == "invalid_method" and exc.value.param == field
    base = {"model": MODEL, "messages": [{"role": "user", "content": "hi"}]}
    for field in ("model", "context_id"):
        with pytest.raises(ApiError) as exc:
            parse_chat({**base, field: "x" * 129}, MODEL)
        assert exc.value.param == field and "got" in exc.value.message
    many = {**base, "messages": [{"role": "user", "content": "a"}] * (MAX_MESSAGES + 1)}
    with pytest.raises(ApiError) as exc:
        parse_chat(many, MODEL)
    assert exc.value.param == "messages" and f"{MAX_MESSAGES + 1:,}" in exc.value.message
    assert len(parse_chat({**base, "messages": base["messages"] * MAX_MESSAGES}, MODEL).messages) == MAX_MESSAGES


def test_messages_characters_are_a_running_total():
    """The messages' characters are counted once each: the limit is reached by the sum, and a
    body of the most messages at the limit is checked in a bounded time."""
    lim = Limits(max_document_chars=1000)
    body = {"model": MODEL, "messages": [{"role": "user", "content": "x" * 100}] * 11}
    with pytest.raises(ApiError) as exc:
        parse_chat(body, MODEL, lim)
    assert exc.value.code == "text_too_long" and "1,100" in exc.value.message
    big = {"model": MODEL, "messages": [{"role": "user", "content": "x" * 240}] * MAX_MESSAGES}
    finishes(lambda: parse_chat(big, MODEL))
    assert len(parse_chat(big, MODEL).messages) == MAX_MESSAGES


# ------------------------------------------------------------------------------ over HTTP
def _http_bodies(limit: int) -> list[tuple[str, str, bytes]]:
    n = limit - 64
    out = [(name, "/v1/contexts", make(n)) for name, make in WORST_BODIES.items()]
    msg = b'{"role":"user","content":"a"},'
    k = n // len(msg)
    out += [
        ("method digits", "/v1/contexts", b'{"document": "hi", "method": "kvpress-snapkv@' + b"1" * n + b'x"}'),
        ("preset digits", "/v1/contexts", b'{"document": "hi", "preset": "' + b"1" * n + b'y"}'),
        ("many small messages", "/v1/chat/completions",
         b'{"model": "%s", "messages": [' % MODEL.encode() + msg * (k - 1) + msg[:-1] + b"]}"),
        ("the most messages", "/v1/chat/completions",
         b'{"model": "%s", "messages": [' % MODEL.encode() + msg * (MAX_MESSAGES - 1) + msg[:-1] + b"]}"),
        ("long unicode document", "/v1/contexts", json.dumps({"document": "é漢" * 499_000}, ensure_ascii=False).encode()),
        ("long astral escapes", "/v1/contexts", json.dumps({"document": "\U0001F600" * 249_000}).encode()),
        ("one long word", "/v1/contexts", json.dumps({"document": "a" * 999_000}).encode()),
        ("long stop string", "/v1/chat/completions", json.dumps({"model": MODEL, "messages": [
            {"role": "user", "content": "hi"}], "stop": ["x" * (n - 200)]}).encode()),
        ("long context id", "/v1/chat/completions", json.dumps({"model": MODEL, "messages": [
            {"role": "user", "content": "hi"}], "context_id": "c" * (n - 200)}).encode()),
    ]
    for _, _, body in out:
        assert len(body) <= limit
    return out


def test_every_worst_case_body_is_answered_4xx_off_the_event_loop_while_health_answers(stories, tmp_path,
                                                                                     monkeypatch):
    """At the default limits (8 MiB bodies), each body built to hit a parser's worst case is
    answered 4xx with an error body, and no body blocks the event loop: each body's parse is held
    (the test wraps the server's ``parse_json``) until ``/health`` has answered 200 while that
    request is still in flight, so a parse on the event loop would stall ``/health`` and fail
    here; ``/health``, polled all the while from another thread, answers 200 every time. The
    timeouts are generous (the wall clock is not what is checked: the parsers' linearity is, by
    ``finishes`` above)."""
    import kv_cache.integrations.serve.app as app_module

    real_parse = app_module.parse_json
    entered, release = threading.Event(), threading.Event()

    def held_parse(raw, max_depth):  # in the server's parser thread, if it is not on the event loop
        entered.set()
        if not release.wait(120):
            raise RuntimeError("the test never released the parse")
        return real_parse(raw, max_depth)

    monkeypatch.setattr(app_module, "parse_json", held_parse)
    model, tok = stories
    with serving(model, tok, tmp_path) as server:
        health: list[int | str] = []
        stop = threading.Event()

        def poll():
            with httpx.Client(base_url=server.base_url, timeout=HTTP_TIMEOUT_S) as c:
                while not stop.is_set():
                    try:
                        health.append(c.get("/health").status_code)
                    except httpx.HTTPError as exc:
                        health.append(type(exc).__name__)
                    time.sleep(0.05)

        poller = threading.Thread(target=poll, daemon=True)
        poller.start()
        sender = ThreadPoolExecutor(1)
        held: list[str] = []
        try:
            with httpx.Client(base_url=server.base_url, headers={**AUTH, "content-type": "application/json"},
                              timeout=HTTP_TIMEOUT_S) as c, httpx.Client(base_url=server.base_url,
                                                                          timeout=HTTP_TIMEOUT_S) as h:
                limit = server.service.limits.max_body_bytes
                half = limit // 2  # from this size every body must reach the (held) parse
                for name, route, body in _http_bodies(limit):
                    entered.clear()
                    release.clear()
                    pending = sender.submit(c.post, route, content=body)
                    deadline = time.monotonic() + HTTP_TIMEOUT_S
                    while not entered.wait(0.05):  # the body read, its parse begun (and held)
                        if pending.done():  # refused before any parse: only a small body may be
                            assert len(body) < half, (name, "answered before its parse", pending.result().text)
                            break
                        assert time.monotonic() < deadline, (name, "the parse never began")
                    else:
                        try:
                            r = h.get("/health")  # the event loop is free while the parse is held
                            assert r.status_code == 200 and r.json()["status"] == "ok", (name, r.status_code, r.text)
                            assert not pending.done(), (name, "the request ended while its parse was held")
                            held.append(name)
                        finally:
                            release.set()
                    r = pending.result(timeout=HTTP_TIMEOUT_S)
                    assert 400 <= r.status_code < 500, (name, r.status_code, r.text[:300])
                    assert r.json()["error"]["code"], (name, r.text[:300])
        finally:
            release.set()
            stop.set()
            poller.join(HTTP_TIMEOUT_S + 10)
            sender.shutdown(wait=False)
        assert health and all(code == 200 for code in health), [c for c in health if c != 200]
        assert held, "no body's parse was held"
