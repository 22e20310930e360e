"""RULER common-words extraction (``cwe``): a numbered word list with ``top_k`` frequent words.

Deviations from upstream RULER: there is no in-context worked example, the words come from the
haystack text's vocabulary (``haystack="text"``) or from seeded pseudo-words
(``haystack="noise"``), and the frequency of the common words is scaled down when the context is
too small for upstream's 30 repetitions.
"""

from __future__ import annotations

import random
import re
from dataclasses import replace

from ...compression._arrays import check_int
from .prompts import CONTEXT_SLACK, RetrievalSample, fit_length, prompt_tokens
from .request import TaskRequest
from .specs import MAX_NEW_TOKENS, distinct

# Upstream: scripts/data/synthetic/constants.py.
_CWE_INSTRUCTION = (
    "Below is a numbered list of words. In these words, some appear more often than "
    "others. Memorize the ones that appear most often.\n"
)
_CWE_QUESTION = "Question: What are the {k} most common words in the above list?"
_CWE_ANSWER = "Answer: The top {k} words that appear most often in the list are:"

_CONSONANTS = "bdfgklmnprstvz"
_VOWELS = "aeiou"


def _pseudo_word(rng: random.Random) -> str:
    return "".join(
        rng.choice(_CONSONANTS) + rng.choice(_VOWELS) for _ in range(rng.randint(2, 3))
    )


def _text_vocabulary(text: str) -> list[str]:
    return list(dict.fromkeys(re.findall(r"\b[a-z]{3,12}\b", text[:2_000_000].lower())))


def build_cwe(
    request: TaskRequest, *, top_k: int = 10, freq_common: int = 30, freq_uncommon: int = 3
) -> list[RetrievalSample]:
    """Build ``cwe`` samples for ``request`` (its ``depths`` are ignored); see ``build_task``."""
    task = "cwe"
    tokenizer, context, seed, haystack = (
        request.tokenizer, request.context, request.seed, request.haystack
    )
    query_aware, use_chat = request.query_aware, request.use_chat
    top_k = check_int(top_k, "top_k", minimum=1)
    freq_uncommon = check_int(freq_uncommon, "freq_uncommon", minimum=1)
    freq_common = check_int(freq_common, "freq_common", minimum=freq_uncommon + 1)
    vocab = _text_vocabulary(request.text) if haystack == "text" else None
    instruction = _CWE_INSTRUCTION
    question = _CWE_QUESTION.format(k=top_k)
    answer_prefix = _CWE_ANSWER.format(k=top_k)
    samples = []
    for i, rng in enumerate(request.rngs(task)):
        shuffle_seed = rng.getrandbits(64)

        def words_for(n_distinct: int) -> list[str]:
            if vocab is None:
                return distinct(rng, _pseudo_word, n_distinct)
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
                    "num_items": len(items), "max_new_tokens": MAX_NEW_TOKENS["cwe"],
                    "fit": {"query_aware": query_aware, "chat": use_chat},
                },
            )
            return sample, prompt_tokens(sample, tokenizer, query_aware, use_chat)

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
        k, sample, n = fit_length(lambda k: make(words, freq, k), context, lo, hi, budget, per_item)
        if k == hi and n < context - CONTEXT_SLACK:  # pragma: no cover - pool is oversized
            raise ValueError(f"cwe word pool exhausted at {n} of {context} tokens")
        samples.append(replace(sample, metadata={**sample.metadata, "num_tokens": n}))
    return samples

