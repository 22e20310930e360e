"""What a needle task puts in one sample: RULER's templates, keys, values and needles.

Each ``*_spec`` function draws one sample's needles, question and expected answer from a
private :class:`random.Random`, before any haystack is fitted around them.  Keys are
``adjective-noun`` pairs from a built-in list (upstream RULER draws them from the
``wonderwords`` package).
"""

from __future__ import annotations

import random
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

from ...compression._arrays import check_int

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

# Classic pass-key retrieval (Mohtashami & Jaggi, "Landmark Attention", 2023).
_PASSKEY_INSTRUCTION = (
    "There is an important info hidden inside a lot of irrelevant text. Find it and "
    "memorize them. I will quiz you about the important information there.\n"
)
_PASSKEY_NEEDLE = "The pass key is {key}. Remember it. {key} is the pass key."
_PASSKEY_QUESTION = "What is the pass key?"
_PASSKEY_ANSWER = "The pass key is"

# Upstream ``tokens_to_generate`` (pass-key: enough for a 5-digit key).
MAX_NEW_TOKENS = {"niah": 128, "vt": 30, "cwe": 120, "passkey": 16}

# Key words: keys are ``adjective-noun`` pairs, 64 x 64 of them (order matters: seeded draws).
_ADJECTIVES = tuple(
    """
    ancient bitter brave bright calm clever cold crimson curious damp dusty eager early empty
    faint fancy fierce fragile gentle giant golden grumpy hidden hollow humble icy jolly keen
    lazy little lively lonely loud lucky mellow misty modern noisy odd pale polite proud quick
    quiet rapid rare rough rusty salty shiny silent sleepy slow smooth sober solid spicy steady
    sturdy sunny swift tender tidy vivid
    """.split()
)
_NOUNS = tuple(
    """
    anchor apple badger basket beacon bottle bridge candle canyon castle cedar chimney cloud
    comet copper cottage desert dragon falcon feather forest garden glacier harbor hammer helmet
    island jacket kettle ladder lantern lemon meadow mirror monkey needle orchard otter parrot
    pebble pepper piano pillow planet pocket rabbit river saddle salmon shadow spider statue
    tiger tunnel turtle valley violin walnut whistle window wizard yacht zebra quartz
    """.split()
)


@dataclass
class Spec:
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


def distinct(rng: random.Random, make: Callable[[random.Random], str], n: int) -> list[str]:
    """``n`` distinct values of ``make(rng)``, in the order they were first drawn."""
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


def niah_spec(
    rng: random.Random,
    depth: float,
    *,
    num_keys: int,
    num_values: int,
    num_queries: int,
) -> Spec:
    """RULER ``niah`` with ``num_needle_k/v/q`` keys, values per key, queried keys."""
    num_keys = max(num_keys, num_queries)  # upstream clamp
    keys = distinct(rng, _key, num_keys)
    values = distinct(rng, lambda r: _number(r, 7), num_keys * num_values)
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
    return Spec(
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


def vt_spec(
    rng: random.Random, depth: float | None, *, num_chains: int = 1, num_hops: int = 4
) -> Spec:
    """RULER variable tracking: ``num_chains`` chains of ``num_hops`` assignments."""
    num_chains = check_int(num_chains, "num_chains", minimum=1)
    num_hops = check_int(num_hops, "num_hops", minimum=1)
    names = distinct(rng, lambda r: "".join(r.choices("ABCDEFGHIJKLMNOPQRSTUVWXYZ", k=5)),
                      num_chains * (num_hops + 1))
    vals = distinct(rng, lambda r: _number(r, 5), num_chains)
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
    return Spec(
        instruction=_VT_INSTRUCTION,
        question=_VT_QUESTION.format(query=query),
        answer_prefix=_VT_ANSWER.format(num_v=num_hops + 1, query=query),
        expected=list(chains[0][0]),
        depth=first_depth,
        needles=needles,
        sep="\n",
        metadata={"value": query, "chains": [stmts for _, stmts in chains]},
    )


def passkey_spec(rng: random.Random, depth: float) -> Spec:
    """Classic pass-key retrieval: one 5-digit key, stated twice in a needle at ``depth``."""
    key = _number(rng, 5)
    return Spec(
        instruction=_PASSKEY_INSTRUCTION,
        question=_PASSKEY_QUESTION,
        answer_prefix=_PASSKEY_ANSWER,
        expected=[key],
        depth=depth,
        needles=[(depth, _PASSKEY_NEEDLE.format(key=key))],
        metadata={"pass_key": key},
    )

