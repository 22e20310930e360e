"""``kvcache serve``: an OpenAI-compatible server over compressed contexts (FastAPI + uvicorn).

``kvcache serve --model stories260K --store contexts/ --port 8000 [--api-key K]`` loads the
model once and serves ``/v1/models``, ``/v1/chat/completions`` (streaming or not) and
``/v1/contexts`` (compress a document once, ask it from any client with ``context_id``).
Contexts are ``.kvc`` files in ``--store`` and survive a restart; ``--cache-bytes`` caps the
bytes of the contexts kept loaded in memory. Requests run one at a time on one model worker;
at most ``--queue-size`` wait (then 503 with ``Retry-After``), each at most
``--request-timeout`` seconds (then 504). Needs ``pip install kv_cache[serve]``.
"""

from __future__ import annotations

import argparse
import os
import re

SIZE_UNITS = {"": 1, "k": 1 << 10, "m": 1 << 20, "g": 1 << 30}


def parse_bytes(text: str) -> int:
    """``"1073741824"``, ``"512M"``, ``"1G"``, ``"64k"`` -> bytes (binary units)."""
    m = re.fullmatch(r"\s*(\d+)\s*([kKmMgG]?)(?:i?[bB])?\s*", str(text))
    if m is None:
        raise ValueError(f"--cache-bytes must be a byte count with an optional unit K, M or G (e.g. 512M); "
                         f"got {text!r}")
    return int(m[1]) * SIZE_UNITS[m[2].lower()]


def add_parser(sub) -> None:
    """Register ``serve`` on ``sub`` (an argparse subparsers object)."""
    p = sub.add_parser("serve", help="an OpenAI-compatible server over compressed contexts",
                       description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--model", default="smollm2", help="as `kvcache eval --model` (an alias or a path) [smollm2]")
    p.add_argument("--store", required=True, metavar="DIR", help="folder of the stored contexts (created if absent)")
    p.add_argument("--host", default="127.0.0.1", help="address to bind [127.0.0.1]")
    p.add_argument("--port", type=int, default=8000, help="port [8000]")
    p.add_argument("--api-key", default=None,
                   help="require 'Authorization: Bearer KEY' on /v1 (default: $KVCACHE_API_KEY if set, else none)")
    p.add_argument("--cache-bytes", default="1G", help="bytes of contexts kept loaded in memory, LRU [1G]")
    p.add_argument("--queue-size", type=int, default=16, help="requests waiting at most; then 503 [16]")
    p.add_argument("--request-timeout", type=float, default=120.0, help="seconds per request, queue included [120]")
    p.add_argument("--max-document-tokens", type=int, default=None,
                   help="longest document POST /v1/contexts takes, in tokens [what the model's positions allow]")
    p.add_argument("--dtype", default="float32", choices=("float32", "bfloat16", "float16"), help="[float32]")
    p.add_argument("--log-level", default="info", choices=("debug", "info", "warning", "error"), help="[info]")
    p.set_defaults(_run=run)


def run(args: argparse.Namespace) -> int:
    try:
        import uvicorn

        from .serve import build
    except ImportError as exc:
        raise SystemExit(f"kvcache serve needs the serve extra: pip install 'kv_cache[serve]' ({exc})") from None
    import logging

    from .models import load_model

    cache_bytes = parse_bytes(args.cache_bytes)
    if args.max_document_tokens is not None and args.max_document_tokens < 1:
        raise ValueError(f"--max-document-tokens must be >= 1; got {args.max_document_tokens}")
    if not 0 < args.port < 65536:
        raise ValueError(f"--port must be in [1, 65535]; got {args.port}")
    logging.getLogger("kv_cache").setLevel(args.log_level.upper())
    model, tok = load_model(args.model, dtype=args.dtype)
    api_key = args.api_key if args.api_key is not None else os.environ.get("KVCACHE_API_KEY") or None
    app, service, _ = build(model, tok, args.store, model_id=args.model, api_key=api_key, cache_bytes=cache_bytes,
                            queue_size=args.queue_size, request_timeout=args.request_timeout,
                            max_document_tokens=args.max_document_tokens)
    n = len(service.store.list())
    print(f"kvcache serve: {args.model} on http://{args.host}:{args.port}/v1, {n} stored context(s) in {args.store}"
          + (", API key required" if api_key else ""), flush=True)
    uvicorn.run(app, host=args.host, port=args.port, log_level=args.log_level)
    return 0
