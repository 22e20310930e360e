"""The ``kv_cache`` model of lm-evaluation-harness on a tiny local task (tests/lm_eval_task).

``method=full`` must give what ``--model hf`` gives on the same model (stories260K's Hugging
Face folder): the same loglikelihoods (to float32 rounding), the same greedy flags, the same
generations and metrics, on loglikelihood (multiple choice), generate_until and
loglikelihood_rolling requests; ``max_length=32`` makes lm-eval left-truncate generation
prompts and split the documents into several rolling windows. A compressed method runs the
same tasks and gives other numbers (the compression is really applied).
"""

from __future__ import annotations

import math
import subprocess
import sys
from pathlib import Path

import pytest

lm_eval = pytest.importorskip("lm_eval", reason="needs the lm-eval extra: pip install 'kv_cache[lm-eval]'")

from kv_cache.lm_eval_model import KVCacheLM  # noqa: E402
from kv_cache.models import shared_data_dir  # noqa: E402

REPO = Path(__file__).resolve().parents[1]
TASK_DIR = REPO / "tests" / "lm_eval_task"
TASKS = ["kvc_mc", "kvc_gen", "kvc_rolling"]
HF_DIR = shared_data_dir() / "stories260K" / "hf"
COMMON = {"device": "cpu", "dtype": "float32", "max_length": 32}
COMPRESSED = "q2dt+kvzip@0.5"  # 2-bit per-token codes from the 5th token on, half the tokens: changes every answer


def _evaluate(model, model_args=None) -> dict:
    from lm_eval.tasks import TaskManager

    with pytest.MonkeyPatch.context() as mp:
        mp.chdir(REPO)  # the task's data_files are relative to the repository root
        return lm_eval.simple_evaluate(model=model, model_args=model_args, tasks=TASKS,
                                       task_manager=TaskManager(include_path=str(TASK_DIR)), log_samples=True)


@pytest.fixture(scope="module")
def hf_results() -> dict:
    if not (HF_DIR / "config.json").is_file():
        pytest.skip(f"stories260K's Hugging Face folder is missing ({HF_DIR})")
    return _evaluate("hf", {"pretrained": str(HF_DIR), **COMMON})


def _responses(results: dict, task: str) -> list:
    return [s["resps"] for s in sorted(results["samples"][task], key=lambda s: s["doc_id"])]


def test_registered_under_kv_cache():
    from lm_eval.api.registry import get_model

    assert get_model("kv_cache") is KVCacheLM


def test_entry_point_declared():
    from importlib.metadata import entry_points

    eps = {ep.name: ep.value for ep in entry_points(group="lm_eval.models")}
    assert eps.get("kv_cache") == "kv_cache.integrations.lm_eval:KVCacheLM"


def test_full_equals_hf(hf_results):
    ours = _evaluate(KVCacheLM(pretrained=str(HF_DIR), method="full", **COMMON))
    for task in TASKS:
        theirs_r, ours_r = _responses(hf_results, task), _responses(ours, task)
        assert len(ours_r) == len(theirs_r) == 4
        for a, b in zip(theirs_r, ours_r):
            if task == "kvc_gen":
                assert a == b  # the same greedy tokens, cut at the same stop string
            elif task == "kvc_mc":  # per choice: [(loglikelihood, is greedy)]
                for ((ll_a, greedy_a),), ((ll_b, greedy_b),) in zip(a, b):
                    assert ll_b == pytest.approx(ll_a, abs=1e-4)
                    assert greedy_b == greedy_a
            else:
                assert b[0][0] == pytest.approx(a[0][0], abs=1e-3)  # [[sum over windows]]
        for metric, value in hf_results["results"][task].items():
            if isinstance(value, float) and math.isfinite(value):
                assert ours["results"][task][metric] == pytest.approx(value, rel=1e-5), (task, metric)
    assert hf_results["results"]["kvc_mc"]["acc,none"] == 1.0  # the task separates answers at all
    assert hf_results["results"]["kvc_gen"]["exact_match,none"] > 0


def test_compressed_method_runs_and_changes_answers(hf_results):
    ours = _evaluate(KVCacheLM(pretrained=str(HF_DIR), method=COMPRESSED, **COMMON))
    lls = [ll for r in _responses(ours, "kvc_mc") for (ll, _), in r]
    ref = [ll for r in _responses(hf_results, "kvc_mc") for (ll, _), in r]
    assert all(math.isfinite(x) for x in lls)
    assert max(abs(a - b) for a, b in zip(lls, ref)) > 0.1
    rolling = [r[0][0] for r in _responses(ours, "kvc_rolling")]
    assert all(math.isfinite(x) and x < 0 for x in rolling)
    assert rolling != pytest.approx([r[0][0] for r in _responses(hf_results, "kvc_rolling")], abs=1e-3)
    assert all(isinstance(r[0][0], str) for r in _responses(ours, "kvc_gen"))
    assert math.isfinite(ours["results"]["kvc_rolling"]["word_perplexity,none"])


def test_bad_method_refused_before_loading():
    with pytest.raises(ValueError, match=r"unknown method 'q4\+nope@0\.5'.*known forms"):
        KVCacheLM(pretrained="no/such-model-is-loaded", method="q4+nope@0.5")


def test_unsupported_generation_argument_refused():
    import torch

    lm = KVCacheLM(pretrained=str(HF_DIR), method="full", **COMMON)
    ctx = torch.tensor([[1, 346, 306]])
    with pytest.raises(ValueError, match=r"\['top_k'\] are not supported.*supported: \["):
        lm._model_generate(ctx, max_length=8, stop=[], top_k=5)


def test_kvcache_lm_eval_command_runs_the_kv_cache_model(tmp_path):
    """``kvcache-lm-eval`` is lm-eval's command line with the model registered (one task)."""
    out = subprocess.run(
        [sys.executable, "-m", "kv_cache.lm_eval_model", "--model", "kv_cache", "--model_args",
         f"pretrained={HF_DIR},method=q4+kvzip@0.3,max_length=32", "--device", "cpu", "--tasks", "kvc_mc",
         "--include_path", str(TASK_DIR)],
        cwd=REPO, capture_output=True, text=True, timeout=300)
    assert out.returncode == 0, out.stderr[-3000:]
    assert "kvc_mc" in out.stdout and "acc" in out.stdout
    assert "method': 'q4+kvzip@0.3'" in out.stdout
