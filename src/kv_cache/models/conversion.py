"""The conversion cache: a GGUF file dequantized once to a float32 safetensors folder.

A converted folder is trusted only if its marker file, written last, names the current
conversion format and the sha256 of the source GGUF; anything else is rebuilt.
"""

from __future__ import annotations

import json
import logging
import os
import shutil
import tempfile
import time
from pathlib import Path
from typing import Any

import torch

from .tokenizer import gguf_tokenizer

log = logging.getLogger(__name__)

# Written last into a converted folder; a folder without it (or with another format
# number) is treated as absent and rebuilt. Bump the format when the conversion changes.
_CONVERSION_MARKER = "kv_cache_conversion.json"
_CONVERSION_FORMAT = 1


def _read_marker(folder: Path) -> dict[str, Any] | None:
    try:
        marker = json.loads((folder / _CONVERSION_MARKER).read_text(encoding="utf-8"))
    except (OSError, ValueError):
        return None
    return marker if isinstance(marker, dict) else None


def is_converted(folder: Path, source_sha256: str) -> bool:
    """Return True if ``folder`` holds a complete conversion of the GGUF with ``source_sha256``."""
    marker = _read_marker(folder)
    return (
        marker is not None
        and marker.get("format") == _CONVERSION_FORMAT
        and marker.get("source_sha256") == source_sha256
        and (folder / "config.json").is_file()
        and (folder / "tokenizer.json").is_file()
        and any(folder.glob("*.safetensors"))
    )


def convert_gguf_to_hf(gguf_path: Path, out_dir: Path, source_sha256: str) -> None:
    """Dequantize ``gguf_path`` to float32 and save it, with its tokenizer, at ``out_dir``.

    The folder is written under a temporary name and renamed into place, so an
    interrupted conversion leaves no half-written ``out_dir``.
    """
    from transformers import AutoModelForCausalLM

    t0 = time.perf_counter()
    log.info("converting %s to float32 safetensors (about 20 s, done once)", gguf_path)
    model = AutoModelForCausalLM.from_pretrained(str(gguf_path.parent), gguf_file=gguf_path.name, dtype=torch.float32)
    tokenizer = gguf_tokenizer(gguf_path)

    out_dir.parent.mkdir(parents=True, exist_ok=True)
    if out_dir.exists():  # stale or broken: move it aside first so the rename below can succeed
        stale = Path(tempfile.mkdtemp(prefix=f".{out_dir.name}.stale-", dir=out_dir.parent))
        os.replace(out_dir, stale / "old")
        shutil.rmtree(stale, ignore_errors=True)
    tmp = Path(tempfile.mkdtemp(prefix=f".{out_dir.name}.tmp-", dir=out_dir.parent))
    try:
        model.save_pretrained(str(tmp))
        tokenizer.save_pretrained(str(tmp))
        import transformers

        marker = {
            "format": _CONVERSION_FORMAT,
            "source": gguf_path.name,
            "source_sha256": source_sha256,
            "dtype": "float32",
            "transformers": transformers.__version__,
        }
        (tmp / _CONVERSION_MARKER).write_text(json.dumps(marker, indent=2) + "\n", encoding="utf-8")
        tmp.chmod(0o755)  # mkdtemp makes it private
        try:
            os.rename(tmp, out_dir)
        except OSError:
            if not is_converted(out_dir, source_sha256):
                raise
            log.info("another process finished converting %s first; using its copy", out_dir)
    finally:
        shutil.rmtree(tmp, ignore_errors=True)
    log.info("converted %s in %.1f s", out_dir, time.perf_counter() - t0)
