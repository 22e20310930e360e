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


def is_conversion(folder: Path) -> bool:
    """Return True if ``folder`` was written by :func:`convert_gguf_to_hf` (it holds the marker file)."""
    return (folder / _CONVERSION_MARKER).is_file()


def is_converted(folder: Path, source_sha256: str) -> bool:
    """Return True if ``folder`` holds a complete conversion of the GGUF with ``source_sha256``."""
    marker = _read_marker(folder)
    return (
        marker is not None
        and marker.get("format") == _CONVERSION_FORMAT
        and marker.get("source_sha256") == source_sha256
        and (folder / "config.json").is_file()
        and (folder / "tokenizer.json").is_file()
        and (folder / "tokenizer_config.json").is_file()
        and any(folder.glob("*.safetensors"))
    )


_SPECIAL_TOKENS = ("bos_token", "eos_token", "unk_token", "pad_token")


def _token_text(value: Any) -> str | None:
    """A special token as saved in ``tokenizer_config.json``: a string or an AddedToken dict."""
    if isinstance(value, str):
        return value
    if isinstance(value, dict) and isinstance(value.get("content"), str):
        return value["content"]
    return None


def load_converted_tokenizer(folder: Path) -> Any:
    """Load the tokenizer of a converted folder straight from its ``tokenizer.json``.

    ``AutoTokenizer`` picks a tokenizer class from ``tokenizer_config.json`` and the model
    type, and some transformers releases then rebuild the tokenizer from its vocabulary
    with the model type's default pre-tokenizer (for a Llama-type model, a sentencepiece
    one), which turns every space of a byte-level BPE text into ``<|endoftext|>``. The
    converted folder's ``tokenizer.json`` is complete (pre-tokenizer, decoder, post-processor
    and added tokens, exactly as :func:`~kv_cache.models.tokenizer.gguf_tokenizer` built
    them), so it is loaded as it is, with the special tokens and the chat template saved
    beside it; the result is the same token ids under every transformers release.
    """
    from transformers import PreTrainedTokenizerFast

    try:
        config = json.loads((folder / "tokenizer_config.json").read_text(encoding="utf-8"))
    except (OSError, ValueError):
        config = {}
    if not isinstance(config, dict):
        config = {}
    specials = {name: _token_text(config.get(name)) for name in _SPECIAL_TOKENS}
    template_file = folder / "chat_template.jinja"
    chat_template = (
        template_file.read_text(encoding="utf-8") if template_file.is_file() else config.get("chat_template")
    )
    # No name_or_path at construction: for a vocabulary over 100,000 tokens (Qwen2.5's 151,936)
    # transformers 5.2 then asks the hub whether the name is a Mistral model, which fails offline
    # on a local path. The folder is recorded once the tokenizer is built.
    tokenizer = PreTrainedTokenizerFast(
        tokenizer_file=str(folder / "tokenizer.json"),
        chat_template=chat_template,
        clean_up_tokenization_spaces=False,
        **{name: token for name, token in specials.items() if token is not None},
    )
    tokenizer.name_or_path = str(folder)
    return tokenizer


def _dequantized_gguf_model(gguf_path: Path) -> Any:
    """Load ``gguf_path`` with transformers as a plain float32 model, free of any GGUF quantizer.

    transformers 5.2 dequantizes a GGUF file into an ordinary model; later releases (5.24)
    keep a GGUF "quantizer" on the model, which refuses ``save_pretrained``, and may keep
    the weights in packed GGUF blocks when a matmul kernel is installed. So the weights are
    loaded with dequantization forced where the release supports asking for it, then copied
    into a fresh model built from the same configuration (no quantization entry), with a
    strict ``load_state_dict`` that fails rather than save anything packed.
    """
    import transformers
    from transformers import AutoModelForCausalLM

    kwargs: dict[str, Any] = {}
    gguf_config = getattr(transformers, "GgufConfig", None)  # absent from 5.2, present in 5.24
    if gguf_config is not None:
        kwargs["quantization_config"] = gguf_config(dequantize=True)
    loaded = AutoModelForCausalLM.from_pretrained(
        str(gguf_path.parent), gguf_file=gguf_path.name, dtype=torch.float32, **kwargs
    )
    config = loaded.config
    if getattr(config, "quantization_config", None) is not None:
        del config.quantization_config
    model = AutoModelForCausalLM.from_config(config, dtype=torch.float32)
    with torch.no_grad():
        model.load_state_dict(loaded.state_dict(), strict=True)
    model.generation_config = loaded.generation_config
    return model


def convert_gguf_to_hf(gguf_path: Path, out_dir: Path, source_sha256: str) -> None:
    """Dequantize ``gguf_path`` to float32 and save it, with its tokenizer, at ``out_dir``.

    The folder is written under a temporary name and renamed into place, so an
    interrupted conversion leaves no half-written ``out_dir``.
    """
    t0 = time.perf_counter()
    log.info("converting %s to float32 safetensors (about 20 s, done once)", gguf_path)
    model = _dequantized_gguf_model(gguf_path)
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
