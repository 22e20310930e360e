"""The import contract (``[tool.importlinter]`` in pyproject.toml) is exhaustive: every top-level
package or module of ``kv_cache`` stands in one of its layers, so a new one cannot land
unconstrained. Checked on the real tree's names, and by running the real contract on a throwaway
``kv_cache`` with one unlisted module added (child processes, as ``test_architecture.py``)."""

from __future__ import annotations

import json
import tomllib
from pathlib import Path

import pytest

pytest.importorskip("importlinter", reason="the test extra installs import-linter")

from test_architecture import lint_imports  # noqa: E402

REPO = Path(__file__).resolve().parents[1]
SRC = REPO / "src" / "kv_cache"


def _contract() -> dict:
    (contract,) = tomllib.loads((REPO / "pyproject.toml").read_text())["tool"]["importlinter"]["contracts"]
    return contract


def _layer_names(contract: dict) -> list[str]:
    return [name.strip() for layer in contract["layers"] for name in layer.split("|")]


def _top_level() -> set[str]:
    return ({p.name for p in SRC.iterdir() if (p / "__init__.py").is_file()}
            | {p.stem for p in SRC.glob("*.py") if p.stem != "__init__"})


def test_the_contract_is_exhaustive_and_names_every_top_level_module():
    contract = _contract()
    assert contract.get("exhaustive") is True and contract.get("containers") == ["kv_cache"]
    names = _layer_names(contract)
    assert len(names) == len(set(names)), "a module stands in two layers"
    assert set(names) == _top_level()


def _write_config(path: Path, contract: dict) -> None:
    # JSON strings, lists and booleans are valid TOML values
    body = "\n".join(f"{k} = {json.dumps(v)}" for k, v in contract.items())
    path.write_text(f'[tool.importlinter]\nroot_package = "kv_cache"\n\n[[tool.importlinter.contracts]]\n{body}\n')


def test_an_unlisted_top_level_module_breaks_the_contract(tmp_path):
    contract = _contract()
    pkg = tmp_path / "kv_cache"
    pkg.mkdir()
    (pkg / "__init__.py").write_text("")
    for name in _layer_names(contract):  # the real layout, empty: one package per layer name
        (pkg / name).mkdir()
        (pkg / name / "__init__.py").write_text("")
    config = tmp_path / "contract.toml"
    _write_config(config, contract)
    assert lint_imports(str(config), cwd=tmp_path, path=tmp_path) == 0
    (pkg / "newcomer.py").write_text("x = 1\n")  # imports nothing: being unplaced alone fails it
    assert lint_imports(str(config), cwd=tmp_path, path=tmp_path) == 1
