"""Add rows of a ``kvcache eval`` run to a committed layout table (``docs/results/<model>_mobydick_prerope_ctx2048``).

The committed tables of layouts, every token kept, merge several runs on the same windows (their
``full`` perplexity is checked equal, so every Δppl is against the same reference). Each row keeps
its ``resolved`` QuantConfig. ``held b/e`` counts the bytes over the K/V elements each layer holds
after the prefill (a sliding-window layer holds its last ``W - 1`` tokens; Gemma 3), the figure the
byte targets of issue 62 are stated in; ``b/e`` is over the whole context, as before.

Run: ``python benchmarks/merge_eval_rows.py docs/results/smollm2_mobydick_prerope_ctx2048 runs/eval/x/results.json
--model smollm2 --note "..."``.
"""

from __future__ import annotations

import argparse
import json
import math
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT / "src"))


def held_factor(model: str, tokens: int) -> float:
    """Whole-context elements over held elements after a prefill of ``tokens`` (1 without sliding layers)."""
    from kv_cache.cache.architecture import layer_windows
    from kv_cache.models import load_model

    windows = layer_windows(load_model(model)[0].config)
    held = sum(tokens if w is None else min(tokens, w - 1) for w in windows)
    return len(windows) * tokens / held


def merge(table: Path, results: Path, model: str, note: str | None) -> None:
    data = json.loads(table.with_suffix(".json").read_text())
    run = json.loads(results.read_text())
    cfg = run["config"]
    tokens = cfg["context"] - cfg["continuation"]
    factor = held_factor(model, tokens)
    full_ref = data["methods"]["full"]["ppl"]
    full_run = run["methods"]["full"]["tasks"]["ppl"]["score"]
    if not math.isclose(full_ref, full_run, rel_tol=1e-6):
        raise SystemExit(f"the run's full perplexity {full_run} is not the table's {full_ref}: other windows")
    for spec, m in run["methods"].items():
        if spec == "full":
            continue
        t = m["tasks"]["ppl"]
        data["methods"][spec] = {"spec": spec, "bpe": t["bits_per_element"], "ppl": t["score"], "kl": t["kl"],
                                 "agree": t["agreement"], "resolved": m["resolved"]}
    for m in data["methods"].values():
        m["bpe_held"] = m["bpe"] * factor if m["spec"] != "full" else 32.0
    if note:
        data["notes"] = [*data.get("notes", []), note]
    table.with_suffix(".json").write_text(json.dumps(data, indent=1))
    write_md(table, data)


def write_md(table: Path, data: dict) -> None:
    md = table.with_suffix(".md").read_text().split("\n")
    footer = [line for line in md if line and not line.startswith("|")]
    full = data["methods"]["full"]["ppl"]
    rows = ["| cache | bits / element | held b/e | ppl | Δppl | KL | greedy agree |", "|---|---|---|---|---|---|---|"]
    order = list(data["methods"])
    by_width = sorted(order, key=lambda s: (s != "full", -int(s[1]) if s[1:2].isdigit() else 0, order.index(s)))
    for spec in by_width:
        m = data["methods"][spec]
        if spec == "full":
            rows.append(f"| `full` | 32.00 | 32.00 | {full:.3f} | - | - | - |")
            continue
        rows.append(f"| `{spec}` | {m['bpe']:.2f} | {m['bpe_held']:.2f} | {m['ppl']:.3f} | "
                    f"{100 * (m['ppl'] / full - 1):+.2f}% | {m['kl']:.4f} | {100 * m['agree']:.1f}% |")
    notes = [f"{n}" for n in data.get("notes", []) if n not in footer]
    table.with_suffix(".md").write_text("\n".join(rows + [""] + footer + notes) + "\n")


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("table", help="the committed table, without its suffix")
    ap.add_argument("results", help="a kvcache eval results.json on the same windows")
    ap.add_argument("--model", required=True)
    ap.add_argument("--note", default=None, help="a line added under the table")
    args = ap.parse_args()
    merge(Path(args.table), Path(args.results), args.model, args.note)


if __name__ == "__main__":
    main()
