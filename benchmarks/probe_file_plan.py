"""Which KVzip budget the file planner picks for a ``--file-ratio R`` file (issue 30).

Runs :func:`kv_cache.plan.file_plan.plan_file` (what ``kvcache compress --file-ratio R`` and
``CompressedContext.save(..., file_ratio=R)`` run) on the prefixes of the 4K wikitext windows
that the eval's tables score, and records each candidate's held-out-tail loss and the choice.

Run: ``python benchmarks/probe_file_plan.py --model smollm2 --ratio 20``; results go to
``benchmarks/results/probe_file_plan_<model>_r<R>_ctx<context>.{json,md}``.
"""

from __future__ import annotations

import argparse
import json
from pathlib import Path

import torch

from kv_cache.codec import basis_for_model
from kv_cache.eval.tasks import read_text
from kv_cache.eval.tasks.perplexity import perplexity_windows
from kv_cache.models import load_model, shared_data_dir
from kv_cache.plan.file_plan import candidate_budgets, plan_file


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--model", default="smollm2")
    ap.add_argument("--ratio", type=float, default=20.0)
    ap.add_argument("--context", type=int, default=4096)
    ap.add_argument("--continuation", type=int, default=256)
    ap.add_argument("--windows", type=int, default=2)
    ap.add_argument("--out", default=str(Path(__file__).resolve().parent / "results"))
    args = ap.parse_args()
    model, tok = load_model(args.model)
    text = read_text(str(shared_data_dir() / "wikitext-2-raw" / "wiki.test.raw"))
    windows = perplexity_windows(tok, text, context=args.context, prefix_len=args.context - args.continuation,
                                 num_windows=args.windows)
    basis = basis_for_model(model)
    rows = []
    for w in windows:
        with torch.no_grad():
            p = plan_file(model, tok, w.prefix_ids, args.ratio, basis=basis)
        rows.append({"window": w.index, "chosen": p.budget,
                     "measured": [{"budget": b, "nll": n, "file_bytes": s} for b, n, s in p.measured]})
        print(p.describe(), flush=True)
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    stem = out / f"probe_file_plan_{args.model}_r{args.ratio:g}_ctx{args.context}"
    stem.with_suffix(".json").write_text(json.dumps({"args": vars(args), "rows": rows}, indent=1) + "\n")
    cands = candidate_budgets(args.ratio)
    lines = [f"# The file planner's choice at {args.ratio:g}x ({args.model}, wikitext windows of {args.context} "
             f"tokens, the prefix of {args.context - args.continuation})", "",
             "| window | " + " | ".join(f"kvzip@{b:g}: held-out NLL" if b else "all tokens" for b in cands)
             + " | chosen |", "|---|" + "---|" * (len(cands) + 1)]
    for r in rows:
        nll = {m["budget"]: m["nll"] for m in r["measured"]}
        lines.append(f"| {r['window']} | " + " | ".join(f"{nll[b]:.3f}" if b in nll else "-" for b in cands)
                     + f" | `kvzip@{r['chosen']:g}` |")
    lines += ["", f"Produced by `benchmarks/probe_file_plan.py --model {args.model} --ratio {args.ratio:g}`: "
              "`plan_file` holds out the prefix's last 64 tokens, codes the rest at the ratio with each "
              "candidate budget, loads it back and scores the held-out tokens.", ""]
    stem.with_suffix(".md").write_text("\n".join(lines))
    print(f"wrote {stem}.{{json,md}}")


if __name__ == "__main__":
    main()
