"""Every relative link of the README and the docs points at a file that exists, and every
``#anchor`` at a heading of that file (GitHub's slugs). Model-free."""

from __future__ import annotations

import re
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
PAGES = sorted([ROOT / "README.md", ROOT / "CHANGELOG.md", *(ROOT / "docs").rglob("*.md"),
                *(ROOT / "benchmarks").rglob("*.md"), *(ROOT / "math_dictionary").rglob("*.md")])
LINK = re.compile(r"\]\(([^)\s]+)\)")


def slug(heading: str) -> str:
    """GitHub's anchor of a heading: lower case, punctuation dropped, spaces to hyphens."""
    text = re.sub(r"[`*]", "", heading.strip().lower())  # GitHub keeps underscores (`kv_cache` -> kv_cache)
    return re.sub(r"[^\w\- ]", "", text).replace(" ", "-")


def anchors(page: Path) -> set[str]:
    found, seen, fence = set(), {}, False
    for line in page.read_text().splitlines():
        if line.startswith("```"):
            fence = not fence
        if fence or not line.startswith("#"):
            continue
        base = slug(line.lstrip("#"))
        n = seen.get(base, 0)
        seen[base] = n + 1
        found.add(base if n == 0 else f"{base}-{n}")
    return found


def links(page: Path) -> list[str]:
    text, out, fence = page.read_text(), [], False
    for line in text.splitlines():
        if line.startswith("```"):
            fence = not fence
        if not fence:
            out += [m for m in LINK.findall(line) if not re.match(r"[a-z]+:", m)]
    return out


def test_slugs_follow_github():
    assert slug("Every family (wave 4): SmolLM2 and Qwen2.5-Coder-0.5B") == "every-family-wave-4-smollm2-and-qwen25-coder-05b"
    assert slug("Drop-in cache for `model.generate`") == "drop-in-cache-for-modelgenerate"
    assert slug("Speed, memory, serving, kernels") == "speed-memory-serving-kernels"
    assert slug("Using `kv_cache` in **vLLM**") == "using-kv_cache-in-vllm"


@pytest.mark.parametrize("page", PAGES, ids=lambda p: str(p.relative_to(ROOT)))
def test_every_relative_link_resolves(page: Path):
    broken = []
    for link in links(page):
        path, _, anchor = link.partition("#")
        target = (page.parent / path).resolve() if path else page
        if not target.exists():
            broken.append(f"{link} (no file)")
        elif anchor and target.suffix == ".md" and anchor not in anchors(target):
            broken.append(f"{link} (no heading)")
    assert not broken, f"{page.relative_to(ROOT)}: {broken}"
