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
* **Failed checks.** A file whose header or tensors fail their checks, whose description has
  fields of the wrong type, or that was made for another model, is listed with
  ``status: "corrupted"`` and its error; using it raises :class:`ContextCorrupted` (the server
  answers 422); deleting it works. Nothing in a file stops the store from opening.
* **Owners.** Each context records the owner id of the API key that stored it
  (:func:`kv_cache.integrations.serve.auth.key_id`; None without keys). Every lookup names an owner: another
  owner's context is :class:`ContextNotFound`, exactly like a missing one. Contexts stored
  before keys were configured have owner None and are seen by no key; the operator assigns or
  deletes them (``kvcache contexts``, :meth:`ContextStore.assign`).
* **Quotas.** At most ``max_contexts`` contexts and ``max_bytes`` bytes of files in all, and
  ``max_contexts_per_key`` / ``max_bytes_per_key`` per owner: past them :meth:`ContextStore.add`
  raises :class:`StoreFull` and writes nothing (the server answers 429). Nothing is evicted to
  make room: a context stays until its owner deletes it.
* **Closing.** :meth:`ContextStore.close` waits for a write in progress and refuses new ones
  (:class:`StoreClosed`): a server that stops never leaves a partial file.

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

from ...cache.serialize import model_identity, read_info, rewrite_extra, save_cache
from ...context import CompressedContext

log = logging.getLogger(__name__)

SUFFIX = ".kvc"
TMP_PREFIX = ".tmp-"
ID_RE = re.compile(r"^ctx-[0-9a-f]{24}$")
SALT_FILE = ".owner-salt"
"""The file of the store's owner-id salt (hex; see :meth:`ContextStore._salt`)."""


class ContextNotFound(KeyError):
    """No stored context has this id."""


class ContextCorrupted(ValueError):
    """A stored context whose file fails its checks (or was made for another model)."""


class StoreFull(Exception):
    """A quota of the store (count or bytes, per owner or in all) would be passed."""


class StoreClosed(Exception):
    """The store is closed (the server is stopping): nothing more is written."""


ANY_OWNER = object()
"""The owner argument of the operator's calls (:meth:`ContextStore.delete`, ``list``): any owner."""

_INT_FIELDS = ("context_tokens", "kv_bytes", "fp16_bytes")
_OPTIONAL_INT_FIELDS = ("document_tokens", "created")
_OPTIONAL_NUMBER_FIELDS = ("prefill_seconds", "reconstruction_seconds")
_OPTIONAL_STR_FIELDS = ("model", "method", "owner", "question_suffix")


def check_extra(extra: Any) -> dict[str, Any]:
    """``extra`` of a stored context, its fields of the types :func:`describe` reads; ``ValueError``
    naming the field otherwise (a header-valid file written by something else)."""
    if not isinstance(extra, dict):
        raise ValueError(f"its description is not an object (found {type(extra).__name__})")

    def bad(name: str, want: str) -> ValueError:
        return ValueError(f"its description's {name!r} must be {want}; found {type(extra[name]).__name__}")

    for name in _INT_FIELDS + _OPTIONAL_INT_FIELDS:
        v = extra.get(name)
        if (v is None and name in _OPTIONAL_INT_FIELDS) or (isinstance(v, int) and not isinstance(v, bool) and v >= 0):
            continue
        if name not in extra:
            raise ValueError(f"its description lacks {name!r}")
        raise bad(name, "an integer >= 0")
    for name in _OPTIONAL_NUMBER_FIELDS:
        v = extra.get(name)
        if v is not None and (isinstance(v, bool) or not isinstance(v, (int, float))):
            raise bad(name, "a number")
    for name in _OPTIONAL_STR_FIELDS:
        if extra.get(name) is not None and not isinstance(extra[name], str):
            raise bad(name, "a string")
    return extra


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

    def __init__(self, directory: str | os.PathLike, model: Any, tokenizer: Any, *, cache_bytes: int = 1 << 30,
                 max_contexts: int | None = None, max_bytes: int | None = None, max_contexts_per_key: int | None = None,
                 max_bytes_per_key: int | None = None):
        if isinstance(cache_bytes, bool) or not isinstance(cache_bytes, int) or cache_bytes < 0:
            raise ValueError(f"cache_bytes must be an int >= 0; got {cache_bytes!r}")
        quotas = {"max_contexts": max_contexts, "max_bytes": max_bytes, "max_contexts_per_key": max_contexts_per_key,
                  "max_bytes_per_key": max_bytes_per_key}
        for name, v in quotas.items():
            if v is not None and (isinstance(v, bool) or not isinstance(v, int) or v < 1):
                raise ValueError(f"{name} must be an int >= 1 or None; got {v!r}")
        self.quotas = quotas
        self.directory = Path(directory)
        self.directory.mkdir(parents=True, exist_ok=True)
        self.model, self.tokenizer, self.cache_bytes = model, tokenizer, cache_bytes
        self._identity = model_identity(model.config)
        self._lock = threading.Lock()
        self._index: dict[str, dict[str, Any]] = {}  # id -> description (status ready or corrupted)
        self._meta: dict[str, dict[str, Any]] = {}  # id -> {"owner", "suffix", "file_bytes"} (not shown)
        self._write_lock = threading.Lock()  # held while a file is written; close() takes it
        self._closed = False
        self._lru: OrderedDict[str, tuple[CompressedContext, int]] = OrderedDict()
        self._held = 0
        self._scan()
        self.owner_salt = self._salt()

    def _salt(self) -> bytes:
        """The salt of this store's owner ids (:func:`kv_cache.integrations.serve.auth.key_id`), kept
        in :data:`SALT_FILE`: random for a new store (owner ids differ between deployments); a store
        that already holds owned contexts and no salt file keeps the salt they were made with."""
        from .auth import LEGACY_SALT

        path = self.directory / SALT_FILE
        try:
            text = path.read_text(encoding="ascii").strip()
            salt = bytes.fromhex(text)
            if len(salt) < 16:
                raise ValueError(f"{len(salt)} bytes")
            return salt
        except FileNotFoundError:
            pass
        except (ValueError, UnicodeDecodeError) as exc:
            raise ValueError(f"{SALT_FILE} in the store folder is not the hex salt the server wrote ({exc}); "
                             "restore it from a backup (removing it changes every key's owner id)") from None
        owned = any(m.get("owner") is not None for m in self._meta.values())
        salt = LEGACY_SALT if owned else os.urandom(32)
        tmp = self.directory / f"{TMP_PREFIX}salt"
        fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o600)
        with os.fdopen(fd, "w", encoding="ascii") as f:
            f.write(salt.hex() + "\n")
            f.flush()
            os.fsync(f.fileno())
        os.replace(tmp, path)
        return salt

    def usage_by_owner(self) -> dict[Any, tuple[int, int]]:
        """``{owner id or None: (contexts, file bytes)}`` of every owner with a context."""
        out: dict[Any, list[int]] = {}
        with self._lock:
            for m in self._meta.values():
                row = out.setdefault(m["owner"], [0, 0])
                row[0] += 1
                row[1] += m["file_bytes"]
        return {k: (n, b) for k, (n, b) in out.items()}

    @property
    def cache_bytes_held(self) -> int:
        """Bytes of the contexts held loaded in memory (the LRU; at most ``cache_bytes``)."""
        return self._held

    # ------------------------------------------------------------------ opening the folder
    def _path(self, cid: str) -> Path:
        return self.directory / f"{cid}{SUFFIX}"

    def _scan(self) -> None:
        for p in sorted(self.directory.iterdir()):
            if p.name.startswith(TMP_PREFIX):
                log.warning("removing %s: a partial write left by a server that stopped mid-write", p)
                try:
                    p.unlink(missing_ok=True)
                except OSError as exc:  # a folder of that name, or no permission: left as it is
                    log.error("could not remove %s: %s", p, exc)
                continue
            if p.suffix == SUFFIX and ID_RE.match(p.stem) and p.is_file():
                self._index[p.stem], self._meta[p.stem] = self._read(p.stem)

    def _read(self, cid: str) -> tuple[dict[str, Any], dict[str, Any]]:
        """``(description, meta)`` of a file from its checked header, or a ``corrupted`` entry.
        Never raises: whatever a file holds, the store opens."""
        path = self._path(cid)
        try:
            size = path.stat().st_size
        except OSError:
            size = 0
        try:
            info = read_info(path)
            model, extra = info["model"], check_extra(info["extra"])
            if model != self._identity:
                kind = model.get("model_type") if isinstance(model, dict) else None
                raise ValueError(f"it was made for another model (type {kind!r}); this server runs "
                                 f"{self._identity.get('model_type')!r}")
            meta = {"owner": extra.get("owner"), "suffix": extra.get("question_suffix"), "file_bytes": size}
            return describe(cid, extra, size), meta
        except Exception as exc:  # any content: a header-valid file with fields of the wrong type included
            msg = str(exc).replace(str(path), f"the file of {cid}")
            log.error("stored context %s fails its checks: %s", cid, msg)
            return self._corrupted(cid, msg), {"owner": None, "suffix": None, "file_bytes": size}

    @staticmethod
    def _corrupted(cid: str, msg: str) -> dict[str, Any]:
        return {"id": cid, "object": "context", "status": "corrupted", "error": msg}

    def _visible(self, cid: Any, owner: Any) -> bool:  # under the lock
        if not (isinstance(cid, str) and ID_RE.match(cid)) or cid not in self._index:
            return False
        return owner is ANY_OWNER or self._meta.get(cid, {}).get("owner") == owner

    # ------------------------------------------------------------------ resources
    def list(self, owner: Any = None) -> list[dict[str, Any]]:
        """The descriptions of ``owner``'s contexts (:data:`ANY_OWNER`: every context, with its
        ``owner`` id), oldest first."""
        with self._lock:
            out = [dict(d, owner=self._meta[cid]["owner"]) if owner is ANY_OWNER else d
                   for cid, d in self._index.items() if self._visible(cid, owner)]
        return sorted(out, key=lambda d: (d.get("created") or 0, d["id"]))

    def usage(self, owner: Any = ANY_OWNER) -> tuple[int, int]:
        """``(contexts, file bytes)`` of ``owner`` (:data:`ANY_OWNER`: in all)."""
        with self._lock:
            return self._usage(owner)

    def _usage(self, owner: Any) -> tuple[int, int]:  # under the lock
        sizes = [m["file_bytes"] for m in self._meta.values() if owner is ANY_OWNER or m["owner"] == owner]
        return len(sizes), sum(sizes)

    def check_room(self, owner: Any, new_bytes: int = 0) -> None:
        """Raise :class:`StoreFull` unless ``owner`` may store one more context of ``new_bytes``."""
        with self._lock:
            self._check_room(owner, new_bytes)

    def _check_room(self, owner: Any, new_bytes: int) -> None:  # under the lock
        q = self.quotas
        for scope, count_max, bytes_max, who in (("in all", q["max_contexts"], q["max_bytes"], ANY_OWNER),
                                                 ("for this API key", q["max_contexts_per_key"],
                                                  q["max_bytes_per_key"], owner)):
            n, size = self._usage(who)
            if count_max is not None and n + 1 > count_max:
                raise StoreFull(f"the store holds {n:,} contexts {scope}, its limit ({count_max:,}); delete "
                                "contexts to make room")
            if bytes_max is not None and size + new_bytes > bytes_max:
                raise StoreFull(f"the store holds {size:,} bytes of contexts {scope}; {new_bytes:,} more would pass "
                                f"its limit ({bytes_max:,}); delete contexts to make room")

    def describe(self, cid: str, owner: Any = None) -> dict[str, Any]:
        """The description of ``owner``'s context ``cid``; :class:`ContextNotFound` (missing, or
        another owner's), :class:`ContextCorrupted`."""
        with self._lock:
            entry = self._index.get(cid) if self._visible(cid, owner) else None
        if entry is None:
            raise ContextNotFound(cid)
        if entry["status"] == "corrupted":
            raise ContextCorrupted(entry["error"])
        return entry

    def add(self, ctx: CompressedContext, extra: dict[str, Any], owner: str | None = None) -> dict[str, Any]:
        """Write ``ctx`` (atomically, see the module docstring) as a new context of ``owner``; its
        description. :class:`StoreFull` past a quota, :class:`StoreClosed` once closed: then
        nothing is left in the folder."""
        cid = new_id()
        report = ctx.cache.memory_report()
        extra = {**extra, "context_tokens": ctx.context_tokens, "document_tokens": ctx.document_tokens,
                 "created": int(time.time()), "kv_bytes": int(report.total_bytes),
                 "fp16_bytes": int(report.fp16_bytes)}
        if owner is not None:
            extra["owner"] = owner
        if getattr(ctx, "question_suffix", None) is not None:  # CompressedContext.load restores it
            extra["question_suffix"] = ctx.question_suffix
        tmp, final = self.directory / f"{TMP_PREFIX}{cid}{SUFFIX}", self._path(cid)
        self.check_room(owner)
        with self._write_lock:
            if self._closed:
                raise StoreClosed("the store is closed: the server is stopping")
            try:
                save_cache(ctx.cache, tmp, model_config=self.model.config, extra=extra)
                fd = os.open(tmp, os.O_RDONLY)
                try:
                    os.fsync(fd)
                finally:
                    os.close(fd)
                size = tmp.stat().st_size
                with self._lock:
                    self._check_room(owner, size)
                    os.replace(tmp, final)
                    entry = describe(cid, extra, size)
                    self._index[cid] = entry
                    self._meta[cid] = {"owner": owner, "suffix": extra.get("question_suffix"), "file_bytes": size}
                    self._keep(cid, ctx)
                _fsync_dir(self.directory)
            except BaseException:
                for p in (tmp, tmp.with_name(tmp.name + ".tmp")):
                    p.unlink(missing_ok=True)
                raise
        return entry

    def question_suffix(self, cid: str, owner: Any = None) -> str | None:
        """The chat template's tail saved with ``owner``'s context ``cid`` (None: raw text)."""
        self.describe(cid, owner)
        with self._lock:
            return self._meta.get(cid, {}).get("suffix")

    def get(self, cid: str, owner: Any = None) -> CompressedContext:
        """``owner``'s loaded context ``cid`` (from memory, or read and checked from its file)."""
        self.describe(cid, owner)
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
                self._meta.pop(cid, None)
            raise ContextNotFound(cid) from None
        except Exception as exc:  # whatever the file holds: a corrupted context, never a crash
            msg = str(exc).replace(str(self._path(cid)), f"the file of {cid}")
            log.error("stored context %s fails its checks: %s", cid, msg)
            with self._lock:
                if cid in self._index:
                    self._index[cid] = self._corrupted(cid, msg)
            raise ContextCorrupted(msg) from None
        with self._lock:
            if cid in self._index:  # not deleted meanwhile
                self._keep(cid, ctx)
        return ctx

    def delete(self, cid: str, owner: Any = None) -> None:
        """Remove ``owner``'s context ``cid`` (:data:`ANY_OWNER`: the operator's call)."""
        with self._lock:
            if not self._visible(cid, owner):
                raise ContextNotFound(cid)
            self._index.pop(cid)
            self._meta.pop(cid, None)
            dropped = self._lru.pop(cid, None)
            if dropped is not None:
                self._held -= dropped[1]
        self._path(cid).unlink(missing_ok=True)
        _fsync_dir(self.directory)

    def assign(self, cid: str, owner: str | None) -> dict[str, Any]:
        """Give context ``cid`` (any owner's) to ``owner`` (an owner id, :func:`~kv_cache.integrations.serve.auth.key_id`;
        None: no key's): its file is rewritten atomically with the new owner. The operator's call
        (``kvcache contexts assign``), on a store no server is using."""
        if owner is not None and not (isinstance(owner, str) and re.fullmatch(r"[0-9a-f]{32}", owner)):
            raise ValueError(f"owner must be an owner id (32 hex digits, kv_cache.integrations.serve.auth.key_id) or None; "
                             f"got {owner!r}")
        with self._lock:
            if not self._visible(cid, ANY_OWNER):
                raise ContextNotFound(cid)
            if self._index[cid]["status"] != "ready":
                raise ContextCorrupted(self._index[cid]["error"])
        path = self._path(cid)
        extra = dict(read_info(path)["extra"])
        extra.pop("owner", None)
        if owner is not None:
            extra["owner"] = owner
        with self._write_lock:
            rewrite_extra(path, extra)
            _fsync_dir(self.directory)
        with self._lock:
            self._index[cid], self._meta[cid] = self._read(cid)
            return self._index[cid]

    def close(self, timeout: float | None = None) -> bool:
        """Wait (at most ``timeout`` seconds; None: as long as it takes) for a write in progress,
        then refuse new ones. True when closed cleanly."""
        if not self._write_lock.acquire(timeout=-1 if timeout is None else max(timeout, 0.0)):
            return False
        try:
            self._closed = True
        finally:
            self._write_lock.release()
        return True

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
