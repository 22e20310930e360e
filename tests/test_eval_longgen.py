"""``kvcache eval --tasks longgen`` and the prefill cost of every retrieval row.

The model-level tests run stories260K (context 256 = 128 prompt + 128 continuation). They
assert on bytes, which are deterministic, never on times.
"""

from __future__ import annotations

import dataclasses
import json

import pytest
import torch

from kv_cache.cli import main
from kv_cache.eval import runner
from kv_cache.eval.longgen import _kept_steps, check_longgen, longgen_table, memory_summary, run_longgen_sample
from kv_cache.spec.grammar import parse_method
from kv_cache.eval.prefill_cost import plain_prefill_seconds, prefill_cost
from kv_cache.eval.report import markdown_table, write_reports
from kv_cache.eval.runner import EvalConfig, resolve_task, run_eval
from kv_cache.models import shared_data_dir

TEXT = shared_data_dir() / "tinyshakespeare" / "input.txt"


@pytest.mark.parametrize("context,continuation,match", [
    (256, 256, "continuation must be in (0, context=256)"),
    (256, 300, "got continuation=300"),
    (256, 0, "got continuation=0"),
    (256, -5, "got continuation=-5"),
])
def test_bad_lengths_are_refused_with_the_allowed_range(context, continuation, match):
    with pytest.raises(ValueError, match=match.replace("(", r"\(").replace(")", r"\)")):
        check_longgen(context, continuation)


@pytest.mark.parametrize("context,continuation", [(256.0, 128), (256, "128"), (256, True)])
def test_lengths_must_be_ints(context, continuation):
    with pytest.raises(TypeError, match="must be an int; got"):
        check_longgen(context, continuation)


def test_task_name_and_help():
    assert resolve_task("LongGen") == "longgen" and "longgen" in runner.KNOWN_TASKS
    helps = {f.name: f.metadata["help"] for f in dataclasses.fields(EvalConfig)}
    assert "longgen" in helps["continuation"]


def test_memory_summary_and_kept_steps():
    # Flat at 10 from step 1: growth over the second half (steps 2..4, from 10) is 1.
    assert memory_summary([8, 10, 10, 10, 10]) == {"end_bytes": 10, "max_bytes": 10, "growth": 1.0}
    # Growing by 1 a step: the second half (steps 2..4) goes from 12 to 14.
    assert memory_summary([10, 11, 12, 13, 14]) == {"end_bytes": 14, "max_bytes": 14, "growth": 14 / 12}
    # A peak inside the second half counts, even when the end is back down.
    assert memory_summary([5, 5, 5, 9, 5])["growth"] == 9 / 5
    assert memory_summary([7]) == {"end_bytes": 7, "max_bytes": 7, "growth": 1.0}
    with pytest.raises(ValueError, match="at least the bytes after the prefill; got an empty list"):
        memory_summary([])
    assert _kept_steps(127, 64) == [0, 1, 64, 127]
    assert _kept_steps(128, 64) == [0, 1, 64, 128]
    assert _kept_steps(0, 64) == [0]


@pytest.mark.parametrize("every", [0, -1, 1.5, True])
def test_memory_interval_is_checked(stories, every):
    model, tok = stories
    sample = runner.perplexity_windows(tok, TEXT.read_text(), context=64, prefix_len=32, num_windows=1)[0]
    with pytest.raises(ValueError, match=f"memory_every must be an int >= 1 .*; got {every!r}"):
        run_longgen_sample(model, parse_method("full"), sample, memory_every=every)


def test_eval_refuses_a_continuation_as_long_as_the_context(tmp_path, capsys):
    rc = main(["eval", "--model", "stories260K", "--text", str(TEXT), "--tasks", "longgen", "--methods", "full",
               "--samples", "1", "--context", "256", "--continuation", "256", "--out", str(tmp_path / "o"), "--quiet"])
    assert rc == 2
    assert "longgen: continuation must be in (0, context=256)" in capsys.readouterr().err


def _per_token_bytes(model) -> int:
    """Bytes one token adds to the float32 full cache: K and V of every layer and KV head."""
    c = model.config
    head_dim = getattr(c, "head_dim", None) or c.hidden_size // c.num_attention_heads
    return 2 * c.num_hidden_layers * c.num_key_value_heads * head_dim * 4


def test_bounded_caches_stay_flat_and_the_full_cache_grows(stories, tmp_path, monkeypatch):
    model, tok = stories
    cfg = EvalConfig(model="stories260K", text=str(TEXT), tasks=["longgen"], samples=2, context=256,
                     continuation=128, methods=["full", "h2o@0.25", "streaming@0.25"])
    doc = run_eval(cfg, tmp_path, model=model, tokenizer=tok)
    full, h2o, streaming = (doc["methods"][k]["tasks"]["longgen"] for k in ("full", "h2o@0.25", "streaming@0.25"))
    per_token = _per_token_bytes(model)
    for s in full["samples"]:
        assert (s["prompt_tokens"], s["continuation_tokens"], s["steps"]) == (128, 128, 127)
        assert s["memory"]["steps"] == [0, 1, 64, 127]
        # The full cache holds every token: 128 after the prefill, one more per step.
        assert s["memory"]["bytes"] == [(128 + k) * per_token for k in (0, 1, 64, 127)]
        assert s["end_bytes"] == s["max_bytes"] == 255 * per_token
        assert s["growth"] == pytest.approx((128 + 127) / (128 + 63))
        assert s["agreement"] is None and s["ppl"] > 1
    for t in (h2o, streaming):
        for s in t["samples"]:
            at_step_1 = s["memory"]["bytes"][1]
            # Bounded at 25% of the 128-token prompt for the whole generation: flat from the first step.
            assert s["memory"]["bytes"][1:] == [at_step_1] * 3 and s["max_bytes"] == s["end_bytes"] == at_step_1
            assert s["growth"] == 1.0
            assert s["kv_bytes"] <= at_step_1 < 0.4 * 128 * per_token  # 32 tokens kept (+ H2O's sums)
            assert 0 <= s["agreement"] <= 1 and s["ppl"] > 1
        assert t["growth"] == 1.0 and t["max_bytes"] < full["max_bytes"] / 4
        assert t["score"] > 1 and t["delta"] == pytest.approx(t["score"] - full["score"])
    assert full["delta"] == 0.0 and full["score"] > 1

    md = markdown_table(doc)
    assert "Long generation (`longgen`): prompt of 128 tokens" in md and "| growth, 2nd half |" in md
    row = next(line for line in md.splitlines() if line.startswith("| `h2o@0.25` | 0.25 |"))
    assert "| 1.00 |" in row
    assert "longgen acc" not in md  # no accuracy column for it in the main table
    paths = write_reports(doc, tmp_path)
    import matplotlib.image

    assert matplotlib.image.imread(str(paths["plot"])).shape[1] > 1000  # two panels: longgen + its memory

    # Adding a method resumes: only its samples run, and its agreement uses the saved full arg-max.
    calls = []
    real = runner.run_longgen_sample

    def counted(model, method, *args, **kwargs):
        calls.append(method.spec)
        return real(model, method, *args, **kwargs)

    monkeypatch.setattr(runner, "run_longgen_sample", counted)
    cfg.methods = [*cfg.methods, "q4"]
    again = run_eval(cfg, tmp_path, model=model, tokenizer=tok)
    assert calls == ["q4", "q4"]
    assert again["methods"]["h2o@0.25"]["tasks"]["longgen"]["samples"] == h2o["samples"]
    assert 0 <= again["methods"]["q4"]["tasks"]["longgen"]["agreement"] <= 1
    assert json.loads((tmp_path / "results.json").read_text())["methods"].keys() == again["methods"].keys()


def test_every_retrieval_row_carries_a_prefill_cost(stories, tmp_path):
    model, tok = stories
    cfg = EvalConfig(model="stories260K", text=str(TEXT), tasks=["needle"], samples=1, context=320,
                     methods=["full", "q4", "h2o@0.5", "kvzip@0.5"])
    doc = run_eval(cfg, tmp_path, model=model, tokenizer=tok)
    for spec, m in doc["methods"].items():
        (s,) = m["tasks"]["niah_single"]["samples"]
        assert s["prefill_cost"] > 0 and m["prefill_cost"] == s["prefill_cost"], spec
        if spec == "kvzip@0.5":  # its own in-run ratio, not timed twice
            assert "plain_prefill_s" not in s
        else:
            assert s["prefill_cost"] == s["prefill_s"] / s["plain_prefill_s"]
    full = doc["methods"]["full"]["tasks"]["niah_single"]["samples"][0]
    assert full["prefill_cost"] == 1.0 and full["prefill_s"] == full["plain_prefill_s"]  # it is the plain prefill
    rows = [line for line in markdown_table(doc).splitlines() if line.startswith("| `")][:4]
    assert len(rows) == 4 and all(row.endswith("x |") for row in rows)  # the prefill cost column, measured


def test_rows_without_a_measurement_show_a_dash():
    doc = {"config": {"model": "m", "context": 64, "samples": 1}, "methods": {
        "full": {"spec": "full", "kv_bytes": 40, "ratio": 1.0, "tasks": {"niah_single": {
            "metric": "accuracy", "score": 1.0, "samples": [{"score": 1.0, "kv_bytes": 40, "fp16_bytes": 40}]}}},
        "q4": {"spec": "q4", "kv_bytes": 10, "ratio": 4.0, "prefill_cost": 1.25, "tasks": {"niah_single": {
            "metric": "accuracy", "score": 1.0, "samples": [{"score": 1.0, "kv_bytes": 10, "fp16_bytes": 40}]}}}}}
    rows = {line.split("|")[1].strip(): line.rstrip(" |").rsplit("|", 1)[1].strip()
            for line in markdown_table(doc).splitlines() if line.startswith("| `")}
    assert rows == {"`full`": "-", "`q4`": "1.25x"}
    assert longgen_table(doc) == ""


def test_prefill_cost_helpers(stories):
    assert prefill_cost(2.0, 0.5) == {"prefill_cost": 4.0, "prefill_s": 2.0, "plain_prefill_s": 0.5}
    assert prefill_cost(None, 0.5) == prefill_cost(2.0, None) == prefill_cost(2.0, 0.0) == {}
    assert plain_prefill_seconds(stories[0], torch.tensor([[1, 2, 3]])) > 0
    for bad in (torch.tensor([1, 2, 3]), torch.zeros(1, 0, dtype=torch.long), [[1, 2]]):
        with pytest.raises(ValueError, match="ids must be a token id tensor"):
            plain_prefill_seconds(stories[0], bad)
