"""Offline evaluation task builders for KV-cache compression.

Two families of tasks are built from any local text file (the *haystack*) and
a Hugging Face tokenizer, with no network access:

* **Continuation perplexity** (:func:`perplexity_windows`): fixed-length token
  windows cut from the text; the first ``prefix_len`` tokens of each window are
  the part whose KV cache gets compressed, the rest is the continuation whose
  perplexity is measured.
* **RULER-style synthetic retrieval** (:func:`build_task` and the :data:`TASKS`
  table): needle-in-a-haystack variants, variable tracking, common-words
  extraction and the classic pass-key task, following NVIDIA's RULER benchmark
  (https://github.com/NVIDIA/RULER, arXiv:2404.06654).  Prompts are fitted by
  tokens so that the rendered prompt is at most ``context`` tokens long and at
  most :data:`CONTEXT_SLACK` tokens shorter.

Deviations from upstream RULER (deliberate, for an offline library):

* Keys are ``adjective-noun`` pairs from a built-in list (upstream draws them
  from the ``wonderwords`` package).
* The haystack is either any text file (upstream's "essay" type uses Paul
  Graham essays) or upstream's repeated "noise" sentences.
* Needles are placed at a requested depth, snapped to a sentence boundary,
  instead of at uniformly random positions; extra needles (distractors, extra
  values or keys, later variable-tracking hops) are placed at random depths.
* Common-words extraction has no in-context worked example, draws its words
  from the haystack text's vocabulary (``haystack="text"``) or from seeded
  pseudo-words (``haystack="noise"``), and scales the frequency of the common
  words down when the context is too small for upstream's 30 repetitions.
* Seeding uses a private :class:`random.Random` per call, never the global RNG.

Scoring (:func:`score_retrieval`) is RULER's ``string_match_all`` /
``string_match_part`` per sample, except that a reference only matches as a
whole token (``"12345"`` does not match inside ``"123456"``).
"""

from __future__ import annotations

import bisect
import logging
import math
import numbers
import os
import random
import re
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field, replace
from typing import Any

logger = logging.getLogger(__name__)

__all__ = [
    "CONTEXT_SLACK",
    "HAYSTACK_KINDS",
    "NOISE_HAYSTACK",
    "SNAP_CHARS",
    "SNAP_FRACTION",
    "TASKS",
    "PplSample",
    "RetrievalSample",
    "build_prompt",
    "build_task",
    "check_context_fits",
    "count_prompt_tokens",
    "format_chat",
    "has_chat_template",
    "normalize_text",
    "perplexity_windows",
    "read_text",
    "score_retrieval",
]

#: Repeated filler of RULER's ``noise`` haystack and of the classic pass-key task.
NOISE_HAYSTACK = (
    "The grass is green. The sky is blue. The sun is yellow. "
    "Here we go. There and back again."
)

#: Allowed values of the ``haystack`` argument.
HAYSTACK_KINDS = ("text", "noise")

#: A fitted retrieval prompt has ``context - CONTEXT_SLACK <= tokens <= context``.
#: Text and noise haystacks are cut token by token and usually land exactly on
#: ``context``; common-words lists are cut item by item (one ``"123. word"``
#: entry is a few tokens), which is what this bound is sized for.
CONTEXT_SLACK = 16

#: A needle snaps to the nearest sentence start, else line start, else word start,
#: within ``max(SNAP_CHARS, SNAP_FRACTION * len(haystack))`` characters of the
#: exact depth; otherwise it is inserted at the exact character offset.
SNAP_FRACTION = 0.025
SNAP_CHARS = 48

_SCORE_MODES = ("all", "part")

# --------------------------------------------------------------------- RULER templates
# Upstream: scripts/data/synthetic/constants.py and niah.py (answer prefixes are
# stored without upstream's leading space; build_prompt joins them).
_NIAH_INSTRUCTION = (
    "Some special magic {type_v} are hidden within the following text. "
    "Make sure to memorize it. I will quiz you about the {type_v} afterwards.\n"
)
_NIAH_QUESTION = (
    "What are all the special magic {type_v} for {query} mentioned in the provided text?"
)
_NIAH_ANSWER = "The special magic {type_v} for {query} mentioned in the provided text are"
_NIAH_NEEDLE = "One of the special magic {type_v} for {key} is: {value}."

_VT_INSTRUCTION = (
    "Memorize and track the chain(s) of variable assignment hidden in the following text.\n\n"
)
_VT_QUESTION = "Question: Find all variables that are assigned the value {query} in the text above."
_VT_ANSWER = (
    "Answer: According to the chain(s) of variable assignment in the text above, "
    "{num_v} variables are assigned the value {query}, they are:"
)

_CWE_INSTRUCTION = (
    "Below is a numbered list of words. In these words, some appear more often than "
    "others. Memorize the ones that appear most often.\n"
)
_CWE_QUESTION = "Question: What are the {k} most common words in the above list?"
_CWE_ANSWER = "Answer: The top {k} words that appear most often in the list are:"

# Classic pass-key retrieval (Mohtashami & Jaggi, "Landmark Attention", 2023).
_PASSKEY_INSTRUCTION = (
    "There is an important info hidden inside a lot of irrelevant text. Find it and "
    "memorize them. I will quiz you about the important information there.\n"
)
_PASSKEY_NEEDLE = "The pass key is {key}. Remember it. {key} is the pass key."
_PASSKEY_QUESTION = "What is the pass key?"
_PASSKEY_ANSWER = "The pass key is"

# Upstream ``tokens_to_generate`` (pass-key: enough for a 5-digit key).
_MAX_NEW_TOKENS = {"niah": 128, "vt": 30, "cwe": 120, "passkey": 16}

_ADJECTIVES = (
    "ancient", "bitter", "brave", "bright", "calm", "clever", "cold", "crimson",
    "curious", "damp", "dusty", "eager", "early", "empty", "faint", "fancy",
    "fierce", "fragile", "gentle", "giant", "golden", "grumpy", "hidden", "hollow",
    "humble", "icy", "jolly", "keen", "lazy", "little", "lively", "lonely",
    "loud", "lucky", "mellow", "misty", "modern", "noisy", "odd", "pale",
    "polite", "proud", "quick", "quiet", "rapid", "rare", "rough", "rusty",
    "salty", "shiny", "silent", "sleepy", "slow", "smooth", "sober", "solid",
    "spicy", "steady", "sturdy", "sunny", "swift", "tender", "tidy", "vivid",
)
_NOUNS = (
    "anchor", "apple", "badger", "basket", "beacon", "bottle", "bridge", "candle",
    "canyon", "castle", "cedar", "chimney", "cloud", "comet", "copper", "cottage",
    "desert", "dragon", "falcon", "feather", "forest", "garden", "glacier", "harbor",
    "hammer", "helmet", "island", "jacket", "kettle", "ladder", "lantern", "lemon",
    "meadow", "mirror", "monkey", "needle", "orchard", "otter", "parrot", "pebble",
    "pepper", "piano", "pillow", "planet", "pocket", "rabbit", "river", "saddle",
    "salmon", "shadow", "spider", "statue", "tiger", "tunnel", "turtle", "valley",
    "violin", "walnut", "whistle", "window", "wizard", "yacht", "zebra", "quartz",
)
_CONSONANTS = "bdfgklmnprstvz"
_VOWELS = "aeiou"

# Ends of a sentence or paragraph (match end = start of the next one), and
# line starts (weaker: hard-wrapped texts such as Gutenberg break mid-sentence).
_SENTENCE_START = re.compile(r"[.!?][\"')\]]*\s+|\n[ \t]*\n\s*")
_LINE_START = re.compile(r"\n\s*")


# --------------------------------------------------------------------- dataclasses
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


@dataclass(frozen=True)
class RetrievalSample:
    """One synthetic retrieval example.

    Attributes
    ----------
    task : str
        Task name, a key of :data:`TASKS`.
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


# --------------------------------------------------------------------- validation
def _check_int(name: str, value: Any, minimum: int | None = None) -> int:
    if isinstance(value, bool) or not isinstance(value, numbers.Integral):
        raise TypeError(f"{name} must be an int, got {type(value).__name__} {value!r}")
    value = int(value)
    if minimum is not None and value < minimum:
        raise ValueError(f"{name} must be >= {minimum}, got {value}")
    return value


def _check_text(text: Any, name: str = "text") -> str:
    if not isinstance(text, str):
        raise TypeError(f"{name} must be a str, got {type(text).__name__}")
    return normalize_text(text)


def _check_bool(name: str, value: Any) -> bool:
    if not isinstance(value, bool):
        raise TypeError(f"{name} must be a bool, got {type(value).__name__} {value!r}")
    return value


def _check_depths(depths: Any) -> list[float] | None:
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


def _check_tokenizer(tokenizer: Any) -> None:
    if not callable(tokenizer):
        raise TypeError(
            f"tokenizer must be a Hugging Face tokenizer (callable), got {type(tokenizer).__name__}"
        )


# --------------------------------------------------------------------- text helpers
def normalize_text(text: str) -> str:
    """Normalise line endings to ``"\\n"`` and drop a leading byte-order mark.

    Parameters
    ----------
    text : str
        Raw text (e.g. WikiText-2 raw files use CRLF).

    Returns
    -------
    str
        Text with ``"\\r\\n"`` and lone ``"\\r"`` replaced by ``"\\n"``.
    """
    return text.lstrip("\ufeff").replace("\r\n", "\n").replace("\r", "\n")


def read_text(path: str | os.PathLike[str]) -> str:
    """Read a UTF-8 text file and normalise it with :func:`normalize_text`.

    Parameters
    ----------
    path : str or os.PathLike
        File to read.

    Returns
    -------
    str
        The normalised file content.
    """
    with open(path, encoding="utf-8", errors="replace", newline="") as fh:
        return normalize_text(fh.read())


def _encode(tokenizer: Any, text: str, *, special: bool) -> list[int]:
    return list(tokenizer(text, add_special_tokens=special, verbose=False)["input_ids"])


def _encode_offsets(tokenizer: Any, text: str) -> list[int]:
    """End character offset of every token of ``text`` (no special tokens)."""
    try:
        enc = tokenizer(
            text, add_special_tokens=False, return_offsets_mapping=True, verbose=False
        )
    except NotImplementedError as exc:  # slow (Python) tokenizers
        raise TypeError(
            "a fast tokenizer (return_offsets_mapping support) is required to cut "
            f"haystacks by tokens, got {type(tokenizer).__name__}"
        ) from exc
    return [int(end) for _, end in enc["offset_mapping"]]


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
    return len(_encode(tokenizer, prompt, special=special))


# --------------------------------------------------------------------- perplexity
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
    _check_tokenizer(tokenizer)
    text = _check_text(text)
    context = _check_int("context", context, 2)
    prefix_len = _check_int("prefix_len", prefix_len, 1)
    num_windows = _check_int("num_windows", num_windows, 1)
    add_bos = _check_bool("add_bos", add_bos)
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
    stride = width if stride is None else _check_int("stride", stride, 1)
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
    probe = text[:20000]
    probe_ids = _encode(tokenizer, probe, special=False)
    chars_per_token = len(probe) / max(1, len(probe_ids))
    n_chars = int((needed + margin) * chars_per_token * 1.25) + 1000
    while True:
        if n_chars >= len(text):
            return _encode(tokenizer, text, special=False)
        ids = _encode(tokenizer, text[:n_chars], special=False)
        if len(ids) >= needed + margin:
            return ids[:needed]
        n_chars *= 2


# --------------------------------------------------------------------- chat / prompt
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


def _resolve_chat(tokenizer: Any, chat: bool | None) -> bool:
    if chat is None:
        return has_chat_template(tokenizer)
    chat = _check_bool("chat", chat)
    if chat and not has_chat_template(tokenizer):
        raise ValueError("chat=True but the tokenizer has no chat template; use chat=None or False")
    return chat


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
    query_aware = _check_bool("query_aware", query_aware)
    use_chat = _resolve_chat(tokenizer, chat)
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


def _prompt_tokens(sample: RetrievalSample, tokenizer: Any, query_aware: bool, chat: bool) -> int:
    ctx, q = build_prompt(sample, tokenizer, query_aware=query_aware, chat=chat)
    return count_prompt_tokens(tokenizer, ctx + q)


# --------------------------------------------------------------------- scoring
def score_retrieval(prediction: str, expected: Sequence[str], *, mode: str = "all") -> float:
    """Score a greedy answer against the expected strings (RULER metric).

    A reference counts as found when it occurs in the prediction as a whole
    token, case-insensitively: it must not be preceded or followed by a letter,
    digit or underscore.  So ``"12345"`` is found in ``"is: 12345."`` but not in
    ``"123456"``, and ``"apple"`` is found in ``"APPLE,"`` but not in
    ``"pineapple"``.

    Parameters
    ----------
    prediction : str
        The model's generated answer.
    expected : sequence of str
        Non-empty reference strings.
    mode : {"all", "part"}, default "all"
        ``"all"``: fraction of references found (RULER ``string_match_all``,
        used by every task here).  ``"part"``: 1.0 if any reference is found
        (RULER ``string_match_part``).

    Returns
    -------
    float
        Score in ``[0, 1]``.
    """
    if not isinstance(prediction, str):
        raise TypeError(f"prediction must be a str, got {type(prediction).__name__}")
    if isinstance(expected, str) or not isinstance(expected, Sequence):
        raise TypeError(f"expected must be a list of str, got {type(expected).__name__}")
    if len(expected) == 0:
        raise ValueError("expected must contain at least one reference string, got []")
    if mode not in _SCORE_MODES:
        raise ValueError(f"mode must be one of {_SCORE_MODES}, got {mode!r}")
    pred = prediction.casefold()
    hits = []
    for ref in expected:
        if not isinstance(ref, str):
            raise TypeError(f"expected must contain str, got {type(ref).__name__} {ref!r}")
        ref = ref.strip().casefold()
        if not ref:
            raise ValueError("expected reference strings must be non-empty")
        pattern = r"(?<!\w)" + re.escape(ref) + r"(?!\w)"
        hits.append(1.0 if re.search(pattern, pred) else 0.0)
    if mode == "part":
        return max(hits)
    return sum(hits) / len(hits)


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
    context = _check_int("context", context, 1)
    model_max_positions = _check_int("model_max_positions", model_max_positions, 1)
    max_new_tokens = _check_int("max_new_tokens", max_new_tokens, 0)
    total = context + max_new_tokens
    if total > model_max_positions:
        raise ValueError(
            f"the task needs {total} positions ({context} context tokens + {max_new_tokens} "
            f"generated tokens) but the model supports at most {model_max_positions} "
            f"(max_position_embeddings); use context <= {model_max_positions - max_new_tokens}"
        )


# --------------------------------------------------------------------- haystack
@dataclass
class _Source:
    """A haystack source string with the end offset of each of its tokens."""

    text: str
    ends: list[int]
    start: int  # character offset in the original text (0 for noise)
    complete: bool  # True when ``text`` runs to the end of the original text


def _noise_source(tokenizer: Any, n_tokens: int) -> _Source:
    per = max(1, len(_encode(tokenizer, NOISE_HAYSTACK + " ", special=False)))
    reps = n_tokens // per + 2
    text = " ".join([NOISE_HAYSTACK] * reps)
    return _Source(text, _encode_offsets(tokenizer, text), 0, True)


def _chars_per_token(tokenizer: Any, text: str) -> float:
    probe = text[:20000]
    return len(probe) / max(1, len(_encode(tokenizer, probe, special=False)))


def _text_source(
    tokenizer: Any, text: str, n_tokens: int, rng: random.Random, cpt: float, grow: int
) -> _Source:
    """A window of ``text`` starting at a random line/sentence start."""
    need = int(n_tokens * cpt * 1.3 * (2**grow)) + 2000
    if need >= len(text):
        start = 0
    else:
        start = rng.randrange(0, len(text) - need + 1)
        m = _SENTENCE_START.search(text, start)
        if m is not None and m.end() <= len(text) - need:
            start = m.end()
    while start < len(text) and text[start].isspace():
        start += 1
    window = text[start : start + need]
    complete = start + need >= len(text)
    ends = _encode_offsets(tokenizer, window)
    if not complete:
        ends = ends[:-4]  # tokens at the cut may merge differently in the full text
    return _Source(window, ends, start, complete)


def _cut(source: _Source, k: int) -> str:
    if k <= 0 or not source.ends:
        return ""
    return source.text[: source.ends[min(k, len(source.ends)) - 1]].strip()


def _nearest(points: list[int], target: int) -> int | None:
    i = bisect.bisect_left(points, target)
    cands = [points[j] for j in (i - 1, i) if 0 <= j < len(points)]
    return min(cands, key=lambda p: abs(p - target)) if cands else None


def _insertion_point(hay: str, depth: float, bounds: list[list[int]]) -> int:
    """Character offset for a needle at ``depth`` in ``hay``.

    The exact offset ``depth * len(hay)`` is snapped to the nearest boundary of
    the first kind in ``bounds`` (sentence starts, then line starts, then word
    starts) that lies within the snapping tolerance.
    """
    n = len(hay)
    target = int(round(depth * n))
    if target <= 0 or target >= n:
        return max(0, min(target, n))
    tol = max(SNAP_CHARS, int(SNAP_FRACTION * n))
    for points in bounds:
        best = _nearest(points, target)
        if best is not None and abs(best - target) <= tol:
            return best
    return target


def _splice(
    hay: str, items: list[tuple[float, str]], sep: str
) -> tuple[str, list[int], list[int]]:
    """Insert ``(depth, needle)`` items into ``hay``.

    Returns the spliced text, each needle's character offset in it, and each
    needle's insertion point in ``hay`` (same order as ``items``).
    """
    bounds = [
        [m.end() for m in _SENTENCE_START.finditer(hay)],
        [m.end() for m in _LINE_START.finditer(hay)],
        [m.end() for m in re.finditer(r"\s+", hay)],
    ]
    points = [_insertion_point(hay, d, bounds) for d, _ in items]
    order = sorted(range(len(items)), key=lambda i: (points[i], i))
    acc = ""
    cursor = 0
    positions = [0] * len(items)
    for i in order:
        chunk = hay[cursor : points[i]]
        if acc and acc[-1].isspace():
            chunk = chunk.lstrip(" \t")
        acc += chunk
        cursor = points[i]
        if sep == "\n":
            acc = acc.rstrip(" \t")
            if acc and not acc.endswith("\n"):
                acc += "\n"
        elif acc and not acc[-1].isspace():
            acc += sep
        positions[i] = len(acc)
        acc += items[i][1] + sep
    rest = hay[cursor:]
    if acc and acc[-1].isspace():
        rest = rest.lstrip(" \t")
    acc = (acc + rest).rstrip()
    return acc, positions, points


# --------------------------------------------------------------------- length fitting
def _fit(
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


def _short_error(task: str, source: _Source, context: int, n: int) -> ValueError:
    return ValueError(
        f"text too short for task {task!r}: its {len(source.ends)} tokens (from character "
        f"{source.start}) fill the prompt to only {n} of the requested {context} tokens; "
        f"use a longer text, a smaller context, or haystack='noise'"
    )


# --------------------------------------------------------------------- needle tasks
@dataclass
class _Spec:
    """What a needle task puts in one sample (before the haystack is fitted)."""

    instruction: str
    question: str
    answer_prefix: str
    expected: list[str]
    depth: float
    needles: list[tuple[float, str]]  # (depth, needle); the first is the target
    sep: str = " "
    metadata: dict[str, Any] = field(default_factory=dict)


def _number(rng: random.Random, digits: int) -> str:
    return str(rng.randint(10 ** (digits - 1), 10**digits - 1))


def _distinct(rng: random.Random, make: Callable[[random.Random], str], n: int) -> list[str]:
    out: list[str] = []
    seen: set[str] = set()
    while len(out) < n:
        v = make(rng)
        if v not in seen:
            seen.add(v)
            out.append(v)
    return out


def _key(rng: random.Random) -> str:
    return f"{rng.choice(_ADJECTIVES)}-{rng.choice(_NOUNS)}"


def _join_query(keys: list[str]) -> str:
    return keys[0] if len(keys) == 1 else ", ".join(keys[:-1]) + ", and " + keys[-1]


def _niah_spec(
    rng: random.Random,
    depth: float,
    *,
    num_keys: int,
    num_values: int,
    num_queries: int,
) -> _Spec:
    """RULER ``niah`` with ``num_needle_k/v/q`` keys, values per key, queried keys."""
    num_keys = max(num_keys, num_queries)  # upstream clamp
    keys = _distinct(rng, _key, num_keys)
    values = _distinct(rng, lambda r: _number(r, 7), num_keys * num_values)
    by_key = {k: values[i * num_values : (i + 1) * num_values] for i, k in enumerate(keys)}
    queried = keys[:num_queries]  # keys are already in random order
    singular = num_queries * num_values == 1
    type_v = "number" if singular else "numbers"

    def fmt(template: str) -> str:
        if singular:  # upstream's singular rewrite, applied to the raw template
            template = template.replace("Some", "A").replace("are all", "is").replace("are", "is")
        return template.format(type_v=type_v, query=_join_query(queried))

    targets = [(k, v) for k in queried for v in by_key[k]]
    others = [(k, v) for k in keys if k not in queried for v in by_key[k]]
    needles: list[tuple[float, str]] = []
    for i, (k, v) in enumerate(targets + others):
        d = depth if i == 0 else rng.random()
        needles.append((d, _NIAH_NEEDLE.format(type_v="numbers", key=k, value=v)))
    return _Spec(
        instruction=fmt(_NIAH_INSTRUCTION),
        question=fmt(_NIAH_QUESTION),
        answer_prefix=fmt(_NIAH_ANSWER),
        expected=[v for k in queried for v in by_key[k]],
        depth=depth,
        needles=needles,
        metadata={
            "keys": keys,
            "query_keys": list(queried),
            "values": {k: list(v) for k, v in by_key.items()},
            "distractor_keys": [k for k in keys if k not in queried],
        },
    )


def _vt_spec(
    rng: random.Random, depth: float | None, *, num_chains: int = 1, num_hops: int = 4
) -> _Spec:
    """RULER variable tracking: ``num_chains`` chains of ``num_hops`` assignments."""
    num_chains = _check_int("num_chains", num_chains, 1)
    num_hops = _check_int("num_hops", num_hops, 1)
    names = _distinct(rng, lambda r: "".join(r.choices("ABCDEFGHIJKLMNOPQRSTUVWXYZ", k=5)),
                      num_chains * (num_hops + 1))
    vals = _distinct(rng, lambda r: _number(r, 5), num_chains)
    chains = []
    for c in range(num_chains):
        vs = names[c * (num_hops + 1) : (c + 1) * (num_hops + 1)]
        stmts = [f"VAR {vs[0]} = {vals[c]}"] + [
            f"VAR {vs[j + 1]} = VAR {vs[j]}" for j in range(num_hops)
        ]
        chains.append((vs, stmts))
    needles: list[tuple[float, str]] = []
    for c, (_, stmts) in enumerate(chains):
        if c == 0 and depth is not None:
            ds = [depth] + sorted(rng.uniform(depth, 1.0) for _ in stmts[1:])
        else:
            ds = sorted(rng.random() for _ in stmts)
        if c == 0:
            first_depth = ds[0]
        needles.extend(zip(ds, stmts))
    query = vals[0]
    return _Spec(
        instruction=_VT_INSTRUCTION,
        question=_VT_QUESTION.format(query=query),
        answer_prefix=_VT_ANSWER.format(num_v=num_hops + 1, query=query),
        expected=list(chains[0][0]),
        depth=first_depth,
        needles=needles,
        sep="\n",
        metadata={"value": query, "chains": [stmts for _, stmts in chains]},
    )


def _passkey_spec(rng: random.Random, depth: float) -> _Spec:
    key = _number(rng, 5)
    return _Spec(
        instruction=_PASSKEY_INSTRUCTION,
        question=_PASSKEY_QUESTION,
        answer_prefix=_PASSKEY_ANSWER,
        expected=[key],
        depth=depth,
        needles=[(depth, _PASSKEY_NEEDLE.format(key=key))],
        metadata={"pass_key": key},
    )


def _prepare(
    tokenizer: Any,
    text: Any,
    context: Any,
    num_samples: Any,
    depths: Any,
    seed: Any,
    haystack: Any,
    query_aware: Any,
    chat: Any,
) -> tuple[str | None, int, int, list[float] | None, int, bool, bool]:
    _check_tokenizer(tokenizer)
    if haystack not in HAYSTACK_KINDS:
        raise ValueError(f"haystack must be one of {HAYSTACK_KINDS}, got {haystack!r}")
    if text is None:
        if haystack == "text":
            raise ValueError(
                "text is required with haystack='text' (got None); use haystack='noise'"
            )
    else:
        text = _check_text(text)
    context = _check_int("context", context, 1)
    num_samples = _check_int("num_samples", num_samples, 1)
    seed = _check_int("seed", seed)
    query_aware = _check_bool("query_aware", query_aware)
    use_chat = _resolve_chat(tokenizer, chat)
    return text, context, num_samples, _check_depths(depths), seed, query_aware, use_chat


def _rngs(task: str, seed: int, num_samples: int) -> list[random.Random]:
    master = random.Random(f"kv_cache.eval:{task}:{seed}")
    return [random.Random(master.getrandbits(64)) for _ in range(num_samples)]


def _build_needle_task(
    task: str,
    make_spec: Callable[[random.Random, float | None], _Spec],
    tokenizer: Any,
    text: str | None,
    *,
    context: int,
    num_samples: int,
    depths: Sequence[float] | None,
    seed: int,
    haystack: str,
    query_aware: bool,
    chat: bool | None,
    max_new_tokens: int,
    random_depth: bool = True,
) -> list[RetrievalSample]:
    text, context, num_samples, depths, seed, query_aware, use_chat = _prepare(
        tokenizer, text, context, num_samples, depths, seed, haystack, query_aware, chat
    )
    noise = _noise_source(tokenizer, context) if haystack == "noise" else None
    cpt = _chars_per_token(tokenizer, text) if haystack == "text" else 1.0
    samples = []
    for i, rng in enumerate(_rngs(task, seed, num_samples)):
        if depths is not None:
            depth: float | None = depths[i % len(depths)]
        else:
            depth = rng.random() if random_depth else None
        spec = make_spec(rng, depth)
        src_seed = rng.getrandbits(64)

        def render(k: int, source: _Source) -> tuple[RetrievalSample, int]:
            hay = _cut(source, k)
            ctx, positions, points = _splice(hay, spec.needles, spec.sep)
            meta = dict(spec.metadata)
            meta.update(
                needles=[nd for _, nd in spec.needles],
                needle_positions=positions,
                needle_depths=[p / max(1, len(hay)) for p in points],
                haystack=haystack,
                haystack_tokens=k,
                source_start=source.start,
                seed=seed,
                index=i,
                max_new_tokens=max_new_tokens,
                fit={"query_aware": query_aware, "chat": use_chat},
            )
            sample = RetrievalSample(
                task=task,
                context=ctx,
                question=spec.question,
                answer_prefix=spec.answer_prefix,
                expected=list(spec.expected),
                depth=spec.depth,
                metadata=meta,
                instruction=spec.instruction,
            )
            return sample, _prompt_tokens(sample, tokenizer, query_aware, use_chat)

        for grow in range(4):
            source = noise if noise is not None else _text_source(
                tokenizer, text, context, random.Random(src_seed), cpt, grow
            )
            hi = len(source.ends)
            _, n0 = render(0, source)
            k, sample, n = _fit(lambda k: render(k, source), context, 0, hi, context - n0)
            if k < hi or n >= context - CONTEXT_SLACK:
                break
            if source.complete:
                raise _short_error(task, source, context, n)
        else:  # pragma: no cover - the window grows to the whole text within 4 tries
            raise _short_error(task, source, context, n)
        samples.append(replace(sample, metadata={**sample.metadata, "num_tokens": n}))
        logger.debug("%s sample %d: %d prompt tokens (target %d)", task, i, n, context)
    return samples


# --------------------------------------------------------------------- cwe
def _pseudo_word(rng: random.Random) -> str:
    return "".join(
        rng.choice(_CONSONANTS) + rng.choice(_VOWELS) for _ in range(rng.randint(2, 3))
    )


def _text_vocabulary(text: str) -> list[str]:
    return list(dict.fromkeys(re.findall(r"\b[a-z]{3,12}\b", text[:2_000_000].lower())))


def _build_cwe(
    tokenizer: Any,
    text: str | None,
    *,
    context: int,
    num_samples: int,
    depths: Sequence[float] | None = None,
    seed: int = 0,
    haystack: str = "text",
    query_aware: bool = False,
    chat: bool | None = None,
    top_k: int = 10,
    freq_common: int = 30,
    freq_uncommon: int = 3,
) -> list[RetrievalSample]:
    """RULER common-words extraction; ``depths`` is accepted and ignored."""
    task = "cwe"
    text, context, num_samples, _, seed, query_aware, use_chat = _prepare(
        tokenizer, text, context, num_samples, depths, seed, haystack, query_aware, chat
    )
    top_k = _check_int("top_k", top_k, 1)
    freq_uncommon = _check_int("freq_uncommon", freq_uncommon, 1)
    freq_common = _check_int("freq_common", freq_common, freq_uncommon + 1)
    vocab = _text_vocabulary(text) if haystack == "text" else None
    instruction = _CWE_INSTRUCTION
    question = _CWE_QUESTION.format(k=top_k)
    answer_prefix = _CWE_ANSWER.format(k=top_k)
    samples = []
    for i, rng in enumerate(_rngs(task, seed, num_samples)):
        shuffle_seed = rng.getrandbits(64)

        def words_for(n_distinct: int) -> list[str]:
            if vocab is None:
                return _distinct(rng, _pseudo_word, n_distinct)
            if len(vocab) < n_distinct:
                raise ValueError(
                    f"text too short for task 'cwe': its vocabulary has {len(vocab)} distinct "
                    f"words but context={context} needs about {n_distinct}; use a longer text, "
                    f"a smaller context, or haystack='noise'"
                )
            return rng.sample(vocab, n_distinct)

        def make(words: list[str], freq: int, n_items: int) -> tuple[RetrievalSample, int]:
            common = words[:top_k]
            items = [w for w in common for _ in range(freq)]
            for w in words[top_k:]:
                if len(items) >= n_items:
                    break
                items.extend([w] * min(freq_uncommon, n_items - len(items)))
            random.Random(shuffle_seed).shuffle(items)
            ctx = " ".join(f"{j + 1}. {w}" for j, w in enumerate(items))
            sample = RetrievalSample(
                task=task, context=ctx, question=question, answer_prefix=answer_prefix,
                expected=list(common), depth=None, instruction=instruction,
                metadata={
                    "haystack": haystack, "seed": seed, "index": i, "top_k": top_k,
                    "freq_common": freq, "freq_uncommon": freq_uncommon,
                    "num_items": len(items), "max_new_tokens": _MAX_NEW_TOKENS["cwe"],
                    "fit": {"query_aware": query_aware, "chat": use_chat},
                },
            )
            return sample, _prompt_tokens(sample, tokenizer, query_aware, use_chat)

        # Estimate tokens per list item to size the word pool and the common frequency.
        probe_words = words_for(top_k + 40)
        s_small, n_small = make(probe_words, 1, top_k)
        s_big, n_big = make(probe_words, 1, top_k + 40 * freq_uncommon)
        per_item = max(1.0, (n_big - n_small) / max(1, s_big.metadata["num_items"] - top_k))
        budget = int((context - n_small) / per_item) + top_k
        freq = min(freq_common, budget // (2 * top_k))
        if freq <= freq_uncommon:
            raise ValueError(
                f"context={context} tokens is too small for task 'cwe' with top_k={top_k}: "
                f"about {budget} list items fit but {top_k} common words must each appear "
                f"more than freq_uncommon={freq_uncommon} times; lower top_k or raise context"
            )
        n_distinct = top_k + max(0, budget - top_k * freq) // freq_uncommon + 8
        words = probe_words[:top_k] + words_for(n_distinct)[: n_distinct - top_k]
        words = list(dict.fromkeys(words))
        lo = top_k * freq
        hi = lo + (len(words) - top_k) * freq_uncommon
        k, sample, n = _fit(lambda k: make(words, freq, k), context, lo, hi, budget, per_item)
        if k == hi and n < context - CONTEXT_SLACK:  # pragma: no cover - pool is oversized
            raise ValueError(f"cwe word pool exhausted at {n} of {context} tokens")
        samples.append(replace(sample, metadata={**sample.metadata, "num_tokens": n}))
    return samples


# --------------------------------------------------------------------- registry
def _needle_builder(
    task: str, make_spec: Callable[..., _Spec], max_new_tokens: int, random_depth: bool = True
) -> Callable[..., list[RetrievalSample]]:
    def builder(
        tokenizer: Any,
        text: str | None,
        *,
        context: int,
        num_samples: int,
        depths: Sequence[float] | None = None,
        seed: int = 0,
        haystack: str = "text",
        query_aware: bool = False,
        chat: bool | None = None,
        **options: Any,
    ) -> list[RetrievalSample]:
        return _build_needle_task(
            task,
            lambda rng, depth: make_spec(rng, depth, **options),
            tokenizer,
            text,
            context=context,
            num_samples=num_samples,
            depths=depths,
            seed=seed,
            haystack=haystack,
            query_aware=query_aware,
            chat=chat,
            max_new_tokens=max_new_tokens,
            random_depth=random_depth,
        )

    builder.__name__ = f"build_{task}"
    builder.__doc__ = f"Build ``{task}`` samples; see :func:`build_task`."
    return builder


def _niah(num_keys: int, num_values: int, num_queries: int) -> Callable[..., _Spec]:
    def make(rng: random.Random, depth: float, **options: Any) -> _Spec:
        if options:
            raise TypeError(f"unexpected options for niah tasks: {sorted(options)}")
        return _niah_spec(
            rng, depth, num_keys=num_keys, num_values=num_values, num_queries=num_queries
        )

    return make


def _passkey(rng: random.Random, depth: float, **options: Any) -> _Spec:
    if options:
        raise TypeError(f"unexpected options for passkey: {sorted(options)}")
    return _passkey_spec(rng, depth)


#: Task name -> builder ``f(tokenizer, text, *, context, num_samples, depths=None,
#: seed=0, haystack="text", query_aware=False, chat=None, **options)``.
#: Upstream RULER settings: multikey = 4 keys / 1 queried, multivalue = 4
#: values, multiquery = 4 keys all queried, vt = 1 chain of 4 hops.
TASKS: dict[str, Callable[..., list[RetrievalSample]]] = {
    "niah_single": _needle_builder("niah_single", _niah(1, 1, 1), _MAX_NEW_TOKENS["niah"]),
    "niah_multikey": _needle_builder("niah_multikey", _niah(4, 1, 1), _MAX_NEW_TOKENS["niah"]),
    "niah_multivalue": _needle_builder("niah_multivalue", _niah(1, 4, 1), _MAX_NEW_TOKENS["niah"]),
    "niah_multiquery": _needle_builder("niah_multiquery", _niah(4, 1, 4), _MAX_NEW_TOKENS["niah"]),
    "vt": _needle_builder("vt", _vt_spec, _MAX_NEW_TOKENS["vt"], random_depth=False),
    "cwe": _build_cwe,
    "passkey": _needle_builder("passkey", _passkey, _MAX_NEW_TOKENS["passkey"]),
}


def build_task(
    name: str,
    tokenizer: Any,
    text: str | None,
    *,
    context: int,
    num_samples: int,
    depths: Sequence[float] | float | None = None,
    seed: int = 0,
    haystack: str = "text",
    query_aware: bool = False,
    chat: bool | None = None,
    **options: Any,
) -> list[RetrievalSample]:
    """Build samples of a RULER-style retrieval task.

    Each sample's prompt, rendered by :func:`build_prompt` with the same
    ``query_aware`` and ``chat`` settings, has between ``context -
    CONTEXT_SLACK`` and ``context`` tokens (counted by
    :func:`count_prompt_tokens`, i.e. ``len(tokenizer(prompt).input_ids)``).
    Both modes render the same prompt (only the compression boundary differs),
    so the length holds for either.

    Parameters
    ----------
    name : str
        A key of :data:`TASKS`: ``niah_single``, ``niah_multikey``,
        ``niah_multivalue``, ``niah_multiquery``, ``vt``, ``cwe`` or ``passkey``.
    tokenizer : transformers tokenizer
        The model's (fast) tokenizer.
    text : str or None
        Haystack text (CRLF is normalised); may be ``None`` with
        ``haystack="noise"``.
    context : int
        Target prompt length in tokens.
    num_samples : int
        Number of samples, >= 1.
    depths : sequence of float in [0, 1], optional
        Depth of the first target needle, as a fraction of the haystack;
        sample ``i`` uses ``depths[i % len(depths)]``.  ``None`` draws a
        uniform depth per sample (``vt``: the chain's hops at sorted uniform
        depths).  Needles are snapped to a sentence or line start (see
        :data:`SNAP_FRACTION`) when there is one nearby.  Ignored by ``cwe``.
    seed : int, default 0
        Seed; the same arguments give identical samples.
    haystack : {"text", "noise"}, default "text"
        ``"text"``: a window of ``text`` starting at a seeded random sentence
        start.  ``"noise"``: RULER's repeated noise sentences (``cwe``: seeded
        pseudo-words instead of the text's vocabulary).
    query_aware : bool, default False
        Recorded in ``metadata["fit"]``; both renderings of :func:`build_prompt`
        have the same length.
    chat : bool or None, default None
        Fit the length for the chat-template rendering; ``None`` uses the
        chat template when the tokenizer has one.
    **options
        Task-specific knobs: ``vt``: ``num_chains`` (1), ``num_hops`` (4);
        ``cwe``: ``top_k`` (10), ``freq_common`` (30, scaled down to fit),
        ``freq_uncommon`` (3).

    Returns
    -------
    list of RetrievalSample

    Raises
    ------
    ValueError
        Unknown task name, invalid argument, context too small for the task,
        or text too short to fill the context.
    """
    if not isinstance(name, str) or name not in TASKS:
        raise ValueError(f"unknown task {name!r}; known tasks: {', '.join(sorted(TASKS))}")
    return TASKS[name](
        tokenizer,
        text,
        context=context,
        num_samples=num_samples,
        depths=depths,
        seed=seed,
        haystack=haystack,
        query_aware=query_aware,
        chat=chat,
        **options,
    )
