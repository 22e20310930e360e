"""A document's tokens against the model's positions: the ids of a text, what fits
(:func:`max_context_tokens`: ``max_position_embeddings``, less the room KVzip's reconstruction
pass reads after the context) and :func:`fit_context`, which cuts a document only when told
what to keep."""

from __future__ import annotations

from typing import Any, Sequence

from ..policies.kvzip import CONTINUE_PROMPT, REPEAT_PROMPT

def token_ids(tokenizer: Any, text: str) -> list[int]:
    if hasattr(tokenizer, "encode"):
        try:
            return list(tokenizer.encode(text, add_special_tokens=False))
        except TypeError:
            return list(tokenizer.encode(text))
    raise TypeError(f"tokenizer must have an encode() method; got {type(tokenizer).__name__}")


KEEP = ("head", "tail")
"""Which part of a document :func:`fit_context` keeps when it cuts it: the first or the last tokens."""


def max_positions(config: Any) -> int | None:
    """The positions a model was trained on (``max_position_embeddings`` of its text config);
    None when the config does not say."""
    text = config.get_text_config() if hasattr(config, "get_text_config") else config
    n = getattr(text, "max_position_embeddings", None)
    return n if isinstance(n, int) and not isinstance(n, bool) and n > 0 else None


def reconstruction_positions(context_tokens: int, eviction: Any, tokenizer: Any, first: int = 0) -> int:
    """Positions KVzip's reconstruction pass (:func:`reconstruct`) reads after a context of
    ``context_tokens`` tokens: its longest chunk, repeat prompt (or continue prompt + overlap)
    included; every chunk starts at the position after the context. 0 for a policy without the
    pass. ``first``: 1 when the context starts with a BOS token, which is not repeated."""
    if eviction is None or not eviction.needs_reconstruction or context_tokens <= first:
        return 0
    repeat, cont = len(token_ids(tokenizer, REPEAT_PROMPT)), len(token_ids(tokenizer, CONTINUE_PROMPT))
    c, longest = eviction.chunk_size, 0
    for s in range(first, context_tokens, c):  # as reconstruct() feeds them
        head = repeat if s == first else cont + s - max(first, s - eviction.overlap)
        longest = max(longest, head + min(context_tokens, s + c) - s)
    return longest


def max_context_tokens(config: Any, tokenizer: Any, eviction: Any = None, first: int = 0) -> int | None:
    """How many context tokens :meth:`CompressedContext.build` takes on a model with this
    config: its positions (:func:`max_positions`), less what KVzip's reconstruction pass reads
    after the context (:func:`reconstruction_positions`). None when the model does not say. A
    question and its answer need positions after the context too (:meth:`CompressedContext.ask`
    checks them)."""
    limit = max_positions(config)
    if limit is None:
        return None
    lo, hi = 0, limit  # the largest n with n + pass(n) <= limit; n + pass(n) grows with n
    while lo < hi:
        mid = (lo + hi + 1) // 2
        if mid + reconstruction_positions(mid, eviction, tokenizer, min(first, mid - 1)) <= limit:
            lo = mid
        else:
            hi = mid - 1
    return lo


def fit_context(ids: Sequence[int], config: Any, tokenizer: Any, eviction: Any = None, *,
                max_tokens: int | None = None, keep: str | None = None,
                names: tuple[str, str] = ("max_tokens=", "keep=")) -> list[int]:
    """The context ids :meth:`CompressedContext.build` prefills: ``ids`` unchanged when they fit
    the model's positions, cut when ``max_tokens`` / ``keep`` say what to keep, refused otherwise.

    Parameters
    ----------
    max_tokens : int >= 1 or None
        Keep at most this many tokens (a leading BOS included); it must fit
        (:func:`max_context_tokens`). None: the whole document, which must fit.
    keep : ``"head"``, ``"tail"`` or None
        Which tokens ``max_tokens`` keeps: the first (``"head"``, the default) or the last
        (``"tail"``, after a leading BOS token, which stays first). Only with ``max_tokens``.
    names : the option names used in error messages, as they are written before a value
        (``kvcache compress`` passes ``("--max-tokens ", "--keep ")``).

    Raises
    ------
    ValueError
        ``max_tokens`` not an int >= 1, or more than fits; ``keep`` not in :data:`KEEP`, or
        without ``max_tokens``; a document longer than fits without ``max_tokens`` (the
        message names its token count, the model's positions, what fits and the option).
    """
    opt_max, opt_keep = names
    n_max, n_keep = opt_max.rstrip("= "), opt_keep.rstrip("= ")
    if max_tokens is not None and (isinstance(max_tokens, bool) or not isinstance(max_tokens, int) or max_tokens < 1):
        raise ValueError(f"{n_max} must be an int >= 1 or None; got {max_tokens!r}")
    if keep is not None and keep not in KEEP:
        raise ValueError(f"{n_keep} must be one of {list(KEEP)} or None; got {keep!r}")
    ids = list(ids)
    if keep is not None and max_tokens is None:
        given = f"{opt_keep}{keep if opt_keep.endswith(' ') else repr(keep)}"
        raise ValueError(f"{n_keep} says which tokens {n_max} keeps; got {given} without {n_max}: "
                         f"pass {opt_max}N as well")
    bos = getattr(tokenizer, "bos_token_id", None)
    first = 1 if len(ids) > 1 and bos is not None and ids[0] == bos else 0
    fits = max_context_tokens(config, tokenizer, eviction, first)
    if fits is not None:
        limit = max_positions(config)
        why = f"the model has {limit:,} positions (max_position_embeddings)"
        if fits < limit:
            why += (f" and {type(eviction).__name__}'s reconstruction pass reads up to "
                    f"{reconstruction_positions(max(fits, 1), eviction, tokenizer, first):,} more after the context "
                    f"(chunk_size={eviction.chunk_size})")
        if fits < 1:
            raise ValueError(f"no context fits: {why}")
        if max_tokens is not None and max_tokens > fits:
            raise ValueError(f"{opt_max}{max_tokens} does not fit: {why}, so at most {fits:,} context tokens fit")
        if max_tokens is None and len(ids) > fits:
            values = " or ".join(repr(k) if opt_keep.endswith("=") else k for k in KEEP)
            raise ValueError(
                f"the document is {len(ids):,} tokens but {why}: at most {fits:,} context tokens fit; "
                f"pass {opt_max}N (N <= {fits:,}, leaving room for the questions) to compress the first N "
                f"tokens, with {opt_keep}{values} to choose the part"
            )
    if max_tokens is None or len(ids) <= max_tokens:
        return ids
    if keep == "tail":
        return ids[:first] + ids[len(ids) - (max_tokens - first):] if max_tokens > first else ids[:max_tokens]
    return ids[:max_tokens]


def text_token_ids(tokenizer: Any, text: str) -> list[int]:
    """Token ids of a context text, with the special tokens (BOS) the tokenizer adds."""
    return list(tokenizer(text).input_ids) if callable(tokenizer) else token_ids(tokenizer, text)


def check_text(text: Any, what: str = "the context text") -> str:
    """Refuse a text that is not a ``str``, is empty (or whitespace only) or holds NUL
    characters (binary data decoded as text)."""
    if not isinstance(text, str):
        raise TypeError(f"{what} must be a str; got {type(text).__name__}")
    if not text.strip():
        raise ValueError(f"{what} is empty" + (f" ({len(text)} whitespace characters)" if text else ""))
    nul = text.find("\x00")
    if nul >= 0:
        raise ValueError(f"{what} holds a NUL character at offset {nul}: binary data, not text")
    return text


_ids = token_ids  # the names other modules used before these were public
_text_ids = text_token_ids
