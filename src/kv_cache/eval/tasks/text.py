"""Text and tokenizer plumbing shared by the task builders.

Reading and normalising haystack text (CRLF, byte-order mark), encoding it with a Hugging Face
tokenizer, and the argument checks for text, flags and tokenizers.
"""

from __future__ import annotations

import os
from typing import Any

__all__ = ["normalize_text", "read_text"]


def normalize_text(text: str) -> str:
    """Normalise line endings to ``"\\n"`` and drop a leading byte-order mark.

    Parameters
    ----------
    text : str
        Raw text (e.g. WikiText-2 raw files use CRLF).

    Returns
    -------
    str
        Text with ``"\\r\\n"`` and lone ``"\\r"`` replaced by ``"\\n"``.
    """
    return text.lstrip("\ufeff").replace("\r\n", "\n").replace("\r", "\n")


def read_text(path: str | os.PathLike[str]) -> str:
    """Read a UTF-8 text file and normalise it with :func:`normalize_text`.

    Parameters
    ----------
    path : str or os.PathLike
        File to read.

    Returns
    -------
    str
        The normalised file content.
    """
    with open(path, encoding="utf-8", errors="replace", newline="") as fh:
        return normalize_text(fh.read())


def check_text(text: Any, name: str = "text") -> str:
    """Return ``text`` normalised by :func:`normalize_text`; raise ``TypeError`` for a non-str."""
    if not isinstance(text, str):
        raise TypeError(f"{name} must be a str, got {type(text).__name__}")
    return normalize_text(text)


def check_bool(value: Any, name: str) -> bool:
    """Return ``value`` if it is a bool; raise ``TypeError`` otherwise (no truthiness)."""
    if not isinstance(value, bool):
        raise TypeError(f"{name} must be a bool, got {type(value).__name__} {value!r}")
    return value


def check_tokenizer(tokenizer: Any) -> None:
    """Raise ``TypeError`` unless ``tokenizer`` is callable like a Hugging Face tokenizer."""
    if not callable(tokenizer):
        raise TypeError(
            f"tokenizer must be a Hugging Face tokenizer (callable), got {type(tokenizer).__name__}"
        )


def encode(tokenizer: Any, text: str, *, special: bool) -> list[int]:
    """Token ids of ``text``, with the tokenizer's special tokens when ``special``."""
    return list(tokenizer(text, add_special_tokens=special, verbose=False)["input_ids"])


def encode_offsets(tokenizer: Any, text: str) -> list[int]:
    """End character offset of every token of ``text`` (no special tokens)."""
    try:
        enc = tokenizer(
            text, add_special_tokens=False, return_offsets_mapping=True, verbose=False
        )
    except NotImplementedError as exc:  # slow (Python) tokenizers
        raise TypeError(
            "a fast tokenizer (return_offsets_mapping support) is required to cut "
            f"haystacks by tokens, got {type(tokenizer).__name__}"
        ) from exc
    return [int(end) for _, end in enc["offset_mapping"]]


def chars_per_token(tokenizer: Any, text: str) -> float:
    """Average characters per token over the first 20,000 characters of ``text``."""
    probe = text[:20000]
    return len(probe) / max(1, len(encode(tokenizer, probe, special=False)))
