"""Run one vLLM engine configuration and print what the tests check, as one JSON line.

Used by ``tests/test_vllm_plugin.py`` in a subprocess (vLLM's engine core is a spawned process,
and one engine per process keeps the runs independent)::

    python tests/vllm_probe.py '{"engine": {...}, "generate": [...], "max_tokens": 32, ...}'

Output (the stdout line that starts with ``{"``; vLLM may print more at shutdown): ``{"capacity_tokens": int, "max_concurrency": float, "generate":
[[token ids], ...], "margins": [smallest top-1 / top-2 log-prob gap along the greedy path, ...],
"prompt_logprobs": [[logprob per prompt token after the first], ...],
"cached_tokens": [int, ...]}``.
"""

from __future__ import annotations

import json
import os
import re
import sys

CAPACITY = re.compile(r"KV cache size: ([\d,]+) tokens, Maximum concurrency for [\d,]+ tokens per request: ([\d.]+)x")


def capacity_from_log(text: str) -> tuple[int, float] | None:
    """``(tokens, max concurrency)`` from vLLM's "KV cache size" log line, or None."""
    m = CAPACITY.search(text)
    return (int(m.group(1).replace(",", "")), float(m.group(2))) if m else None


def _gap(step: dict) -> float:
    best = sorted((lp.logprob for lp in step.values()), reverse=True)
    return best[0] - best[1] if len(best) > 1 else float("inf")


def main(spec: dict) -> dict:
    from vllm import LLM

    llm = LLM(**spec["engine"])
    try:
        return _run(llm, spec)
    finally:
        close(llm)


def close(llm) -> None:
    """Stop ``llm``'s engine core now (its processes exit), not in the interpreter's teardown: left
    to the teardown, a C++ thread of the engine may still be joinable and abort the process
    ("terminate called without an active exception", rc -6) after the result was printed."""
    try:
        llm.llm_engine.engine_core.shutdown()
    except Exception as exc:  # noqa: BLE001 -- reported, then the caller exits anyway
        print(f"vllm_probe: engine shutdown raised {type(exc).__name__}: {exc}", file=sys.stderr)


def _run(llm, spec: dict) -> dict:
    from vllm import SamplingParams

    result: dict = {}
    if spec.get("generate"):
        params = SamplingParams(temperature=0.0, max_tokens=spec.get("max_tokens", 32), ignore_eos=True, logprobs=2)
        outs = llm.generate(spec["generate"], params, use_tqdm=False)
        result["generate"] = [list(o.outputs[0].token_ids) for o in outs]
        result["cached_tokens"] = [o.num_cached_tokens for o in outs]
        # the smallest gap between the greedy token and the runner-up over the steps (nats)
        result["margins"] = [min(_gap(step) for step in o.outputs[0].logprobs) for o in outs]
    if spec.get("sequential"):  # one request at a time, in order (prefix-cache hits)
        params = SamplingParams(temperature=0.0, max_tokens=spec.get("sequential_max_tokens", 8), ignore_eos=True)
        result["sequential"], result["sequential_cached"] = [], []
        for prompt in spec["sequential"]:
            out = llm.generate([prompt], params, use_tqdm=False)[0]
            result["sequential"].append(list(out.outputs[0].token_ids))
            result["sequential_cached"].append(out.num_cached_tokens)
    if spec.get("prompt_logprobs"):
        params = SamplingParams(temperature=0.0, max_tokens=1, prompt_logprobs=0)
        outs = llm.generate(spec["prompt_logprobs"], params, use_tqdm=False)
        rows = []
        for o in outs:
            lp = []
            for tok, entry in zip(o.prompt_token_ids[1:], o.prompt_logprobs[1:]):
                lp.append(entry[tok].logprob)
            rows.append(lp)
        result["prompt_logprobs"] = rows
    return result


if __name__ == "__main__":
    out = main(json.loads(sys.argv[1]))
    print(json.dumps(out), flush=True)
    sys.stderr.flush()
    os._exit(0)  # the engine is shut down; skip a teardown that may abort (see close)
