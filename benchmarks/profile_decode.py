"""Where a decoding step's time goes: the full cache against compressed caches, one process, steps
alternating between the caches (the machine's drift falls on every cache alike).

For each method spec (the ``kvcache eval`` grammar; ours run inside :func:`kv_cache.compress`)
the script prefills the same ``--context`` tokens of *Moby Dick* into its own cache, then decodes
``--steps`` rounds; in each round every cache takes one greedy step in turn. It prints per cache
the median step time and its ratio to the first method's (the full cache by default; each cache's
hooks are installed only while it steps, :func:`kv_cache.compress` around each step, outside the
time), and, from
``cProfile`` over ``--profile-steps`` further steps per cache (its own overhead inflates the
Python share, so read the shares, not the profiled times), the share of the step spent in the
library's compiled kernels (the extension's functions), in torch's operators (the model's linear
layers, norms, activations; torch's attention for the full cache), and in Python (hooks, the
cache's bookkeeping, the attention function's glue), plus the top functions by own time.

Run: ``python benchmarks/profile_decode.py [--context 4096] [--methods full,q4d,q2d] [--steps 24]
[--out benchmarks/results]``; writes ``profile_decode_<model>_ctx<N>_<methods>.md``.
"""

from __future__ import annotations

import argparse
import statistics
import sys
import time
from pathlib import Path

KERNEL_NAMES = ("attend", "write_paged", "compact_rows", "quantize_pack", "dequant")
"""Built-in functions of the compiled extension (``kv_cache_kernels``) counted as kernel time."""


def _category(func: tuple) -> str:
    """``"kernels"``, ``"torch"`` or ``"python"`` for a cProfile function key ``(file, line, name)``."""
    file, _, name = func
    if file == "~":  # a built-in
        if "kv_cache_kernels" in name or (any(k in name for k in KERNEL_NAMES) and "torch" not in name):
            return "kernels"
        if "torch" in name or "Tensor" in name or "aten" in name:
            return "torch"
    return "python"


def _prepare(method_spec: str, model, tok, ids):
    from kv_cache.eval.prefilled import prefill_method
    from kv_cache.spec.grammar import parse_method

    return prefill_method(model, parse_method(method_spec), ids, tok, last_only=True)


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--model", default="smollm2")
    ap.add_argument("--context", type=int, default=4096)
    ap.add_argument("--methods", default="full,q4d,q2d")
    ap.add_argument("--steps", type=int, default=24, help="timed rounds (each cache one step per round)")
    ap.add_argument("--profile-steps", type=int, default=6)
    ap.add_argument("--top", type=int, default=12)
    ap.add_argument("--out", default=str(Path(__file__).parent / "results"))
    args = ap.parse_args(argv)

    import contextlib
    import cProfile
    import pstats

    import torch

    from kv_cache import CompressedCache, compress
    from kv_cache.generation import forward_at
    from kv_cache.models import load_model, shared_data_dir

    torch.set_num_threads(2)
    model, tok = load_model(args.model)
    text = (shared_data_dir() / "gutenberg" / "pg2701.txt").read_text().replace("\r\n", "\n")
    ids = tok(text[: args.context * 8], return_tensors="pt").input_ids[:, : args.context]
    methods = [m.strip() for m in args.methods.split(",") if m.strip()]
    state = {}

    def scope(cache):
        """The cache's own hooks, only while it steps: one cache's hooks never see another's step."""
        return compress(model, cache) if isinstance(cache, CompressedCache) else contextlib.nullcontext()

    def step(m: str) -> float:
        st = state[m]
        with scope(st[0]):
            t0 = time.perf_counter()
            logits = forward_at(model, st[0], st[1], st[2])
            dt = time.perf_counter() - t0
        st[1], st[2] = logits[:, -1:].argmax(-1), st[2] + 1
        return dt

    with torch.no_grad():
        for m in methods:
            pre = _prepare(m, model, tok, ids)
            pre.scope.close()  # each prefill under its own hooks, then closed
            state[m] = [pre.cache, pre.logits[:, -1:].argmax(-1), args.context]
        for m in methods:  # warm-up: two steps each
            for _ in range(2):
                step(m)
        times = {m: [] for m in methods}
        for _ in range(args.steps):
            for m in methods:
                times[m].append(step(m))
        profiles = {}
        for m in methods:
            prof = cProfile.Profile()
            with scope(state[m][0]):
                prof.enable()
                for _ in range(args.profile_steps):
                    st = state[m]
                    logits = forward_at(model, st[0], st[1], st[2])
                    st[1], st[2] = logits[:, -1:].argmax(-1), st[2] + 1
                prof.disable()
            profiles[m] = pstats.Stats(prof).stats  # {func: (cc, nc, tottime, cumtime, callers)}

    base = statistics.median(times[methods[0]])
    lines = [f"# Where a decoding step goes: {args.model}, {args.context} tokens", "",
             f"`python benchmarks/profile_decode.py --model {args.model} --context {args.context} --methods "
             f"{','.join(methods)} --steps {args.steps} --profile-steps {args.profile_steps}`; torch "
             f"{torch.__version__}, 2 threads; steps alternate between the caches in one process.", "",
             "| cache | median step | tokens/s | vs first | compiled kernels | torch ops | Python |",
             "|---|---:|---:|---:|---:|---:|---:|"]
    tops = []
    for m in methods:
        med = statistics.median(times[m])
        st = profiles[m]
        shares = {"kernels": 0.0, "torch": 0.0, "python": 0.0}
        for func, (_, _, tottime, _, _) in st.items():
            shares[_category(func)] += tottime
        total = sum(shares.values())
        lines.append(f"| `{m}` | {med * 1e3:.1f} ms | {1 / med:.1f} | {base / med:.2f}x | "
                     + " | ".join(f"{100 * shares[k] / total:.0f}%" for k in ("kernels", "torch", "python")) + " |")
        top = sorted(st.items(), key=lambda kv: kv[1][2], reverse=True)[: args.top]
        tops += ["", f"Top functions by own time, `{m}` ({args.profile_steps} profiled steps):", "",
                 "| function | calls / step | own ms / step | category |", "|---|---:|---:|---|"]
        for (file, line, name), (_, nc, tottime, _, _) in top:
            where = name if file == "~" else f"{Path(file).name}:{line} {name}"
            tops.append(f"| `{where}` | {nc / args.profile_steps:.0f} | {tottime * 1e3 / args.profile_steps:.2f} | "
                        f"{_category((file, line, name))} |")
    text_out = "\n".join(lines + tops) + "\n"
    print(text_out)
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    name = f"profile_decode_{Path(str(args.model)).name}_ctx{args.context}_{'-'.join(m.replace('@', '') for m in methods)}.md"
    (out / name).write_text(text_out)
    print(f"wrote {out / name}", file=sys.stderr)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
