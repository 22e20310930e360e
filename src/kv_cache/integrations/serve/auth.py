"""API keys of ``kvcache serve``: several keys, each one a tenant with its own contexts.

* Keys come from ``--api-key`` (repeatable), ``--api-keys-file FILE`` (one key a line; blank
  lines and lines starting with ``#`` skipped) and ``$KVCACHE_API_KEY``; an empty key is refused
  at start-up (it would turn authentication on with a key anyone can send).
* A request sends ``Authorization: Bearer <key>``. The key is compared with every configured key
  by :func:`hmac.compare_digest` over sha256 digests, all of them each time (no early exit), so
  the time does not depend on which key, or how much of one, matched.
* A key's *owner id* (:func:`key_id`, a salted sha256 prefix; the key itself is never stored)
  is written into each context it stores. The salt is the store's own (random, kept in the store
  folder: owner ids differ between deployments, :meth:`ContextStore._salt`); a store made before
  salts were per store keeps :data:`LEGACY_SALT`, so its owners still match. A key sees, uses
  and deletes only contexts with its
  owner id. Without keys the owner id is None, the owner of contexts stored without keys.
* **Admin keys** (``--admin-key``, repeatable) are keys like the others (with contexts of their
  own) that may also read every tenant's figures on ``/metrics``; any other key sees only its
  own (:meth:`ApiKeys.is_admin`).
* :func:`is_loopback`: ``kvcache serve`` refuses a non-loopback ``--host`` without a key unless
  ``--insecure`` is given.
"""

from __future__ import annotations

import hashlib
import hmac
import ipaddress
import os
from pathlib import Path
from typing import Iterable

from .errors import ApiError

KEY_ENV = "KVCACHE_API_KEY"
LEGACY_SALT = b"kv_cache.serve key\x00"
"""The salt every store shared before each got its own (kept by stores that already use it)."""


def key_id(key: str, salt: bytes = LEGACY_SALT) -> str:
    """The owner id of ``key``: 32 hex digits of a sha256 salted with ``salt`` (the store's
    :attr:`~kv_cache.integrations.serve.store.ContextStore.owner_salt`; what a stored context
    records)."""
    return hashlib.sha256(salt + key.encode()).hexdigest()[:32]


def read_keys_file(path: str | os.PathLike) -> list[str]:
    """The keys in ``path``: one a line, surrounding whitespace stripped, blank lines and ``#``
    comments skipped. ``ValueError`` for a file that holds none."""
    text = Path(path).read_text(encoding="utf-8")
    keys = [line.strip() for line in text.splitlines()]
    keys = [k for k in keys if k and not k.startswith("#")]
    if not keys:
        raise ValueError(f"--api-keys-file {path}: no key in it (one key a line; blank lines and # comments "
                         "are skipped)")
    return keys


def collect_keys(api_keys: Iterable[str] | None = None, keys_file: str | os.PathLike | None = None,
                 env: dict[str, str] | None = None) -> list[str]:
    """Every configured key: ``--api-key`` values, the keys file's and ``$KVCACHE_API_KEY`` (read
    only when neither flag is given; empty there means unset). ``ValueError`` for an empty
    ``--api-key``."""
    keys: list[str] = []
    for k in api_keys or ():
        if not isinstance(k, str) or not k.strip():
            raise ValueError(f"--api-key must be a non-empty key (an empty one would let anyone in); got {k!r}")
        keys.append(k.strip())
    if keys_file is not None:
        keys += read_keys_file(keys_file)
    if not keys and keys_file is None:
        from_env = (env if env is not None else os.environ).get(KEY_ENV, "").strip()
        if from_env:
            keys.append(from_env)
    return list(dict.fromkeys(keys))


def is_loopback(host: str) -> bool:
    """True for ``localhost`` and loopback addresses (``127.0.0.0/8``, ``::1``)."""
    if host.strip().lower() == "localhost":
        return True
    try:
        return ipaddress.ip_address(host.strip().strip("[]")).is_loopback
    except ValueError:
        return False


def _split_host(netloc: str) -> str:
    """The host of ``host[:port]`` / ``[v6]:port``, lower-cased."""
    netloc = netloc.strip().lower()
    if netloc.startswith("["):
        return netloc[1:netloc.find("]")] if "]" in netloc else netloc
    return netloc.rsplit(":", 1)[0] if netloc.count(":") == 1 else netloc


def host_allowed(host_header: str | None, allowed: Iterable[str] = ()) -> bool:
    """True when a request's ``Host`` header names a loopback host (``localhost``, ``127.x``,
    ``[::1]``) or one of ``allowed`` (host names, compared without the port; ``"*"``: any)."""
    allowed = {a.strip().lower() for a in allowed}
    if "*" in allowed:
        return True
    if not host_header:
        return False
    host = _split_host(host_header)
    return is_loopback(host) or host in allowed


def origin_allowed(origin: str | None, allowed: Iterable[str] = ()) -> bool:
    """True for no ``Origin`` header (not a browser's cross-origin request) or one whose host is
    loopback or in ``allowed`` (``"*"``: any)."""
    if origin is None:
        return True
    scheme, sep, rest = origin.partition("://")
    if not sep or scheme.lower() not in ("http", "https"):
        return "*" in {a.strip() for a in allowed}  # "null" (a file or sandboxed page) and the like
    return host_allowed(rest.split("/", 1)[0], allowed)


class ApiKeys:
    """The configured keys (none: no authentication, every request is owner None); ``admin``:
    keys that also see every tenant's figures (they are keys too)."""

    def __init__(self, keys: Iterable[str] = (), salt: bytes = LEGACY_SALT, admin: Iterable[str] = ()):
        admin = list(admin)
        keys = [*keys, *admin]
        for k in keys:
            if not isinstance(k, str) or not k:
                raise ValueError(f"an API key must be a non-empty string; got {k!r}")
        self._digests = [hashlib.sha256(k.encode()).digest() for k in dict.fromkeys(keys)]
        self._owners = [key_id(k, salt) for k in dict.fromkeys(keys)]
        self._admins = frozenset(key_id(k, salt) for k in admin)

    def is_admin(self, owner: str | None) -> bool:
        """True for the owner id of an admin key."""
        return owner is not None and owner in self._admins

    @property
    def enabled(self) -> bool:
        return bool(self._digests)

    def __len__(self) -> int:
        return len(self._digests)

    def owner(self, authorization: str | None) -> str | None:
        """The owner id of the request's ``Authorization`` header; :class:`ApiError`
        ``invalid_api_key`` (401) without a known key. None when no key is configured."""
        if not self._digests:
            return None
        header = authorization or ""
        scheme, _, given = header.partition(" ")
        digest = hashlib.sha256(given.strip().encode()).digest()
        found = None
        for d, owner in zip(self._digests, self._owners):  # every key, each time: no early exit
            if hmac.compare_digest(digest, d):
                found = owner
        if scheme.lower() != "bearer" or not given.strip() or found is None:
            what = "no API key" if not header else "an incorrect API key"
            raise ApiError("invalid_api_key", f"{what} was provided: send one of the server's keys as "
                                              "'Authorization: Bearer <key>'")
        return found
