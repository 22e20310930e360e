"""The package layout the README describes: the core imports no engine and no integration, the
integrations live together, the command line is one package, and the old import paths still work.
Model-free."""

from __future__ import annotations

import ast
import importlib.util
import subprocess
import sys
from pathlib import Path

import pytest

import kv_cache

PACKAGE = Path(kv_cache.__file__).parent
CORE = ("compression", "kernels", "cache", "attention")
ENGINES = ("vllm", "fastapi", "uvicorn", "lm_eval", "openai")
OUTER = ("integrations", "serve", "cli", "lm_eval_model")  # kv_cache's own modules above the core


def _imports(path: Path) -> list[tuple[int, str]]:
    """``(level, module)`` of every import in ``path`` (level 0: absolute)."""
    out = []
    for node in ast.walk(ast.parse(path.read_text(encoding="utf-8"))):
        if isinstance(node, ast.Import):
            out += [(0, a.name) for a in node.names]
        elif isinstance(node, ast.ImportFrom):
            out.append((node.level, node.module or ""))
            if node.module is None:  # from . import x
                out += [(node.level, a.name) for a in node.names]
    return out


@pytest.mark.parametrize("folder", CORE)
def test_the_core_imports_no_engine_and_no_integration(folder):
    bad = []
    for path in sorted((PACKAGE / folder).rglob("*.py")):
        depth = len(path.relative_to(PACKAGE).parts) - 1  # levels from the file's package to kv_cache
        for level, name in _imports(path):
            top = name.split(".")[0]
            if level == 0 and (top in ENGINES or (top == "kv_cache" and name.split(".")[1:2] and
                                                  name.split(".")[1] in OUTER)):
                bad.append(f"{path.relative_to(PACKAGE)}: import {name}")
            elif level > 0 and level == depth and top in OUTER:
                bad.append(f"{path.relative_to(PACKAGE)}: from {'.' * level}{name}")
    assert not bad, bad


def test_the_command_line_is_one_package():
    assert not sorted(p.name for p in PACKAGE.glob("cli_*.py"))
    assert (PACKAGE / "cli" / "__main__.py").is_file()
    run = subprocess.run([sys.executable, "-m", "kv_cache.cli", "--help"], capture_output=True, text=True,
                         timeout=120)
    assert run.returncode == 0 and "compress" in run.stdout and "serve" in run.stdout, run.stderr


def test_integrations_live_together():
    for name in ("vllm", "serve"):
        assert (PACKAGE / "integrations" / name / "__init__.py").is_file(), name
    assert (PACKAGE / "integrations" / "lm_eval.py").is_file()


@pytest.mark.skipif(importlib.util.find_spec("fastapi") is None, reason="needs kv_cache[serve]")
def test_the_old_server_path_still_imports():
    import kv_cache.integrations.serve as new
    import kv_cache.serve as old

    assert old.build is new.build and old.Limits is new.Limits and set(old.__all__) == set(new.__all__)


@pytest.mark.skipif(importlib.util.find_spec("lm_eval") is None, reason="needs kv_cache[lm-eval]")
def test_the_old_lm_eval_path_still_imports():
    import kv_cache.integrations.lm_eval as new
    import kv_cache.lm_eval_model as old

    assert old.KVCacheLM is new.KVCacheLM and old.cli_main is new.cli_main
