"""``kvcache serve``: an OpenAI-compatible server over compressed contexts (``pip install kv_cache[serve]``).

* :mod:`.app`: the FastAPI application (:func:`create_app`);
* :mod:`.service`: what each request runs (compress a document, answer a chat);
* :mod:`.engine`: the single model worker, its bounded queue and lock;
* :mod:`.store`: the ``.kvc`` files (atomic writes) and the in-memory LRU capped in bytes;
* :mod:`.requests`: the request bodies, checked; :mod:`.errors`: OpenAI-style errors;
* :mod:`.limits`: the bound of every input; :mod:`.auth`: API keys and their tenants;
* :mod:`.files`: the files a request may name (registered by the operator, by name);
* :mod:`.rows`: a batch's rows (each chat's sampling, stops, events) and the decoding loop;
* :mod:`.batch`: concurrent chats without a stored context decoded together;
* :mod:`.batch_context`: concurrent chats on stored contexts (the same or different ones)
  decoded together, the contexts stacked as rows of one cache (:mod:`kv_cache.cache.stack`).

:func:`build` puts them together for a loaded model; ``kvcache serve`` (:mod:`kv_cache.cli.serve`)
runs it with uvicorn.
"""

from __future__ import annotations

from typing import Any

import dataclasses
from typing import Iterable

from .engine import Engine
from .errors import ERROR_CASES, ApiError
from .files import ServedFiles
from .limits import Limits
from .service import Service
from .store import ContextStore


def build(model: Any, tokenizer: Any, store_dir: str, *, model_id: str, api_key: str | None = None,
          api_keys: Iterable[str] = (), cache_bytes: int = 1 << 30, queue_size: int = 16,
          request_timeout: float = 120.0, max_document_tokens: int | None = None, limits: Limits | None = None,
          files: ServedFiles | None = None, shutdown_timeout: float = 10.0, max_batch: int = 8,
          batch_wait: float = 0.05, strict: bool = False, max_queued_per_key: int | None | str = "auto",
          max_running_per_key: int | None = 4, allowed_hosts: Iterable[str] = (), admin_keys: Iterable[str] = ()):
    """``(app, service, engine)`` serving ``model`` with contexts in ``store_dir``.

    Parameters
    ----------
    model_id : str
        The name the model is served as (``/v1/models``, a chat's ``model``): a name, not a path.
    api_key, api_keys : str, iterable of str
        The keys (none: no authentication); each key has its own contexts.
    limits : Limits, optional
        The bound of every input (default :class:`Limits`); ``max_document_tokens``, when given,
        overrides its field of that name.
    files : ServedFiles, optional
        The plans, scorers and bit profiles requests may name (default: none).
    max_batch : int, default 8
        Concurrent chats decoded together at most (1: one at a time): chats without a stored
        context in one batch, chats on stored contexts (the same or different ones) in another.
    batch_wait : float, default 0.05
        Seconds a chat waits for others to batch with while fewer than ``max_batch`` are queued
        (clients a batch just answered ask again a moment later; 0: start at once).
    strict : bool, default False
        Refuse (400 ``invalid_method``, nothing stored) a context whose compressed cache fails the
        fidelity check or the eviction check (math dictionary §26, §26.1) instead of storing it
        with a warning in the log.
    max_queued_per_key : int, None or "auto", default "auto"
        Requests one key may have being prepared or waiting (then 429 ``rate_limit_exceeded``);
        "auto": half of ``queue_size`` when the server has two keys or more, else no limit (one
        tenant may use the whole queue); None: no limit.
    max_running_per_key : int or None, default 4
        Jobs of one key a batch takes while other keys' jobs of its kind wait (None: no limit).
    allowed_hosts : iterable of str
        With no key, the ``Host`` / ``Origin`` names answered besides loopback ones (``"*"``: any).
    admin_keys : iterable of str
        Keys that also read every key's figures on ``/metrics`` (keys like the others otherwise).
    """
    from .app import create_app

    if max_document_tokens is not None and (isinstance(max_document_tokens, bool)
                                            or not isinstance(max_document_tokens, int) or max_document_tokens < 1):
        raise ValueError(f"max_document_tokens must be an int >= 1 or None; got {max_document_tokens!r}")
    if not isinstance(model_id, str) or not model_id.strip():
        raise ValueError(f"model_id must be a non-empty name; got {model_id!r}")
    limits = limits or Limits()
    if max_document_tokens is not None:
        limits = dataclasses.replace(limits, max_document_tokens=max_document_tokens)
    store = ContextStore(store_dir, model, tokenizer, cache_bytes=cache_bytes, max_contexts=limits.max_contexts,
                         max_bytes=limits.max_store_bytes, max_contexts_per_key=limits.max_contexts_per_key,
                         max_bytes_per_key=limits.max_store_bytes_per_key)
    service = Service(model, tokenizer, store, model_id, limits.max_document_tokens, files or ServedFiles(), limits,
                      strict=strict)
    api_keys = list(api_keys)
    admin_keys = list(admin_keys)
    n_keys = len({*([api_key] if api_key is not None else []), *api_keys, *admin_keys})
    if max_queued_per_key == "auto":
        max_queued_per_key = max(1, queue_size // 2) if n_keys >= 2 else None
    engine = Engine(queue_size=queue_size, request_timeout=request_timeout, max_batch=max_batch,
                    batch_wait=batch_wait, max_queued_per_key=max_queued_per_key,
                    max_running_per_key=max_running_per_key)
    app = create_app(service, engine, api_key=api_key, api_keys=api_keys, shutdown_timeout=shutdown_timeout,
                     allowed_hosts=allowed_hosts, admin_keys=admin_keys)
    return app, service, engine


__all__ = ["ERROR_CASES", "ApiError", "ContextStore", "Engine", "Limits", "ServedFiles", "Service", "build"]
