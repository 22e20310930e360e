"""The checked safetensors files the library writes (KVzap scorers, codec bases, calibrated
rotations): one header, one sha256, one cached loader.

A file holds its tensors and, under one metadata key, a JSON header; a second key may hold the
header's sha256 (then a header changed on disk is refused), and the header may list each
tensor's sha256 (:func:`tensor_digest`; then a tensor changed on disk is refused). Writes go to a
temporary file that is then renamed, so a reader never sees half a file. Every failure is the
caller's own error class, naming the file and what was expected.
"""

from __future__ import annotations

import functools
import hashlib
import json
import os
from pathlib import Path
from typing import Any, Callable, Mapping

import torch


def tensor_digest(t: torch.Tensor) -> str:
    """sha256 of a tensor's dtype, shape and bytes."""
    h = hashlib.sha256(f"{t.dtype}{tuple(t.shape)}".encode())
    h.update(t.detach().cpu().contiguous().reshape(-1).view(torch.uint8).numpy())
    return h.hexdigest()


def write_checked(path: str | os.PathLike, tensors: Mapping[str, torch.Tensor], header: Mapping[str, Any], *,
                  header_key: str, sha_key: str | None = None) -> str:
    """Write ``tensors`` with ``header`` (JSON, keys sorted) under ``header_key`` and, with
    ``sha_key``, the header's sha256 under it; a temporary file renamed onto ``path``. Returns the
    header's sha256."""
    from safetensors.torch import save_file

    path = Path(path)
    text = json.dumps(dict(header), sort_keys=True)
    sha = hashlib.sha256(text.encode()).hexdigest()
    meta = {header_key: text, **({sha_key: sha} if sha_key else {})}
    tmp = path.with_name(path.name + ".tmp")
    save_file({k: v.detach().cpu().contiguous() for k, v in tensors.items()}, str(tmp), metadata=meta)
    os.replace(tmp, path)
    return sha


def read_checked_header(path: str | os.PathLike, *, header_key: str, sha_key: str | None, error: type[Exception],
                        what: str, written_by: str) -> tuple[dict[str, Any], str]:
    """``(header, its sha256)`` of a checked file, tensors unread: ``FileNotFoundError`` without
    a file; ``error`` for a file that is not readable safetensors, has no header, a header that
    is not JSON, or one whose sha256 differs from the recorded one. ``what`` names the kind of
    file, ``written_by`` the command that writes it (both go into the messages)."""
    from safetensors import SafetensorError, safe_open

    path = Path(path)
    if not path.is_file():
        raise FileNotFoundError(f"no {what} file at {str(path)!r}")
    try:
        with safe_open(str(path), framework="pt") as f:
            meta = f.metadata() or {}
    except (SafetensorError, OSError, ValueError, RuntimeError) as exc:
        raise error(f"{path}: not a readable safetensors {what} file (corrupted or truncated?): {exc}") from None
    text = meta.get(header_key)
    if text is None:
        raise error(f"{path}: no {header_key!r} header; was it written by {written_by}?")
    found = hashlib.sha256(text.encode()).hexdigest()
    if sha_key is not None and meta.get(sha_key) != found:
        raise error(f"{path} is corrupted: header sha256 expected {meta.get(sha_key)}, found {found}")
    try:
        header = json.loads(text)
    except json.JSONDecodeError as exc:
        raise error(f"{path}: the {header_key!r} header is not valid JSON: {exc}") from None
    if not isinstance(header, dict):
        raise error(f"{path}: the {header_key!r} header must be a JSON object; got {type(header).__name__}")
    return header, found


def check_format(header: Mapping[str, Any], path: Any, fmt: str | None, version: int, error: type[Exception]) -> None:
    """``error`` unless the header's ``format`` (when ``fmt`` is given) and ``format_version`` are these."""
    if (fmt is not None and header.get("format") != fmt) or header.get("format_version") != version:
        got = f"format {header.get('format')!r} version" if fmt is not None else "format version"
        want = f"{fmt!r} version {version}" if fmt is not None else f"format version {version}"
        raise error(f"{path}: {got} {header.get('format_version')!r}; this release reads {want}")


def read_tensors(path: str | os.PathLike, error: type[Exception], what: str,
                 digests: Mapping[str, str] | None = None) -> dict[str, torch.Tensor]:
    """The tensors of a checked file; with ``digests`` (name -> :func:`tensor_digest`), the names
    must be exactly those and every tensor must match its digest, else ``error``."""
    from safetensors import SafetensorError
    from safetensors.torch import load_file

    try:
        tensors = load_file(str(path))
    except (SafetensorError, OSError, ValueError, RuntimeError) as exc:
        raise error(f"{path}: not a readable safetensors {what} file (corrupted or truncated?): {exc}") from None
    if digests is not None:
        if sorted(tensors) != sorted(digests):
            raise error(f"{path}: tensors {sorted(tensors)} do not match the header's {sorted(digests)}")
        for name, t in tensors.items():
            found = tensor_digest(t)
            if found != digests[name]:
                raise error(f"{path} is corrupted: tensor {name!r} sha256 expected {digests[name]}, found {found}")
    return tensors


def cached_loader(load: Callable[[str], Any], maxsize: int, what: str) -> Callable[[str | os.PathLike], Any]:
    """``load(path)`` cached by the file's resolved path, size and modification time (a file
    rewritten in place is read again); ``FileNotFoundError`` without a file."""

    @functools.lru_cache(maxsize=maxsize)
    def cached(path: str, mtime_ns: int, size: int) -> Any:
        return load(path)

    def loader(path: str | os.PathLike) -> Any:
        p = Path(path)
        if not p.is_file():
            raise FileNotFoundError(f"no {what} file at {str(p)!r}")
        st = p.stat()
        return cached(str(p.resolve()), st.st_mtime_ns, st.st_size)

    loader.cache_clear = cached.cache_clear  # type: ignore[attr-defined]
    return loader
