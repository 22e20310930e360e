"""Every figure the README quotes comes from a committed table (issue 61).

A figure is a number the README's prose gives as a ratio or a change (``3.51x``, ``+0.29%``,
``4.77 bits``): it must stand, as a number of its own (not inside a longer one), in a table
committed under ``docs/results/`` (the current page and its tables; not the archive) or
``benchmarks/results/``. A figure no table holds fails, naming it: quote the table's number, or
commit the table that makes it.
"""

from __future__ import annotations

import re
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
FIGURE = re.compile(r"(?<![\w.])[+\-\u2212]?(\d+(?:,\d{3})*(?:\.\d+)?)(?=\s?(?:%|x\b|bits\b|b/e\b))")


def _tables() -> str:
    paths = [p for d in ("docs/results", "benchmarks/results") for p in (ROOT / d).rglob("*")
             if p.suffix in (".md", ".json") and "archive" not in p.relative_to(ROOT).parts]
    return "\n".join(p.read_text(encoding="utf-8", errors="replace") for p in paths)


def _figures(text: str) -> list[str]:
    prose = re.sub(r"```.*?```", "", text, flags=re.S)
    return sorted({m.group(1).replace(",", "") for m in FIGURE.finditer(prose)})


def _held(number: str, tables: str) -> bool:
    pattern = re.compile(r"(?<![\d.])" + re.escape(number).replace(r"\.", r"\.") + r"(?![\d])")
    if pattern.search(tables) or pattern.search(tables.replace(",", "")):
        return True
    return False


def test_every_readme_figure_stands_in_a_committed_table():
    tables = _tables()
    figures = _figures((ROOT / "README.md").read_text(encoding="utf-8"))
    assert len(figures) >= 20, figures  # the README quotes its results
    missing = [f for f in figures if not _held(f, tables)]
    assert not missing, f"README figures in no committed table (docs/results, benchmarks/results): {missing}"


def test_a_figure_in_no_table_fails():
    tables = "| q4d | 4.77 | +0.29% |"
    assert _figures("held at 4.77 bits, +0.29% and 3.51x the tokens") == ["0.29", "3.51", "4.77"]
    assert _held("4.77", tables) and _held("0.29", tables)
    assert not _held("3.51", tables) and not _held("4.7", tables) and not _held("77", tables)
