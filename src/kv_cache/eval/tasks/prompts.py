"""Retrieval prompts: the sample, its chat/plain rendering, its token count and length fitting.

A fitted retrieval prompt has ``context - CONTEXT_SLACK <= tokens <= context``
(:func:`fit_length` finds the largest haystack that fits).
"""

from __future__ import annotations

import math
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

from .text import check_bool, encode

__all__ = [
    "CONTEXT_SLACK",
    "RetrievalSample",
    "build_prompt",
    "count_prompt_tokens",
    "format_chat",
    "has_chat_template",
]

#: A fitted retrieval prompt has ``context - CONTEXT_SLACK <= tokens <= context``.
#: Text and noise haystacks are cut token by token and usually land exactly on
#: ``context``; common-words lists are cut item by item (one ``"123. word"``
#: entry is a few tokens), which is what this bound is sized for.
CONTEXT_SLACK = 16


@dataclass(frozen=True)
class RetrievalSample:
    """One synthetic retrieval example.

    Attributes
    ----------
    task : str
        Task name, a key of :data:`~kv_cache.eval.tasks.TASKS`.
    context : str
        The haystack with the needles inserted (the part to be compressed).
    question : str
        The question asked after the context.
    answer_prefix : str
        Start of the answer, appended after the question (or after the chat
        template's generation prompt); the model continues it greedily.
    expected : list of str
        Strings that must all appear in the answer (RULER ``string_match_all``).
    depth : float or None
        Requested depth in ``[0, 1]`` of the first target needle (``None`` for
        ``cwe``, which has no needle).
    metadata : dict
        Task-specific details: ``needles``, ``needle_positions`` (character
        offsets in ``context``), ``needle_depths`` (insertion offset in the
        needle-free haystack / its length),
        ``num_tokens`` (token count of the fitted prompt), ``fit`` (the
        ``query_aware``/``chat`` rendering the length was fitted for),
        ``max_new_tokens``, ``haystack``, ``seed`` and more.
    instruction : str
        Task instruction placed before the context (RULER's template head).
    """

    task: str
    context: str
    question: str
    answer_prefix: str
    expected: list[str]
    depth: float | None
    metadata: dict[str, Any] = field(default_factory=dict)
    instruction: str = ""


# --------------------------------------------------------------------- chat template
def has_chat_template(tokenizer: Any) -> bool:
    """Whether ``tokenizer`` carries a chat template."""
    return bool(getattr(tokenizer, "chat_template", None))


def format_chat(tokenizer: Any, user_text: str) -> str:
    """Wrap a user message in the tokenizer's chat template, if it has one.

    Parameters
    ----------
    tokenizer : transformers tokenizer
        The model's tokenizer.
    user_text : str
        Content of the single user turn.

    Returns
    -------
    str
        ``tokenizer.apply_chat_template([{"role": "user", "content": user_text}],
        add_generation_prompt=True, tokenize=False)``, or ``user_text`` unchanged
        when the tokenizer has no chat template.
    """
    if not isinstance(user_text, str):
        raise TypeError(f"user_text must be a str, got {type(user_text).__name__}")
    if not has_chat_template(tokenizer):
        return user_text
    out = tokenizer.apply_chat_template(
        [{"role": "user", "content": user_text}], add_generation_prompt=True, tokenize=False
    )
    if not isinstance(out, str):
        raise TypeError(f"apply_chat_template returned {type(out).__name__}, expected str")
    return out


def resolve_chat(tokenizer: Any, chat: bool | None) -> bool:
    """Whether to render with the chat template: ``None`` means "when the tokenizer has one"."""
    if chat is None:
        return has_chat_template(tokenizer)
    chat = check_bool(chat, "chat")
    if chat and not has_chat_template(tokenizer):
        raise ValueError("chat=True but the tokenizer has no chat template; use chat=None or False")
    return chat


# --------------------------------------------------------------------- rendering
def build_prompt(
    sample: RetrievalSample,
    tokenizer: Any,
    *,
    query_aware: bool,
    chat: bool | None = None,
) -> tuple[str, str]:
    """Split a sample's prompt into the part to compress and the part fed after compression.

    Both modes render the same prompt (RULER's layout: instruction, context, then the question;
    with a chat template, the user turn followed by the generation prompt and the answer
    prefix), so the full cache sees identical tokens; only the compression boundary moves.

    * Query-agnostic (``query_aware=False``): ``context_text`` is the instruction and the
      haystack; the question is fed only after compression (kvpress' default pipeline).
    * Query-aware (``query_aware=True``): ``context_text`` ends with the question, so the
      compression method observes it (SnapKV's observation window is then the question, as in
      the SnapKV paper; kvpress' ``compress_questions``); what follows is only the chat
      template's tail and the answer prefix.

    Without a chat template the prompt is ``instruction + context + "\\n" + question + " " +
    answer_prefix``.

    Parameters
    ----------
    sample : RetrievalSample
        The example.
    tokenizer : transformers tokenizer
        The model's tokenizer.
    query_aware : bool
        Compress the question together with the context.
    chat : bool or None, default None
        Use the chat template; ``None`` uses it when the tokenizer has one.

    Returns
    -------
    tuple of (str, str)
        ``(context_text, question_text)``.  Tokenize ``context_text`` with the
        tokenizer's special tokens (as :func:`count_prompt_tokens` does) and
        ``question_text`` without.
    """
    if not isinstance(sample, RetrievalSample):
        raise TypeError(f"sample must be a RetrievalSample, got {type(sample).__name__}")
    query_aware = check_bool(query_aware, "query_aware")
    use_chat = resolve_chat(tokenizer, chat)
    user_ctx = sample.instruction + sample.context
    user_text = user_ctx + "\n" + sample.question
    if not use_chat:
        full = user_text + " " + sample.answer_prefix
        split = len(user_text) if query_aware else len(user_ctx)
        return full[:split], full[split:]
    full = format_chat(tokenizer, user_text)
    idx = full.find(user_text)
    if idx < 0:
        raise ValueError(
            "the chat template altered the user message, so the prompt cannot be split "
            "into context and question; pass chat=False"
        )
    split = idx + len(user_text if query_aware else user_ctx)
    return full[:split], full[split:] + sample.answer_prefix


def count_prompt_tokens(tokenizer: Any, prompt: str) -> int:
    """Number of tokens of a full prompt, as the model will see it.

    This is ``len(tokenizer(prompt).input_ids)`` (special tokens such as a BOS
    are added when the tokenizer adds them), except that no second BOS is
    counted when the prompt text already starts with the BOS token string (some
    chat templates emit it).

    Parameters
    ----------
    tokenizer : transformers tokenizer
        The model's tokenizer.
    prompt : str
        The full prompt text.

    Returns
    -------
    int
        Token count.
    """
    bos = getattr(tokenizer, "bos_token", None)
    special = not (isinstance(bos, str) and bos and prompt.startswith(bos))
    return len(encode(tokenizer, prompt, special=special))


def prompt_tokens(sample: RetrievalSample, tokenizer: Any, query_aware: bool, chat: bool) -> int:
    """Token count of ``sample``'s full prompt rendered by :func:`build_prompt`."""
    ctx, q = build_prompt(sample, tokenizer, query_aware=query_aware, chat=chat)
    return count_prompt_tokens(tokenizer, ctx + q)


# --------------------------------------------------------------------- length fitting
def fit_length(
    render: Callable[[int], tuple[Any, int]],
    context: int,
    lo: int,
    hi: int,
    guess: int,
    tokens_per_unit: float = 1.0,
) -> tuple[int, Any, int]:
    """Largest ``k`` in ``[lo, hi]`` whose rendered prompt has ``<= context`` tokens.

    ``render(k)`` returns ``(payload, n_tokens)``; the token count is assumed to
    grow (roughly) monotonically with ``k``.  Secant steps with bisection
    fallback; returns ``(k, payload, n_tokens)``.
    """
    best: tuple[int, Any, int] | None = None
    fail: int | None = None  # smallest k known to be too long
    k = min(max(guess, lo), hi)
    for _ in range(60):
        payload, n = render(k)
        if n <= context:
            if best is None or k > best[0]:
                best = (k, payload, n)
            if n == context:
                break
            nk = k + max(1, int((context - n) / tokens_per_unit))
        else:
            fail = k if fail is None else min(fail, k)
            nk = k - max(1, math.ceil((n - context) / tokens_per_unit))
        low = best[0] + 1 if best is not None else lo
        high = fail - 1 if fail is not None else hi
        if low > high:
            break
        k = nk if low <= nk <= high else (low + high) // 2
    if best is None:
        n_min = render(lo)[1]
        raise ValueError(
            f"context={context} tokens is too small for this task: the shortest prompt "
            f"(instruction, needles and question) already has {n_min} tokens"
        )
    return best
