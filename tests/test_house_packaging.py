"""Packaging metadata: the package's metadata builds without setuptools' warnings (the SPDX
``license`` string, not the deprecated ``{text = ...}`` table, which warned three times in every
``make demo``), and ``requires-python`` names the oldest Python the package runs on."""

from __future__ import annotations

import re
import subprocess
import sys
import tomllib
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[1]
PYPROJECT = tomllib.loads((REPO / "pyproject.toml").read_text())


def build_metadata(project: Path, out: Path) -> subprocess.CompletedProcess:
    """setuptools' ``prepare_metadata_for_build_wheel`` of ``project`` into ``out``, every warning shown."""
    code = ("import sys; from setuptools import build_meta; "
            "build_meta.prepare_metadata_for_build_wheel(sys.argv[1])")
    return subprocess.run([sys.executable, "-W", "always", "-c", code, str(out)], cwd=project,
                          capture_output=True, text=True, timeout=120)


def test_metadata_builds_without_a_license_warning(tmp_path):
    setuptools = pytest.importorskip("setuptools")
    if int(setuptools.__version__.split(".")[0]) < 77:
        pytest.skip(f"setuptools {setuptools.__version__} predates SPDX license strings (the build requires >= 77)")
    run = build_metadata(REPO, tmp_path)
    assert run.returncode == 0, run.stderr[-2000:]
    said = [line for line in (run.stdout + run.stderr).splitlines() if "license" in line.lower()]
    assert not said, said
    (meta,) = tmp_path.glob("kv_cache-*.dist-info/METADATA")
    assert "License-Expression: Apache-2.0" in meta.read_text().splitlines()


def test_license_is_an_spdx_string_and_the_build_backend_can_read_it():
    assert PYPROJECT["project"]["license"] == "Apache-2.0"
    (req,) = [r for r in PYPROJECT["build-system"]["requires"] if r.startswith("setuptools")]
    assert req.replace(" ", "") == "setuptools>=77"


def test_requires_python_is_the_floor_the_readme_states():
    """3.11: ``kvcache --config x.toml`` reads the file with ``tomllib`` (3.11's standard library),
    every venv the project builds and tests runs 3.11, and torch 2.15 and transformers >= 5.21 need
    it too. ``test_cli.py::test_config_file`` is the ``--config x.toml`` run on it."""
    assert PYPROJECT["project"]["requires-python"] == ">=3.11"
    readme = (REPO / "README.md").read_text()
    stated = re.findall(r"Python\s*(?:>=|≥)\s*(3\.\d+)", readme)
    assert stated and set(stated) == {"3.11"}, f"README.md states Python >= {stated}; pyproject.toml says >=3.11"
