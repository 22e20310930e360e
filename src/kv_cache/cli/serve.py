"""``kvcache serve``: an OpenAI-compatible server over compressed contexts (FastAPI + uvicorn).

``kvcache serve --model stories260K --store contexts/ --port 8000 --api-key K`` loads the model
once and serves ``/v1/models``, ``/v1/chat/completions`` (streaming or not) and ``/v1/contexts``
(compress a document once, ask it with ``context_id``). Contexts are ``.kvc`` files in
``--store`` and survive a restart; each API key has its own. Requests run on one model worker
(concurrent chats decoded together, up to ``--max-batch``, on stored contexts too); at most
``--queue-size`` wait (then 503 with ``Retry-After``), each at most ``--request-timeout`` seconds
(then 504). Every input is bounded (the --max-* flags) and checked in time linear in its size
before any work. Requests never name files: plans, scorers and bit profiles are registered here
by name (--plan, --scorer, --bit-profile). One key may hold at most --max-queued-per-key waiting
requests (then 429) and --max-running-per-key places of a batch while others wait.

Operators watch ``/metrics`` (Prometheus), ``/version``, ``/health`` (503 while draining) and one
JSON access-log line per request on stderr (``--no-access-log`` to turn it off). Off a loopback
``--host`` the server needs keys (or ``--insecure``) and TLS: ``--ssl-keyfile`` /
``--ssl-certfile``, or ``--behind-tls-proxy`` when a proxy in front ends TLS. SIGTERM answers
queued requests 503, stops the running one at its next check and ends the process within
``--shutdown-timeout`` seconds, leaving no partial file (a write in progress finishes); a second
SIGTERM, or the timeout, ends it at once. Needs ``pip install kv_cache[serve]``.

``kvcache contexts --store DIR list|assign|delete`` is the operator's tool over a store no
server is using: list every context with its owner, give one to a key, delete one.
"""

from __future__ import annotations

import argparse
import logging
import os
import re
import sys
import threading
from pathlib import Path

SIZE_UNITS = {"": 1, "k": 1 << 10, "m": 1 << 20, "g": 1 << 30}


def parse_bytes(text: str, flag: str = "--cache-bytes") -> int:
    """``"1073741824"``, ``"512M"``, ``"1G"``, ``"64k"`` -> bytes (binary units)."""
    m = re.fullmatch(r"\s*(\d+)\s*([kKmMgG]?)(?:i?[bB])?\s*", str(text))
    if m is None:
        raise ValueError(f"{flag} must be a byte count with an optional unit K, M or G (e.g. 512M); got {text!r}")
    return int(m[1]) * SIZE_UNITS[m[2].lower()]


def _optional(text: str, flag: str, as_bytes: bool = False) -> int | None:
    """A limit flag's value: a count (or bytes), or ``none`` for no limit."""
    if str(text).strip().lower() == "none":
        return None
    if as_bytes:
        return parse_bytes(text, flag)
    if not str(text).strip().isdigit():
        raise ValueError(f"{flag} must be an integer >= 1 or 'none'; got {text!r}")
    return int(text)


def served_model_name(model: str) -> str:
    """The default ``--served-model-name``: the model folder's name (an alias as it is)."""
    return Path(str(model).rstrip("/\\")).name or str(model)


def add_parser(sub) -> None:
    """Register ``serve`` and ``contexts`` on ``sub`` (an argparse subparsers object)."""
    from ..integrations.serve.limits import Limits

    d = Limits()
    p = sub.add_parser("serve", help="an OpenAI-compatible server over compressed contexts",
                       description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--model", default="smollm2", help="as `kvcache eval --model` (an alias or a path) [smollm2]")
    p.add_argument("--served-model-name", default=None, metavar="NAME",
                   help="the model's id in /v1/models and chat requests [the model folder's name]")
    p.add_argument("--store", required=True, metavar="DIR", help="folder of the stored contexts (created if absent)")
    p.add_argument("--host", default="127.0.0.1", help="address to bind; a non-loopback one needs a key or "
                                                       "--insecure [127.0.0.1]")
    p.add_argument("--port", type=int, default=8000, help="port [8000]")
    g = p.add_argument_group("keys (each key has its own contexts)")
    g.add_argument("--api-key", action="append", default=None, metavar="KEY",
                   help="a key clients send as 'Authorization: Bearer KEY' (repeatable; default: $KVCACHE_API_KEY "
                        "when no key flag is given, else none)")
    g.add_argument("--api-keys-file", default=None, metavar="FILE",
                   help="keys, one a line (blank lines and # comments skipped)")
    g.add_argument("--admin-key", action="append", default=[], metavar="KEY",
                   help="a key that also reads every key's figures on /metrics (repeatable; a key like the others "
                        "otherwise: any other key sees only its own)")
    g.add_argument("--insecure", action="store_true",
                   help="allow a non-loopback --host without any key and without TLS, answering any Host")
    g.add_argument("--allowed-host", action="append", default=[], metavar="NAME",
                   help="without keys, a Host / Origin name answered besides loopback ones (repeatable; '*': any)")
    t = p.add_argument_group("TLS (required off a loopback --host, unless a proxy in front ends it)")
    t.add_argument("--ssl-keyfile", default=None, metavar="FILE", help="the TLS private key (PEM), for uvicorn")
    t.add_argument("--ssl-certfile", default=None, metavar="FILE", help="the TLS certificate chain (PEM), for uvicorn")
    t.add_argument("--behind-tls-proxy", action="store_true",
                   help="TLS ends at a proxy in front of this server: serve plain HTTP off loopback")
    p.add_argument("--strict", action="store_true",
                   help="refuse (400, nothing stored) a context whose compressed cache fails the fidelity check "
                        "or the eviction check (math dictionary §26, §26.1) instead of storing it with a warning")
    f = p.add_argument_group("files requests may name (by NAME; requests never name paths)")
    f.add_argument("--plan", action="append", default=[], metavar="NAME=PATH", help="a plan file: method 'plan[NAME]'")
    f.add_argument("--scorer", action="append", default=[], metavar="[NAME=]PATH",
                   help="a KVzap scorer file: method 'kvzap@0.25[NAME]' (NAME: the file's stem if omitted)")
    f.add_argument("--bit-profile", action="append", default=[], metavar="NAME=PATH",
                   help="a `kvcache allocate` bit profile: method 'q4p[NAME]'")
    lim = p.add_argument_group("limits (checked before any work)")
    lim.add_argument("--max-body-bytes", default="8M", help="a request body's bytes; then 413 [8M]")
    lim.add_argument("--max-body-memory", default=None,
                     help="memory of all request bodies being read or parsed at once, server-wide, each body byte "
                          "counted 7 times (the byte and the parse's peak); then 503 [28 x --max-body-bytes: four "
                          "bodies]")
    lim.add_argument("--body-timeout", type=int, default=d.body_timeout,
                     help=f"seconds a client has to send a request body; then 408 [{d.body_timeout}]")
    lim.add_argument("--max-json-depth", type=int, default=d.max_json_depth,
                     help=f"nesting of a body's arrays and objects; then 400 [{d.max_json_depth}]")
    lim.add_argument("--max-document-chars", type=int, default=d.max_document_chars,
                     help=f"characters of a document, and of a chat's messages; then 400 [{d.max_document_chars}]")
    lim.add_argument("--max-document-tokens", type=int, default=None,
                     help="tokens of a document; then 400 [what the model's positions allow]")
    lim.add_argument("--max-tokens", type=int, default=d.max_tokens,
                     help=f"the max_tokens a chat may ask; then 400 [{d.max_tokens}]")
    lim.add_argument("--max-stop-chars", type=int, default=d.max_stop_chars,
                     help=f"characters of each stop string (4 strings at most); then 400 [{d.max_stop_chars}]")
    lim.add_argument("--max-contexts", default=str(d.max_contexts),
                     help=f"stored contexts in all, or 'none'; then 429 [{d.max_contexts}]")
    lim.add_argument("--max-contexts-per-key", default=str(d.max_contexts_per_key),
                     help=f"stored contexts per key, or 'none'; then 429 [{d.max_contexts_per_key}]")
    lim.add_argument("--max-store-bytes", default="16G", help="bytes of stored files in all, or 'none'; then 429 [16G]")
    lim.add_argument("--max-store-bytes-per-key", default="2G",
                     help="bytes of stored files per key, or 'none'; then 429 [2G]")
    lim.add_argument("--queue-size", type=int, default=16, help="requests waiting at most; then 503 [16]")
    lim.add_argument("--max-queued-per-key", default="auto",
                     help="requests one key may have waiting, or 'none'; then 429 [auto: half of --queue-size with "
                          "two keys or more, else none]")
    lim.add_argument("--max-running-per-key", default="4",
                     help="places of a batch one key takes while other keys' chats wait, or 'none' [4]")
    lim.add_argument("--limit-concurrency", type=int, default=256,
                     help="connections and requests uvicorn serves at once; then 503 [256]")
    lim.add_argument("--request-timeout", type=float, default=120.0,
                     help="seconds per request from its first byte: reading, tokenizing, queueing and generating; "
                          "then 504 [120]")
    p.add_argument("--cache-bytes", default="1G", help="bytes of contexts kept loaded in memory, LRU [1G]")
    p.add_argument("--max-batch", type=int, default=8,
                   help="concurrent chats decoded together at most (without a context, or on stored "
                        "contexts: the same or different ones); 1: one at a time [8]")
    p.add_argument("--batch-wait", type=float, default=0.05,
                   help="seconds a chat waits for others to batch with while fewer than --max-batch are "
                        "queued; 0: start at once [0.05]")
    p.add_argument("--shutdown-timeout", type=float, default=10.0,
                   help="seconds SIGTERM waits for requests in flight before it stops them [10]")
    p.add_argument("--dtype", default="float32", choices=("float32", "bfloat16", "float16"), help="[float32]")
    p.add_argument("--log-level", default="info", choices=("debug", "info", "warning", "error"), help="[info]")
    p.add_argument("--no-access-log", action="store_true",
                   help="no JSON access-log line per request (kv_cache.serve.access) on stderr")
    p.set_defaults(_run=run)

    c = sub.add_parser("contexts", help="the operator's tool over a server's store: list, assign, delete",
                       description="List every context of a store with its owner, give a context to an API key, "
                                   "or delete one. Run it while no server uses the store.")
    c.add_argument("--store", required=True, metavar="DIR")
    c.add_argument("--model", default="smollm2", help="the model the store serves [smollm2]")
    c.add_argument("action", choices=("list", "assign", "delete"))
    c.add_argument("id", nargs="?", help="the context (assign, delete)")
    c.add_argument("--key", default=None, help="assign: the API key that gets it (default $KVCACHE_API_KEY); "
                                               "--no-key: no key's")
    c.add_argument("--no-key", action="store_true", help="assign: to no key (then no key sees it)")
    c.set_defaults(_run=run_contexts)


def limits_from_args(args: argparse.Namespace):
    from ..integrations.serve.limits import Limits

    return Limits(max_body_bytes=parse_bytes(args.max_body_bytes, "--max-body-bytes"), body_timeout=args.body_timeout,
                  max_json_depth=args.max_json_depth, max_document_chars=args.max_document_chars,
                  max_document_tokens=args.max_document_tokens, max_tokens=args.max_tokens,
                  max_stop_chars=args.max_stop_chars,
                  max_contexts=_optional(args.max_contexts, "--max-contexts"),
                  max_contexts_per_key=_optional(args.max_contexts_per_key, "--max-contexts-per-key"),
                  max_store_bytes=_optional(args.max_store_bytes, "--max-store-bytes", as_bytes=True),
                  max_store_bytes_per_key=_optional(args.max_store_bytes_per_key, "--max-store-bytes-per-key",
                                                    as_bytes=True),
                  max_body_memory=None if args.max_body_memory is None else
                  parse_bytes(args.max_body_memory, "--max-body-memory"))


def check_exposure(host: str, keys: list[str], insecure: bool, tls: bool = False, tls_proxy: bool = False) -> None:
    """Refuse a non-loopback ``host`` without any key, or without TLS (``tls``: the server's own;
    ``tls_proxy``: a proxy in front ends it), unless ``insecure``."""
    from ..integrations.serve.auth import is_loopback

    if is_loopback(host) or insecure:
        return
    if not keys:
        raise ValueError(f"--host {host} is not a loopback address and no API key is set: anyone who reaches it "
                         "could use the model and read every context. Give --api-key / --api-keys-file (or "
                         "$KVCACHE_API_KEY), or --insecure to serve without keys anyway")
    if not tls and not tls_proxy:
        raise ValueError(f"--host {host} is not a loopback address and the server has no TLS: the API keys would "
                         "cross the network in clear text. Give --ssl-keyfile and --ssl-certfile, or "
                         "--behind-tls-proxy when a proxy in front ends TLS (or --insecure to serve plain HTTP anyway)")


def check_tls(keyfile: str | None, certfile: str | None) -> bool:
    """True when both TLS files are given (each must be a readable file); neither: False."""
    if (keyfile is None) != (certfile is None):
        raise ValueError("give both --ssl-keyfile and --ssl-certfile (TLS needs the key and its certificate); got "
                         + ("only --ssl-keyfile" if certfile is None else "only --ssl-certfile"))
    if keyfile is None:
        return False
    for flag, path in (("--ssl-keyfile", keyfile), ("--ssl-certfile", certfile)):
        if not os.path.isfile(path) or not os.access(path, os.R_OK):
            raise ValueError(f"{flag} must name a readable file; got {path!r}")
    return True


def _per_key(text: str, flag: str) -> int | None | str:
    if str(text).strip().lower() == "auto":
        return "auto"
    return _optional(text, flag)


class Shutdown:
    """SIGTERM / SIGINT handling of ``kvcache serve`` beyond uvicorn's own.

    The first signal starts the engine's shutdown (queued requests answered 503, the running job
    stopped at its next check) and a watchdog that ends the process ``timeout`` + ``grace``
    (0.5) seconds later if it is still there (a worker stuck in one long step, a write that takes
    longer, a thread that does not end); a second signal ends it at once. Ending is :func:`os._exit`: no thread can hold the
    process, and the store's atomic writes leave at most a temporary file that the next start
    removes."""

    def __init__(self, begin: "callable", timeout: float, grace: float = 0.5, exit_fn=os._exit):
        self.begin, self.timeout, self.grace, self.exit_fn = begin, timeout, grace, exit_fn
        self.signals = 0
        self._lock = threading.Lock()

    def __call__(self) -> None:
        with self._lock:
            self.signals += 1
            n = self.signals
        if n == 1:
            # not in the signal handler itself: it may have interrupted a thread holding a queue lock
            threading.Thread(target=self.begin, name="kv_cache-serve-shutdown", daemon=True).start()
            threading.Thread(target=self._watchdog, name="kv_cache-serve-watchdog", daemon=True).start()
        else:
            self._force("a second signal")

    def _watchdog(self) -> None:
        import time

        time.sleep(self.timeout + self.grace)
        self._force(f"--shutdown-timeout ({self.timeout:g} s) passed")

    def _force(self, why: str) -> None:
        logging.getLogger("kv_cache.serve").error("kvcache serve: %s; exiting now", why)
        sys.stderr.flush()
        self.exit_fn(1)


def run(args: argparse.Namespace) -> int:
    try:
        import uvicorn

        from ..integrations.serve import build
    except ImportError as exc:
        raise SystemExit(f"kvcache serve needs the serve extra: pip install 'kv_cache[serve]' ({exc})") from None
    import logging

    from ..models import load_model
    from ..integrations.serve.auth import collect_keys
    from ..integrations.serve.files import ServedFiles
    from ..integrations.serve.store import ANY_OWNER

    cache_bytes = parse_bytes(args.cache_bytes)
    limits = limits_from_args(args)
    if not 0 < args.port < 65536:
        raise ValueError(f"--port must be in [1, 65535]; got {args.port}")
    if not args.shutdown_timeout >= 0:
        raise ValueError(f"--shutdown-timeout must be a number of seconds >= 0; got {args.shutdown_timeout}")
    keys = collect_keys(args.api_key, args.api_keys_file)
    admin_keys = collect_keys(args.admin_key, env={}) if args.admin_key else []
    tls = check_tls(args.ssl_keyfile, args.ssl_certfile)
    check_exposure(args.host, keys + admin_keys, args.insecure, tls, args.behind_tls_proxy)
    if args.limit_concurrency < 1:
        raise ValueError(f"--limit-concurrency must be an int >= 1; got {args.limit_concurrency}")
    per_key = _per_key(args.max_queued_per_key, "--max-queued-per-key")
    per_batch = _optional(args.max_running_per_key, "--max-running-per-key")
    allowed_hosts = list(args.allowed_host) or (["*"] if args.insecure else [])
    name = args.served_model_name if args.served_model_name is not None else served_model_name(args.model)
    if not name.strip():
        raise ValueError(f"--served-model-name must be a non-empty name; got {name!r}")
    logging.getLogger("kv_cache").setLevel(args.log_level.upper())
    from ..integrations.serve.metrics import ACCESS_LOG

    access = logging.getLogger(ACCESS_LOG)
    if args.no_access_log:
        access.disabled = True
    elif not access.handlers:  # one JSON object a line on stderr, nothing around it
        handler = logging.StreamHandler(sys.stderr)
        handler.setFormatter(logging.Formatter("%(message)s"))
        access.addHandler(handler)
        access.setLevel(logging.INFO)
        access.propagate = False
    model, tok = load_model(args.model, dtype=args.dtype)
    files = ServedFiles.register(args.plan, args.scorer, args.bit_profile, model_config=model.config)
    app, service, engine = build(model, tok, args.store, model_id=name, api_keys=keys, cache_bytes=cache_bytes,
                                 queue_size=args.queue_size, request_timeout=args.request_timeout, limits=limits,
                                 files=files, shutdown_timeout=args.shutdown_timeout, max_batch=args.max_batch,
                                 batch_wait=args.batch_wait, strict=args.strict, max_queued_per_key=per_key,
                                 max_running_per_key=per_batch, allowed_hosts=allowed_hosts, admin_keys=admin_keys)
    shutdown = Shutdown(engine.begin_shutdown, args.shutdown_timeout)

    class Server(uvicorn.Server):
        """uvicorn's server, which on SIGTERM / SIGINT also stops the model worker's jobs and
        bounds the time to exit (:class:`Shutdown`)."""

        def handle_exit(self, sig, frame) -> None:
            shutdown()
            super().handle_exit(sig, frame)

    n = len(service.store.list(ANY_OWNER))
    scheme = "https" if tls else "http"
    print(f"kvcache serve: {name} on {scheme}://{args.host}:{args.port}/v1, {n} stored context(s), "
          + (f"{len(keys) + len(admin_keys)} API key(s)" if keys or admin_keys else "no API key"), flush=True)
    config = uvicorn.Config(app, host=args.host, port=args.port, log_level=args.log_level,
                            timeout_graceful_shutdown=args.shutdown_timeout, limit_concurrency=args.limit_concurrency,
                            access_log=False, ssl_keyfile=args.ssl_keyfile, ssl_certfile=args.ssl_certfile,
                            proxy_headers=args.behind_tls_proxy)
    Server(config).run()
    return 0


def run_contexts(args: argparse.Namespace) -> int:
    import json
    import os

    from ..models import load_model
    from ..integrations.serve.auth import KEY_ENV, key_id
    from ..integrations.serve.store import ANY_OWNER, ContextNotFound, ContextStore

    model, tok = load_model(args.model)
    store = ContextStore(args.store, model, tok, cache_bytes=0)
    if args.action == "list":
        for d in store.list(ANY_OWNER):
            print(json.dumps({k: d.get(k) for k in ("id", "status", "owner", "method", "tokens", "file_bytes",
                                                   "error") if k in d}))
        return 0
    if not args.id:
        raise ValueError(f"kvcache contexts {args.action} needs the context's id")
    if args.id not in {d["id"] for d in store.list(ANY_OWNER)}:
        raise ValueError(f"no context {args.id!r} in {args.store} (kvcache contexts --store {args.store} list)")
    if args.action == "delete":
        try:
            store.delete(args.id, ANY_OWNER)
        except ContextNotFound:
            raise ValueError(f"no context {args.id!r} in {args.store}") from None
        print(f"deleted {args.id}")
        return 0
    if args.no_key:
        owner = None
    else:
        key = args.key if args.key is not None else os.environ.get(KEY_ENV, "")
        if not key.strip():
            raise ValueError("kvcache contexts assign needs --key KEY (or $KVCACHE_API_KEY), or --no-key")
        owner = key_id(key.strip(), store.owner_salt)
    store.assign(args.id, owner)
    print(f"assigned {args.id} to " + ("no key" if owner is None else f"the key with owner id {owner}"),
          file=sys.stdout)
    return 0
