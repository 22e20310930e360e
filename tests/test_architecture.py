"""The package layers (``[tool.importlinter]`` in pyproject.toml): each package of ``kv_cache``
imports only the packages below it, with no cycle between packages.

The contract runs on the real tree, and on a throwaway package with one upward import, to show
that the same contract type fails there. Each run is a child process: import-linter configures
logging (it disables the loggers that exist), which would silence later tests' log checks.
"""

from __future__ import annotations

import sys
import textwrap
from pathlib import Path

import pytest

importlinter = pytest.importorskip("importlinter", reason="the test extra installs import-linter")

REPO = Path(__file__).resolve().parents[1]


def lint_imports(config_filename: str, cwd: Path = REPO, path: Path | None = None) -> int:
    """import-linter's exit status for ``config_filename``, run in a child process."""
    import os
    import subprocess

    env = dict(os.environ)
    if path is not None:
        env["PYTHONPATH"] = os.pathsep.join([str(path), env.get("PYTHONPATH", "")])
    code = ("import sys; from importlinter.cli import lint_imports; "
            f"sys.exit(lint_imports(config_filename={config_filename!r}, no_cache=True))")
    return subprocess.run([sys.executable, "-c", code], cwd=cwd, env=env, capture_output=True).returncode


def test_every_package_imports_only_the_layers_below_it():
    assert lint_imports(str(REPO / "pyproject.toml")) == 0


def test_the_contract_fails_on_an_upward_import(tmp_path):
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
    assert lint_imports(str(config), cwd=tmp_path, path=tmp_path) == 1
    (pkg / "bottom.py").write_text("x = 1\n")  # the upward import removed: kept
    assert lint_imports(str(config), cwd=tmp_path, path=tmp_path) == 0


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
