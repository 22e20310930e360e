"""Model-free tests of ``benchmarks/bench_vllm.py``'s interleaved protocol
(``benchmarks/vllm_rounds.py``): the rounds' order and windows, the per-round ratios, the table,
and the refusals before any engine starts (no vLLM needed)."""

from __future__ import annotations

import argparse
import importlib.util
import math
from pathlib import Path

import pytest

_PATH = Path(__file__).resolve().parents[1] / "benchmarks" / "vllm_rounds.py"
_spec = importlib.util.spec_from_file_location("vllm_rounds", _PATH)
rounds = importlib.util.module_from_spec(_spec)
_spec.loader.exec_module(rounds)


def test_rounds_alternate_the_order():
    assert rounds.round_orders(["auto", "q4d"], 3) == [["auto", "q4d"], ["q4d", "auto"], ["auto", "q4d"]]
    assert rounds.round_orders(["a", "b", "c"], 2) == [["a", "b", "c"], ["c", "b", "a"]]


def test_round_windows_are_disjoint_and_shared_by_every_configuration():
    spans = []
    for r in range(3):
        for n, start in rounds.round_windows([1, 8, 32], 1024, r):
            spans.append((start, start + n * 1024))
    spans.sort()
    assert spans[0][0] == 0
    assert all(a[1] <= b[0] for a, b in zip(spans, spans[1:]))  # no window read twice: no prefix-cache hit
    assert rounds.round_windows([32], 1024, 2) == [(32, 2 * 32 * 1024)]


def _tput(tok_s: float) -> dict:
    return {"32": {"output_tok_s": tok_s, "wall_s": 2048 / tok_s, "output_tokens": 2048}}


def test_summary_takes_ratios_round_by_round():
    # the machine slows down by half between rounds: each round's ratio is still 1.1
    per_round = {"auto": [_tput(10.0), _tput(5.0)], "q4d": [_tput(11.0), _tput(5.5)]}
    s = rounds.interleaved_summary(per_round, [32])
    assert s["auto"]["32"]["rounds"] == [10.0, 5.0]
    assert "ratio_geomean" not in s["auto"]["32"]
    cell = s["q4d"]["32"]
    assert cell["median"] == pytest.approx(8.25)
    assert cell["ratio_geomean"] == pytest.approx(1.1)
    assert cell["ratio_min"] == pytest.approx(1.1) and cell["ratio_max"] == pytest.approx(1.1)
    # the ratio of the medians would be the same here; with unequal rounds the geometric mean of ratios is kept
    per_round = {"auto": [_tput(10.0), _tput(5.0)], "q4d": [_tput(9.0), _tput(6.0)]}
    cell = rounds.interleaved_summary(per_round, [32])["q4d"]["32"]
    assert cell["ratio_geomean"] == pytest.approx(math.sqrt(0.9 * 1.2))
    assert (cell["ratio_min"], cell["ratio_max"]) == (pytest.approx(0.9), pytest.approx(1.2))


def test_summary_without_auto_gives_no_ratio():
    s = rounds.interleaved_summary({"q4d": [_tput(3.0)], "q2d": [_tput(4.0)]}, [32])
    assert "ratio_geomean" not in s["q2d"]["32"] and s["q2d"]["32"]["median"] == 4.0


def _args(**kw) -> argparse.Namespace:
    base = dict(interleave=3, configs="auto,q4d", phases=["throughput"], concurrency=[32], prompt_tokens=1024)
    base.update(kw)
    return argparse.Namespace(**base)


def test_interleave_accepts_the_issue_case():
    rounds.check_interleave(_args(), ["auto", "q4d"])  # 3 rounds of 32 x 1,024 tokens fit below the needle


@pytest.mark.parametrize("kw, configs, match", [
    (dict(interleave=-1), ["auto", "q4d"], "got -1"),
    (dict(configs="auto"), ["auto"], "two or more distinct"),
    (dict(configs="auto,auto"), ["auto", "auto"], "two or more distinct"),
    (dict(phases=["throughput", "ppl"]), ["auto", "q4d"], "--phases throughput"),
    (dict(interleave=4), ["auto", "q4d"], "lower --interleave"),
])
def test_interleave_refuses_what_cannot_give_its_ratios(kw, configs, match):
    with pytest.raises(ValueError, match=match):
        rounds.check_interleave(_args(**kw), configs)


@pytest.mark.parametrize("bad", ["auto@0", "auto@-1", "auto@x", "auto@inf", "auto@nan"])
def test_a_bad_kv_memory_is_refused(bad):
    with pytest.raises(ValueError, match="positive number of GiB"):
        rounds.split_config(bad, 1.0)


def test_markdown_interleaved_states_rounds_and_ratio():
    per_round = {"auto": [_tput(10.0), _tput(5.0)], "q4d": [_tput(11.0), _tput(5.5)]}
    report = {"args": {"model": "/x/smollm2-hf", "kv_space_gib": 1.0, "max_model_len": 4608, "dtype": "bfloat16",
                       "interleave": 2, "concurrency": [32], "prompt_tokens": 1024, "gen_tokens": 64},
              "vllm": "0.32.0", "torch": "2.13.0", "machine": "x86_64",
              "orders": rounds.round_orders(["auto", "q4d"], 2),
              "rows": [{"config": c, "capacity_tokens": 1, "rounds": per_round[c]} for c in per_round],
              "interleaved": rounds.interleaved_summary(per_round, [32])}
    md = rounds.markdown_interleaved(report)
    assert "orders auto q4d, q4d auto" in md
    assert "| kv_cache q4d | 1 | 32 | 11.00, 5.50 | 8.25 | **1.100x** | 1.100x, 1.100x |" in md


def test_the_sequential_windows_are_checked_as_one_round():
    rounds.check_windows([1, 8, 32], 2048, 1)  # bench_vllm.py's defaults: 83,968 tokens
    with pytest.raises(ValueError, match=r"1 round\(s\) .* need 167936 distinct tokens"):
        rounds.check_windows([1, 8, 32], 4096, 1)
