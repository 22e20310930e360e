"""Every code block of README.md and of the docs pages it maps runs, as written or as a stated
small variant.

The fenced blocks of each page in :data:`PAGES` are extracted in order and each becomes one test:

* ```python blocks run in a subprocess with this interpreter;
* ```bash / ```sh blocks run command by command (a ``\\``-continued line is one command) with
  this environment's ``bin/`` first on ``PATH``; ``make <target>`` is checked with
  ``make -n <target>`` (the target exists and its recipe expands), and ``pip install`` lines
  are not run (they build the environment this test runs in);
* ```text blocks are output, not code; a block in any other language (or none) fails the test.

Each block runs in a fresh directory that looks like the repository root (``profiles/``,
``tests/``, ``benchmarks/`` linked in, ``../shared`` linking the shared data) and holds
``doc.txt``, the document the examples name. Blocks do not depend on each other.

Commands that take minutes on SmolLM2 run as the small variant in :data:`VARIANTS` (the same
command on stories260K or with fewer samples), and the blocks and commands this test cannot run
are named in :data:`NOT_RUN` with the reason. Both tables are checked against the pages, so an
entry that no longer matches anything fails instead of going stale. A block that loads SmolLM2
is marked ``slow``.
"""

from __future__ import annotations

import os
import re
import shlex
import subprocess
import sys
from dataclasses import dataclass
from pathlib import Path

import pytest

from kv_cache.models import shared_data_dir

ROOT = Path(__file__).resolve().parents[1]
README = ROOT / "README.md"
PAGES = (README, *(ROOT / "docs" / f"{name}.md" for name in ("usage", "policies", "models", "compress-once", "serve", "gpu")))
"""The README and the docs pages that hold its former sections: every code block of each runs here."""
BIN = Path(sys.executable).parent
TIMEOUT_S = 600

DOC = ("Lily had a red ball. She played with it in the park every day. One day the ball rolled into the pond. "
       "Her friend Tom helped her get it back, and they played together until the sun went down. ") * 2
"""``doc.txt`` of the examples: a short story stories260K knows the words of (well within its positions,
KVzip's reconstruction pass included)."""

NOT_RUN: dict[str, str] = {
    "pip install torch==2.13.0": "installs packages: this test runs in the environment they build (make setup)",
    'pip install -e ".[test,peers,serve,lm-eval]"': "installs packages: this test runs in the environment they "
                                                     "build (make setup)",
    "kvcache serve --model smollm2 --store contexts/ --port 8000 --api-key K": "starts a server that runs until "
        "stopped; tests/test_serve.py starts the same app on stories260K and drives it with the openai client",
    "import httpx, openai": "talks to the server of the block above, which this test does not start; "
                            "tests/test_serve.py makes these calls (contexts, chat completions with context_id)",
    "benchmarks/gpu_check.sh": "needs a CUDA device; tests/test_triton_kernels.py runs the kernels under Triton's "
                               "interpreter, and tests marked cuda run where a device exists",
}
"""Commands (or a python block's first line) this test does not run, and why."""

VARIANTS: dict[str, str] = {
    # doc.txt is ~90 tokens: its exact tokens and per-component parameters alone exceed fp16 / 20
    "kvcache compress --model smollm2 doc.txt -o doc.kvc --file-ratio 20":
        "kvcache compress --model smollm2 doc.txt -o doc.kvc --file-ratio 2",
    "kvcache plan --model smollm2 --ratio 8 -o plan.json":
        "kvcache plan --model stories260K --ratio 4 --context 400 -o plan.json",
    "kvcache eval --model smollm2 --text ../shared/data/wikitext-2-raw/wiki.test.raw --tasks ppl,needle "
    '--methods "full,q4d,8x,q4+kvzip@0.3,hf-quanto-int4" --samples 8 --context 2048 --out runs/wiki2k':
        "kvcache eval --model stories260K --text ../shared/data/wikitext-2-raw/wiki.test.raw --tasks ppl,needle "
        '--methods "full,q4d,4x,q4+kvzip@0.3" --samples 1 --context 256 --continuation 64 --out runs/wiki2k --quiet',
    "kvcache allocate --model smollm2 --average-bits 3.0 --out k3.json":
        "kvcache allocate --model stories260K --average-bits 3.0 --prefix 96 --continuation 32 --windows 1 "
        "--out k3.json",
    "kvcache allocate --average-bits 2.33 --costs-from k3.json --out k2.json":
        "kvcache allocate --model stories260K --average-bits 2.33 --costs-from k3.json --out k2.json",
}
"""Long-running commands (minutes on SmolLM2, on 2 cores) -> the variant this test runs instead."""


@dataclass(frozen=True)
class Block:
    lang: str
    code: str
    line: int  # 1-based line of the opening fence
    section: str = ""  # the heading the block sits under
    index: int = 1  # its place among the section's blocks
    page: str = "README.md"  # the file, relative to the repository root

    @property
    def name(self) -> str:
        """A test id that survives edits elsewhere in the page: page, section slug, block number, language."""
        slug = re.sub(r"[^a-z0-9]+", "-", self.section.lower()).strip("-") or "top"
        prefix = "" if self.page == "README.md" else Path(self.page).stem + ":"
        return f"{prefix}{slug}-{self.index}-{self.lang}"

    def commands(self) -> list[str]:
        """The shell commands of a bash block: continuations joined, comments and blank lines dropped."""
        out, pending = [], ""
        for raw in self.code.splitlines():
            line = pending + raw.strip()
            if line.endswith("\\"):
                pending = line[:-1].rstrip() + " "
                continue
            pending = ""
            words = shlex.split(line, comments=True)
            if words:
                out.append(_strip_comment(line))
        if pending:
            raise ValueError(f"README block at line {self.line}: a command ends with a continuation")
        return out


def _strip_comment(line: str) -> str:
    """``line`` without a trailing ``# comment``: the shell's rule, a ``#`` starting a word outside quotes."""
    quote = None
    for i, ch in enumerate(line):
        if quote:
            quote = None if ch == quote else quote
        elif ch in "'\"":
            quote = ch
        elif ch == "#" and (i == 0 or line[i - 1].isspace()):
            return line[:i].rstrip()
    return line.rstrip()


def readme_blocks(text: str | None = None, page: Path = README) -> list[Block]:
    """Every fenced block of ``page`` (or of ``text``), in order."""
    text = page.read_text() if text is None else text
    where = str(page.relative_to(ROOT))
    blocks, lang, start, body, section, count = [], None, 0, [], "", 0
    for i, line in enumerate(text.splitlines(), 1):
        if lang is None:
            if line.startswith("#"):
                section, count = line.lstrip("#").strip(), 0
            m = re.match(r"^```(\S*)\s*$", line)
            if m:
                lang, start, body = m.group(1), i, []
        elif line.strip() == "```":
            count += 1
            blocks.append(Block(lang, "\n".join(body) + "\n", start, section, count, where))
            lang = None
        else:
            body.append(line)
    if lang is not None:
        raise ValueError(f"{where}: the block opened at line {start} is not closed")
    return blocks


BLOCKS = [b for page in PAGES for b in readme_blocks(page=page)]
CODE = [b for b in BLOCKS if b.lang != "text"]


def _first_line(block: Block) -> str:
    return next(line.strip() for line in block.code.splitlines() if line.strip())


def _uses_smollm2(block: Block) -> bool:
    if block.lang == "python":
        return 'load_model("smollm2")' in block.code
    return any("smollm2" in VARIANTS.get(c, c) and c not in NOT_RUN for c in block.commands()
               if not c.startswith(("make ", "pip ")))


def _params():
    for b in CODE:
        marks = [pytest.mark.slow] if _uses_smollm2(b) else []
        yield pytest.param(b, id=b.name, marks=marks)


@pytest.fixture
def workdir(tmp_path: Path) -> Path:
    """A directory laid out like the repository root, with ``doc.txt`` and ``../shared``."""
    repo = tmp_path / "repo"
    repo.mkdir()
    for name in ("profiles", "tests", "benchmarks"):
        (repo / name).symlink_to(ROOT / name)
    (tmp_path / "shared").mkdir()
    (tmp_path / "shared" / "data").symlink_to(shared_data_dir())
    (repo / "doc.txt").write_text(DOC)
    return repo


def _env() -> dict[str, str]:
    env = dict(os.environ)
    env["PATH"] = f"{BIN}{os.pathsep}{env.get('PATH', '')}"
    env.setdefault("HF_HUB_DISABLE_PROGRESS_BARS", "1")
    env.setdefault("TRANSFORMERS_VERBOSITY", "error")
    env.setdefault("MPLBACKEND", "Agg")
    return env


def _check(proc: subprocess.CompletedProcess, what: str) -> None:
    if proc.returncode != 0:
        raise AssertionError(f"{what} failed (exit {proc.returncode})\n--- stdout\n{proc.stdout[-4000:]}\n"
                             f"--- stderr\n{proc.stderr[-4000:]}")


def test_blocks_are_code_or_output():
    """Every block says what it is: runnable python / bash / sh, or ```text output."""
    assert {b.page for b in CODE} == {str(p.relative_to(ROOT)) for p in PAGES}, "a page in PAGES has no code block"
    bad = [b.name for b in BLOCKS if b.lang not in ("python", "bash", "sh", "text")]
    assert not bad, f"blocks without a known language (python, bash, sh, text): {bad}"


def test_not_run_and_variants_name_readme_commands():
    """Every entry of NOT_RUN and VARIANTS matches a command (or python block) of a page."""
    commands = {c for b in CODE if b.lang != "python" for c in b.commands()}
    firsts = {_first_line(b) for b in CODE if b.lang == "python"}
    stale = [k for k in NOT_RUN if k not in commands and k not in firsts] + [k for k in VARIANTS if k not in commands]
    assert not stale, f"entries naming no command of the pages (update tests/test_readme.py): {stale}"
    assert not set(NOT_RUN) & set(VARIANTS)


def test_command_splitting():
    b = Block("bash", 'make demo   # a comment\nkvcache eval --methods "a,b#c" \\\n  --out x  # done\n\n', 1)
    assert b.commands() == ["make demo", 'kvcache eval --methods "a,b#c" --out x']


@pytest.mark.parametrize("block", list(_params()))
def test_readme_block_runs(block: Block, workdir: Path):
    _run_block(block, workdir)


def test_a_failing_block_fails_the_test(workdir: Path):
    for block in (Block("python", "import sys\nsys.exit(3)\n", 1), Block("bash", "true\nfalse  # fails\n", 1),
                  Block("bash", "make no-such-target\n", 1)):
        with pytest.raises(AssertionError, match="failed"):
            _run_block(block, workdir)


def _run_block(block: Block, workdir: Path) -> None:
    env = _env()
    if block.lang == "python":
        first = _first_line(block)
        if first in NOT_RUN:
            return  # named, with its reason, in NOT_RUN (checked by the test above)
        script = workdir / "block.py"
        script.write_text(block.code)
        proc = subprocess.run([sys.executable, str(script)], cwd=workdir, env=env, capture_output=True, text=True,
                              timeout=TIMEOUT_S)
        _check(proc, f"{block.page} python block at line {block.line}")
        return
    for command in block.commands():
        words = shlex.split(command)
        if command in NOT_RUN or words[:2] == ["pip", "install"]:
            assert command in NOT_RUN, f"{command!r}: pip install lines must be named in NOT_RUN"
            continue
        if words[0] == "make":
            assert len(words) == 2, f"{command!r}: one make target per line"
            proc = subprocess.run(["make", "-n", words[1]], cwd=ROOT, env=env, capture_output=True, text=True,
                                  timeout=60)
            _check(proc, f"make -n {words[1]} ({block.page} line {block.line})")
            continue
        run = VARIANTS.get(command, command)
        proc = subprocess.run(["bash", "-c", run], cwd=workdir, env=env, capture_output=True, text=True,
                              timeout=TIMEOUT_S)
        _check(proc, f"{block.page} command {run!r} (block at line {block.line})")


@pytest.mark.parametrize("page", PAGES, ids=lambda p: p.name)
def test_no_placeholders_left(page: Path):
    assert not re.search(r"\bTBD\b|PRESET_(TABLE|NOTE)|\bTODO\b", page.read_text())


def test_spec_table_lists_every_form_and_letter(monkeypatch):
    """The method-spec table is the grammar of kv_cache.spec.grammar: every quantization letter and
    every non-policy form has a row, and every example in the table parses."""
    from kv_cache.spec.grammar import METHOD_GRAMMAR, QUANT_OPTIONS, parse_method
    from kv_cache.policies import POLICIES

    text = (ROOT / "docs" / "usage.md").read_text()
    section = text[text.index("## Method specs"):]
    section = section[:section.index("\n## ", 1)]
    rows = [line for line in section.splitlines() if line.startswith("| `")]
    first_cells = " ".join(row.split(" | ")[0] for row in rows)
    for option in QUANT_OPTIONS[1:]:
        assert f"`…{option.letter}" in first_cells, f"no row for the quantization letter {option.letter!r}"
    for form in METHOD_GRAMMAR:
        if form.family == "ours" and "@<budget>" in form.grammar:
            policy_row = next(row for row in rows if row.startswith("| `<policy>@<budget>"))
            for name in POLICIES:
                assert f"`{name}`" in policy_row, f"the policy row does not name {name!r}"
            continue
        if form.grammar.startswith("q<bits>"):
            assert "`q<bits>`" in first_cells and "`q<bits>d`" in first_cells  # its letters: checked above
            continue
        if form.family == "hf" and form.grammar != "hf-fp8":
            assert form.grammar.replace("|", "\\|") in first_cells, form.grammar
        elif form.family == "kvpress":
            assert "`kvpress-[adakv-]<press>@<kept>`" in first_cells
        else:
            assert f"`{form.grammar}`" in first_cells, form.grammar
    examples = [e for row in rows for e in re.findall(r"`([^`]+)`", row.split(" | ")[-1])]
    assert len(examples) >= 20
    monkeypatch.chdir(ROOT)  # profiles/... are named from the repository root
    for spec in examples:
        if spec.startswith("plan["):
            continue  # reads the file; tests/test_method_specs.py parses plan files
        parse_method(spec, check_packages=False)
