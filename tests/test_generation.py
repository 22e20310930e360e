"""Tests of the generation loop (kv_cache.generation): its pure parts model-free (sampling,
nucleus cut, seeds, stop strings, ``kvcache serve``'s option parsing), and on stories260K that
the eval runner and ``CompressedContext.ask`` decode with this one loop."""

from __future__ import annotations

import math

import pytest
import torch

import kv_cache.generation
from kv_cache import CompressedContext, QuantConfig, compress
from kv_cache.cli.serve import parse_bytes
from kv_cache.context import forward_at
from kv_cache.eval import runner
from kv_cache.generation import SamplingParams, sample_token, stop_scan


def test_greedy_is_argmax_and_ignores_the_generator():
    logits = torch.tensor([0.1, 2.0, -1.0, 1.9])
    assert sample_token(logits, SamplingParams(0.0)) == 1
    assert sample_token(logits.half(), SamplingParams(0.0), torch.Generator().manual_seed(3)) == 1


def test_nucleus_keeps_the_smallest_set_reaching_top_p():
    logits = torch.log(torch.tensor([0.7, 0.2, 0.1]))
    g = torch.Generator().manual_seed(0)
    draws = [sample_token(logits, SamplingParams(1.0, top_p=0.75), g) for _ in range(3000)]
    assert set(draws) == {0, 1}  # 0.7 < 0.75: the second token joins, the third never
    assert draws.count(0) / len(draws) == pytest.approx(0.7 / 0.9, abs=0.03)
    # a nucleus of one token is greedy whatever the temperature
    assert {sample_token(logits, SamplingParams(2.0, top_p=1e-9), g) for _ in range(50)} == {0}


def test_temperature_flattens_and_seed_reproduces():
    logits = torch.log(torch.tensor([0.9, 0.1]))
    g = torch.Generator().manual_seed(1)
    hot = [sample_token(logits, SamplingParams(2.0), g) for _ in range(4000)]
    p_hot = math.sqrt(0.1) / (math.sqrt(0.9) + math.sqrt(0.1))  # softmax(log p / 2)
    assert hot.count(1) / len(hot) == pytest.approx(p_hot, abs=0.03)
    g1, g2 = SamplingParams(1.0, seed=5).generator(), SamplingParams(1.0, seed=5).generator()
    assert [sample_token(logits, SamplingParams(1.0), g1) for _ in range(64)] == \
           [sample_token(logits, SamplingParams(1.0), g2) for _ in range(64)]


@pytest.mark.parametrize("kw, match", [
    ({"temperature": -0.1}, r"temperature must be a number in \[0, 2\]; got -0.1"),
    ({"temperature": 2.5}, r"temperature must be a number in \[0, 2\]; got 2.5"),
    ({"temperature": float("nan")}, r"temperature must be a number in \[0, 2\]; got nan"),
    ({"top_p": 0.0}, r"top_p must be a number in \(0, 1\]; got 0.0"),
    ({"top_p": 1.01}, r"top_p must be a number in \(0, 1\]; got 1.01"),
    ({"seed": 1.5}, r"seed must be an int or None; got 1.5"),
    ({"temperature": True}, r"temperature must be a number"),
])
def test_sampling_params_refuse_bad_values(kw, match):
    with pytest.raises(ValueError, match=match):
        SamplingParams(**kw)


def test_sample_token_refuses_a_batch():
    with pytest.raises(ValueError, match=r"logits must be \[vocab\]; got shape \(2, 3\)"):
        sample_token(torch.zeros(2, 3), SamplingParams())


@pytest.mark.parametrize("text, stops, expected", [
    ("hello world", ["wor"], (6, True)),
    ("hello world", ["xyz", "lo", "wor"], (3, True)),  # the earliest occurrence wins
    ("hello wo", ["world"], (6, False)),  # "wo" may grow into the stop string: held back
    ("hello w", ["world", " w"], (5, True)),
    ("abc", [], (3, False)),
    ("abc\ufffd", [], (3, False)),  # a character whose bytes are not all decoded yet
    ("abcab", ["abd"], (3, False)),
    ("", ["x"], (0, False)),
])
def test_stop_scan(text, stops, expected):
    assert stop_scan(text, stops) == expected


@pytest.mark.parametrize("text, n", [("1024", 1024), ("512M", 512 << 20), ("1G", 1 << 30), ("64k", 64 << 10),
                                     ("2GiB", 2 << 30), ("0", 0)])
def test_parse_bytes(text, n):
    assert parse_bytes(text) == n


@pytest.mark.parametrize("bad", ["lots", "-1", "1.5G", "1T", ""])
def test_parse_bytes_refuses(bad):
    with pytest.raises(ValueError, match=r"--cache-bytes must be a byte count .*got"):
        parse_bytes(bad)


def test_kvcache_serve_refuses_bad_options_before_loading(tmp_path, capsys):
    from kv_cache.cli import main

    assert main(["serve", "--store", str(tmp_path), "--model", "no-such-model", "--cache-bytes", "lots"]) == 2
    assert "--cache-bytes must be a byte count" in capsys.readouterr().err
    assert main(["serve", "--store", str(tmp_path), "--model", "no-such-model", "--port", "70000"]) == 2
    assert "--port must be in [1, 65535]; got 70000" in capsys.readouterr().err


def test_eval_and_ask_share_one_loop(stories):
    """The eval's greedy answers (runner._greedy) and ``ask`` are the same loop: the same tokens
    over the same compressed context and question, and both stop before an EOS token, which
    neither returns."""
    model, tok = stories
    assert runner.generate_tokens is kv_cache.generation.generate_tokens
    text = "Once upon a time there was a little girl named Lily. She loved to play outside in the sun. " * 4
    ctx = CompressedContext.build(model, tok, text, quant=QuantConfig(bits=4), chat=False)
    question = tok("Lily loved to", add_special_tokens=False).input_ids

    def eval_answer(eos: set[int]) -> list[int]:
        with compress(model, ctx.cache), ctx.cache.session(), torch.no_grad():
            logits = forward_at(model, ctx.cache, torch.tensor([question]), ctx.context_tokens)
            out, tps = runner._greedy(model, ctx.cache, logits[0, -1], ctx.context_tokens + len(question), 12, eos)
        assert len(out) == 0 or tps > 0 or math.isnan(tps)
        return out

    full = eval_answer(set())
    assert len(full) == 12
    assert ctx.ask(question, max_new_tokens=12, eos_token_ids=[]) == tok.decode(full, skip_special_tokens=True)
    # A token of the answer made the EOS: both stop right before its first occurrence.
    k = next(i for i in range(3, 12) if full[i] not in full[:i])
    eos = full[k]
    assert eval_answer({eos}) == full[:k]
    assert ctx.ask(question, max_new_tokens=12, eos_token_ids=[eos]) == tok.decode(full[:k], skip_special_tokens=True)
