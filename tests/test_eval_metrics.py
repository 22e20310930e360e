"""``kvcache eval``'s bits per element and next-token KL: the formulas, then end to end on stories260K."""

from __future__ import annotations

import json
import logging
import math
from pathlib import Path

import pytest
import torch

from kv_cache.cli import main
from kv_cache.eval.report import markdown_table
from kv_cache.eval.runner import _summarize, bits_per_element, next_token_kl
from kv_cache.models import shared_data_dir

TEXT = shared_data_dir() / "tinyshakespeare" / "input.txt"
RESULTS = Path(__file__).resolve().parents[1] / "docs" / "results"


def test_kl_hand_computed():
    # P = (1/2, 1/2), Q = (1/4, 3/4): 1/2 ln 2 + 1/2 ln(2/3).
    p, q = torch.zeros(2, dtype=torch.float64), torch.log(torch.tensor([0.25, 0.75], dtype=torch.float64))
    assert float(next_token_kl(p, q)) == pytest.approx(0.5 * math.log(2) + 0.5 * math.log(2 / 3), abs=1e-12)
    # P = (0.7, 0.2, 0.1), Q = (0.1, 0.3, 0.6), from logits shifted by a constant (softmax ignores it).
    pp, qq = [0.7, 0.2, 0.1], [0.1, 0.3, 0.6]
    # 0.7 ln 7 + 0.2 ln(2/3) + 0.1 ln(1/6) = 1.362137 - 0.081093 - 0.179176 = 1.101868
    want = sum(a * math.log(a / b) for a, b in zip(pp, qq))
    assert want == pytest.approx(1.101868, abs=1e-6)
    f64 = {"dtype": torch.float64}
    got = next_token_kl(torch.log(torch.tensor(pp, **f64)) + 3.0, torch.log(torch.tensor(qq, **f64)) - 1.5)
    assert float(got) == pytest.approx(want, abs=1e-12)
    # The direction matters: KL(Q || P) is another number.
    back = float(next_token_kl(torch.log(torch.tensor(qq, **f64)), torch.log(torch.tensor(pp, **f64))))
    assert back == pytest.approx(sum(b * math.log(b / a) for a, b in zip(pp, qq)), abs=1e-12)
    assert back == pytest.approx(1.002104, abs=1e-6)  # 0.1 ln(1/7) + 0.3 ln(3/2) + 0.6 ln 6


@pytest.mark.parametrize("n,vocab", [(1, 2), (7, 97), (97, 1000)])
def test_kl_zero_on_itself_nonnegative_and_matches_kl_div(n, vocab):
    g = torch.Generator().manual_seed(n)
    a, b = torch.randn(n, vocab, generator=g) * 4, torch.randn(n, vocab, generator=g) * 4
    assert torch.equal(next_token_kl(a, a), torch.zeros(n, dtype=torch.float64))
    kl = next_token_kl(a, b)
    assert kl.shape == (n,) and (kl > 0).all()
    ref = torch.nn.functional.kl_div(torch.log_softmax(b.double(), -1), torch.log_softmax(a.double(), -1),
                                     log_target=True, reduction="none").sum(-1)
    torch.testing.assert_close(kl, ref, rtol=1e-12, atol=1e-14)
    torch.testing.assert_close(next_token_kl(a, b, chunk=3), kl, rtol=0, atol=0)  # chunking changes nothing


@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16, torch.float32, torch.float64])
def test_kl_dtype_shape_and_degenerate_inputs(dtype):
    a = torch.randn(2, 3, 11).to(dtype)
    out = next_token_kl(a, a.flip(-1))
    assert out.dtype == torch.float64 and out.shape == (2, 3)
    # A token the reference rules out costs nothing; one it allows and the method rules out is inf.
    ninf = float("-inf")
    assert float(next_token_kl(torch.tensor([0.0, ninf]), torch.tensor([0.0, 0.0]))) == pytest.approx(math.log(2))
    assert float(next_token_kl(torch.tensor([0.0, 0.0]), torch.tensor([0.0, ninf]))) == math.inf
    assert math.isnan(float(next_token_kl(torch.tensor([0.0, float("nan")]), torch.tensor([0.0, 0.0]))))
    with pytest.raises(ValueError, match="same shape"):
        next_token_kl(torch.zeros(3, 5), torch.zeros(3, 4))
    with pytest.raises(ValueError, match="non-empty vocabulary"):
        next_token_kl(torch.zeros(3, 0), torch.zeros(3, 0))


def test_bits_per_element():
    assert bits_per_element(1000, 1000) == 16.0  # fp16 itself
    assert bits_per_element(2000, 1000) == 32.0  # an fp32 cache
    assert bits_per_element(5, 16) == 5.0
    assert bits_per_element(None, 16) is None and bits_per_element(5, 0) is None


def _without_kl(doc: dict) -> dict:
    """A results document as saved before KL was reported (no ``kl`` anywhere, no bits/elem)."""
    for entry in doc["methods"].values():
        for task in entry["tasks"].values():
            for key in ("kl", "kl_samples", "bits_per_element"):
                task.pop(key, None)
            for sample in task.get("samples", []):
                sample.pop("kl", None)
        entry.pop("bits_per_element", None)
    return doc


def test_results_saved_before_kl_still_render():
    doc = _without_kl(json.loads((RESULTS / "smollm2_wikitext_ppl_ctx2048.json").read_text()))
    for md in (markdown_table(doc), None):  # as saved (no bits_per_element), then re-summarized
        if md is None:
            for entry in doc["methods"].values():
                _summarize(entry, doc["methods"]["full"])
            assert doc["methods"]["q4"]["tasks"]["ppl"]["kl"] is None
            md = markdown_table(doc)
        assert all(_row(md, spec, "KL") == "-" for spec in doc["methods"])
        # smollm2 runs in float32: the full cache holds 32 bits per element; q4: 4 + 2 * 16 / 32.
        assert _row(md, "full", "bits/elem") == "32.00" and _row(md, "q4", "bits/elem") == "5.00"


def _eval(out: Path) -> dict:
    rc = main(["eval", "--model", "stories260K", "--text", str(TEXT), "--tasks", "ppl", "--methods", "full,q4,q2",
               "--samples", "2", "--context", "320", "--continuation", "64", "--out", str(out), "--quiet"])
    assert rc == 0
    return json.loads((out / "results.json").read_text())


def _row(md: str, spec: str, column: str) -> str:
    lines = md.splitlines()
    head = [c.strip() for c in lines[0].strip("|").split("|")]
    row = next(line for line in lines if line.startswith(f"| `{spec}`"))
    return [c.strip() for c in row.strip("|").split("|")][head.index(column)]


def test_eval_reports_kl_and_bits_and_recomputes_a_missing_reference(tmp_path, caplog):
    out = tmp_path / "run"
    doc = _eval(out)
    full, q4, q2 = (doc["methods"][k] for k in ("full", "q4", "q2"))
    assert [s["kl"] for s in full["tasks"]["ppl"]["samples"]] == [0.0, 0.0]
    assert full["tasks"]["ppl"]["kl"] == 0.0
    assert all(s["kl"] > 1e-3 for s in q2["tasks"]["ppl"]["samples"])
    assert 0 < q4["tasks"]["ppl"]["kl"] < q2["tasks"]["ppl"]["kl"]  # fewer bits, further from the full cache
    # stories260K runs in float32: the full cache holds 2x the fp16 bytes.
    assert full["bits_per_element"] == 32.0 and full["tasks"]["ppl"]["bits_per_element"] == 32.0
    # q4 on 256 prefix tokens (no residual left): keys 4 + 2*16/32 bits (scale and zero per 32 tokens),
    # values 4 + 2*16/8 (a group cannot exceed head_dim = 8 channels); mean 6.5.
    assert q4["bits_per_element"] == pytest.approx(6.5) and q2["bits_per_element"] == pytest.approx(4.5)
    for m in (full, q4, q2):
        assert m["bits_per_element"] == pytest.approx(16 * m["kv_bytes"] / m["fp16_bytes"])
    md = (out / "results.md").read_text()
    assert _row(md, "full", "KL") == "0.0000" and _row(md, "full", "bits/elem") == "32.00"
    assert _row(md, "q2", "KL") == f"{q2['tasks']['ppl']['kl']:.4f}" and _row(md, "q4", "bits/elem") == "6.50"
    assert "per element of the full context" in md
    ref_files = sorted(p.name for p in (out / "reference").iterdir())
    assert ref_files == ["ppl-0.safetensors", "ppl-1.safetensors"]

    # Resume: q4's samples as an older release saved them (no KL), q2's second window unfinished and
    # the reference file it needs deleted: the reference is recomputed, with a log line, to the same KL.
    before = json.loads((out / "results.json").read_text())
    for s in before["methods"]["q4"]["tasks"]["ppl"]["samples"]:
        del s["kl"]
    for key in ("bits_per_element",):
        for m in before["methods"].values():
            m.pop(key, None)
    kl_q2 = [s["kl"] for s in before["methods"]["q2"]["tasks"]["ppl"]["samples"]]
    before["methods"]["q2"]["tasks"]["ppl"]["samples"].pop(1)
    (out / "results.json").write_text(json.dumps(before))
    (out / "reference" / "ppl-1.safetensors").unlink()
    with caplog.at_level(logging.WARNING, logger="kv_cache.eval.runner"):
        doc = _eval(out)
    assert "reference log-probabilities of ppl window 1" in caplog.text
    assert (out / "reference" / "ppl-1.safetensors").exists()
    again = [s["kl"] for s in doc["methods"]["q2"]["tasks"]["ppl"]["samples"]]
    assert again == pytest.approx(kl_q2, rel=1e-12)
    assert doc["methods"]["q4"]["tasks"]["ppl"]["kl"] is None and doc["methods"]["q4"]["bits_per_element"] == 6.5
    md = (out / "results.md").read_text()
    assert _row(md, "q4", "KL") == "-" and _row(md, "q2", "KL") == f"{sum(kl_q2) / 2:.4f}"


def test_report_shows_prefill_cost_and_accuracy_by_depth():
    from kv_cache.eval.report import markdown_table

    def sample(score, depth, **extra):
        return {"score": score, "depth": depth, "kv_bytes": 10, "fp16_bytes": 40, **extra}

    doc = {"config": {"model": "m", "context": 64, "samples": 3}, "methods": {
        "full": {"spec": "full", "kv_bytes": 40, "ratio": 1.0, "tasks": {"niah_single": {
            "metric": "accuracy", "score": 1.0, "samples": [sample(1.0, 0.1), sample(1.0, 0.5), sample(1.0, 0.9)]}}},
        "kvzip@0.25": {"spec": "kvzip@0.25", "kv_bytes": 10, "ratio": 4.0, "prefill_cost": 2.5, "tasks": {
            "niah_single": {"metric": "accuracy", "score": 2 / 3, "samples": [
                sample(1.0, 0.1, prefill_cost=2.5), sample(0.0, 0.5, prefill_cost=2.5),
                sample(1.0, 0.95, prefill_cost=2.5)]}}}}}
    text = markdown_table(doc)
    assert "| prefill cost |" in text and "| 2.50x |" in text and "| 1x |" not in text  # full: not measured, -
    rows = {line.split("|")[1].strip(): line for line in text.splitlines() if line.startswith("| `")}
    depth_rows = [line for line in text.splitlines() if line.startswith("| `kvzip@0.25` | 100% (1)")]
    assert len(depth_rows) == 1 and "| 0% (1) |" in depth_rows[0]  # the 40-60% bin lost its needle
    assert "niah_single 40%-60%" in text and rows
