"""What ``kvcache compress``, the server and lm-eval take from a method spec: our own methods only,
as the :class:`~kv_cache.QuantConfig` and eviction policy they build."""

from __future__ import annotations

from typing import Any

from ..cache import CompressedCache
from .grammar import parse_method


def parse_ours(spec: str, bits: int | None) -> tuple[Any, str]:
    """``(method, spec)``: an ``kvcache eval`` method spec (ours only), ``bits`` prefixed; no model needed."""
    if bits is not None:
        spec = f"q{bits}+{spec}"
    method = parse_method(spec, check_packages=False)  # a peer is refused below, installed or not
    if method.family != "ours":
        raise ValueError(f"--method {spec!r} is a peer's method; `kvcache compress` takes kv_cache's own "
                         "(e.g. kvzip@0.3, q4+kvzip@0.3, q4htc8l, snapkv@0.5:layer, full)")
    return method, spec


def method_settings(spec: str, bits: int | None, model: Any) -> tuple[Any, Any, str]:
    """``(quant, eviction, spec)`` of an ``kvcache eval`` method spec (ours only), ``bits`` prefixed."""
    method, spec = parse_ours(spec, bits)
    cache, _ = method.make(model)
    if not isinstance(cache, CompressedCache):  # "full": the uncompressed cache
        return None, None, spec
    return cache.quant, cache.eviction, spec
