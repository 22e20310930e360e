"""The rows of a batch of chats (:mod:`kv_cache.integrations.serve.rows`), without a model: each row stops on
its own (``max_tokens``, a stop string, end of sequence, its deadline), is answered the moment it
is done, and a row that is done is fed the padding token."""

from __future__ import annotations

from types import SimpleNamespace

import pytest
import torch

from kv_cache.generation import SamplingParams
from kv_cache.integrations.serve.engine import Job
from kv_cache.integrations.serve.errors import ApiError
from kv_cache.integrations.serve.rows import Row, decode_rows

V, PAD, EOS = 8, 0, 7


class Letters:
    """A tokenizer whose token ``t`` is the letter ``"abcdefgh"[t]``."""

    def decode(self, ids, skip_special_tokens=True):
        return "".join("abcdefgh"[i] for i in ids)


def _job(n_new: int, stop=(), stream=False, deadline: float = float("inf")) -> Job:
    req = SimpleNamespace(sampling=SamplingParams(), stop=list(stop), stream=stream)
    return Job(lambda j: None, deadline, None, item=SimpleNamespace(req=req, n_new=n_new))


def _events(job: Job) -> list:
    out = []
    while not job.events.empty():
        out.append(job.events.get_nowait())
    return out


def _onehot(tokens: list[int]) -> torch.Tensor:
    return torch.nn.functional.one_hot(torch.tensor(tokens), V).float()


def test_rows_finish_on_their_own():
    service = SimpleNamespace(decoder=Letters())
    jobs = [_job(3), _job(10, stop=["cd"], stream=True), _job(10), _job(5)]
    rows = [Row(service, j, prompt=5, cached=100 * (i % 2)) for i, j in enumerate(jobs)]
    # each row's script of next tokens: row 0 runs to max_tokens, row 1 meets its stop string,
    # row 2 ends with EOS, row 3 gets cut by max_tokens later
    script = [[1, 2, 3, 4, 5, 6], [1, 2, 3, 4, 5, 6], [2, 2, EOS, 1, 1, 1], [3, 3, 3, 3, 3, 3]]
    fed, step = [], [0]

    def feed(tokens: torch.Tensor) -> torch.Tensor:
        assert tokens.shape == (4, 1)
        fed.append(tokens.reshape(-1).tolist())
        step[0] += 1
        return _onehot([s[step[0]] for s in script])

    decode_rows(rows, _onehot([s[0] for s in script]), feed, {EOS}, PAD)
    assert [r.text for r in rows] == ["bcd", "b", "cc", "ddddd"]
    assert fed == [[1, 1, 2, 3], [2, 2, 2, 3], [PAD, PAD, PAD, 3], [PAD, PAD, PAD, 3]]  # done rows: padding
    done = [_events(j)[-1] for j in jobs]
    assert [d[0] for d in done] == ["done"] * 4
    assert [d[1]["finish_reason"] for d in done] == ["length", "stop", "stop", "length"]
    assert done[1][1]["usage"] == {"prompt_tokens": 105, "completion_tokens": 3, "total_tokens": 108,
                                   "prompt_tokens_details": {"cached_tokens": 100}}
    assert done[0][1]["usage"]["prompt_tokens_details"]["cached_tokens"] == 0


def test_a_row_past_its_deadline_is_answered_alone():
    service = SimpleNamespace(decoder=Letters())
    late, fine = _job(4, deadline=0.0), _job(2)
    rows = [Row(service, late, prompt=1), Row(service, fine, prompt=1)]
    decode_rows(rows, _onehot([1, 1]), lambda t: _onehot([2, 2]), {EOS}, PAD)
    kind, err = _events(late)[-1]
    assert kind == "error" and isinstance(err, ApiError) and err.code == "request_timeout"
    assert _events(fine)[-1][1]["text"] == "bc"


def test_decode_rows_checks_the_logits_shape():
    service = SimpleNamespace(decoder=Letters())
    rows = [Row(service, _job(2), prompt=1)]
    with pytest.raises(ValueError, match=r"logits must be \[batch=1, vocab\]; got shape \(2, 8\)"):
        decode_rows(rows, torch.zeros(2, V), lambda t: t, {EOS}, PAD)


def test_rows_that_drew_their_first_token_start_by_feeding_it():
    service = SimpleNamespace(decoder=Letters())
    rows = [Row(service, _job(3), prompt=1), Row(service, _job(2), prompt=1)]
    for r, t in zip(rows, [1, 2]):
        r.step(_onehot([t])[0], {EOS})  # each from its own prefill
    fed = []

    def feed(tokens):
        fed.append(tokens.reshape(-1).tolist())
        return _onehot([3, 4])

    decode_rows(rows, None, feed, {EOS}, PAD)
    assert fed == [[1, 2], [3, PAD]] and [r.text for r in rows] == ["bdd", "ce"]
    with pytest.raises(ValueError, match="logits=None needs every row to have drawn its first token"):
        decode_rows([Row(service, _job(2), prompt=1)], None, feed, {EOS}, PAD)
