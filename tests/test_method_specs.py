"""Method specs are table-driven: every table row parses, renders and keeps the committed evidence.

Model-free: nothing here loads a model or runs an evaluation.
"""

from __future__ import annotations

import dataclasses
import json
import re
from pathlib import Path

import pytest

from kv_cache import QuantConfig
from kv_cache.spec.grammar import (
    EXAMPLES,
    METHOD_GRAMMAR,
    QUANT_OPTIONS,
    REFERENCE_SPEC,
    MethodUnavailable,
    grammar_help,
    parse_method,
    parse_methods,
    parse_quant,
)
from kv_cache.policies import POLICIES

RESULTS = Path(__file__).resolve().parents[1] / "docs" / "results"


def _evidence() -> dict[str, str]:
    """Spec -> ``resolved`` of every method in the committed results documents (the current ones
    and the archive's)."""
    found: dict[str, str] = {}
    for path in sorted([*RESULTS.glob("*.json"), *(RESULTS / "archive").glob("*.json")]):
        data = json.loads(path.read_text())
        if "methods" not in data:  # another kind of result (bench_vllm's codecs inside vLLM)
            continue
        methods = data["methods"]
        for spec, entry in methods.items():
            assert found.setdefault(spec, entry["resolved"]) == entry["resolved"], (path.name, spec)
    return found


EVIDENCE = _evidence()


def test_evidence_covers_the_documented_commands():
    """Every spec of a documented ``--methods`` run (the current page and the archive's diary)
    has committed evidence, and every committed spec is documented."""
    pages = (RESULTS / "README.md").read_text() + (RESULTS / "archive" / "diary.md").read_text()
    # A run may be quoted (specs with a bit profile, p[...], hold shell glob characters).
    runs = re.findall(r"--methods ['\"]?([^\s'\"`]+)", pages)
    documented = {s for run in runs if "," in run for s in run.split(",") if s}
    assert len(EVIDENCE) >= 16 and documented == set(EVIDENCE)


@pytest.mark.parametrize("spec", sorted(EVIDENCE))
def test_resolved_settings_of_the_committed_evidence_are_unchanged(spec, monkeypatch):
    # A changed string would make a restarted run discard these results (see Method.resolved).
    monkeypatch.chdir(RESULTS.parents[1])  # bit profiles (p[profiles/...]) are named from the repository root
    assert parse_method(spec, check_packages=False).resolved == EVIDENCE[spec]


def test_missing_peer_package_is_reported_only_when_checked(monkeypatch):
    import importlib.util

    monkeypatch.setattr(importlib.util, "find_spec", lambda name: None)
    with pytest.raises(MethodUnavailable, match="pip install kvpress"):
        parse_method("kvpress-snapkv@0.5")
    assert parse_method("kvpress-snapkv@0.5", check_packages=False).requires == ("kvpress", "kvpress")
    assert parse_method("hf-fp8").requires is None  # a backport ships with us


def test_every_quantization_option_sets_its_field(tmp_path):
    from kv_cache.plan.bit_allocation import save_bit_profile

    head, *suffixes = QUANT_OPTIONS
    assert head.field == "bits"
    profile = save_bit_profile(tmp_path / "bits.json", {0: (4, 2)}, {})
    valid = {"group_size": 8, "residual_length": 16, "sink_tokens": 4, "key_bits": 3, "value_bits": 2,
             "channel_group": 64, "clip_keys": 0.96, "clip_values": 0.92,
             "layer_bits": f"[{profile}]", "evicted_bits": 2,
             "evicted_layer_bits": f"[{profile}]"}  # distinct, valid for every valued field
    text = {o.field: "" if not o.value else str(valid[o.field]) for o in suffixes}
    # Flags that undo a default (a: after RoPE, m: per-channel keys, i: no key scale) share their
    # field with another flag: each is checked alone, below.
    undo = {"a", "m", "i"}
    values = {o.field: o.convert(text[o.field]) for o in suffixes if o.letter not in undo}
    # All at once: clipping applies to uniform levels only, so with `l` the ratios are 1, and
    # Lloyd-Max levels have no zero point, so `z` is left out.
    every = {**text, "clip_keys": "1.0", "clip_values": "1.0"}
    # `w` (scale_keys) needs centered keys, which `n` turns off: it is checked alone, below
    together = [o for o in suffixes if o.field not in ("zero_dtype", "scale_keys") and o.letter not in undo]
    # the evicted tier (o, u) needs a one-shot policy
    policy = "+snapkv@0.5"
    evicts = parse_method(policy[1:]).resolved.split(" eviction=")[1]
    spec = "q4" + "".join(f"{o.letter}{every[o.field]}" for o in together) + policy
    combined = {o.field: o.convert(every[o.field]) for o in together}
    assert parse_method(spec).resolved == f"kv_cache quant={QuantConfig.kivi(bits=4, **combined)!r} eviction={evicts}"
    for o in suffixes:  # each alone, the others at QuantConfig's defaults (flags that need others get them)
        if o.letter in undo:
            field, value = o.field, o.convert("")
            assert parse_method(f"q3d{o.letter}").resolved == (
                f"kv_cache quant={QuantConfig(bits=3, **{field: value})!r} eviction=None")
            assert getattr(parse_quant(f"q3d{o.letter}"), field) == value != getattr(QuantConfig(bits=3), field)
            continue
        if o.field == "scale_keys":  # needs pre-RoPE centered keys: per-token keys from the defaults
            assert parse_method("q2dtbw").resolved == (
                f"kv_cache quant={QuantConfig(bits=2, key_grouping='token', pre_rope=True, scale_keys=True)!r} "
                "eviction=None")
            continue
        kw = {o.field: values[o.field]}
        extra = ""
        if o.field == "levels":
            kw["key_grouping"], extra = "token", "t"
        if o.field == "scale_dtype":  # 8-bit log-coded norms need norm-only (Lloyd-Max) levels
            kw.update(key_grouping="token", levels="lloyd_max")
            extra = "tl"
        tail, want = "", "None"
        if o.field.startswith("evicted"):
            tail, want = policy, evicts
            if o.field == "evicted_layer_bits":
                kw["evicted_bits"], extra = 2, "o2"
        letters = f"{extra}{o.letter}{text[o.field]}" if extra else f"{o.letter}{text[o.field]}"
        method = parse_method(f"q2{letters}{tail}")
        assert method.resolved == f"kv_cache quant={QuantConfig.kivi(bits=2, **kw)!r} eviction={want}"
    with pytest.raises(ValueError, match="needs a one-shot policy"):
        parse_method("q4do2")
    with pytest.raises(ValueError, match="needs a one-shot policy"):
        parse_method("q4do2+h2o@0.5")
    grammar = "q<bits>[d]" + "".join(f"[{o.letter}<{o.placeholder}>]" if o.placeholder else f"[{o.letter}]"
                                  for o in suffixes)
    assert grammar in grammar_help()


def test_quantization_options_keep_their_order():
    letters = [o.letter for o in QUANT_OPTIONS[1:]]
    with pytest.raises(ValueError, match="unknown method"):
        parse_method("q4" + "".join(f"{letter}8" for letter in reversed(letters)))
    with pytest.raises(ValueError, match="unknown method"):
        parse_method("q2lt")  # t must come before l


@pytest.mark.parametrize("name", sorted(POLICIES))
def test_policy_defaults_are_the_dataclasses(name):
    cls = POLICIES[name]
    assert parse_method(f"{name}@0.5").resolved == f"kv_cache quant=None eviction={cls(budget=0.5)!r}"
    # A token window is capped at a quarter of a token budget, so a small budget keeps room beyond it.
    window = next(f.default for f in dataclasses.fields(cls) if f.name == "recent_window")
    expected = cls(budget=16, recent_window=min(window, 4)) if isinstance(window, int) else cls(budget=16)
    assert parse_method(f"{name}@16").resolved == f"kv_cache quant=None eviction={expected!r}"
    assert name in grammar_help()


def test_streaming_keeps_its_spec_name():
    assert "StreamingLLM(budget=512, recent_window=32, sink_tokens=4)" in parse_method("streaming@512").resolved
    with pytest.raises(ValueError, match="unknown method"):
        parse_method("streaming_llm@512")


def test_every_form_renders_in_the_help_and_the_error(tmp_path, monkeypatch, stories):
    from kv_cache.plan import CachePlan

    monkeypatch.chdir(tmp_path)  # the plan[plan.json] example reads ./plan.json
    CachePlan.uniform(stories[0].config, QuantConfig(bits=4)).save("plan.json")
    text = grammar_help()
    with pytest.raises(ValueError) as err:
        parse_method("turbo@0.5")
    message = str(err.value)
    for form in METHOD_GRAMMAR:
        assert form.grammar in text and form.grammar in message
        for example in form.examples:
            method = parse_method(example, check_packages=False)
            assert method.family == form.family and example in message
    assert EXAMPLES[0] == REFERENCE_SPEC and len(set(EXAMPLES)) == len(EXAMPLES)


def test_presets_and_plan_files_as_specs(tmp_path, stories):
    from kv_cache.plan import CachePlan

    model, tok = stories
    m = parse_method("4X")  # sized for 256 tokens on stories260K (half its positions): 8x does not fit there
    assert m.family == "ours" and m.resolved == "kv_cache preset 4x" and m.needs_tokenizer
    cache, _ = m.make(model)
    assert cache.plan is not None and cache.plan.predicted["ratio"] >= 4
    assert parse_method("8x").resolved == "kv_cache preset 8x"
    path = tmp_path / "Plan.json"  # the path keeps its case
    plan = CachePlan.uniform(model.config, QuantConfig(bits=2))
    plan.save(path)
    m = parse_method(f"plan[{path}]")
    assert m.resolved == f"kv_cache plan {plan.fingerprint}"
    assert m.make(model)[0].quant == QuantConfig(bits=2).for_model(model.config)
    with pytest.raises(FileNotFoundError, match="no plan file"):
        parse_method(f"plan[{tmp_path / 'missing.json'}]")
    with pytest.raises(ValueError, match="target ratio must be > 1"):
        parse_method("1x")


def test_reference_property_and_run_order():
    assert [parse_method(s).is_reference for s in ("full", " FULL ", "q4", "full+q4")] == [True, True, False, False]
    methods, skipped = parse_methods(["q4", "FULL", "h2o@0.5", "full"])
    assert [m.spec for m in methods] == ["full", "q4", "h2o@0.5"] and skipped == {}
    assert methods[0].is_reference and not any(m.is_reference for m in methods[1:])
    with pytest.raises(ValueError, match="unknown method 'turbo'"):
        parse_methods(["q4", "turbo"])


def test_metadata_thrift_letters():
    """``z``: uint8 zero points, ``f``: float16 residual and sinks; a spec without them is unchanged."""
    resolved = parse_method("q4zf").resolved
    assert "zero_dtype=torch.uint8" in resolved and "residual_dtype=torch.float16" in resolved
    assert "zero_dtype" not in parse_method("q4").resolved
    with pytest.raises(ValueError, match="zero_dtype"):
        parse_method("q4tlz")  # Lloyd-Max levels have no zero point (per-token keys: none anywhere)
    assert "zero_dtype=torch.uint8" in parse_method("q4lz").resolved  # per-channel keys keep theirs


def test_kvpress_kvzip_and_adakv_specs():
    """kvpress' KVzipPress and AdaKVPress-wrapped presses parse (run only where kvpress is installed)."""
    assert parse_method("kvpress-kvzip@0.5", check_packages=False).resolved == "kvpress KVzipPress(compression_ratio=0.5)"
    wrapped = parse_method("kvpress-adakv-snapkv@0.25", check_packages=False)
    assert wrapped.resolved == "kvpress AdaKVPress(SnapKVPress(compression_ratio=0.75))" and wrapped.budget == 0.25
    with pytest.raises(ValueError, match="adakv-<press>"):
        parse_method("kvpress-foo-snapkv@0.5", check_packages=False)
