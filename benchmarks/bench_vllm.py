"""kv_cache's codecs inside vLLM (CPU) against vLLM's own caches, same model, same KV memory.

For every configuration (``auto`` = vLLM's bf16 cache, ``fp8`` = vLLM's fp8 cache, and ours
``q4d``, ``q3d``, ``q2d`` through ``attention_backend="CUSTOM"``), a fresh subprocess starts one
``LLM(...)`` with the same KV memory (``VLLM_CPU_KVCACHE_SPACE``, or the engine's
``kv_cache_memory_bytes`` for a fraction of a GiB) and ``max_model_len`` and reports:

* **capacity**: the KV cache size in tokens and the maximum concurrency, as vLLM logs them
  ("CPU KV cache size: N tokens, Maximum concurrency ..."), and the ratio to ``auto``;
* **throughput** (``--throughput-configs``, default auto and q4d: q3d and q2d run the same
  attention code): output tokens/s with 1, 8 and 32 concurrent requests of ``--prompt-tokens``
  distinct wikitext tokens each, ``--gen-tokens`` greedy tokens each (wall time of one
  ``generate`` call over all of them, prefill included; after one warm-up request);
* **perplexity**: from ``prompt_logprobs`` over ``--ppl-windows`` windows of ``--ppl-tokens``
  wikitext tokens (teacher-forced, chunked prefill), and its change against ``auto``;
* **needle**: a single 7-digit number hidden at several depths of a ``--needle-tokens`` wikitext
  haystack, then asked for; greedy answer; accuracy.

Every engine runs chunked prefill with ``max_num_batched_tokens=256`` (so prefill attends over
earlier chunks read back from the codes) and ``enforce_eager=True``. ``fp8`` needs AVX-512 or AMX
on CPU: on a machine without them, vLLM still logs its capacity before it refuses to run, and the
row says so.

A configuration may carry its own KV memory as ``NAME@GIB`` (``auto@4``: vLLM's bf16 cache with
4 GiB), so one run can set a cache against the same cache with room for every request: the
ceiling that batching more sequences can reach on the machine. Ratios are taken against the
row named plain ``auto``.

**Interleaved throughput** (``--interleave R``): one process per configuration, all started
before any is timed and each warmed up, then ``R`` rounds in which every configuration runs the
same ``generate`` in turn, the order reversed every other round (A B, B A, A B, ...). Each round
uses prompt windows of its own (no prefix-cache hits), the same for every configuration. The
table gives each configuration's per-round output tokens/s and their median, and for each
configuration against ``auto`` the geometric mean of the per-round ratios (each taken between
runs minutes apart) with their range. A machine whose speed drifts over an hour then moves
both sides of every ratio alike, where the sequential mode's ratio takes the drift whole.
Every engine stays resident during the rounds: the KV memory is held once per configuration.
The protocol (rounds, windows, ratios, the children's pipes) is in ``vllm_rounds.py``.

Run: ``python benchmarks/bench_vllm.py [--configs auto,fp8,q4d,q3d,q2d] [--kv-space-gib 2]
[--out docs/results]``; writes ``vllm_<model>_cpu_kv<space>gib.{json,md}``.
"""

from __future__ import annotations

import argparse
import json
import math
import os
import platform
import subprocess
import sys
import tempfile
import time
from pathlib import Path

from vllm_rounds import (CAPACITY, NEEDLE_START, check_interleave, check_windows, child_env, markdown_interleaved,
                         round_windows, run_interleaved, split_config)

ROOT = Path(__file__).resolve().parents[1]
NEEDLE = "The special magic number is {n}."
QUESTION = "\n\nQuestion: What is the special magic number mentioned in the text above?\nAnswer: The special magic number is"


def _wikitext() -> str:
    from kv_cache.models.paths import shared_data_dir

    path = shared_data_dir() / "wikitext-2-raw" / "wiki.test.raw"
    return path.read_text(encoding="utf-8").replace("\r\n", "\n")


def _progress(config: str, what: str, t0: float) -> None:
    print(f"[bench_vllm {config}] {what} after {time.perf_counter() - t0:.0f} s", file=sys.stderr, flush=True)


def machine() -> str:
    """The machine in words: architecture, CPUs, CPU model and the vector extensions vLLM's CPU
    kernels pick from (AVX-512, its bf16 dot products, AMX); throughput ratios depend on them."""
    model, flags = platform.processor() or "", set()
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            key, _, value = line.partition(":")
            if key.strip() == "model name" and not model:
                model = value.strip()
            elif key.strip() == "flags":
                flags = set(value.split())
                break
    except OSError:
        pass
    isa = [f for f in ("avx2", "avx512f", "avx512_bf16", "amx_bf16") if f in flags]
    return f"{platform.machine()}, {os.cpu_count()} CPUs, {model or 'unknown CPU'}" + (
        f" ({', '.join(isa)})" if isa else "")


def _engine_kwargs(args: argparse.Namespace, name: str, kv_gib: float) -> dict:
    """``LLM(...)``'s arguments for cache ``name`` (``auto``, ``fp8`` or one of ours) with ``kv_gib``."""
    kw = dict(model=args.model, max_model_len=args.max_model_len, enforce_eager=True, max_num_batched_tokens=256,
              enable_chunked_prefill=True, dtype=args.dtype, seed=0, max_num_seqs=max(args.concurrency),
              disable_log_stats=False)  # per-request scheduler timestamps: how many ran at once
    if not kv_gib.is_integer():  # VLLM_CPU_KVCACHE_SPACE takes whole GiB only
        kw["kv_cache_memory_bytes"] = int(kv_gib * 2**30)
    if name == "fp8":
        kw["kv_cache_dtype"] = "fp8"
    elif name != "auto":
        kw.update(attention_backend="CUSTOM", additional_config={"kv_cache": {"codec": name}})
    return kw


def child(args: argparse.Namespace, config: str) -> dict:
    """One configuration in this process: build the engine, run every measurement, return a dict."""
    from vllm import LLM

    config, kv_gib = split_config(config, args.kv_space_gib)
    t_start = time.perf_counter()
    llm = LLM(**_engine_kwargs(args, config, kv_gib))
    _progress(config, "engine up", t_start)
    try:
        return _measure(args, config, llm, t_start)
    finally:  # stop the engine core now: left to the interpreter's teardown it may abort (rc -6)
        llm.llm_engine.engine_core.shutdown()


def _measure(args: argparse.Namespace, config: str, llm, t_start: float) -> dict:
    """Every measurement of one configuration on its running engine ``llm``."""
    from vllm import SamplingParams
    from vllm.inputs import TokensPrompt

    tok = llm.get_tokenizer()
    ids = tok(_wikitext(), add_special_tokens=False)["input_ids"]
    out: dict = {}
    name = split_config(config, args.kv_space_gib)[0]
    if name not in ("auto", "fp8"):
        out["attention_path"] = _attention_path()

    # throughput: distinct windows (no prefix-cache hits), warm-up first
    if config not in args.throughput_configs or "throughput" not in args.phases:
        args.concurrency = []
    if args.concurrency:
        _warm_up(args, llm, ids)
        out["throughput"] = _throughput(args, config, llm, ids, 0, t_start)

    if "ppl" not in args.phases:
        return out
    # perplexity from prompt log-probs
    lp_params = SamplingParams(temperature=0.0, max_tokens=1, prompt_logprobs=0)
    start = 200_000  # a stretch not used above
    windows = [TokensPrompt(prompt_token_ids=ids[start + i * args.ppl_tokens: start + (i + 1) * args.ppl_tokens])
               for i in range(args.ppl_windows)]
    nll, count = 0.0, 0
    for r in llm.generate(windows, lp_params, use_tqdm=False):
        for t, entry in zip(r.prompt_token_ids[1:], r.prompt_logprobs[1:]):
            nll -= entry[t].logprob
            count += 1
    out["ppl"] = math.exp(nll / count)
    out["ppl_tokens"] = count
    _progress(config, f"ppl {out['ppl']:.3f}", t_start)

    if "needle" not in args.phases:
        return out
    # single needle
    hay = ids[NEEDLE_START:NEEDLE_START + args.needle_tokens]
    correct, rows = 0, []
    for k, depth in enumerate(args.needle_depths):
        number = str(7_000_000 + 123_457 * (k + 1))
        needle = tok(" " + NEEDLE.format(n=number), add_special_tokens=False)["input_ids"]
        question = tok(QUESTION, add_special_tokens=False)["input_ids"]
        body = hay[: args.needle_tokens - len(needle) - len(question)]
        cut = int(depth * len(body))
        prompt = body[:cut] + needle + body[cut:] + question
        res = llm.generate([TokensPrompt(prompt_token_ids=prompt)],
                           SamplingParams(temperature=0.0, max_tokens=12), use_tqdm=False)[0]
        text = res.outputs[0].text
        hit = number in text.replace(",", "")
        correct += hit
        rows.append({"depth": depth, "number": number, "answer": text, "hit": hit})
    out["needle"] = {"accuracy": correct / len(rows), "samples": rows, "context_tokens": args.needle_tokens}
    return out


def _attention_path() -> str:
    """Which of kv_cache's attention paths serves a CPU engine: ``kernels`` or ``torch``."""
    from kv_cache.integrations.vllm.attention import kernels_serve

    return "kernels" if kernels_serve("cpu") else "torch"


def _warm_up(args: argparse.Namespace, llm, ids: list[int]) -> None:
    """One request of the prompt length from the text's end (outside every timed window)."""
    from vllm import SamplingParams
    from vllm.inputs import TokensPrompt

    greedy = SamplingParams(temperature=0.0, max_tokens=args.gen_tokens, ignore_eos=True)
    llm.generate([TokensPrompt(prompt_token_ids=ids[-args.prompt_tokens:])], greedy, use_tqdm=False)


def _throughput(args: argparse.Namespace, config: str, llm, ids: list[int], round_index: int,
                t_start: float) -> dict:
    """``{str(n): {"output_tok_s", "wall_s", "output_tokens", running_at_once...}}``: one timed
    ``generate`` per concurrency ``n`` over round ``round_index``'s windows."""
    from vllm import SamplingParams
    from vllm.inputs import TokensPrompt

    greedy = SamplingParams(temperature=0.0, max_tokens=args.gen_tokens, ignore_eos=True)
    p, out = args.prompt_tokens, {}
    for n, start in round_windows(args.concurrency, p, round_index):
        prompts = [TokensPrompt(prompt_token_ids=ids[start + i * p: start + (i + 1) * p]) for i in range(n)]
        t0 = time.perf_counter()
        res = llm.generate(prompts, greedy, use_tqdm=False)
        wall = time.perf_counter() - t0
        gen = sum(len(r.outputs[0].token_ids) for r in res)
        out[str(n)] = {"output_tok_s": gen / wall, "wall_s": wall, "output_tokens": gen, **running_at_once(res)}
        _progress(config, f"round {round_index} throughput @{n}: {gen / wall:.2f} tok/s, {out[str(n)]}", t_start)
    return out


def serve(args: argparse.Namespace, config: str, result_fd: int) -> None:
    """The interleaved mode's child: build the engine and warm it up, say so on ``result_fd``, then
    answer each ``round K`` line on stdin with that round's throughput (one JSON line on
    ``result_fd``) until ``quit``."""
    from vllm import LLM

    name, kv_gib = split_config(config, args.kv_space_gib)
    t_start = time.perf_counter()
    llm = LLM(**_engine_kwargs(args, name, kv_gib))
    _progress(config, "engine up", t_start)
    results = os.fdopen(result_fd, "w", buffering=1)
    try:
        ids = llm.get_tokenizer()(_wikitext(), add_special_tokens=False)["input_ids"]
        ready: dict = {"ready": True}
        if name not in ("auto", "fp8"):
            ready["attention_path"] = _attention_path()
        _warm_up(args, llm, ids)
        results.write(json.dumps(ready) + "\n")
        for line in sys.stdin:
            command = line.split()
            if command[:1] == ["quit"]:
                break
            if len(command) != 2 or command[0] != "round" or not command[1].isdigit():
                raise ValueError(f"serve: expected 'round K' or 'quit', got {line.strip()!r}")
            results.write(json.dumps({"round": int(command[1]),
                                      "throughput": _throughput(args, config, llm, ids, int(command[1]),
                                                                t_start)}) + "\n")
    finally:
        results.close()
        llm.llm_engine.engine_core.shutdown()


def running_at_once(results) -> dict:
    """``{"max_running", "mean_running", "preemptions"}`` from vLLM's per-request scheduler stats
    (``RequestOutput.metrics``: first scheduled and last token timestamps of the engine core):
    the most requests between their first scheduling and their last token at one time, the
    time-weighted mean of that count, and the requests' preemptions in all. ``{}`` when the
    engine keeps no such stats."""
    spans, preempted = [], 0
    for r in results:
        m = getattr(r, "metrics", None)
        if m is None or not getattr(m, "scheduled_ts", 0) or not getattr(m, "last_token_ts", 0):
            return {}
        spans.append((m.scheduled_ts, m.last_token_ts))
        preempted += int(getattr(m, "num_preemptions", 0))
    events = sorted([(a, 1) for a, _ in spans] + [(b, -1) for _, b in spans])
    now = best = 0
    area, last = 0.0, events[0][0] if events else 0.0
    for t, d in events:
        area += now * (t - last)
        last = t
        now += d
        best = max(best, now)
    width = (events[-1][0] - events[0][0]) if events else 0.0
    return {"max_running": best, "mean_running": area / width if width > 0 else float(best),
            "preemptions": preempted}


def run_config(args: argparse.Namespace, config: str) -> dict:
    env = child_env(config, args.kv_space_gib)
    cmd = [sys.executable, __file__, "--child", config, *sys.argv[1:]]
    t0 = time.perf_counter()
    log_path = Path(args.out) / f"bench_vllm_{config}.log" if args.keep_logs else None
    with tempfile.TemporaryFile("w+") as tmp:  # the child's whole output, readable while it runs if kept
        sink = open(log_path, "w+") if log_path else tmp
        proc = subprocess.run(cmd, stdout=sink, stderr=subprocess.STDOUT, text=True, env=env)
        sink.seek(0)
        log = sink.read()
        if log_path:
            sink.close()
    row: dict = {"config": config, "seconds": time.perf_counter() - t0}
    m = CAPACITY.search(log)
    if m:
        row["capacity_tokens"] = int(m.group(1).replace(",", ""))
        row["max_concurrency"] = float(m.group(2))
    result = [line for line in log.splitlines() if line.startswith('{"')]
    if proc.returncode == 0 and result:
        row.update(json.loads(result[-1]))
    else:
        lines = log.splitlines()
        # the root cause vLLM logs first (e.g. "NotImplementedError: FP8 KV cache on CPU requires ..."),
        # not the "Engine core initialization failed" that follows it
        causes = [x for x in lines if "NotImplementedError:" in x or "ValueError:" in x] or \
                 [x for x in lines if "Error" in x]
        row["error"] = (causes[0] if causes else log[-500:]).strip()[-300:]
    return row


def _tput_cell(row: dict, base: dict | None, n: int) -> str:
    """``tok/s (x auto; k at once)`` of one throughput run (``-`` when not run)."""
    t = row.get("throughput", {}).get(str(n))
    if t is None:
        return "–"
    cell = f"{t['output_tok_s']:.2f}"
    notes = []
    bt = (base or {}).get("throughput", {}).get(str(n))
    if bt and row is not base:
        notes.append(f"{t['output_tok_s'] / bt['output_tok_s']:.2f}x")
    if "max_running" in t:
        notes.append(f"{t['max_running']} at once, mean {t['mean_running']:.1f}"
                     + (f", {t['preemptions']} preempted" if t.get("preemptions") else ""))
    return cell + (f" ({'; '.join(notes)})" if notes else "")


def markdown(report: dict) -> str:
    rows = report["rows"]
    base = next((r for r in rows if r["config"] == "auto"), None)
    a = report["args"]
    lines = [f"# vLLM (CPU) with kv_cache codecs: {Path(a['model']).name}", "",
             f"vllm-cpu {report['vllm']}, torch {report['torch']}, {report['machine']}; "
             f"KV memory {a['kv_space_gib']:g} GiB (`VLLM_CPU_KVCACHE_SPACE`, or `kv_cache_memory_bytes` below 1 GiB), `max_model_len={a['max_model_len']}`, {a.get('dtype', 'bfloat16')} weights, "
             "chunked prefill (`max_num_batched_tokens=256`), `enforce_eager=True`, prefix caching on. "
             "Produced by `benchmarks/bench_vllm.py`.", "",
             "| cache | KV capacity (tokens, vLLM) | x auto | max concurrency | "
             + " | ".join(f"out tok/s @{n}" for n in a["concurrency"])
             + f" | ppl ({a['ppl_windows']}x{a['ppl_tokens']} tok) | Δppl vs auto | needle @{a['needle_tokens']} |",
             "|---|---|---|---|" + "---|" * len(a["concurrency"]) + "---|---|---|"]
    for r in rows:
        cap = r.get("capacity_tokens")
        ratio = f"{cap / base['capacity_tokens']:.2f}x" if cap and base and base.get("capacity_tokens") else "–"
        tput = [_tput_cell(r, base, n) for n in a["concurrency"]]
        ppl = f"{r['ppl']:.3f}" if "ppl" in r else "–"
        dppl = (f"{100 * (r['ppl'] / base['ppl'] - 1):+.2f}%" if "ppl" in r and base and "ppl" in base else "–")
        needle = f"{r['needle']['accuracy']:.0%}" if "needle" in r else "–"
        conc = f"{r['max_concurrency']:.2f}x" if "max_concurrency" in r else "–"
        kind, gib = split_config(r["config"], a["kv_space_gib"])
        name = (kind if kind in ("auto", "fp8") else f"kv_cache {kind}") + (
            f" ({gib:g} GiB of KV)" if "@" in r["config"] else "")
        lines.append(f"| {name} | {cap if cap else '–'} | {ratio} | {conc} | " + " | ".join(tput)
                     + f" | {ppl} | {dppl} | {needle} |")
    notes = [r for r in rows if "error" in r]
    if notes:
        lines += ["", "Configurations that did not run here:"]
        lines += [f"- `{r['config']}`: {r['error']}" for r in notes]
    lines += ["", "Throughput: output tokens / wall time of one `generate` over N concurrent requests of "
              f"{a['prompt_tokens']} prompt tokens and {a['gen_tokens']} greedy tokens each (prefill included; "
              "in brackets: the ratio to auto's, and how many requests ran at once, from vLLM's per-request "
              "scheduler timestamps: the most between a request's first scheduling and its last token, and "
              "the time-weighted mean). "
              "kv_cache's attention reads the codes block by block with an online softmax, through the path in the "
              "JSON's `attention_path` (`kernels`: the library's compiled CPU kernels read the codes in place; "
              "`torch`: each part decoded, then torch's CPU flash kernel), against vLLM's compiled CPU kernels "
              "for auto/fp8.", ""]
    return "\n".join(lines)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--model", default=None, help="HF folder (default: the SmolLM2-135M conversion)")
    ap.add_argument("--configs", default="auto,fp8,q4d,q3d,q2d")
    ap.add_argument("--kv-space-gib", type=float, default=2,
                    help="KV memory in GiB: VLLM_CPU_KVCACHE_SPACE when whole, else the engine's "
                         "kv_cache_memory_bytes (the same setting, in bytes)")
    ap.add_argument("--max-model-len", type=int, default=4608)
    ap.add_argument("--dtype", default="bfloat16", choices=("bfloat16", "float32"),
                    help="the weights' and activations' dtype [bfloat16]; float32 where the CPU has no bf16 "
                         "arithmetic (AVX2 only), on which vLLM's bf16 path runs tens of times slower")
    ap.add_argument("--concurrency", default="1,8,32")
    ap.add_argument("--throughput-configs", default="auto,q4d",
                    help="configurations whose throughput is measured (the q*d codecs share one attention path)")
    ap.add_argument("--prompt-tokens", type=int, default=2048)
    ap.add_argument("--gen-tokens", type=int, default=32)
    ap.add_argument("--ppl-windows", type=int, default=2)
    ap.add_argument("--ppl-tokens", type=int, default=2048)
    ap.add_argument("--needle-tokens", type=int, default=4096)
    ap.add_argument("--needle-depths", default="0.1,0.5,0.9")
    ap.add_argument("--out", default=str(ROOT / "docs" / "results"))
    ap.add_argument("--tag", default="", help="appended to the output files' stem (e.g. the case measured)")
    ap.add_argument("--phases", default="throughput,ppl,needle",
                    help="measurements to run after the capacity (comma-separated subset)")
    ap.add_argument("--keep-logs", action="store_true", help="keep each child's log as <out>/bench_vllm_<config>.log")
    ap.add_argument("--interleave", type=int, default=0,
                    help="R > 0: throughput only, every configuration's engine resident at once, R rounds "
                         "alternating the configurations (A B, B A, ...); the ratio is the geometric mean of "
                         "the rounds' ratios [0: one configuration after the other]")
    ap.add_argument("--child", default=None, help=argparse.SUPPRESS)
    ap.add_argument("--serve", default=None, help=argparse.SUPPRESS)
    ap.add_argument("--result-fd", type=int, default=None, help=argparse.SUPPRESS)
    args = ap.parse_args()
    if args.model is None:
        from kv_cache.models.paths import smollm2_converted_dir

        args.model = str(smollm2_converted_dir())
    args.concurrency = [int(x) for x in str(args.concurrency).split(",")]
    args.throughput_configs = str(args.throughput_configs).split(",")
    args.phases = str(args.phases).split(",")
    args.needle_depths = [float(x) for x in str(args.needle_depths).split(",")]
    if args.child:
        print(json.dumps(child(args, args.child)), flush=True)
        sys.stderr.flush()
        os._exit(0)  # the engine is shut down; skip a teardown that may abort after the result
    if args.serve:
        serve(args, args.serve, args.result_fd)
        sys.stderr.flush()
        os._exit(0)
    configs = args.configs.split(",")
    for config in configs:  # a bad NAME@GIB fails before any engine starts
        split_config(config, args.kv_space_gib)
    if args.interleave:
        check_interleave(args, configs)
    elif "throughput" in args.phases:
        check_windows(args.concurrency, args.prompt_tokens, 1)
    import torch
    import vllm

    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    stem = f"vllm_{Path(args.model).name.replace('-hf', '')}_cpu_kv{args.kv_space_gib:g}gib" + (
        f"_{args.tag}" if args.tag else "")
    if args.interleave:
        report = {"args": {k: v for k, v in vars(args).items() if k not in ("child", "keep_logs", "serve", "result_fd")},
                  "vllm": vllm.__version__, "torch": torch.__version__, "machine": machine(),
                  **run_interleaved(args, configs, __file__)}
        (out / f"{stem}.json").write_text(json.dumps(report, indent=1) + "\n")
        (out / f"{stem}.md").write_text(markdown_interleaved(report))
        print(f"wrote {out / stem}.{{json,md}}")
        return
    rows = []
    for config in configs:
        row = run_config(args, config)
        print(json.dumps({k: v for k, v in row.items() if k != "needle"}), flush=True)
        rows.append(row)
        report = {"args": {k: v for k, v in vars(args).items() if k not in ("child", "keep_logs", "serve", "result_fd")},
                  "vllm": vllm.__version__, "torch": torch.__version__,
                  "machine": machine(), "rows": rows}
        (out / f"{stem}.json").write_text(json.dumps(report, indent=1) + "\n")  # after every configuration
        (out / f"{stem}.md").write_text(markdown(report))
    print(f"wrote {out / stem}.{{json,md}}")


if __name__ == "__main__":
    main()
