"""The compressed contexts of ``kvcache serve``: ``.kvc`` files in one folder, an in-memory LRU.

Layout: ``DIR/<id>.kvc`` (:mod:`kv_cache.cache.serialize`; its ``extra`` holds the description:
method, tokens, bytes, prefill seconds). Ids are ``ctx-`` + 24 hex digits; any other name is
an unknown context (never a path).

* **Atomic writes.** A context is written to ``DIR/.tmp-<id>.kvc`` (fsynced), then renamed
  onto ``DIR/<id>.kvc`` (``os.replace``) and the folder fsynced: a kill at any moment leaves
  either no entry or a whole one. Names starting with ``.tmp-`` are never entries; the store
  removes them when it opens the folder (what a killed writer left).
* **Lazy loading, LRU capped in bytes.** Opening the folder reads each file's checked header
  only (:func:`~kv_cache.cache.serialize.read_info`). :meth:`ContextStore.get` loads the tensors
  on first use (every tensor's sha256 checked) and keeps the context in memory while the
  contexts held stay within ``cache_bytes`` (the bytes their tensors hold); the least recently
  used go first. A context larger than the cap is loaded for each use and not kept.
* **Failed checks.** A file whose header or tensors fail their checks, or that was made for
  another model, is listed with ``status: "corrupted"`` and its error; using it raises
  :class:`ContextCorrupted` (the server answers 422); deleting it works.

Thread-safe: one lock guards the index and the LRU (file reads happen outside it). One server
per folder: a second one opening it would remove the first one's writes in progress.
"""

from __future__ import annotations

import logging
import os
import re
import secrets
import threading
import time
from collections import OrderedDict
from pathlib import Path
from typing import Any

from ..cache.serialize import model_identity, read_info, save_cache
from ..context import CompressedContext

log = logging.getLogger(__name__)

SUFFIX = ".kvc"
TMP_PREFIX = ".tmp-"
ID_RE = re.compile(r"^ctx-[0-9a-f]{24}$")


class ContextNotFound(KeyError):
    """No stored context has this id."""


class ContextCorrupted(ValueError):
    """A stored context whose file fails its checks (or was made for another model)."""


def new_id() -> str:
    return "ctx-" + secrets.token_hex(12)


def _fsync_dir(directory: Path) -> None:
    try:
        fd = os.open(directory, os.O_RDONLY)
    except OSError:  # not every platform opens folders
        return
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def describe(cid: str, extra: dict[str, Any], file_bytes: int) -> dict[str, Any]:
    """The public description of a stored context from the ``extra`` it was saved with."""
    kv, fp16 = int(extra.get("kv_bytes", 0)), int(extra.get("fp16_bytes", 0))
    return {"id": cid, "object": "context", "status": "ready", "created": extra.get("created"),
            "model": extra.get("model"), "method": extra.get("method"),
            "tokens": int(extra.get("context_tokens", 0)),
            "document_tokens": int(extra.get("document_tokens", extra.get("context_tokens", 0))),
            "bytes": kv, "fp16_bytes": fp16, "ratio": (fp16 / kv) if kv else None, "file_bytes": file_bytes,
            "prefill_seconds": extra.get("prefill_seconds"),
            "reconstruction_seconds": extra.get("reconstruction_seconds", 0.0)}


class ContextStore:
    """The contexts in ``directory`` for one model (``model``, ``tokenizer``), with an LRU of
    at most ``cache_bytes`` bytes of loaded tensors (0: nothing kept in memory)."""

    def __init__(self, directory: str | os.PathLike, model: Any, tokenizer: Any, *, cache_bytes: int = 1 << 30):
        if isinstance(cache_bytes, bool) or not isinstance(cache_bytes, int) or cache_bytes < 0:
            raise ValueError(f"cache_bytes must be an int >= 0; got {cache_bytes!r}")
        self.directory = Path(directory)
        self.directory.mkdir(parents=True, exist_ok=True)
        self.model, self.tokenizer, self.cache_bytes = model, tokenizer, cache_bytes
        self._identity = model_identity(model.config)
        self._lock = threading.Lock()
        self._index: dict[str, dict[str, Any]] = {}  # id -> description (status ready or corrupted)
        self._lru: OrderedDict[str, tuple[CompressedContext, int]] = OrderedDict()
        self._held = 0
        self._scan()

    # ------------------------------------------------------------------ opening the folder
    def _path(self, cid: str) -> Path:
        return self.directory / f"{cid}{SUFFIX}"

    def _scan(self) -> None:
        for p in sorted(self.directory.iterdir()):
            if p.name.startswith(TMP_PREFIX):
                log.warning("removing %s: a partial write left by a server that stopped mid-write", p)
                p.unlink(missing_ok=True)
                continue
            if p.suffix == SUFFIX and ID_RE.match(p.stem):
                self._index[p.stem] = self._read(p.stem)

    def _read(self, cid: str) -> dict[str, Any]:
        """The description of a file from its checked header, or a ``corrupted`` entry."""
        path = self._path(cid)
        try:
            info = read_info(path)
            if info["model"] != self._identity:
                raise ValueError(f"{path} was made for another model (type {info['model'].get('model_type')!r}); "
                                 f"this server runs {self._identity.get('model_type')!r}")
            return describe(cid, info["extra"], path.stat().st_size)
        except ValueError as exc:
            log.error("stored context %s fails its checks: %s", cid, exc)
            return {"id": cid, "object": "context", "status": "corrupted", "error": str(exc)}

    # ------------------------------------------------------------------ resources
    def list(self) -> list[dict[str, Any]]:
        with self._lock:
            return sorted(self._index.values(), key=lambda d: (d.get("created") or 0, d["id"]))

    def describe(self, cid: str) -> dict[str, Any]:
        """The description of ``cid``; :class:`ContextNotFound`, :class:`ContextCorrupted`."""
        with self._lock:
            entry = self._index.get(cid) if isinstance(cid, str) and ID_RE.match(cid) else None
        if entry is None:
            raise ContextNotFound(cid)
        if entry["status"] == "corrupted":
            raise ContextCorrupted(entry["error"])
        return entry

    def add(self, ctx: CompressedContext, extra: dict[str, Any]) -> dict[str, Any]:
        """Write ``ctx`` (atomically, see the module docstring) as a new context; its description."""
        cid = new_id()
        report = ctx.cache.memory_report()
        extra = {**extra, "context_tokens": ctx.context_tokens, "document_tokens": ctx.document_tokens,
                 "created": int(time.time()), "kv_bytes": int(report.total_bytes),
                 "fp16_bytes": int(report.fp16_bytes)}
        if getattr(ctx, "question_suffix", None) is not None:  # CompressedContext.load restores it
            extra["question_suffix"] = ctx.question_suffix
        tmp, final = self.directory / f"{TMP_PREFIX}{cid}{SUFFIX}", self._path(cid)
        try:
            save_cache(ctx.cache, tmp, model_config=self.model.config, extra=extra)
            fd = os.open(tmp, os.O_RDONLY)
            try:
                os.fsync(fd)
            finally:
                os.close(fd)
            os.replace(tmp, final)
            _fsync_dir(self.directory)
        except BaseException:
            for p in (tmp, tmp.with_name(tmp.name + ".tmp")):
                p.unlink(missing_ok=True)
            raise
        entry = describe(cid, extra, final.stat().st_size)
        with self._lock:
            self._index[cid] = entry
            self._keep(cid, ctx)
        return entry

    def get(self, cid: str) -> CompressedContext:
        """The loaded context ``cid`` (from memory, or read and checked from its file)."""
        self.describe(cid)
        with self._lock:
            hit = self._lru.get(cid)
            if hit is not None:
                self._lru.move_to_end(cid)
                return hit[0]
        try:
            ctx = CompressedContext.load(self._path(cid), self.model, self.tokenizer)
        except FileNotFoundError:
            with self._lock:
                self._index.pop(cid, None)
            raise ContextNotFound(cid) from None
        except ValueError as exc:
            log.error("stored context %s fails its checks: %s", cid, exc)
            with self._lock:
                if cid in self._index:
                    self._index[cid] = {"id": cid, "object": "context", "status": "corrupted", "error": str(exc)}
            raise ContextCorrupted(str(exc)) from None
        with self._lock:
            if cid in self._index:  # not deleted meanwhile
                self._keep(cid, ctx)
        return ctx

    def delete(self, cid: str) -> None:
        with self._lock:
            if not (isinstance(cid, str) and ID_RE.match(cid)) or cid not in self._index:
                raise ContextNotFound(cid)
            self._index.pop(cid)
            dropped = self._lru.pop(cid, None)
            if dropped is not None:
                self._held -= dropped[1]
        self._path(cid).unlink(missing_ok=True)
        _fsync_dir(self.directory)

    # ------------------------------------------------------------------ the LRU
    @property
    def held_bytes(self) -> int:
        """Bytes of the tensors of the contexts kept in memory."""
        return self._held

    def cached_ids(self) -> list[str]:
        """Ids kept in memory, least recently used first."""
        with self._lock:
            return list(self._lru)

    def _keep(self, cid: str, ctx: CompressedContext) -> None:  # under the lock
        size = int(ctx.cache.memory_report().total_bytes)
        old = self._lru.pop(cid, None)
        if old is not None:
            self._held -= old[1]
        if size > self.cache_bytes:
            return
        self._lru[cid] = (ctx, size)
        self._held += size
        while self._held > self.cache_bytes:
            _, (_, n) = self._lru.popitem(last=False)
            self._held -= n
