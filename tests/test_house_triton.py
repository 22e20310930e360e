"""``triton`` is optional and declared: the package imports and computes without it (the Triton
kernels are imported lazily, only by :func:`kv_cache.kernels._select.triton_module`), CUDA tensors
then fall back to the torch reference with one warning that says how to install it, forcing
``KV_CACHE_KERNELS=triton`` fails with that advice, and every third-party package ``kv_cache``
imports is declared for users (core or a user-facing extra: ``triton`` for the Triton kernels),
not only in the ``test`` extra."""

from __future__ import annotations

import ast
import os
import re
import subprocess
import sys
import textwrap
import tomllib
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
SRC = REPO / "src" / "kv_cache"
PROJECT = tomllib.loads((REPO / "pyproject.toml").read_text())["project"]
IMPORT_TO_DIST = {"yaml": "pyyaml", "lm_eval": "lm-eval", "prometheus_client": "prometheus-client"}
BROUGHT_BY_THE_USER = {"vllm", "kvpress"}  # see OPTIONAL in test_dependencies.py


def _name(req: str) -> str:
    return re.split(r"[<>=!~;\[ ]", req, maxsplit=1)[0].strip().lower()


def _imports(tree: ast.AST) -> list[str]:
    out = []
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            out += [a.name for a in node.names]
        elif isinstance(node, ast.ImportFrom) and node.level == 0 and node.module:
            out.append(node.module)
    return out


def test_every_import_is_declared_for_users_not_only_for_tests():
    user_facing = {_name(r) for r in PROJECT["dependencies"]}
    user_facing |= {_name(r) for extra, reqs in PROJECT["optional-dependencies"].items() if extra != "test"
                    for r in reqs}
    missing = {}
    for f in SRC.rglob("*.py"):
        for mod in _imports(ast.parse(f.read_text())):
            top = mod.split(".")[0]
            if top in sys.stdlib_module_names or top == "kv_cache":
                continue
            dist = IMPORT_TO_DIST.get(top, top).lower()
            if dist not in user_facing and dist not in BROUGHT_BY_THE_USER:
                missing.setdefault(dist, []).append(str(f.relative_to(SRC)))
    assert not missing, f"imported at run time but declared for no user (only in `test`?): {missing}"
    assert "triton" in {_name(r) for r in PROJECT["optional-dependencies"]["triton"]}


def test_only_the_selector_imports_the_triton_kernels():
    """Outside ``kernels/triton/`` nothing imports ``triton`` or ``kv_cache.kernels.triton`` by name:
    the selector imports it with importlib, on first use, and catches its failure."""
    offenders = []
    for f in SRC.rglob("*.py"):
        if f.is_relative_to(SRC / "kernels" / "triton"):
            continue
        tree = ast.parse(f.read_text())
        names = _imports(tree)
        names += [f".{n.module}" for n in ast.walk(tree)
                  if isinstance(n, ast.ImportFrom) and n.level and n.module and n.module.split(".")[0] == "triton"]
        names += [a.name for n in ast.walk(tree) if isinstance(n, ast.ImportFrom) and n.level
                  for a in n.names if a.name == "triton"]
        if any(n.split(".")[0] in ("triton", ".triton") or n.startswith("kv_cache.kernels.triton") for n in names):
            offenders.append(str(f.relative_to(SRC)))
    assert not offenders


def _without_triton(body: str, **env: str) -> subprocess.CompletedProcess:
    """``body`` in a child process where ``import triton`` fails, as on a machine without it."""
    code = "import sys\nsys.modules['triton'] = None  # import triton -> ImportError\n" + textwrap.dedent(body)
    child_env = {k: v for k, v in os.environ.items() if k not in ("KV_CACHE_KERNELS", "TRITON_INTERPRET")}
    return subprocess.run([sys.executable, "-c", code], cwd=REPO, env={**child_env, **env},
                          capture_output=True, text=True, timeout=300)


def test_the_package_works_without_triton_and_cuda_falls_back_with_advice():
    run = _without_triton("""
        import logging
        import torch
        import kv_cache
        from kv_cache.kernels import _select, dequantize_block, quantize_block

        records = []
        handler = logging.Handler()
        handler.emit = records.append
        logging.getLogger("kv_cache.kernels").addHandler(handler)
        x = torch.randn(2, 32, 64)
        y = dequantize_block(quantize_block(x, 8, "token", 32))  # computes on the CPU
        assert (y - x).abs().max() < 0.05
        assert "triton" not in [m for m in sys.modules if sys.modules[m] is not None]
        assert _select.backend("cuda") == "torch" and _select.backend("cuda") == "torch"
        (warning,) = [r.getMessage() for r in records]  # one warning, however often it is asked
        assert "Triton is not usable" in warning and "pip install 'kv_cache[triton]'" in warning, warning
        print("ok")
    """)
    assert run.returncode == 0 and run.stdout.strip() == "ok", run.stderr[-3000:]


def test_forcing_triton_without_it_says_how_to_install_it():
    run = _without_triton("""
        from kv_cache.kernels import _select

        try:
            _select.backend("cpu")
        except RuntimeError as exc:
            print(exc)
    """, KV_CACHE_KERNELS="triton")
    assert run.returncode == 0, run.stderr[-3000:]
    assert "KV_CACHE_KERNELS=triton but Triton cannot be imported" in run.stdout
    assert "pip install 'kv_cache[triton]'" in run.stdout
