"""A document and its questions through the tokenizer's chat template, split at the question.

As kvpress' pipeline does it: the user turn is ``document + question``; the template's head and
the document are the compressed prefix, and the question, the rest of the template (the end of
the user turn and the assistant's generation prompt) and the answer are the session's tail.

    prefix          = template_head + document
    question tokens = "\\n" + question + template_tail
"""

from __future__ import annotations

from typing import Any

_MARK = "\n<<kv_cache: question goes here>>"


def has_chat_template(tokenizer: Any) -> bool:
    """True when ``tokenizer`` has a chat template to apply."""
    return bool(getattr(tokenizer, "chat_template", None)) and callable(getattr(tokenizer, "apply_chat_template", None))


def split_chat(tokenizer: Any, document: str) -> tuple[str, str]:
    """``(prefix, question_suffix)``: the rendered user turn holding ``document``, cut where the
    question goes; the suffix is the template's text after the user's content (with the
    assistant's generation prompt).

    Raises ``ValueError`` if the tokenizer has no chat template or the template does not keep
    the user's text in one piece."""
    if not has_chat_template(tokenizer):
        raise ValueError("the tokenizer has no chat template: use the raw text (chat=False)")
    rendered = tokenizer.apply_chat_template([{"role": "user", "content": document + _MARK}],
                                             add_generation_prompt=True, tokenize=False)
    parts = rendered.split(_MARK)
    if len(parts) != 2:
        raise ValueError("the chat template does not keep the user's text in one piece; use chat=False")
    return parts[0], parts[1]


def question_text(question: str, suffix: str) -> str:
    """What follows the compressed prefix for one question (see the module docstring)."""
    return "\n" + question + suffix
