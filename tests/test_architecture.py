"""The package layers (``[tool.importlinter]`` in pyproject.toml): each package of ``kv_cache``
imports only the packages below it, with no cycle between packages.

The contract runs on the real tree, and on a throwaway package with one upward import, to show
that the same contract type fails there.
"""

from __future__ import annotations

import sys
import textwrap
from pathlib import Path

import pytest

importlinter = pytest.importorskip("importlinter", reason="the test extra installs import-linter")
from importlinter.cli import lint_imports  # noqa: E402

REPO = Path(__file__).resolve().parents[1]


def test_every_package_imports_only_the_layers_below_it():
    assert lint_imports(config_filename=str(REPO / "pyproject.toml"), no_cache=True) == 0


def test_the_contract_fails_on_an_upward_import(tmp_path, monkeypatch):
    pkg = tmp_path / "layered"
    for name, body in {"__init__.py": "", "top.py": "from . import bottom\n",
                       "bottom.py": "from . import top  # upward\n"}.items():
        (pkg / name).parent.mkdir(parents=True, exist_ok=True)
        (pkg / name).write_text(body)
    config = tmp_path / "contract.toml"
    config.write_text(textwrap.dedent("""
        [tool.importlinter]
        root_package = "layered"

        [[tool.importlinter.contracts]]
        name = "layers"
        type = "layers"
        layers = ["layered.top", "layered.bottom"]
    """))
    monkeypatch.syspath_prepend(str(tmp_path))
    monkeypatch.chdir(tmp_path)
    assert lint_imports(config_filename=str(config), no_cache=True) == 1
    sys.modules.pop("layered", None)


@pytest.mark.parametrize("old, new", [
    ("kv_cache.cache.fidelity", "kv_cache.attention.fidelity"),
    ("kv_cache.cache.key_offset", "kv_cache.attention.key_offset"),
    ("kv_cache.codec.calibrate", "kv_cache.plan.codec_calibration"),
    ("kv_cache.eval.methods", "kv_cache.spec.grammar"),
    ("kv_cache.eval.plan_methods", "kv_cache.spec.plans"),
    ("kv_cache.eval.fp8", "kv_cache.spec.hf_fp8"),
])
def test_old_import_paths_still_work_and_warn(old, new):
    import importlib

    sys.modules.pop(old, None)
    with pytest.warns(DeprecationWarning, match=new):
        mod = importlib.import_module(old)
    target = importlib.import_module(new)
    public = [k for k in vars(target) if not k.startswith("__")]
    assert public and all(getattr(mod, k) is getattr(target, k) for k in public)
