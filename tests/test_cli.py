"""``kvcache`` end to end on stories260K, method specs, peer adapters, errors users can act on."""

from __future__ import annotations

import json

import pytest
import torch

from kv_cache import CompressedCache, QuantConfig
from kv_cache.cli import main
from kv_cache.spec.grammar import MethodUnavailable, parse_method
from kv_cache.eval.runner import held_nbytes, resolve_task
from kv_cache.models import shared_data_dir

TEXT = shared_data_dir() / "tinyshakespeare" / "input.txt"


def _eval(tmp_path, *extra):
    out = tmp_path / "run"
    argv = ["eval", "--model", "stories260K", "--text", str(TEXT), "--tasks", "ppl,needle",
            "--methods", "full,q4,h2o@0.5", "--samples", "2", "--context", "320", "--continuation", "64",
            "--out", str(out), "--quiet", *extra]
    return main(argv), out


def test_eval_end_to_end_schema_table_plot_and_resume(tmp_path, capsys):
    rc, out = _eval(tmp_path)
    assert rc == 0
    doc = json.loads((out / "results.json").read_text())
    assert set(doc["methods"]) == {"full", "q4", "h2o@0.5"}
    for spec, m in doc["methods"].items():
        assert m["spec"] == spec and m["kv_bytes"] > 0 and m["fp16_bytes"] > 0
        assert m["ratio"] == pytest.approx(m["fp16_bytes"] / m["kv_bytes"])
        assert set(m["tasks"]) == {"ppl", "niah_single"}
        ppl = m["tasks"]["ppl"]
        assert len(ppl["samples"]) == 2 and ppl["score"] > 1
        assert all(s["kv_bytes"] > 0 for s in ppl["samples"])
        needle = m["tasks"]["niah_single"]
        assert len(needle["samples"]) == 2 and 0 <= needle["score"] <= 1
    full, q4, h2o = (doc["methods"][k] for k in ("full", "q4", "h2o@0.5"))
    assert q4["kv_bytes"] < full["kv_bytes"] / 3  # 4-bit codes + metadata vs the fp32 full cache
    assert h2o["kv_bytes"] < 0.6 * full["kv_bytes"]  # half the tokens (plus scores)
    assert full["tasks"]["ppl"]["delta"] == 0.0
    md = (out / "results.md").read_text()
    assert "| `q4` | 4 |" in md and "ratio vs fp16" in md and "niah_single acc" in md
    png = (out / "pareto.png").read_bytes()
    assert png[:8] == b"\x89PNG\r\n\x1a\n"
    import matplotlib.image

    assert matplotlib.image.imread(str(out / "pareto.png")).shape[0] > 100
    printed = capsys.readouterr().out
    assert "plot:" in printed and str(out / "pareto.png") in printed

    # Restart: every sample is reused, nothing recomputed (identical results document).
    before = (out / "results.json").read_text()
    rc, _ = _eval(tmp_path)
    assert rc == 0 and json.loads((out / "results.json").read_text())["methods"] == json.loads(before)["methods"]

    # A method whose settings changed since (e.g. a new default) is recomputed, the others reused.
    doc = json.loads(before)
    assert all(len(doc["methods"][m]["plan"]) == 16 for m in ("q4", "h2o@0.5"))  # ours resume by plan fingerprint
    doc["methods"]["h2o@0.5"]["plan"] = "0" * 16
    for task in doc["methods"]["h2o@0.5"]["tasks"].values():
        for s in task["samples"]:
            s["nll" if "nll" in s else "score"] = -1.0
    (out / "results.json").write_text(json.dumps(doc))
    rc, _ = _eval(tmp_path)
    after = json.loads((out / "results.json").read_text())["methods"]
    assert rc == 0 and after["q4"] == json.loads(before)["methods"]["q4"]
    assert list(after) == ["full", "q4", "h2o@0.5"]  # the order asked for, recomputed rows included
    old_h2o = json.loads(before)["methods"]["h2o@0.5"]
    for task, t in after["h2o@0.5"]["tasks"].items():  # recomputed (deterministic, so equal again)
        key = "nll" if task == "ppl" else "score"
        assert [s[key] for s in t["samples"]] == [s[key] for s in old_h2o["tasks"][task]["samples"]]
        assert all(s[key] >= 0 for s in t["samples"])


def test_config_file(tmp_path):
    cfg = tmp_path / "grid.toml"
    cfg.write_text('model = "stories260K"\ntasks = ["ppl"]\nmethods = ["full", "q8"]\nsamples = 1\n'
                   'context = 128\ncontinuation = 32\n' + f'text = "{TEXT}"\nout = "{tmp_path / "o"}"\n')
    assert main(["eval", "--config", str(cfg), "--quiet"]) == 0
    doc = json.loads((tmp_path / "o" / "results.json").read_text())
    assert set(doc["methods"]) == {"full", "q8"} and doc["config"]["context"] == 128


@pytest.mark.parametrize(
    "argv,match",
    [
        (["--methods", "full,q5"], "bits must be one of"),
        (["--methods", "full,turbo@0.5"], "unknown method 'turbo@0.5'"),
        (["--tasks", "ppl,haystack"], "unknown task 'haystack'; known tasks: ppl, niah_single"),
        (["--context", "4096"], "context"),
        (["--depths", "0.5,deep"], "--depths must be comma-separated numbers in [0, 1]; got '0.5,deep'"),
        (["--depths", "1.5"], "--depths must be comma-separated numbers in [0, 1]; got '1.5'"),
    ],
)
def test_errors_users_can_act_on(tmp_path, capsys, argv, match):
    rc = main(["eval", "--model", "stories260K", "--text", str(TEXT), "--samples", "1", "--quiet",
               "--out", str(tmp_path / "o"), *argv])
    assert rc == 2
    assert match in capsys.readouterr().err


def test_text_too_short_and_unwritable_out(tmp_path, capsys):
    short = tmp_path / "short.txt"
    short.write_text("Once upon a time. " * 5)
    rc = main(["eval", "--model", "stories260K", "--text", str(short), "--tasks", "ppl", "--methods", "full",
               "--samples", "4", "--context", "256", "--continuation", "64", "--out", str(tmp_path / "o"), "--quiet"])
    assert rc == 2 and "too short" in capsys.readouterr().err
    blocker = tmp_path / "file"
    blocker.write_text("x")
    rc = main(["eval", "--model", "stories260K", "--text", str(TEXT), "--tasks", "ppl", "--methods", "full",
               "--out", str(blocker / "sub"), "--quiet"])
    assert rc == 2 and "not writable" in capsys.readouterr().err


def test_method_specs(stories):
    m = parse_method("q4g64r128+h2o@0.25")
    assert (m.family, m.bits, m.budget) == ("ours", 4, 0.25)
    assert parse_method("streaming@512").budget == 512
    assert parse_method("FULL").bits is None
    for bad in ("", "q4+q8", "h2o@0.5+snapkv@0.5", "hf-foo-int4", "kvpress-snapkv@1.5", "kvpress-magic@0.5"):
        with pytest.raises(ValueError, match="unknown method"):
            parse_method(bad)
    assert resolve_task("needle") == "niah_single" and resolve_task("PPL") == "ppl"
    model = stories[0]
    windows = {"h2o@0.5": 0.5, "h2o@0.5w32": 32, "h2o@512w0.25": 0.25, "snapkv@0.5": 32, "snapkv@0.5w64": 64}
    for spec, window in windows.items():
        assert parse_method(spec).make(model)[0].eviction.recent_window == window
    for bad in ("h2o@0.5w1.5", "snapkv@0.5w0.5"):
        with pytest.raises(ValueError, match="recent_window"):
            parse_method(bad)


def test_held_nbytes_matches_our_report(stories):
    model, tok = stories
    cache = CompressedCache(model.config, quant=QuantConfig.kivi(bits=4, group_size=8, residual_length=8))
    with torch.no_grad():
        model(tok("Once upon a time there was a dog", return_tensors="pt").input_ids, past_key_values=cache)
    assert held_nbytes(cache) == cache.memory_report().total_bytes


def test_hf_quanto_adapter_counts_quantized_bytes(stories):
    try:
        method = parse_method("hf-quanto-int4")
    except MethodUnavailable as exc:
        pytest.skip(str(exc))
    model = stories[0]
    cache, ctx = method.make(model)
    ids = torch.randint(3, 500, (1, 256))
    with torch.no_grad(), ctx():
        model(ids, past_key_values=cache)
    held = held_nbytes(cache)
    # The packed int4 codes (plus scales, shifts and the residual) are far below the fp32 cache.
    full_fp32 = 2 * 4 * model.config.num_hidden_layers * model.config.num_key_value_heads * 8 * 256
    assert 0 < held < full_fp32 / 3


def test_kvpress_adapter_evicts(stories):
    try:
        method = parse_method("kvpress-streamingllm@0.5")
    except MethodUnavailable as exc:
        pytest.skip(str(exc))
    model = stories[0]
    cache, ctx = method.make(model)
    with torch.no_grad(), ctx():
        model(torch.randint(3, 500, (1, 200)), past_key_values=cache)
    assert cache.layers[0].keys.shape[2] == 100


def test_hf_fp8_matches_fp8_formula_and_counts_bytes(stories):
    from kv_cache.spec.hf_fp8 import FP8_MAX, fp8_dequantize, fp8_quantize

    method = parse_method("hf-fp8")
    assert (method.family, method.bits) == ("hf", 8)
    model = stories[0]
    cache, ctx = method.make(model)
    ids = torch.randint(3, 500, (1, 64))
    with torch.no_grad(), ctx():
        out = model(ids, past_key_values=cache)
        model(ids[:, :5], past_key_values=cache)  # appended with the frozen prefill scale
    layer = cache.layers[0]
    codes, scale = layer._quantized_keys
    assert codes.dtype == torch.float8_e4m3fn and codes.shape[2] == 69 and cache.get_seq_length() == 69
    # One byte per cached element plus two float32 scales per layer.
    cfg = model.config
    head_dim = cfg.hidden_size // cfg.num_attention_heads
    elems = 2 * cfg.num_hidden_layers * cfg.num_key_value_heads * head_dim * 69
    assert held_nbytes(cache) == elems + 2 * 4 * cfg.num_hidden_layers
    # Formula: s = amax/448, c = e4m3(x / s); round trip error is e4m3's relative precision (2^-4).
    x = torch.randn(2, 3, 17, 8) * 7
    c, s = fp8_quantize(x)
    assert torch.allclose(s, x.abs().amax() / FP8_MAX)
    x_hat = fp8_dequantize(c, s, x.dtype)
    assert x_hat.dtype == x.dtype and ((x_hat - x).abs() <= x.abs() * 2**-4 + s * 2**-9).all()
    assert fp8_quantize(torch.zeros(3))[1] > 0  # an all-zero tensor gets a positive scale
    # A later token beyond the frozen prefill scale saturates at 448 s (no NaN).
    c, s = fp8_quantize(torch.tensor([10.0, -10.0]), scale=torch.tensor(0.01))
    assert fp8_dequantize(c, s, torch.float32).tolist() == pytest.approx([4.48, -4.48])
    with pytest.raises(TypeError, match="floating-point"):
        fp8_quantize(torch.ones(3, dtype=torch.int32))
    assert out.logits.isfinite().all()


def test_fp8_backport_equals_transformers_fp8_layer():
    from transformers import cache_utils

    from kv_cache.spec.hf_fp8 import Fp8QuantizedLayerBackport

    if not hasattr(cache_utils, "Fp8QuantizedLayer"):
        pytest.skip("the installed transformers has no Fp8QuantizedLayer (it ships from 5.24 at the latest)")
    torch.manual_seed(0)
    theirs, ours = cache_utils.Fp8QuantizedLayer(), Fp8QuantizedLayerBackport()
    for n in (40, 1, 1, 7):  # prefill, two decode steps, a chunk
        k, v = torch.randn(2, 3, n, 16) * 5, torch.randn(2, 3, n, 16)
        for a, b in zip(theirs.update(k, v), ours.update(k.clone(), v.clone())):
            assert torch.equal(a, b)
    assert theirs.get_seq_length() == ours.get_seq_length() == 49


def test_eval_depths_place_the_needles(tmp_path):
    out = tmp_path / "d"
    rc = main(["eval", "--model", "stories260K", "--text", str(TEXT), "--tasks", "needle", "--methods", "full",
               "--samples", "2", "--context", "400", "--depths", "0.1,0.9", "--out", str(out), "--quiet"])
    doc = json.loads((out / "results.json").read_text())
    assert rc == 0 and doc["config"]["depths"] == [0.1, 0.9]
    got = [s["depth"] for s in doc["methods"]["full"]["tasks"]["niah_single"]["samples"]]
    assert got[0] == pytest.approx(0.1, abs=0.15) and got[1] == pytest.approx(0.9, abs=0.15)



class _Stop(Exception):
    """Raised by a stand-in ``run_eval``: the CLI's parsing is under test, not the evaluation."""


def _config_from_cli(monkeypatch, argv):
    from kv_cache.eval import runner

    seen = {}

    def run_eval(cfg, out, progress=None):
        seen.update(cfg=cfg, out=out)
        raise _Stop

    monkeypatch.setattr(runner, "run_eval", run_eval)
    with pytest.raises(_Stop):
        main([*argv, "--quiet"])
    return seen["cfg"], seen["out"]


def test_cli_defaults_are_the_config_dataclass(monkeypatch, capsys):
    from kv_cache.spec.grammar import grammar_help
    from kv_cache.eval.runner import EvalConfig

    assert _config_from_cli(monkeypatch, ["eval"]) == (EvalConfig(), "runs/eval")
    from kv_cache.cli.main import DEMO_TEXT

    demo = EvalConfig(model="smollm2", tasks=["ppl", "needle"], samples=2, context=1024, continuation=128,
                      methods=["full", "q8", "q4", "q4d", "q2d", "8x", "kvzip@0.25", "kvzap@0.25",
                               "snapkv@0.5", "h2o@0.5", "q4+h2o@0.5"], text=str(DEMO_TEXT))
    assert _config_from_cli(monkeypatch, ["demo"]) == (demo, "runs/demo")
    assert DEMO_TEXT.is_file() and DEMO_TEXT.stat().st_size > 200_000  # shipped: a bare clone has no shared/
    flags = ["eval", "--tasks", "ppl,needle", "--query-aware", "--depths", "0.1,0.9", "--samples", "3",
             "--haystack", "noise", "--text", str(TEXT), "--out", "o"]
    want = EvalConfig(tasks=["ppl", "needle"], query_aware=True, depths=[0.1, 0.9], samples=3, haystack="noise",
                      text=str(TEXT))
    assert _config_from_cli(monkeypatch, flags) == (want, "o")

    with pytest.raises(SystemExit):
        main(["eval", "--help"])
    out = capsys.readouterr().out
    assert grammar_help() in out
    for shown in ("[smollm2]", "tasks [ppl]", "specs [full,q4]", "task [8]", "tokens [2048]", "prefix [256]",
                  "haystack [text]", "seed [0]", "cap [32]", "directory [runs/eval]", "depths[i % len]"):
        assert shown in " ".join(out.split()), shown
    with pytest.raises(SystemExit):
        main(["demo", "--help"])
    assert "task [2]" in " ".join(capsys.readouterr().out.split())


def test_every_calibration_command_reads_its_text_the_same_way(tmp_path, capsys):
    """calibrate, calibrate-scorer, calibrate-codec, allocate and plan share --model / --text /
    -o: a missing text file is one error naming --text, before any model is loaded."""
    from kv_cache.cli.calibration_args import calibration_text, read_text_file

    missing = str(tmp_path / "nope.txt")
    for argv in (["calibrate", "--text", missing, "-o", str(tmp_path / "r.safetensors")],
                 ["calibrate-scorer", "--text", missing, "-o", str(tmp_path / "s.safetensors")],
                 ["calibrate-codec", "--text", missing, "-o", str(tmp_path / "c.safetensors")],
                 ["allocate", "--text", missing, "--average-bits", "3", "-o", str(tmp_path / "p.json")],
                 ["plan", "--text", missing, "--ratio", "4", "-o", str(tmp_path / "plan.json")]):
        assert main(argv[:1] + ["--model", "no-such-model-is-loaded"] + argv[1:]) != 0, argv[0]
        assert "--text: no file at" in capsys.readouterr().err, argv[0]
    crlf = tmp_path / "crlf.txt"
    crlf.write_bytes(b"one\r\ntwo \xff\r\n")
    assert read_text_file(crlf) == "one\ntwo \ufffd\n"
    assert calibration_text(str(crlf), "unused.txt") == (crlf, "one\ntwo \ufffd\n")


@pytest.mark.parametrize("argv, message", [
    (["allocate", "-o", "x.json", "--average-bits", "3", "--windows", "0"], "--windows must be >= 1; got 0"),
    (["allocate", "-o", "x.json", "--average-bits", "3", "--prefix", "-2"], "--prefix must be >= 1; got -2"),
    (["calibrate", "-o", "x.safetensors", "--window", "0"], "--window must be >= 1; got 0"),
    (["preset-scorers", "--context", "0"], "--context must be >= 1; got 0"),
    (["calibrate-scorer", "-o", "x.safetensors", "--kind", "mlp", "--mlp-width", "0"], "--mlp-width must be >= 1; got 0"),
    (["calibrate-scorer", "-o", "x.safetensors", "--kind", "mlp", "--mlp-steps", "-1"], "--mlp-steps must be >= 1; got -1"),
    (["calibrate-scorer", "-o", "x.safetensors", "--ridge", "-0.5"], "--ridge must be a finite number >= 0; got -0.5"),
    (["calibrate-scorer", "-o", "x.safetensors", "--ridge", "nan"], "--ridge must be a finite number >= 0; got nan"),
    (["calibrate-scorer", "-o", "x.safetensors", "--kind", "mlp", "--ridge", "0.1"], "--ridge sets the linear scorer's penalty"),
])
def test_calibration_commands_refuse_counts_below_one(argv, message, tmp_path, monkeypatch, capsys):
    """Each count a calibration command takes is checked (``check_positive``) before a model loads."""
    monkeypatch.chdir(tmp_path)
    assert main(argv) == 2
    assert message in capsys.readouterr().err
    assert not list(tmp_path.iterdir())  # nothing written
