"""What a retrieval task is asked to build (:class:`TaskRequest`) and the checks on it."""

from __future__ import annotations

import numbers
import random
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any

from ...compression._arrays import check_int
from .haystack import HAYSTACK_KINDS
from .prompts import resolve_chat
from .text import check_bool, check_text, check_tokenizer

__all__ = ["TaskRequest", "check_context_fits", "check_depths"]


def check_depths(depths: Any) -> list[float] | None:
    """Validate needle depths: ``None``, one float, or a non-empty sequence of floats in [0, 1].

    Parameters
    ----------
    depths : float, sequence of float, or None
        Requested depths.

    Returns
    -------
    list of float or None
        The depths as floats (a single number becomes a one-element list).

    Raises
    ------
    TypeError
        If ``depths`` is not a number, a sequence of numbers or ``None``.
    ValueError
        If the sequence is empty or a depth lies outside ``[0, 1]``.
    """
    if depths is None:
        return None
    if isinstance(depths, numbers.Real) and not isinstance(depths, bool):
        depths = [depths]
    if isinstance(depths, (str, bytes)) or not isinstance(depths, Sequence):
        raise TypeError(f"depths must be None or a sequence of floats in [0, 1], got {depths!r}")
    if len(depths) == 0:
        raise ValueError("depths must be None or a non-empty sequence of floats in [0, 1], got []")
    out = []
    for d in depths:
        if isinstance(d, bool) or not isinstance(d, numbers.Real):
            raise TypeError(f"depths must contain floats in [0, 1], got {d!r}")
        d = float(d)
        if not (0.0 <= d <= 1.0):
            raise ValueError(f"depths must be in [0, 1], got {d}")
        out.append(d)
    return out


@dataclass(frozen=True)
class TaskRequest:
    """The arguments every retrieval task shares, checked once at construction.

    The caller builds one request and passes it to :func:`~kv_cache.eval.tasks.build_task`,
    which hands it unchanged to the task's builder.  Construction validates every field and
    normalises ``text`` (CRLF, see :func:`~kv_cache.eval.tasks.normalize_text`) and
    ``depths`` (a tuple of floats), so an existing request is a valid one.

    Attributes
    ----------
    tokenizer : transformers tokenizer
        The model's (fast) tokenizer.
    text : str or None
        Haystack text (CRLF is normalised); may be ``None`` with ``haystack="noise"``.
        Left out of ``repr`` (it is usually a whole book).
    context : int
        Target prompt length in tokens, >= 1.
    num_samples : int
        Number of samples, >= 1.
    depths : sequence of float in [0, 1], float or None, default None
        Depth of the first target needle, as a fraction of the haystack; sample ``i`` uses
        ``depths[i % len(depths)]``.  ``None`` draws a uniform depth per sample (``vt``: the
        chain's hops at sorted uniform depths).  Needles are snapped to a sentence or line
        start (see :data:`~kv_cache.eval.tasks.SNAP_FRACTION`) when there is one nearby.
        Ignored by ``cwe``.  Stored as a tuple.
    seed : int, default 0
        Seed; the same request gives identical samples.
    haystack : {"text", "noise"}, default "text"
        ``"text"``: a window of ``text`` starting at a seeded random sentence start.
        ``"noise"``: RULER's repeated noise sentences (``cwe``: seeded pseudo-words instead
        of the text's vocabulary).
    query_aware : bool, default False
        Recorded in each sample's ``metadata["fit"]``; both renderings of
        :func:`~kv_cache.eval.tasks.build_prompt` have the same length.
    chat : bool or None, default None
        Fit the length for the chat-template rendering; ``None`` uses the chat template when
        the tokenizer has one (see :attr:`use_chat`).

    Raises
    ------
    TypeError
        If a field has the wrong type (e.g. ``context="500"``, ``seed=1.5``).
    ValueError
        If a field is out of range, ``haystack`` is unknown, ``text`` is ``None`` with
        ``haystack="text"``, or ``chat=True`` for a tokenizer without a chat template.
    """

    tokenizer: Any
    text: str | None = field(repr=False)
    context: int
    num_samples: int
    depths: Sequence[float] | None = None
    seed: int = 0
    haystack: str = "text"
    query_aware: bool = False
    chat: bool | None = None

    def __post_init__(self) -> None:
        check_tokenizer(self.tokenizer)
        if self.haystack not in HAYSTACK_KINDS:
            raise ValueError(f"haystack must be one of {HAYSTACK_KINDS}, got {self.haystack!r}")
        text = self.text
        if text is None:
            if self.haystack == "text":
                raise ValueError(
                    "text is required with haystack='text' (got None); use haystack='noise'"
                )
        else:
            text = check_text(text)
        context = check_int(self.context, "context", minimum=1)
        num_samples = check_int(self.num_samples, "num_samples", minimum=1)
        seed = check_int(self.seed, "seed")
        check_bool(self.query_aware, "query_aware")
        resolve_chat(self.tokenizer, self.chat)  # raises for chat=True without a template
        depths = check_depths(self.depths)
        # Frozen: the normalised values are written once, here, and never again.
        object.__setattr__(self, "text", text)
        object.__setattr__(self, "context", context)
        object.__setattr__(self, "num_samples", num_samples)
        object.__setattr__(self, "seed", seed)
        object.__setattr__(self, "depths", None if depths is None else tuple(depths))

    @property
    def use_chat(self) -> bool:
        """Whether prompts are rendered (and fitted) with the tokenizer's chat template."""
        return resolve_chat(self.tokenizer, self.chat)

    def rngs(self, task: str) -> list[random.Random]:
        """One private generator per sample, derived from ``task`` and :attr:`seed` only."""
        master = random.Random(f"kv_cache.eval:{task}:{self.seed}")
        return [random.Random(master.getrandbits(64)) for _ in range(self.num_samples)]


def check_context_fits(context: int, model_max_positions: int, *, max_new_tokens: int = 0) -> None:
    """Raise if a task's prompt plus generated tokens exceed the model's positions.

    Parameters
    ----------
    context : int
        Prompt length in tokens requested for the task.
    model_max_positions : int
        The model's maximum sequence length (``config.max_position_embeddings``).
    max_new_tokens : int, default 0
        Tokens that will be generated after the prompt.

    Raises
    ------
    ValueError
        If ``context + max_new_tokens > model_max_positions``.
    """
    context = check_int(context, "context", minimum=1)
    model_max_positions = check_int(model_max_positions, "model_max_positions", minimum=1)
    max_new_tokens = check_int(max_new_tokens, "max_new_tokens", minimum=0)
    total = context + max_new_tokens
    if total > model_max_positions:
        raise ValueError(
            f"the task needs {total} positions ({context} context tokens + {max_new_tokens} "
            f"generated tokens) but the model supports at most {model_max_positions} "
            f"(max_position_embeddings); use context <= {model_max_positions - max_new_tokens}"
        )
