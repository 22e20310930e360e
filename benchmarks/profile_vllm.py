"""Where a vLLM serving run goes: ``cProfile`` over one ``generate`` of N concurrent requests,
vLLM's engine in this process (``VLLM_ENABLE_V1_MULTIPROCESSING=0``), for each cache in turn.

For each configuration (``auto`` = vLLM's bf16 cache; ours through ``attention_backend="CUSTOM"``)
a fresh subprocess builds the engine (SmolLM2 bf16 by default, chunked prefill in 256-token
chunks, ``enforce_eager``, ``VLLM_CPU_KVCACHE_SPACE``), runs one warm-up request, then profiles
one ``generate`` of ``--requests`` prompts of ``--prompt-tokens`` distinct wikitext tokens with
``--gen-tokens`` greedy tokens each. It prints the output tokens/s of the profiled run (cProfile
slows Python, so compare the shares, and take throughput from ``bench_vllm.py``) and the top
functions by own time: vLLM's GEMMs (``onednn_mm``), its attention (``cpu_attention_with_kv_cache``)
or ours (``attend_paged_batch``, ``write_paged``), and the Python around them.

Run: ``python benchmarks/profile_vllm.py [--configs auto,q4d] [--requests 32] [--prompt-tokens 1024]
[--gen-tokens 64] [--model DIR] [--out benchmarks/results]``; writes
``profile_vllm_<model>_<requests>x<prompt>_<gen>_<configs>.md``.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]


def child(args: argparse.Namespace, config: str) -> dict:
    """One configuration in this process: build the engine, profile one generate, return rows."""
    import cProfile
    import pstats

    from vllm import LLM, SamplingParams
    from vllm.inputs import TokensPrompt

    sys.path.insert(0, str(Path(__file__).parent))
    from bench_vllm import _wikitext

    kw = dict(model=args.model, max_model_len=4608, enforce_eager=True, max_num_batched_tokens=256,
              enable_chunked_prefill=True, dtype="bfloat16", seed=0, max_num_seqs=args.requests)
    if config != "auto":
        kw.update(attention_backend="CUSTOM", additional_config={"kv_cache": {"codec": config}})
    llm = LLM(**kw)
    try:
        ids = llm.get_tokenizer()(_wikitext(), add_special_tokens=False)["input_ids"]
        p = args.prompt_tokens
        greedy = SamplingParams(temperature=0.0, max_tokens=args.gen_tokens, ignore_eos=True)
        llm.generate([TokensPrompt(prompt_token_ids=ids[-p:])], greedy, use_tqdm=False)
        prompts = [TokensPrompt(prompt_token_ids=ids[i * p:(i + 1) * p]) for i in range(args.requests)]
        prof = cProfile.Profile()
        t0 = time.perf_counter()
        prof.enable()
        res = llm.generate(prompts, greedy, use_tqdm=False)
        prof.disable()
        wall = time.perf_counter() - t0
    finally:
        llm.llm_engine.engine_core.shutdown()
    gen = sum(len(r.outputs[0].token_ids) for r in res)
    st = pstats.Stats(prof).stats
    total = sum(v[2] for v in st.values())
    top = []
    for (file, line, name), (_, nc, tottime, _, _) in sorted(st.items(), key=lambda kv: kv[1][2],
                                                             reverse=True)[: args.top]:
        where = name if file == "~" else f"{Path(file).name}:{line} {name}"
        top.append({"function": where, "calls": nc, "own_s": tottime, "share": tottime / total})
    return {"config": config, "output_tok_s": gen / wall, "wall_s": wall, "profiled_s": total, "top": top}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--model", default=None, help="HF folder (default: the SmolLM2-135M conversion)")
    ap.add_argument("--configs", default="auto,q4d")
    ap.add_argument("--requests", type=int, default=32)
    ap.add_argument("--prompt-tokens", type=int, default=1024)
    ap.add_argument("--gen-tokens", type=int, default=64)
    ap.add_argument("--kv-space-gib", type=int, default=1)
    ap.add_argument("--top", type=int, default=14)
    ap.add_argument("--out", default=str(Path(__file__).parent / "results"))
    ap.add_argument("--child", default=None, help=argparse.SUPPRESS)
    args = ap.parse_args()
    if args.model is None:
        from kv_cache.models.paths import smollm2_converted_dir

        args.model = str(smollm2_converted_dir())
    if args.child:
        print(json.dumps(child(args, args.child)), flush=True)
        os._exit(0)
    env = dict(os.environ, VLLM_ENABLE_V1_MULTIPROCESSING="0", VLLM_CPU_KVCACHE_SPACE=str(args.kv_space_gib))
    rows = []
    for config in args.configs.split(","):
        proc = subprocess.run([sys.executable, __file__, "--child", config, *sys.argv[1:]], env=env,
                              capture_output=True, text=True)
        found = [x for x in proc.stdout.splitlines() if x.startswith('{"')]
        if proc.returncode or not found:
            raise SystemExit(f"{config}: the child failed (rc {proc.returncode}):\n{proc.stderr[-2000:]}")
        rows.append(json.loads(found[-1]))
        print(config, f"{rows[-1]['output_tok_s']:.2f} tok/s (profiled)", file=sys.stderr, flush=True)
    name = Path(args.model).name.replace("-hf", "")
    lines = [f"# Where a vLLM serving run goes: {name}, {args.requests} x {args.prompt_tokens} tokens, "
             f"{args.gen_tokens} out", "",
             f"`python benchmarks/profile_vllm.py --configs {args.configs} --requests {args.requests} "
             f"--prompt-tokens {args.prompt_tokens} --gen-tokens {args.gen_tokens}`; cProfile over one "
             "`generate`, vLLM's engine in the process, chunked prefill (256 tokens), bf16 weights, "
             f"{args.kv_space_gib} GiB of KV. Tokens/s under the profiler (Python runs slower there).", ""]
    for r in rows:
        lines += [f"## `{r['config']}`: {r['output_tok_s']:.2f} output tok/s, {r['profiled_s']:.1f} s profiled", "",
                  "| function | calls | own s | share |", "|---|---:|---:|---:|"]
        lines += [f"| `{t['function']}` | {t['calls']} | {t['own_s']:.2f} | {100 * t['share']:.0f}% |"
                  for t in r["top"]]
        lines.append("")
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    path = out / (f"profile_vllm_{name}_{args.requests}x{args.prompt_tokens}_{args.gen_tokens}_"
                  f"{args.configs.replace(',', '-')}.md")
    path.write_text("\n".join(lines))
    print("\n".join(lines))
    print(f"wrote {path}", file=sys.stderr)


if __name__ == "__main__":
    main()
