"""Does a longer window change the golden tests' verdicts? (issue 27)

``tests/test_golden_families.py`` scores one held-out Moby Dick window per model: ``PREFIX``
tokens prefilled and compressed, the next 256 scored, against the full cache of the same window,
for ``q4d``, the ``8x`` preset (sized to the window) and ``kvzip@0.25``. This probe runs the same
functions with other prefix lengths, to tell a short-window effect (fixed bytes such as sinks and
scales weigh more in a short window) from a family effect.

Run: ``python benchmarks/probe_golden_window.py --models smollm2,qwen2.5-0.5b --prefixes 768,1536``
(the test's window holds up to about 1,780 prefix tokens). Writes
``benchmarks/results/probe_golden_window_<prefixes>.md``.
"""

from __future__ import annotations

import argparse
import sys
import warnings
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT / "tests"))

import test_golden_families as golden  # noqa: E402

from kv_cache import CompressedCache, FidelityWarning  # noqa: E402
from kv_cache.models import load_model  # noqa: E402


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--models", default="smollm2,qwen2.5-0.5b")
    ap.add_argument("--prefixes", default="768,1536")
    args = ap.parse_args()
    rows = []
    for prefix in (int(p) for p in args.prefixes.split(",")):
        golden.PREFIX = prefix
        for alias in args.models.split(","):
            model, tok = load_model(alias)
            ids = golden._window(tok)
            if ids.shape[1] != prefix + golden.SCORED:
                raise SystemExit(f"the test's window holds {ids.shape[1]} tokens for {alias}; "
                                 f"prefix {prefix} + {golden.SCORED} scored does not fit")
            full = golden._ppl(model, tok, ids, CompressedCache(model.config))
            for name, limit in golden.LIMITS.items():
                with warnings.catch_warnings(record=True) as caught:
                    warnings.simplefilter("always")
                    ppl = golden._ppl(model, tok, ids, golden._cache(model, name))
                warned = any(issubclass(w.category, FidelityWarning) for w in caught)
                rows.append((alias, prefix, name, full, ppl, limit, warned))
                print(alias, prefix, name, f"{ppl / full - 1:+.2%}", flush=True)
    lines = ["# Golden-test verdicts at other window lengths (issue 27)", "",
             f"`python benchmarks/probe_golden_window.py --models {args.models} --prefixes {args.prefixes}`: "
             "the functions of `tests/test_golden_families.py` (Moby Dick from \"CHAPTER 1. Loomings.\", "
             f"{golden.SCORED} tokens scored after the prefix, float32), with other prefix lengths.", "",
             "| model | prefix | cache | ppl full | ppl | Δppl | limit | within | fidelity warning |",
             "|---|---|---|---|---|---|---|---|---|"]
    for alias, prefix, name, full, ppl, limit, warned in rows:
        d = ppl / full - 1
        lines.append(f"| {alias} | {prefix} | `{name}` | {full:.3f} | {ppl:.3f} | {d:+.2%} | +{limit:.1%} | "
                     f"{'yes' if d <= limit else '**no**'} | {'yes' if warned else 'no'} |")
    out = ROOT / "benchmarks" / "results" / f"probe_golden_window_{args.prefixes.replace(',', '-')}.md"
    out.write_text("\n".join(lines) + "\n")
    print(f"wrote {out}")


if __name__ == "__main__":
    main()
