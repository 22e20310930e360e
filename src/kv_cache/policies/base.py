"""The eviction-policy contract: a policy only scores tokens; the cache selects and frees.

A policy is a small dataclass. It says whether it needs attention statistics
(``needs_attention``), when it evicts (``prefill_only``) and implements
:meth:`EvictionPolicy.score`, returning ``[batch, kv_heads, kept_len]`` scores. Top-k, forced
tokens (sinks, recent window, the cache's full-precision residual), padding and the physical
gather are done once, in :class:`kv_cache.cache.layer.CompressedLayer`, with
:func:`kv_cache.compression.select_tokens`.
"""

from __future__ import annotations

from abc import ABC, abstractmethod
from dataclasses import dataclass, fields
from typing import ClassVar

import torch

from ..compression.selection import check_budget, resolve_budget


@dataclass
class ScoreInputs:
    """What a policy may look at, for one layer after its attention call (``T`` kept slots).

    Attributes
    ----------
    shape : tuple of int
        ``(batch, kv_heads, T)``: the shape of the scores to return.
    keys : torch.Tensor or None, shape ``[batch, kv_heads, T, head_dim]``
        Keys attention just used (dequantized), post-RoPE; None when ``attention`` is given.
    query : torch.Tensor or None, shape ``[batch, q_heads, n, head_dim]``
        The last ``n = query_window(q_len)`` post-RoPE queries (reference attention path).
    key_valid : torch.Tensor or None, shape ``[batch, T]`` or ``[batch, kv_heads, T]``, bool
        False for padding; None when every key is valid.
    scaling : float
    state : dict
        Per-layer state the policy keeps (e.g. H2O's accumulated scores), gathered by the
        cache whenever tokens are evicted (tensors of shape ``[batch, kv_heads, T']``).
    attention : torch.Tensor or None, shape ``[batch, q_heads, T]``, float32
        Attention probabilities of the last ``n`` queries summed over those queries, per
        query head, as computed by the attention itself (:mod:`kv_cache.attention`); None on
        the reference path, where the policy computes them from ``query`` and ``keys``.
    attention_queries : int
        ``n``, the number of queries summed into ``attention``.
    device : torch.device or None
        Where the layer's tensors live: scores made from nothing but positions go there (None:
        the CPU).
    hidden : torch.Tensor or None, shape ``[batch, q_len, hidden_size]``
        The hidden states entering the layer's attention for this call's ``q_len`` tokens (the
        last ``q_len`` of the ``T`` slots), for a policy with ``needs_hidden`` (KVzap); None
        otherwise.
    layer_idx : int
        The layer being scored.
    """

    shape: tuple[int, int, int]
    keys: torch.Tensor | None
    query: torch.Tensor | None
    key_valid: torch.Tensor | None
    scaling: float
    state: dict
    attention: torch.Tensor | None = None
    attention_queries: int = 0
    device: torch.device | None = None
    hidden: torch.Tensor | None = None
    layer_idx: int = 0


SCOPES = ("head", "layer", "model")
"""Who shares a token budget: every KV head its own (``head``), the KV heads of a layer one
top-k (``layer``, Ada-KV), or every head of every layer one top-k (``model``, KVzip)."""


SHARED_FIELDS = {"scope": "head", "head_floor": 0.2, "evict_every": 1, "target_ratio": None}
"""Fields of shared budgets and their per-head defaults (hidden from ``repr`` when equal)."""
LATER_FIELDS = {"continuation_queries": 0}
"""Fields added after policies were first saved, at the value that means "as before": hidden from
``repr`` and left out of saved files and plan fingerprints when equal, so an evaluation resumes and
an existing file loads with the same fingerprint."""


def check_target_ratio(policy: "EvictionPolicy") -> None:
    """Raise unless ``policy.target_ratio`` is None or a finite ratio > 1 with ``scope="model"``
    (the model-wide top-k is what it sizes, math dictionary §19.6)."""
    r, name = policy.target_ratio, type(policy).__name__
    if r is None:
        return
    if isinstance(r, bool) or not isinstance(r, (int, float)) or not 1.0 < r < float("inf"):
        raise ValueError(f"{name}.target_ratio must be None or a finite ratio > 1 (vs fp16); got {r!r}")
    if policy.scope != "model":
        raise ValueError(f"{name}.target_ratio sizes the model-wide budget: it needs scope='model'; got "
                         f"scope={policy.scope!r}")


def at_hidden_default(name: str, value, hidden: dict) -> bool:
    """Whether field ``name`` is one of ``hidden`` (:data:`SHARED_FIELDS`, :data:`LATER_FIELDS`)
    and holds its default there: such a field is left out of the repr and, for
    :data:`LATER_FIELDS`, of saved files and plan fingerprints."""
    return name in hidden and value == hidden[name]


@dataclass(repr=False)
class EvictionPolicy(ABC):
    """Base class. ``budget`` is a token count (int) or a fraction (float in (0, 1]) of the
    prompt length (resolved once, at the first forward call). ``recent_window`` is a token
    count (int) or a fraction (float in [0, 1]) of the resolved token budget: H2O's paper
    splits its budget evenly, ``H2O(budget=0.2, recent_window=0.5)`` = 10% heavy + 10% recent.

    ``scope`` (:data:`SCOPES`): ``"head"`` keeps ``budget`` tokens in every KV head; ``"layer"``
    and ``"model"`` keep ``budget`` tokens per head *on average*, chosen by one top-k over the
    heads of a layer or of the whole model (math dictionary §19), each head first keeping
    ``head_floor`` (a fraction of ``budget``) of its best tokens. Heads then hold different
    numbers of tokens (:class:`kv_cache.cache.ragged.RaggedStorage`): memory is the tokens kept."""

    budget: int | float = 0.5
    recent_window: int | float = 32
    sink_tokens: int = 0
    scope: str = "head"
    head_floor: float = 0.2

    needs_attention: ClassVar[bool] = False
    prefill_only: ClassVar[bool] = False
    needs_hidden: ClassVar[bool] = False
    """True for a policy scored from the hidden states entering each layer (KVzap): the layer
    hands them to :meth:`score` as ``ScoreInputs.hidden`` (captured by :func:`kv_cache.compress`)."""
    needs_reconstruction: ClassVar[bool] = False
    """True for a policy scored by a pass of its own after the prefill (KVzip's reconstruction),
    run by :func:`kv_cache.prefill`."""

    def __post_init__(self) -> None:
        check_budget(self.budget)
        if self.scope not in SCOPES:
            raise ValueError(f"{type(self).__name__}.scope must be one of {list(SCOPES)}; got {self.scope!r}")
        f = self.head_floor
        if isinstance(f, bool) or not isinstance(f, (int, float)) or not 0.0 <= f <= 1.0:
            raise ValueError(f"{type(self).__name__}.head_floor must be a fraction of the budget in [0, 1]; got {f!r}")
        v = self.sink_tokens
        if isinstance(v, bool) or not isinstance(v, int) or v < 0:
            raise ValueError(f"{type(self).__name__}.sink_tokens must be an int >= 0; got {v!r}")
        w = self.recent_window
        if isinstance(w, bool) or not isinstance(w, (int, float)) or w < 0 or (isinstance(w, float) and not w <= 1.0):
            raise ValueError(
                f"{type(self).__name__}.recent_window must be an int >= 0 (tokens) or a float in [0, 1] "
                f"(fraction of the budget); got {w!r}"
            )
        if isinstance(self.budget, int) and self.budget < self.window_tokens(self.budget) + self.sink_tokens:
            raise ValueError(
                f"{type(self).__name__}: budget ({self.budget}) must be >= recent_window + sink_tokens "
                f"({self.window_tokens(self.budget)} + {self.sink_tokens})"
            )

    def __repr__(self) -> str:
        """The dataclass repr, with :data:`SHARED_FIELDS` only where they differ from the
        per-head default: a per-head policy prints exactly as before shared budgets existed
        (``kvcache eval`` resumes by it)."""
        parts = []
        for f in fields(self):
            if not f.repr:
                continue
            v = getattr(self, f.name)
            if at_hidden_default(f.name, v, SHARED_FIELDS) or at_hidden_default(f.name, v, LATER_FIELDS):
                continue
            parts.append(f"{f.name}={v!r}")
        return f"{type(self).__name__}({', '.join(parts)})"

    def eviction_slack(self) -> int:
        """Tokens a head may hold beyond its budget before it is evicted while decoding
        (0: never over the budget; H2O's ``evict_every - 1``)."""
        return 0

    def floor_tokens(self, budget_tokens: int) -> int:
        """Tokens every head keeps first under a shared budget (``head_floor * budget``)."""
        return int(self.head_floor * budget_tokens)

    def window_tokens(self, budget_tokens: int) -> int:
        """Recent-window length in tokens for a resolved budget of ``budget_tokens``."""
        w = self.recent_window
        return int(w * budget_tokens) if isinstance(w, float) else int(w)

    def budget_tokens(self, layer_idx: int, prompt_len: int) -> int:
        """Token budget of ``layer_idx``; fractions resolve against the prompt length."""
        b = self.budget
        if isinstance(b, float):
            return resolve_budget(b, prompt_len)
        return int(b)

    def query_window(self, q_len: int, budget_tokens: int) -> int:
        """How many trailing queries of a ``q_len``-token forward call :meth:`score` needs.

        0 for a policy that needs no attention statistics; policies that do override it. The
        observer computes (or receives) only these queries.
        """
        return 0

    @abstractmethod
    def score(self, inputs: ScoreInputs) -> torch.Tensor:
        """Return float32 scores ``[batch, kv_heads, kept_len]``; higher is kept first."""
