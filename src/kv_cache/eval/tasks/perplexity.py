"""Continuation-perplexity windows: fixed-length token windows cut from a text.

The first ``prefix_len`` tokens of each window are the part whose KV cache gets compressed; the
rest is the continuation whose perplexity is measured.
"""

from __future__ import annotations

import logging
from dataclasses import dataclass
from typing import Any

from ...compression._arrays import check_int
from .text import check_bool, check_text, check_tokenizer, chars_per_token, encode

logger = logging.getLogger(__name__)

__all__ = ["PplSample", "perplexity_windows"]


@dataclass(frozen=True)
class PplSample:
    """One continuation-perplexity window.

    Attributes
    ----------
    input_ids : list of int
        Exactly ``context`` token ids.
    prefix_len : int
        Number of leading tokens that form the compressed prefix; the remaining
        ``len(input_ids) - prefix_len`` tokens are the continuation.
    start : int
        Offset of the window's first text token in the tokenized text.
    index : int
        Position of the window in the returned list.
    """

    input_ids: list[int]
    prefix_len: int
    start: int
    index: int

    @property
    def prefix_ids(self) -> list[int]:
        """Token ids of the compressed prefix."""
        return self.input_ids[: self.prefix_len]

    @property
    def continuation_ids(self) -> list[int]:
        """Token ids of the continuation (scored by perplexity)."""
        return self.input_ids[self.prefix_len :]


def perplexity_windows(
    tokenizer: Any,
    text: str,
    *,
    context: int,
    prefix_len: int,
    num_windows: int,
    stride: int | None = None,
    add_bos: bool = False,
) -> list[PplSample]:
    """Cut continuation-perplexity windows from a text.

    The text is CRLF-normalised and tokenized **without** special tokens, so a
    window holds plain text tokens only (no BOS, even for tokenizers such as
    Llama's that add one by default).  With ``add_bos=True`` each window instead
    starts with ``tokenizer.bos_token_id`` followed by ``context - 1`` text
    tokens (the BOS counts towards ``prefix_len``).  Windows start at the
    beginning of the text and advance by ``stride`` tokens.

    Parameters
    ----------
    tokenizer : transformers tokenizer
        The model's tokenizer.
    text : str
        Source text (e.g. WikiText-2 test split).
    context : int
        Tokens per window, >= 2.
    prefix_len : int
        Leading tokens of each window that form the compressed prefix,
        ``1 <= prefix_len < context``.
    num_windows : int
        Number of windows, >= 1.
    stride : int, optional
        Distance in text tokens between window starts; defaults to the window
        width (non-overlapping windows).
    add_bos : bool, default False
        Prepend the BOS token to each window.

    Returns
    -------
    list of PplSample
        ``num_windows`` windows of exactly ``context`` tokens.

    Raises
    ------
    ValueError
        If the arguments are out of range or the text has too few tokens.
    """
    check_tokenizer(tokenizer)
    text = check_text(text)
    context = check_int(context, "context", minimum=2)
    prefix_len = check_int(prefix_len, "prefix_len", minimum=1)
    num_windows = check_int(num_windows, "num_windows", minimum=1)
    add_bos = check_bool(add_bos, "add_bos")
    if prefix_len >= context:
        raise ValueError(
            f"prefix_len must be < context ({context}) so the continuation is non-empty, "
            f"got {prefix_len}"
        )
    bos_id = None
    if add_bos:
        bos_id = getattr(tokenizer, "bos_token_id", None)
        if bos_id is None:
            raise ValueError("add_bos=True but the tokenizer has no bos_token_id")
    width = context - 1 if add_bos else context
    stride = width if stride is None else check_int(stride, "stride", minimum=1)
    needed = (num_windows - 1) * stride + width

    ids = _tokenize_prefix(tokenizer, text, needed)
    if len(ids) < needed:
        raise ValueError(
            f"text too short: it has {len(ids)} tokens but {num_windows} window(s) of "
            f"{context} tokens with stride {stride} need {needed} tokens"
        )
    samples = []
    for i in range(num_windows):
        start = i * stride
        window = ids[start : start + width]
        if bos_id is not None:
            window = [int(bos_id)] + window
        samples.append(PplSample(input_ids=window, prefix_len=prefix_len, start=start, index=i))
    logger.debug("built %d perplexity windows of %d tokens", num_windows, context)
    return samples


def _tokenize_prefix(tokenizer: Any, text: str, needed: int) -> list[int]:
    """Tokens of the start of ``text``: at least ``needed`` of them if it has that many.

    Only a character prefix is tokenized; tokens near the cut (which could merge
    differently in the full text) are dropped.
    """
    margin = 16
    n_chars = int((needed + margin) * chars_per_token(tokenizer, text) * 1.25) + 1000
    while True:
        if n_chars >= len(text):
            return encode(tokenizer, text, special=False)
        ids = encode(tokenizer, text[:n_chars], special=False)
        if len(ids) >= needed + margin:
            return ids[:needed]
        n_chars *= 2
