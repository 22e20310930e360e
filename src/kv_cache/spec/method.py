"""A parsed method spec: :class:`Method` (how to make its cache) and the names every spec module
shares (:data:`REFERENCE_SPEC`, :data:`MAX_SPEC_CHARS`, :class:`MethodUnavailable`)."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, Callable

REFERENCE_SPEC = "full"  # the uncompressed cache every other method is measured against
MAX_SPEC_CHARS = 4096
"""The longest method spec :func:`parse_method` reads (a path in brackets included); every pattern
of the grammar is also free of nested or adjacent overlapping quantifiers, so its time is linear."""


class MethodUnavailable(RuntimeError):
    """A peer baseline whose package is missing; the message says what to install."""


@dataclass
class Method:
    """A parsed method spec.

    Attributes
    ----------
    spec : str
        The string as given.
    family : {"ours", "hf", "kvpress"}
    bits : int or None
        Quantization bits (None: full precision).
    budget : float or int or None
        Kept fraction/count of the context (None: all tokens).
    make : callable ``(model) -> (cache, context_manager_factory)``
    make_for_prompt : callable ``(model, prompt_tokens) -> (cache, context_manager_factory)``, or None
        What a caller that knows the prompt's length builds (:meth:`build`): a preset ``<r>x``
        chooses its eviction scorer for that length (math dictionary §23.5).
    prefill_only_context : bool
        True when the context manager must wrap only the prefill (kvpress presses); ours
        wraps every forward call (H2O observes decoding too).
    resolved : str
        Every setting the spec expands to (defaults included). Saved samples are reused on a
        restart only when it is unchanged, so a changed default never mixes into old results.
    requires : tuple of (import name, pip package), or None
        The optional package a peer needs.
    needs_tokenizer : bool
        The prefill is :func:`kv_cache.prefill` with the tokenizer (KVzip's reconstruction
        pass reads a repeat prompt).
    """

    spec: str
    family: str
    bits: int | None
    budget: float | int | None
    make: Callable[[Any], tuple[Any, Callable[[], Any]]] = field(repr=False)
    prefill_only_context: bool = False
    resolved: str = ""
    requires: tuple[str, str] | None = None
    needs_tokenizer: bool = False  # the prefill runs a reconstruction pass (KVzip): kv_cache.prefill
    file_ratio: float | None = None  # file<R>: saved transform-coded at ratio R and loaded back (kv_cache.codec)
    load_quant: Any = None  # q<...>+file<R>: the layout the file is loaded into (the prefill is full precision)
    make_for_prompt: Callable[[Any, int], tuple[Any, Callable[[], Any]]] | None = field(default=None, repr=False)

    def build(self, model: Any, prompt_tokens: int | None = None) -> tuple[Any, Callable[[], Any]]:
        """``(cache, context_manager_factory)`` for a prompt of ``prompt_tokens`` tokens (None:
        not known; :attr:`make`)."""
        if prompt_tokens is not None and self.make_for_prompt is not None:
            return self.make_for_prompt(model, prompt_tokens)
        return self.make(model)

    @property
    def is_peer(self) -> bool:
        return self.family != "ours"

    @property
    def is_reference(self) -> bool:
        """True for the uncompressed cache (``full``) that every other method is measured against."""
        return self.spec.strip().lower() == REFERENCE_SPEC
