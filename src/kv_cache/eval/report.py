"""Render ``results.json`` as a Markdown table and a Pareto plot (quality vs measured KV bytes)."""

from __future__ import annotations

import math
from pathlib import Path
from typing import Any

from ..attention.fidelity import EVICTION_THRESHOLD
from .longgen import TASK as LONGGEN, longgen_table, plot_memory


def fmt_bytes(n: float | None) -> str:
    if n is None:
        return "-"
    for unit in ("B", "KiB", "MiB", "GiB"):
        if abs(n) < 1024 or unit == "GiB":
            return f"{n:,.0f} {unit}" if unit == "B" else f"{n:,.2f} {unit}"
        n /= 1024
    return f"{n}"


_fmt_bytes = fmt_bytes  # the old private name


def _bits_per_element(m: dict) -> float | None:
    """The summary's ``bits_per_element``; derived from its bytes for documents saved before it existed."""
    if m.get("bits_per_element") is not None:
        return m["bits_per_element"]
    kv, fp16 = m.get("kv_bytes"), m.get("fp16_bytes")
    return 16.0 * kv / fp16 if kv is not None and fp16 else None


def _fmt_kl(te: dict) -> str:
    """Mean KL with 4 decimals; ``-`` when no sample has one (documents saved before KL existed)."""
    kl = te.get("kl")
    if kl is None:
        return "-"
    n, total = te.get("kl_samples"), len(te.get("samples", []))
    partial = f" (n={n})" if n is not None and 0 < n < total else ""
    return f"{kl:.4f}{partial}"


def markdown_table(doc: dict) -> str:
    """One row per method: bits, budget, measured KV bytes, ratio vs fp16, bits per element, scores
    (ppl: ppl, Δppl, greedy agreement, KL from the full cache), decode tokens/s, prefill cost;
    then the accuracy by needle depth and the long-generation table (:func:`longgen_table`)."""
    methods = list(doc["methods"].values())
    tasks = []
    for m in methods:
        for t in m["tasks"]:
            if t not in tasks and t != LONGGEN:  # longgen has a table of its own
                tasks.append(t)
    full = next((m for m in methods if m.get("spec") == "full" and m.get("kv_bytes")), None)
    dtype = doc.get("config", {}).get("dtype") or "the model's dtype"
    head = ["method", "bits", "budget", "KV bytes (measured)", *([f"vs full ({dtype})"] if full else []),
            "ratio vs fp16", "bits/elem"]
    for t in tasks:
        head += ["ppl", "Δppl", "greedy agree", "KL"] if t == "ppl" else [f"{t} acc"]
    head.append("decode tok/s")
    with_fidelity = any(m.get("attention_error") is not None for m in methods)
    if with_fidelity:
        head.append("attn err")
    with_eviction = any(m.get("evicted_attention") is not None for m in methods)
    if with_eviction:
        head.append("evicted attn")
    with_cost = any(m.get("prefill_cost") is not None for m in methods)
    if with_cost:
        head.append("prefill cost")
    lines = ["| " + " | ".join(head) + " |", "|" + "---|" * len(head)]
    for m in methods:
        # A plan (preset or file) sets its widths per layer and model: no single bits to show.
        planned = str(m.get("resolved", "")).startswith(("kv_cache preset", "kv_cache plan"))
        unquantized = {"float32": "32"}.get(doc.get("config", {}).get("dtype"), "16")  # the model's own width
        bits = "-" if planned and m.get("bits") is None else str(m.get("bits") or unquantized)
        row = [f"`{m['spec']}`", bits, "-" if m.get("budget") is None else str(m["budget"]), fmt_bytes(m.get("kv_bytes"))]
        if full:  # against the full cache in the model's own dtype: the full row reads 1.00x
            row.append(f"{full['kv_bytes'] / m['kv_bytes']:.2f}x" if m.get("kv_bytes") else "-")
        row.append("-" if not m.get("ratio") else f"{m['ratio']:.2f}x")
        bpe = _bits_per_element(m)
        row.append("-" if bpe is None else f"{bpe:.2f}")
        for t in tasks:
            te = m["tasks"].get(t, {})
            if t == "ppl":
                sc, d, a = te.get("score"), te.get("delta"), te.get("agreement")
                row += ["-" if sc is None else f"{sc:.3f}", "-" if d is None else f"{d:+.3f}",
                        "-" if a is None else f"{a:.1%}", _fmt_kl(te)]
            else:
                sc = te.get("score")
                n, want = len(te.get("samples", [])), doc.get("config", {}).get("samples")
                partial = f" (n={n})" if want and 0 < n < want else ""
                row.append("-" if sc is None else f"{sc:.1%}{partial}")
        tps = m.get("decode_tokens_per_s")
        row.append("-" if tps is None else f"{tps:.1f}")
        if with_fidelity:
            err = m.get("attention_error")
            row.append("-" if err is None else f"{err:.3f}")
        if with_eviction:
            x = m.get("evicted_attention")
            row.append("-" if x is None else f"{x:.3f}")
        if with_cost:
            cost = m.get("prefill_cost")
            row.append("-" if cost is None else f"{cost:.2f}x")
        if m.get("error"):
            row[0] += f" (failed: {m['error'][:60]})"
        lines.append("| " + " | ".join(row) + " |")
    for spec, why in doc.get("skipped", {}).items():
        if spec in doc.get("methods", {}):  # saved samples of an earlier run are still shown
            lines.append(f"\n`{spec}`: results of an earlier run of the same samples and settings, not re-run here ({why})")
        else:
            lines.append(f"\nSkipped `{spec}`: {why}")
    cfg = doc.get("config", {})
    lines.append(f"\nModel `{cfg.get('model')}`, context {cfg.get('context')} tokens, {cfg.get('samples')} samples "
                 f"per task, {'query-aware' if cfg.get('query_aware') else 'query-agnostic'}; KV bytes are the sum "
                 "of tensor nbytes each cache holds after prefill; vs full = the full cache's measured bytes (the model's "
                 "dtype) / measured bytes; ratio vs fp16 = fp16 full-cache bytes / measured bytes; "
                 "bits/elem = 8 x KV bytes / (2 x layers x kv_heads x head_dim x tokens) = 16 / ratio, over every "
                 "token of the context prefilled, so for eviction methods it is per element of the full context "
                 "(what a token of context costs), not per element kept.")
    if with_fidelity:
        lines.append("attn err = the fidelity check (math dictionary §26): the largest relative attention-output error "
                     "of the prompt's last 8 queries over the compressed prompt, over layers and samples, measured at "
                     "prefill; past 0.5 the cache warns (strict=True raises); `-`: not measured (full precision, "
                     "peers' caches, rows of earlier runs).")
    if with_eviction:
        lines.append("evicted attn = the eviction check (math dictionary §26.1): the share of the attention of the "
                     "prompt's last 8 queries on the slots KVzip dropped, the mean over the evicting layers, the "
                     f"largest over samples; past {EVICTION_THRESHOLD} (times the share of full-attention layers on a "
                     "hybrid model) the cache warns (strict=True raises); `-`: no "
                     "KVzip eviction, or precision tiers (evicted tokens kept at low precision, not dropped).")
    if with_cost:
        lines.append("prefill cost = time of the method's prefill over a plain prefill (transformers DynamicCache, "
                     "no hooks) of the same ids, run just before it in the same sample (retrieval tasks); `full` is "
                     "that plain prefill (1x by construction); KVzip: its context prefill + reconstruction pass over "
                     "its own context prefill, in every task; a preset or plan that runs no such pass (KVzap): its "
                     "prefill over a plain prefill of the same ids timed right after it, in every task; `-`: not "
                     "measured (rows of runs before the measurement).")
    depth = depth_table(doc)
    if depth:
        lines.append("\n" + depth)
    longgen = longgen_table(doc)
    if longgen:
        lines.append("\n" + longgen)
    if "ppl" in tasks:
        lines.append("KL = mean over continuation positions and windows of KL(P_full || P_method) of the "
                     "next-token distribution (softmax of the logits, whole vocabulary); `-`: not measured "
                     "(results saved before KL was reported).")
    return "\n".join(lines)


DEPTH_BINS = (0.0, 0.2, 0.4, 0.6, 0.8, 1.0001)
"""Needle-depth bins of :func:`depth_table` (fraction of the context before the needle)."""


def depth_table(doc: dict) -> str:
    """Accuracy per retrieval task and needle depth bin (``""`` when no sample has a depth).

    One row per method, one column per (task, depth bin); each cell is ``accuracy (samples)``.
    """
    methods = list(doc["methods"].values())
    cols = []
    for m in methods:
        for t, te in m["tasks"].items():
            if t == "ppl" or not any(s.get("depth") is not None for s in te.get("samples", [])):
                continue
            for i in range(len(DEPTH_BINS) - 1):
                if (t, i) not in cols:
                    cols.append((t, i))
    if not cols:
        return ""

    def label(i: int) -> str:
        return f"{DEPTH_BINS[i]:.0%}-{min(DEPTH_BINS[i + 1], 1.0):.0%}"

    head = ["method"] + [f"{t} {label(i)}" for t, i in cols]
    lines = ["Accuracy by needle depth (share of the context before the needle; cell: accuracy (samples)):", "",
             "| " + " | ".join(head) + " |", "|" + "---|" * len(head)]
    for m in methods:
        row = [f"`{m['spec']}`"]
        for t, i in cols:
            got = [s["score"] for s in m["tasks"].get(t, {}).get("samples", [])
                   if s.get("depth") is not None and DEPTH_BINS[i] <= s["depth"] < DEPTH_BINS[i + 1]]
            row.append(f"{sum(got) / len(got):.0%} ({len(got)})" if got else "-")
        lines.append("| " + " | ".join(row) + " |")
    return "\n".join(lines)


def _plain_log_labels(axis: Any) -> None:
    """Label a log-scaled matplotlib axis with plain numbers (``20``, ``0.5``), not ``2×10^1``.

    Minor ticks are labelled only at 2, 3 and 5 times a power of ten, and only while the
    axis spans at most two decades, so that labels do not run into each other.
    """
    from matplotlib.ticker import FuncFormatter

    def minor(value: float, _pos: Any) -> str:
        lo, hi = axis.get_view_interval()
        lead = round(value / 10 ** math.floor(math.log10(value)))
        return f"{value:g}" if hi <= 100 * lo and lead in (2, 3, 5) else ""

    axis.set_major_formatter(FuncFormatter(lambda value, _pos: f"{value:g}"))
    axis.set_minor_formatter(FuncFormatter(minor))


def pareto_plot(doc: dict, path: str | Path) -> Path:
    """One panel per task: quality against measured KV bytes; ours as circles, peers as triangles."""
    from matplotlib.backends.backend_agg import FigureCanvasAgg
    from matplotlib.figure import Figure

    methods = [m for m in doc["methods"].values() if m.get("kv_bytes")]
    tasks: list[str] = []
    for m in methods:
        tasks += [t for t in m["tasks"] if t not in tasks]
    tasks = tasks or ["ppl"]
    panels = len(tasks) + (LONGGEN in tasks)  # longgen adds its memory over the steps
    fig = Figure(figsize=(max(7.0, 6.0 * panels), 5.0))
    FigureCanvasAgg(fig)
    for i, task in enumerate(tasks):
        ax = fig.add_subplot(1, panels, i + 1)
        points = []
        for m in methods:
            te = m["tasks"].get(task, {})
            x = te.get("max_bytes") if task == LONGGEN else m["kv_bytes"]  # longgen: the most held while decoding
            if te.get("score") is not None and x:
                points.append((x / 2**20, te["score"], m))
        # Stagger labels of nearby points so they stay readable.
        points.sort(key=lambda p: (p[0], p[1]))
        for j, (x, y, m) in enumerate(points):
            peer = m["family"] != "ours"
            ax.scatter(x, y, marker="^" if peer else "o", s=55, zorder=3,
                       color="tab:red" if peer else ("black" if m["spec"] == "full" else "tab:blue"))
            ax.annotate(m["spec"], (x, y), fontsize=7, xytext=(4, 4 + 9 * (j % 3)), textcoords="offset points",
                        arrowprops={"arrowstyle": "-", "lw": 0.4, "color": "0.6"})
        ax.set_xscale("log")
        _plain_log_labels(ax.xaxis)
        if task in ("ppl", LONGGEN):
            ax.set_yscale("log")  # one bad configuration must not flatten the rest
            _plain_log_labels(ax.yaxis)
        ax.set_xlabel("largest KV bytes held over the steps (MiB, log)" if task == LONGGEN
                      else "KV bytes held after prefill (MiB, log)")
        ax.set_ylabel("perplexity of the generated part (log, lower is better)" if task == LONGGEN else
                      "perplexity (log, lower is better)" if task == "ppl" else "accuracy (higher is better)")
        ax.set_title(task)
        ax.grid(True, which="both", alpha=0.3)
    if LONGGEN in tasks:
        plot_memory(fig.add_subplot(1, panels, panels), doc)
    fig.suptitle("kv_cache: quality vs measured KV memory (circles: kv_cache, triangles: peers)", fontsize=9)
    fig.tight_layout()
    path = Path(path)
    fig.savefig(path, dpi=110)
    return path


PLOT_EXTRA = "pip install 'kv_cache[plot]'"
"""What draws ``pareto.png``: matplotlib, in the ``plot`` extra (``make demo`` installs it)."""


def write_reports(doc: dict, out_dir: str | Path) -> dict[str, Any]:
    """Write ``results.md`` and ``pareto.png`` next to ``results.json``; return their paths
    (``plot`` None, and ``plot_missing`` saying how to get it, without matplotlib)."""
    import importlib.util

    out = Path(out_dir)
    md = out / "results.md"
    md.write_text(markdown_table(doc) + "\n")
    if importlib.util.find_spec("matplotlib") is None:
        return {"markdown": md, "plot": None, "plot_missing": f"not drawn: matplotlib is not installed ({PLOT_EXTRA})",
                "json": out / "results.json"}
    png = pareto_plot(doc, out / "pareto.png")
    return {"markdown": md, "plot": png, "json": out / "results.json"}
