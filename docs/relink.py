#!/usr/bin/env python3
"""Re-point the line links of the formula-to-source pages by content.

docs/kv-compression-formula-to-source.md and its Chinese twin link code lines from their tables
as ``[L46](../src/kv_cache/cache/config.py#L46)``. Line numbers rot whenever code moves, so this
script derives them again from names. In each table cell:

* A *definition link* follows a backticked name with nothing but spaces or a comma between,
  e.g. ``check_layers`` then ``[L359](...)``. It is set to the line where that name is defined
  in the linked file: in Python (read with ``ast``) a ``def`` or ``class`` (nested ones too) or
  an assignment or annotated field at module or class level, else a registry entry whose first
  argument is the quoted name (``QuantOption("e", ...)``); in other files (C++) a function,
  ``struct``/``class``/``enum`` or ``#define``. Only the span's leading identifier counts
  (``QBlock(scale_table=...)`` -> ``QBlock``, ``p[<profile>]`` -> ``p``); for ``Class.method``
  the last part is looked up, preferring a definition inside ``Class``; a plain name prefers a
  module-level definition. Among equal candidates the one nearest the link's old line wins. A
  range ``[L5-L9]`` to a Python definition becomes its whole extent, decorators included.
* An *interior link* has other text between it and the nearest preceding backticked name, e.g.
  ``attend`` ``[L470](...)`` ``(merge [L641](...))``: it points inside that definition and
  moves by as much as the name's definition link earlier in the same cell (same file) moved.

A link's text may carry the file first, ``[`tests/test_x.py` L5-L9](...)``. Links outside tables
(the prose sections, whose ranges frame code excerpts) are counted but not touched. An unknown
name, a missing file or an interior link without an anchor keeps its number and is reported.

Usage::

    python docs/relink.py            # rewrite both pages in place, print what changed
    python docs/relink.py --check    # change nothing; exit 1 if a link would change or is broken
    python docs/relink.py [--check] PAGE...   # other pages instead of the default two

Standard library only.
"""
from __future__ import annotations

import ast
import functools
import re
import sys
from pathlib import Path

DOCS = Path(__file__).resolve().parent
PAGES = (DOCS / "kv-compression-formula-to-source.md", DOCS / "zh" / "kv-compression-formula-to-source.md")

# [L<a>](path#L<a>), [L<a>-L<b>](path#L<a>-L<b>), optionally "`some/file.py` " before the L
LINK = re.compile(r"\[(`[^`]*/[^`]*`\s+)?L\d+(?:-L\d+)?\]\(([^()\s#]+)#L(\d+)(?:-L(\d+))?\)")
ANY_LINK = re.compile(r"\]\([^()\s#]+#L\d+")  # every link into a code line, for the count
SPAN = re.compile(r"`([^`]*)`")
IDENT = re.compile(r"[A-Za-z_][\w.]*")
ATTACHED = re.compile(r"[\s,，]*")  # what may stand between a name and its definition link

Def = tuple  # (name, line, (first line, last line) or None, owning class, None or NESTED)
NESTED = "()"  # the owner of a definition inside a function


@functools.lru_cache(maxsize=None)
def definitions(path: Path) -> tuple[list[Def], list[Def]]:
    """``(defs, registry)`` of a file; registry: calls whose first argument is a string."""
    text = path.read_text(encoding="utf-8")
    if path.suffix != ".py":
        return c_definitions(text), []
    defs: list[Def] = []

    def visit(body: list, owner: str | None) -> None:
        for node in body:
            extent = (min([node.lineno] + [d.lineno for d in getattr(node, "decorator_list", [])]),
                      node.end_lineno)
            if isinstance(node, (ast.ClassDef, ast.FunctionDef, ast.AsyncFunctionDef)):
                defs.append((node.name, node.lineno, extent, owner))
                visit(node.body, node.name if isinstance(node, ast.ClassDef) else NESTED)
            elif isinstance(node, (ast.Assign, ast.AnnAssign)):
                if owner != NESTED:  # a function's locals are not definitions
                    targets = node.targets if isinstance(node, ast.Assign) else [node.target]
                    defs.extend((n.id, node.lineno, extent, owner)
                                for t in targets for n in ast.walk(t) if isinstance(n, ast.Name))
            else:  # if / try / with / for blocks: look inside
                for child in ast.iter_child_nodes(node):
                    if isinstance(child, (ast.stmt, ast.excepthandler)):
                        visit(child.body if isinstance(child, ast.excepthandler) else [child], owner)

    tree = ast.parse(text, str(path))
    visit(tree.body, None)
    registry = [(n.args[0].value, n.lineno, None, None) for n in ast.walk(tree)
                if isinstance(n, ast.Call) and n.args and isinstance(n.args[0], ast.Constant)
                and isinstance(n.args[0].value, str)]
    return defs, registry


C_TYPE = re.compile(r"^\s*(?:#\s*define|(?:typedef\s+)?(?:struct|class|union|enum(?:\s+class)?))\s+(\w+)\b(?!\s*;)")
# a return type (maybe with __attribute__((...))) then the name and "(": no "=", ";", "." or ","
C_FUNC = re.compile(r"^(?!\s*(?:return|else|case|if|while|for|switch|do|delete|throw)\b)"
                    r"[^=;.,(]*(?:\(\(\w+\)\)[^=;.,(]*)?[\w*&>]\s+[*&]*(\w+)\s*\(")


def c_definitions(text: str) -> list[Def]:
    """Function, struct/class/enum and macro definitions of a C/C++ file."""
    out = []
    for i, line in enumerate(text.splitlines(), 1):
        if line.lstrip().startswith(("//", "*", "/*")):
            continue
        m = C_TYPE.match(line) or C_FUNC.match(line)
        if m and not (m.re is C_FUNC and line.rstrip().endswith(";")):  # a prototype or a call
            out.append((m.group(1), i, None, None))
    return out


def resolve(name: str, path: Path, old: int, is_range: bool) -> tuple[int, int | None] | None:
    """``(line, last line or None)`` of the definition of ``name`` nearest ``old``, or None."""
    defs, registry = definitions(path)
    owner, _, leaf = name.rpartition(".")
    owner = owner.rpartition(".")[2]
    named = [d for d in defs if d[0] == leaf]  # inside the named class, else module level, else anywhere
    found = ([d for d in named if owner and d[3] == owner] or [d for d in named if d[3] is None] or named
             or [d for d in registry if d[0] == leaf])
    if not found:
        return None
    start = lambda d: d[2][0] if is_range and d[2] else d[1]  # noqa: E731
    best = min(found, key=lambda d: (abs(start(d) - old), start(d)))
    return (best[2] if is_range and best[2] else (best[1], None))


def cell_start(line: str, pos: int) -> int:
    """Start of the table cell holding ``pos`` (``|`` inside backticks or escaped is no border)."""
    masked = re.sub(r"`[^`]*`|\\\|", lambda m: "x" * len(m.group()), line[:pos])
    return masked.rfind("|") + 1


def relink_line(line: str, page: Path, where: str, problems: list[str], changes: list[str]) -> str:
    """``line`` (a table row) with its links re-pointed; problems and changes are appended."""
    moved: dict[tuple[int, str, Path], int] = {}  # (cell, name, file) -> how far its definition moved
    out, last = [], 0
    for m in LINK.finditer(line):
        prefix, rel, old = m.group(1) or "", m.group(2), int(m.group(3))
        end = int(m.group(4)) if m.group(4) else None
        start = cell_start(line, m.start())
        spans = list(SPAN.finditer(line, start, m.start()))
        ident = IDENT.match(spans[-1].group(1)) if spans else None
        name = ident.group().rstrip(".") if ident else None
        target = (page.parent / rel).resolve()
        new, new_end, label = None, None, f"{where}: `{name}` L{old} ({rel})"
        if not target.is_file():
            problems.append(f"{label}: file not found")
        elif name is None:
            problems.append(f"{where}: L{old} ({rel}): no backticked name before the link")
        elif ATTACHED.fullmatch(line, spans[-1].end(), m.start()):  # a definition link
            found = resolve(name, target, old, end is not None)
            if found is None:
                problems.append(f"{label}: name not defined in the file")
            else:
                new, new_end = found
                moved[(start, name, target)] = new - old
        elif (start, name, target) in moved:  # an interior link
            new = old + moved[(start, name, target)]
        else:
            problems.append(f"{label}: inside `{name}` but no definition link of it before, in this cell")
        if new is None:
            continue
        if end is not None and new_end is None:
            new_end = end + new - old
        text = f"L{new}" if end is None else f"L{new}-L{new_end}"
        if (new, new_end) == (old, end):
            continue
        out += [line[last:m.start()], f"[{prefix}{text}]({rel}#{text})"]
        last = m.end()
        changes.append(f"{label} -> {text}")
    return "".join(out) + line[last:]


def main(argv: list[str]) -> int:
    check = "--check" in argv
    pages = [Path(a).resolve() for a in argv if a != "--check"] or list(PAGES)
    problems: list[str] = []
    changes: list[str] = []
    for page in pages:
        lines = page.read_text(encoding="utf-8").splitlines(keepends=True)
        name = page.relative_to(DOCS).as_posix() if page.is_relative_to(DOCS) else str(page)
        before = len(changes), len(problems)
        new, n_links, n_other = [], 0, 0
        for i, line in enumerate(lines, 1):
            n_other += len(ANY_LINK.findall(line))
            if line.lstrip().startswith("|"):
                n_links += len(LINK.findall(line))
                line = relink_line(line, page, f"{name}:{i}", problems, changes)
            new.append(line)
        if not check and new != lines:
            page.write_text("".join(new), encoding="utf-8")
        print(f"{name}: {n_links} table line links, {len(changes) - before[0]} "
              f"{'would change' if check else 'changed'}, {len(problems) - before[1]} unresolved; "
              f"{n_other - n_links} other line links (prose, other forms) not checked")
    for c in changes:
        print(("  would change " if check else "  ") + c)
    for p in problems:
        print(f"relink: {p}", file=sys.stderr)
    return 1 if check and (changes or problems) else 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
