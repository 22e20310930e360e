"""Which eviction the presets use per model (KVzip, or KVzap where it measured as well), KVzap's
continuation score and its eviction check: the rule and the record (model-free), then on
stories260K with a scorer fitted here."""

from __future__ import annotations

import json
import math
import shutil
import subprocess
import sys
from pathlib import Path

import pytest
import torch

import kv_cache
from kv_cache import CompressedCache, KVzap, KVzip
from kv_cache.cache.cache import FidelityWarning
from kv_cache.compression.scorer_file import model_identity, save_scorer
from kv_cache.plan import model_preset_plan, preset_plan, preset_scorer
from kv_cache.plan.planner import CONTINUATION_QUERIES
from kv_cache.plan.preset_scorers import TOLERANCE, choose, choose_layout, measure, read_record, write_entry
from kv_cache.plan.scorer_training import fit_scorer
from kv_cache.policies.base import ScoreInputs

STORY = "Once upon a time there was a little girl named Lily. She liked to play with her toys in the park. " * 6
TEXT = Path(__file__).read_text()  # calibration text the tiny model tokenizes; never an evaluation text


# ----------------------------------------------------------------------------------- model-free
def _cost(delta, warned=False, kl=0.01):
    return {"kl": kl, "delta_ppl": delta, "warned": warned}


def test_choose_kvzap_only_within_the_tolerance_and_quiet():
    assert choose(_cost(0.010), _cost(0.009)) == "kvzap"
    assert choose(_cost(0.010), _cost(0.010 + TOLERANCE * 0.99)) == "kvzap"
    assert choose(_cost(0.010), _cost(0.010 + TOLERANCE * 1.01)) == "kvzip"
    assert choose(_cost(0.010), _cost(-0.5, warned=True)) == "kvzip"  # a check warned on it: never
    with pytest.raises(ValueError, match=r"kvzap cost lacks \['warned'\]"):
        choose(_cost(0.0), {"delta_ppl": 0.0})


def test_choose_layout_moves_off_k4v3_only_when_lower_and_quiet():
    assert choose_layout({"k4v3d": _cost(0.03), "k3v2d": _cost(0.02)}) == "k3v2d"
    assert choose_layout({"k4v3d": _cost(0.02), "k3v2d": _cost(0.02)}) == "k4v3d"  # a tie keeps the default
    assert choose_layout({"k4v3d": _cost(0.03), "k3v2d": _cost(0.01, warned=True)}) == "k4v3d"
    with pytest.raises(ValueError, match=r"layouts among \['q4d'.*'k4v3d' included; got \['k3v2d'\]"):
        choose_layout({"k3v2d": _cost(0.01)})
    with pytest.raises(ValueError, match="got \\['k4v3d', 'q5d'\\]"):
        choose_layout({"k4v3d": _cost(0.01), "q5d": _cost(0.0)})


def test_record_read_write(tmp_path):
    record = tmp_path / "presets.json"
    assert read_record(record) == []
    a = {"model": {"m": 1}, "targets": {"8x": {"scorer": "kvzap"}}}
    b = {"model": {"m": 2}, "targets": {"8x": {"scorer": "kvzip"}}}
    write_entry(a, record)
    write_entry(b, record)
    write_entry({**a, "targets": {"8x": {"scorer": "kvzip"}}}, record)  # the same model: replaced
    got = read_record(record)
    assert len(got) == 2 and {e["model"]["m"]: e["targets"]["8x"]["scorer"] for e in got} == {1: "kvzip", 2: "kvzip"}
    assert not list(tmp_path.glob("*.tmp"))
    record.write_text(json.dumps({"format": 99, "entries": []}))
    with pytest.raises(ValueError, match="not a preset-scorer record of format 1"):
        read_record(record)


def test_kvzap_continuation_validation():
    for bad in (-1, 1.5, True):
        with pytest.raises(ValueError, match="continuation_queries must be an int >= 0"):
            KVzap(decoding=False, continuation_queries=bad)
    with pytest.raises(ValueError, match="decoding=False"):
        KVzap(continuation_queries=8)
    pol = KVzap(decoding=False, continuation_queries=8)
    assert pol.needs_attention and not KVzap().needs_attention
    assert pol.query_window(5, 100) == 5 and pol.query_window(50, 100) == 8
    assert "continuation_queries" not in repr(KVzap()) and "continuation_queries=8" in repr(pol)
    with pytest.raises(ValueError, match="scorer must be one of"):
        preset_plan(object(), "8x", scorer="h2o")


# ----------------------------------------------------------------------------------- stories260K
@pytest.fixture(scope="module")
def scorer_dir(stories, tmp_path_factory):
    model, tok = stories
    sc = fit_scorer(model, tok, TEXT, tokens=1200, window=200, max_tokens_per_window=150)
    d = tmp_path_factory.mktemp("preset_scorers")
    save_scorer(d / "stories_linear.safetensors", sc)
    return d


def test_continuation_score_is_the_larger_of_the_two(stories, scorer_dir):
    """A slot's log score is max(predicted, log of the last queries' summed attention, the largest
    over the query heads of its KV head)."""
    model, _ = stories
    pol = KVzap(decoding=False, continuation_queries=4, scorer=str(scorer_dir / "stories_linear.safetensors"))
    pol.bind(model)
    cfg = model.config
    H, Hq, T = cfg.num_key_value_heads, cfg.num_attention_heads, 12
    hidden = torch.randn(1, T, cfg.hidden_size, generator=torch.Generator().manual_seed(0))
    learned = pol._bound.score(0, hidden)  # [1, H, T]
    attention = torch.full((1, Hq, T), 1e-30)
    attention[0, 0, 3] = 3.5  # one query head gives slot 3 most of four queries' attention
    got = pol.score(ScoreInputs(shape=(1, H, T), keys=None, query=None, key_valid=None, scaling=1.0, state={},
                                attention=attention, attention_queries=4, hidden=hidden))
    head = 0  # the KV head of query head 0
    assert got[0, head, 3] == pytest.approx(math.log(3.5))
    others = torch.ones(T, dtype=torch.bool)
    others[3] = False
    assert torch.allclose(got[0, head, others], learned[0, head, others])
    with pytest.raises(RuntimeError, match="compress"):
        pol.score(ScoreInputs(shape=(1, H, T), keys=None, query=None, key_valid=None, scaling=1.0, state={},
                              hidden=hidden))


def test_native_and_reference_paths_agree_with_continuation(stories, scorer_dir):
    model, tok = stories
    ids = tok(STORY, return_tensors="pt").input_ids
    outs = []
    for attention in ("native", "reference"):
        pol = KVzap(budget=0.3, scope="head", decoding=False, continuation_queries=16,
                    scorer=str(scorer_dir / "stories_linear.safetensors"))
        cache = CompressedCache(model.config, eviction=pol)
        with kv_cache.compress(model, cache, attention=attention):
            out = model.generate(ids, past_key_values=cache, max_new_tokens=12, min_new_tokens=12, do_sample=False)
        outs.append((out, torch.stack([layer.head_lengths() for layer in cache.layers])))
    assert torch.equal(outs[0][0], outs[1][0]) and torch.equal(outs[0][1], outs[1][1])
    assert int(outs[0][1].sum()) < ids.shape[1] * model.config.num_hidden_layers * model.config.num_key_value_heads


def test_kvzap_once_runs_the_eviction_check(stories, scorer_dir):
    """KVzap acting once under a model-wide budget (the presets' form) drops tokens after the
    prefill's forward: the eviction check (§26.1) measures it and warns past its limit."""
    model, tok = stories
    ids = tok(STORY, return_tensors="pt").input_ids
    path = str(scorer_dir / "stories_linear.safetensors")
    cache = CompressedCache(model.config, eviction=KVzap(budget=0.2, decoding=False, scorer=path))
    with torch.no_grad():
        kv_cache.prefill(model, cache, ids, last_only=True)
    shares = cache.memory_report().evicted_attention
    assert len(shares) == model.config.num_hidden_layers and all(0.0 <= s <= 1.0 for s in shares.values())
    assert all(not layer.state for layer in cache.layers)  # the recorded attention is dropped, never held
    strict = CompressedCache(model.config, eviction=KVzap(budget=0.2, decoding=False, scorer=path),
                             eviction_threshold=1e-6)
    with pytest.warns(FidelityWarning, match="evict"), torch.no_grad():
        kv_cache.prefill(model, strict, ids, last_only=True)
    decoding = CompressedCache(model.config, eviction=KVzap(budget=0.2, scorer=path))  # evicts all along: unchecked
    with torch.no_grad():
        kv_cache.prefill(model, decoding, ids, last_only=True)
    assert decoding.memory_report().evicted_attention == {}


def test_measure_record_and_presets(stories, scorer_dir):
    """``measure`` builds the preset with both scorers on the same windows; the record beside the
    scorer file makes the model's presets evict with the chosen one, at the nearest measured ratio."""
    model, tok = stories
    path = scorer_dir / "stories_linear.safetensors"
    entry = measure(model, tok, TEXT, source="test_preset_scorers.py", targets=["5x"], context_tokens=200,
                    continuation=16, windows=1, scorer_path=path)
    row = entry["targets"]["5x"]
    assert entry["model"] == model_identity(model) and entry["scorer_file"] == path.name
    assert row["scorer"] == choose(row["kvzip"], row["kvzap"])
    assert row["kvzip"]["budget"] == row["kvzap"]["budget"] and row["kvzip"]["fingerprint"] != row["kvzap"]["fingerprint"]
    assert set(row["seconds"]) == {"kvzip", "kvzap"} and all(c["kl"] >= 0 for c in (row["kvzip"], row["kvzap"]))
    # KVzip's half is taken over from an entry of the same model, text, windows and plan; only KVzap runs
    again = measure(model, tok, TEXT, source="test_preset_scorers.py", targets=["5x"], context_tokens=200,
                    continuation=16, windows=1, scorer_path=path, prior=entry)
    assert again["targets"]["5x"]["kvzip_reused"] and again["targets"]["5x"]["kvzip"] == row["kvzip"]
    assert again["targets"]["5x"]["kvzap"]["kl"] == pytest.approx(row["kvzap"]["kl"], rel=1e-5)
    for other in ({**entry, "calibration": {**entry["calibration"], "windows": 2}},
                  {**entry, "model": {**entry["model"], "num_layers": 99}},
                  {**entry, "targets": {"5x": {**row, "kvzip": {**row["kvzip"], "fingerprint": "0" * 16}}}}):
        fresh = measure(model, tok, TEXT, source="test_preset_scorers.py", targets=["5x"], context_tokens=200,
                        continuation=16, windows=1, scorer_path=path, prior=other)
        assert "kvzip_reused" not in fresh["targets"]["5x"]
    record = write_entry(entry, scorer_dir / "presets.json")
    assert preset_scorer(model, "5x", record) == row["scorer"]
    # the choice at each measured ratio, the nearest one (log scale) for the others
    forced = {**entry, "targets": {"4.5x": {"scorer": "kvzap"}, "9x": {"scorer": "kvzip"}}}
    write_entry(forced, record)
    assert [preset_scorer(model, t, record) for t in ("4.5x", "6x", "6.5x", "9x", "20x")] == [
        "kvzap", "kvzap", "kvzip", "kvzip", "kvzip"]
    plan = model_preset_plan(model, "5x", context_tokens=200, record=record)
    assert isinstance(plan.policy, KVzap) and plan.policy.continuation_queries == CONTINUATION_QUERIES
    assert plan.policy.scorer == str(path) and not plan.policy.decoding
    other = model_preset_plan(model, "7x", context_tokens=200, record=record)
    assert isinstance(other.policy, KVzip)
    # the KVzap preset runs: it prefills in one pass and reaches its ratio
    cache = CompressedCache(model.config, plan=plan)
    ids = tok(STORY * 2, return_tensors="pt").input_ids[:, :200]
    with torch.no_grad():
        kv_cache.prefill(model, cache, ids, last_only=True)
    assert cache.memory_report().ratio >= 5.0
    # no entry, or the scorer file not beside the record: KVzip
    assert preset_scorer(model, "5x", scorer_dir / "missing.json") == "kvzip"
    elsewhere = scorer_dir / "elsewhere"
    elsewhere.mkdir()
    shutil.copy(record, elsewhere / "presets.json")
    assert preset_scorer(model, "4.5x", elsewhere / "presets.json") == "kvzip"
    # a prompt shorter than the calibration windows' context keeps KVzip, whatever was chosen
    assert [preset_scorer(model, "4.5x", record, prompt_tokens=n) for n in (199, 200, 256, None)] == [
        "kvzip", "kvzap", "kvzap", "kvzap"]  # None: the default context a preset is sized for (256 here)
    assert isinstance(model_preset_plan(model, "4.5x", context_tokens=150, record=record).policy, KVzip)
    assert isinstance(model_preset_plan(model, "4.5x", context_tokens=150, prompt_tokens=200, record=record).policy,
                      KVzap)
    for bad in (0, -5, 1.5, True, "200"):
        with pytest.raises(ValueError, match="prompt_tokens must be a positive int"):
            preset_scorer(model, "4.5x", record, prompt_tokens=bad)
    broken = {**forced, "calibration": {**forced["calibration"], "context_tokens": None}}
    write_entry(broken, record)
    with pytest.raises(ValueError, match="calibration context_tokens"):
        preset_scorer(model, "4.5x", record)
    write_entry(forced, record)
    # the shipped record has no entry for stories260K
    assert isinstance(model_preset_plan(model, "5x", context_tokens=200).policy, KVzip)


def test_measure_records_the_heavy_layout(stories, scorer_dir, tmp_path):
    """A preset that evicts heavily (6x at 200 tokens: 4-bit codes would keep 18%) is measured
    evicting from each of ``HEAVY_LAYOUTS`` with the chosen scorer; the record's layout is the
    rule's, and the model's presets evict from it (a light preset ignores it; an unknown name in
    the record is refused)."""
    from kv_cache.plan.planner import HEAVY_LAYOUTS, heavy_evicting, layouts_for
    from kv_cache.plan.preset_scorers import preset_layout

    model, tok = stories
    path = scorer_dir / "stories_linear.safetensors"
    assert heavy_evicting(model.config, "6x", context_tokens=200)
    entry = measure(model, tok, TEXT, source="t", targets=["6x"], context_tokens=200, continuation=16, windows=1,
                    scorer_path=path)
    row = entry["targets"]["6x"]
    assert set(row["layouts"]) == set(HEAVY_LAYOUTS) and row["layout"] == choose_layout(row["layouts"])
    assert row["layouts"]["k4v3d"] == row[row["scorer"]]
    assert row["layouts"]["k3v2d"]["budget"] > row["layouts"]["k4v3d"]["budget"]  # fewer bits keep more tokens
    assert f"{row['scorer']}+k3v2d" in row["seconds"]
    shutil.copy(path, tmp_path / path.name)
    forced = {**entry, "targets": {"6x": {**row, "scorer": "kvzip", "layout": "k3v2d"}}}
    record = write_entry(forced, tmp_path / "presets.json")
    assert preset_layout(model, "6x", record) == "k3v2d"
    plan = model_preset_plan(model, "6x", context_tokens=200, record=record)
    assert plan.quant_config() == layouts_for(model.config)["k3v2d"] and isinstance(plan.policy, KVzip)
    assert model_preset_plan(model, "4x", context_tokens=200, record=record).quant_config() == \
        layouts_for(model.config)["q4d"]
    assert preset_layout(model, "6x", record, prompt_tokens=150) is None  # shorter than measured
    write_entry({**entry, "targets": {"6x": {**row, "layout": "q7d"}}}, record)
    with pytest.raises(ValueError, match="names layout 'q7d'"):
        model_preset_plan(model, "6x", context_tokens=200, record=record)


def test_measure_refuses_a_model_without_a_scorer(stories, scorer_dir, tmp_path):
    model, tok = stories
    with pytest.raises(ValueError, match="calibrate-scorer"):
        measure(model, tok, TEXT, source="x", targets=["5x"], context_tokens=200, continuation=16, windows=1)
    cli = [sys.executable, "-m", "kv_cache.cli", "preset-scorers", "--model", "stories260K", "--context", "200",
           "--continuation", "16", "--windows", "1", "--targets", "5x"]
    out = subprocess.run(cli + ["--text", __file__], capture_output=True, text=True, timeout=300)
    assert out.returncode == 2 and "calibrate-scorer" in out.stderr
    bad = subprocess.run(cli + ["--text", __file__, "--scorer", str(scorer_dir / "stories_linear.safetensors"),
                                "-o", str(tmp_path / "p.json")], capture_output=True, text=True, timeout=300)
    assert bad.returncode == 2 and "--out must sit beside the scorer file" in bad.stderr


def test_a_kvzap_plan_reports_its_prefill_against_a_plain_one(stories, scorer_dir, tmp_path):
    """A plan that runs no reconstruction pass is never reported at 1x by construction: both tasks
    time a plain prefill of the same ids and report the ratio."""
    from kv_cache.eval.runner import EvalConfig, run_eval

    model, tok = stories
    plan = preset_plan(model.config, "5x", context_tokens=200, scorer="kvzap",
                       scorer_path=str(scorer_dir / "stories_linear.safetensors"))
    path = plan.save(tmp_path / "kvzap_plan.json")
    cfg = EvalConfig(model="stories260K", text=__file__, tasks=["ppl", "needle"], samples=1, context=320,
                     continuation=32, methods=["full", f"plan[{path}]"])
    doc = run_eval(cfg, tmp_path / "out", model=model, tokenizer=tok)
    m = doc["methods"][f"plan[{path}]"]
    for task in ("ppl", "niah_single"):
        (s,) = m["tasks"][task]["samples"]
        assert s["prefill_cost"] == s["prefill_s"] / s["plain_prefill_s"] and s["prefill_cost"] > 0, task


def test_the_shipped_record_is_consistent():
    """Every shipped entry names a scorer file beside the record, and every choice is the rule's."""
    from kv_cache.plan.preset_scorers import MEASURED_TARGETS, RECORD

    entries = read_record(RECORD)
    assert entries, "the shipped record is empty"
    for e in entries:
        assert (RECORD.parent / e["scorer_file"]).is_file(), e["scorer_file"]
        assert set(e["targets"]) == set(MEASURED_TARGETS)
        for target, row in e["targets"].items():
            assert row["scorer"] == choose(row["kvzip"], row["kvzap"]), (e["scorer_file"], target)
            assert row["kvzip"]["budget"] == row["kvzap"]["budget"]
        assert e["calibration"]["text"] == "pg98.txt"  # neither the scorers' fitting text nor an evaluation text


@pytest.mark.slow
def test_smollm2_presets_evict_with_kvzap_in_one_pass():
    from kv_cache.models import load_model

    model, tok = load_model("smollm2")
    # measured at 4,096 tokens: a shorter prompt keeps KVzip (KVzap's 8x lost 1.6 points at 1,024)
    assert isinstance(model_preset_plan(model, "8x", context_tokens=1024).policy, KVzip)
    assert isinstance(model_preset_plan(model, "8x").policy, KVzap)  # sized for 4,096 by default
    plan = model_preset_plan(model, "8x", context_tokens=1024, prompt_tokens=4096)  # sized for this test's prompt
    assert isinstance(plan.policy, KVzap) and plan.policy.continuation_queries == CONTINUATION_QUERIES
    assert plan.policy.scorer is None  # the shipped scorer, found by the model's identity
    ids = tok(Path(__file__).read_text(), return_tensors="pt").input_ids[:, :1024]
    cache = CompressedCache(model.config, plan=plan)
    with torch.no_grad():
        _, stats = kv_cache.prefill(model, cache, ids, tokenizer=tok, last_only=True)
    report = cache.memory_report()
    assert stats.reconstruction_s == 0 and report.ratio >= 8.0 and report.evicted_attention


def test_the_eval_preset_builds_for_the_prompt(stories):
    """``<r>x`` in the eval grammar builds for the prompt's length where a caller knows it
    (``Method.build``): the same plan as ``model_preset_plan`` with that prompt."""
    from kv_cache.spec.grammar import parse_method

    model, _ = stories
    method = parse_method("5x")
    assert method.make_for_prompt is not None
    for n in (None, 100, 256):
        cache, _ = method.build(model, n)
        assert cache.plan.fingerprint == model_preset_plan(model, "5x", prompt_tokens=n).fingerprint
    assert parse_method("q4").make_for_prompt is None and parse_method("q4").build(model, 100)[0] is not None


def test_each_preset_may_use_its_own_scorer_file(stories, scorer_dir, tmp_path):
    """A merged entry names, per preset, the scorer file it was measured with: the presets then
    evict with that file (the linear scorer at one ratio, the per-head static score at another);
    a row's file outside the record's folder, or fitted on another model, falls back to KVzip."""
    from kv_cache.plan.preset_scorers import merge_entry, scorer_file

    model, tok = stories
    shutil.copy(scorer_dir / "stories_linear.safetensors", tmp_path / "stories_linear.safetensors")
    (tmp_path / "presets").mkdir()
    save_scorer(tmp_path / "presets" / "stories_static.safetensors",
                fit_scorer(model, tok, TEXT, kind="static", tokens=1200, window=200, max_tokens_per_window=150))
    calibration = {"text": "t", "windows": 1, "context_tokens": 200, "continuation": 16, "tolerance": 0.003}
    old = {"model": model_identity(model), "scorer_file": "stories_linear.safetensors", "calibration": calibration,
           "targets": {"4.5x": {"scorer": "kvzap"}, "9x": {"scorer": "kvzip"}}}
    new = {"model": model_identity(model), "scorer_file": "presets/stories_static.safetensors",
           "calibration": calibration, "targets": {"9x": {"scorer": "kvzap"}}}
    merged = merge_entry(old, new)
    assert merged["scorer_file"] == "stories_linear.safetensors"
    assert {t: (r["scorer"], r["scorer_file"]) for t, r in merged["targets"].items()} == {
        "4.5x": ("kvzap", "stories_linear.safetensors"), "9x": ("kvzap", "presets/stories_static.safetensors")}
    record = write_entry(old, tmp_path / "presets.json")
    write_entry(new, record, merge=True)
    assert read_record(record)[0] == merged
    plans = {t: model_preset_plan(model, t, context_tokens=400, record=record) for t in ("4.5x", "9x")}
    assert plans["4.5x"].policy.scorer == str((tmp_path / "stories_linear.safetensors").resolve())
    assert plans["9x"].policy.scorer == str((tmp_path / "presets" / "stories_static.safetensors").resolve())
    assert plans["4.5x"].fingerprint != plans["9x"].fingerprint
    # a row naming a file outside the record's folder, or a missing one: KVzip
    for bad in ("../stories_linear.safetensors", "presets/missing.safetensors"):
        write_entry({**merged, "targets": {"9x": {"scorer": "kvzap", "scorer_file": bad}}}, record)
        assert preset_scorer(model, "9x", record) == "kvzip"
    assert scorer_file(record, {"targets": {"9x": {}}, "scorer_file": "/etc/passwd"}, "9x") is None
    # the shipped record names a shipped file that is not KVzap()'s default install-independently
    from kv_cache.policies.kvzap import SCORERS_DIR, resolve_scorer
    from kv_cache.compression.scorer_file import ScorerFileError

    assert resolve_scorer("shipped:presets/x.safetensors") == (SCORERS_DIR / "presets" / "x.safetensors").resolve()
    assert resolve_scorer("a/b.safetensors") == Path("a/b.safetensors")
    with pytest.raises(ScorerFileError, match="inside"):
        resolve_scorer("shipped:../../cache/x.safetensors")
    # entries of other calibration windows or another model are not merged
    with pytest.raises(ValueError, match="different calibration windows \\(windows differ\\)"):
        merge_entry(old, {**new, "calibration": {**calibration, "windows": 2}})
    with pytest.raises(ValueError, match="two different models"):
        merge_entry(old, {**new, "model": {**new["model"], "num_layers": 99}})
