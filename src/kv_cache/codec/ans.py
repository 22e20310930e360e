"""Entropy coding of the storage codec: range-ANS from ``constriction`` (math dictionary §27.3).

Symbols are integers in ``[-MAX_SYMBOL, MAX_SYMBOL]``, each coded under a Laplace model of its
own scale (``b`` of its component) quantized to unit bins: ``constriction``'s
``QuantizedLaplace`` with ``mean 0``. No entropy coder is written here; this module only checks
what goes in and out.
"""

from __future__ import annotations

import numpy as np

from .allocation import MAX_SYMBOL, MIN_SCALE


class CodecStreamError(ValueError):
    """A coded stream that does not decode to what its header says (damaged or hostile)."""


def _model():
    import constriction

    return constriction.stream.model.QuantizedLaplace(-MAX_SYMBOL, MAX_SYMBOL + 1)


def encode(symbols: np.ndarray, scales: np.ndarray) -> np.ndarray:
    """Code ``symbols`` ``[n]`` int32 with per-symbol Laplace ``scales`` ``[n]`` (float, in steps);
    returns the compressed words ``[w]`` uint32."""
    import constriction

    symbols = np.ascontiguousarray(symbols, dtype=np.int32)
    scales = np.ascontiguousarray(scales, dtype=np.float64)
    if symbols.shape != scales.shape or symbols.ndim != 1:
        raise ValueError(f"ans.encode: symbols and scales must be 1-D of one length; got {symbols.shape}, {scales.shape}")
    if symbols.size and (np.abs(symbols).max() > MAX_SYMBOL):
        raise ValueError(f"ans.encode: symbols must be in [-{MAX_SYMBOL}, {MAX_SYMBOL}]")
    if scales.size and not (np.isfinite(scales).all() and scales.min() >= MIN_SCALE):
        raise ValueError(f"ans.encode: scales must be finite and >= {MIN_SCALE}")
    coder = constriction.stream.stack.AnsCoder()
    if symbols.size:
        coder.encode_reverse(symbols, _model(), np.zeros_like(scales), scales)
    return np.ascontiguousarray(coder.get_compressed(), dtype=np.uint32)


def decode(words: np.ndarray, scales: np.ndarray) -> np.ndarray:
    """Decode ``len(scales)`` symbols (int32) from ``words`` coded by :func:`encode` with the
    same ``scales``. Raises :class:`CodecStreamError` when the words run out or are left over."""
    import constriction

    scales = np.ascontiguousarray(scales, dtype=np.float64)
    if scales.size and not (np.isfinite(scales).all() and scales.min() >= MIN_SCALE):
        raise CodecStreamError(f"a coded stream's scales must be finite and >= {MIN_SCALE}")
    words = np.ascontiguousarray(words, dtype=np.uint32)
    if not scales.size:
        if words.size:
            raise CodecStreamError(f"a coded stream holds {words.size} words but no symbols")
        return np.zeros(0, dtype=np.int32)
    try:
        coder = constriction.stream.stack.AnsCoder(words)
        out = coder.decode(_model(), np.zeros_like(scales), scales)
    except Exception as exc:  # constriction reports a stream that ran out in its own exception types
        raise CodecStreamError(f"a coded stream does not decode: {exc}") from None
    if not coder.is_empty():
        raise CodecStreamError("a coded stream holds more words than its symbols use (damaged or not this header's)")
    return np.asarray(out, dtype=np.int32)


__all__ = ["CodecStreamError", "decode", "encode"]
