"""Haystacks: the filler text that needles are spliced into.

A haystack is either a window of any text file (upstream RULER's "essay" type uses Paul Graham
essays) or upstream's repeated "noise" sentences.  Needles are placed at a requested depth,
snapped to a sentence boundary (see :data:`SNAP_FRACTION`), instead of at uniformly random
positions.
"""

from __future__ import annotations

import bisect
import random
import re
from dataclasses import dataclass
from typing import Any

from .text import encode, encode_offsets

__all__ = ["HAYSTACK_KINDS", "NOISE_HAYSTACK", "SNAP_CHARS", "SNAP_FRACTION"]

#: Repeated filler of RULER's ``noise`` haystack and of the classic pass-key task.
NOISE_HAYSTACK = (
    "The grass is green. The sky is blue. The sun is yellow. "
    "Here we go. There and back again."
)

#: Allowed values of the ``haystack`` argument.
HAYSTACK_KINDS = ("text", "noise")

#: A needle snaps to the nearest sentence start, else line start, else word start,
#: within ``max(SNAP_CHARS, SNAP_FRACTION * len(haystack))`` characters of the
#: exact depth; otherwise it is inserted at the exact character offset.
SNAP_FRACTION = 0.025
SNAP_CHARS = 48

# Ends of a sentence or paragraph (match end = start of the next one), and
# line starts (weaker: hard-wrapped texts such as Gutenberg break mid-sentence).
_SENTENCE_START = re.compile(r"[.!?][\"')\]]*\s+|\n[ \t]*\n\s*")
_LINE_START = re.compile(r"\n\s*")


@dataclass
class Source:
    """A haystack source string with the end offset of each of its tokens."""

    text: str
    ends: list[int]
    start: int  # character offset in the original text (0 for noise)
    complete: bool  # True when ``text`` runs to the end of the original text


def noise_source(tokenizer: Any, n_tokens: int) -> Source:
    """Enough repeats of :data:`NOISE_HAYSTACK` to fill ``n_tokens`` tokens, with a margin."""
    per = max(1, len(encode(tokenizer, NOISE_HAYSTACK + " ", special=False)))
    reps = n_tokens // per + 2
    text = " ".join([NOISE_HAYSTACK] * reps)
    return Source(text, encode_offsets(tokenizer, text), 0, True)


def text_source(
    tokenizer: Any, text: str, n_tokens: int, rng: random.Random, cpt: float, grow: int
) -> Source:
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
    ends = encode_offsets(tokenizer, window)
    if not complete:
        ends = ends[:-4]  # tokens at the cut may merge differently in the full text
    return Source(window, ends, start, complete)


def cut(source: Source, k: int) -> str:
    """The first ``k`` tokens of ``source`` as text, stripped of surrounding whitespace."""
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


def splice(
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

