"""Where a method's prefill goes: a plain prefill and the method's (KVzip's repeat pass included),
timed back to back in one process, with ``cProfile``'s top functions of the method's prefill.

For each method spec (the ``kvcache eval`` grammar) the script times a plain prefill
(transformers' ``DynamicCache``) of the same ``--context`` tokens of *Moby Dick*, then the
method's own prefill (:func:`kv_cache.eval.prefilled.prefill_method`: the context and, for
KVzip, its reconstruction pass) and a second plain prefill (the ratio is over the two plain
prefills' mean; a short warm-up prefill runs first), then profiles one more of the method's prefills. It prints the
ratio of the two timed prefills and the profile's top functions by own time (cProfile's overhead
is small here: the time is in torch's operators).

Run: ``python benchmarks/profile_prefill.py [--model qwen2.5-0.5b] [--context 4096] [--methods 8x]
[--plain] [--no-profile] [--out benchmarks/results]`` (``--plain``: a plain prefill's profile too;
``--no-profile``: the timed ratios only); writes ``profile_prefill_<model>_ctx<N>_<methods>.md``.
"""

from __future__ import annotations

import argparse
import sys
import time
from pathlib import Path


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--model", default="qwen2.5-0.5b")
    ap.add_argument("--context", type=int, default=4096)
    ap.add_argument("--methods", default="8x")
    ap.add_argument("--top", type=int, default=14)
    ap.add_argument("--plain", action="store_true", help="also profile one plain prefill (its top functions)")
    ap.add_argument("--no-profile", action="store_true",
                    help="time the prefills only (no profiled prefill: at 16K tokens each one costs minutes)")
    ap.add_argument("--out", default=str(Path(__file__).parent / "results"))
    args = ap.parse_args(argv)

    import cProfile
    import pstats

    import torch

    from kv_cache.eval.prefill_cost import plain_prefill_seconds
    from kv_cache.eval.prefilled import prefill_method
    from kv_cache.models import load_model, shared_data_dir
    from kv_cache.spec.grammar import parse_method

    torch.set_num_threads(2)
    model, tok = load_model(args.model)
    text = (shared_data_dir() / "gutenberg" / "pg2701.txt").read_text().replace("\r\n", "\n")
    ids = tok(text[: args.context * 8], return_tensors="pt").input_ids[:, : args.context]
    methods = [m.strip() for m in args.methods.split(",") if m.strip()]
    lines = [f"# Where a prefill goes: {args.model}, {args.context} tokens", "",
             f"`python benchmarks/profile_prefill.py --model {args.model} --context {args.context} --methods "
             f"{','.join(methods)}{' --plain' if args.plain else ''}{' --no-profile' if args.no_profile else ''}`; torch {torch.__version__}, 2 threads; each method's prefill timed between "
             "two plain prefills of the same tokens (after a warm-up).", "",
             "| method | plain prefill (mean of before and after) | method's prefill | ratio |", "|---|---:|---:|---:|"]
    tops = []
    with torch.no_grad():
        plain_prefill_seconds(model, ids[:, :512], last_only=True)  # warm-up: a process's first forward is slow
        for m in methods:
            method = parse_method(m)
            plain_before = plain_prefill_seconds(model, ids, last_only=True)
            t0 = time.perf_counter()
            pre = prefill_method(model, method, ids, tok, last_only=True)
            seconds = time.perf_counter() - t0
            pre.scope.close()
            del pre
            plain = (plain_before + plain_prefill_seconds(model, ids, last_only=True)) / 2
            lines.append(f"| `{m}` | {plain:.2f} s | {seconds:.2f} s | {seconds / plain:.2f}x |")
            if args.no_profile:
                continue
            prof = cProfile.Profile()
            prof.enable()
            pre = prefill_method(model, method, ids, tok, last_only=True)
            prof.disable()
            pre.scope.close()
            del pre
            tops += _top_table(pstats.Stats(prof).stats, f"`{m}`", args.top)
        if args.plain:
            prof = cProfile.Profile()
            prof.enable()
            plain_prefill_seconds(model, ids, last_only=True)
            prof.disable()
            tops += _top_table(pstats.Stats(prof).stats, "a plain prefill", args.top)
    text_out = "\n".join(lines + tops) + "\n"
    print(text_out)
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    name = (f"profile_prefill_{Path(str(args.model)).name}_ctx{args.context}_"
            f"{'-'.join(m.replace('@', '') for m in methods)}.md")
    (out / name).write_text(text_out)
    print(f"wrote {out / name}", file=sys.stderr)
    return 0


def _top_table(stats: dict, what: str, top: int) -> list[str]:
    """Markdown lines: the ``top`` functions of one profiled prefill by own time."""
    total = sum(v[2] for v in stats.values())
    lines = ["", f"Top functions by own time, {what} (one profiled prefill, {total:.1f} s):", "",
             "| function | calls | own s | share |", "|---|---:|---:|---:|"]
    for (file, line, name), (_, nc, tottime, _, _) in sorted(stats.items(), key=lambda kv: kv[1][2], reverse=True)[:top]:
        where = name if file == "~" else f"{Path(file).name}:{line} {name}"
        lines.append(f"| `{where}` | {nc} | {tottime:.2f} | {100 * tottime / total:.0f}% |")
    return lines


if __name__ == "__main__":
    raise SystemExit(main())
