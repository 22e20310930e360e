"""``kvcache serve``: an OpenAI-compatible server over compressed contexts (``pip install kv_cache[serve]``).

* :mod:`.app`: the FastAPI application (:func:`create_app`);
* :mod:`.service`: what each request runs (compress a document, answer a chat);
* :mod:`.engine`: the single model worker, its bounded queue and lock;
* :mod:`.store`: the ``.kvc`` files (atomic writes) and the in-memory LRU capped in bytes;
* :mod:`.requests`: the request bodies, checked; :mod:`.errors`: OpenAI-style errors.

:func:`build` puts them together for a loaded model; ``kvcache serve`` (:mod:`kv_cache.cli_serve`)
runs it with uvicorn.
"""

from __future__ import annotations

from typing import Any

from .engine import Engine
from .errors import ERROR_CASES, ApiError
from .service import Service
from .store import ContextStore


def build(model: Any, tokenizer: Any, store_dir: str, *, model_id: str, api_key: str | None = None,
          cache_bytes: int = 1 << 30, queue_size: int = 16, request_timeout: float = 120.0,
          max_document_tokens: int | None = None):
    """``(app, service, engine)`` serving ``model`` with contexts in ``store_dir``."""
    from .app import create_app

    if max_document_tokens is not None and (isinstance(max_document_tokens, bool)
                                            or not isinstance(max_document_tokens, int) or max_document_tokens < 1):
        raise ValueError(f"max_document_tokens must be an int >= 1 or None; got {max_document_tokens!r}")
    store = ContextStore(store_dir, model, tokenizer, cache_bytes=cache_bytes)
    service = Service(model, tokenizer, store, model_id, max_document_tokens)
    engine = Engine(queue_size=queue_size, request_timeout=request_timeout)
    return create_app(service, engine, api_key=api_key), service, engine


__all__ = ["ERROR_CASES", "ApiError", "ContextStore", "Engine", "Service", "build"]
