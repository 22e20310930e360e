"""Scoring a greedy answer: RULER's ``string_match_all`` / ``string_match_part``.

Unlike upstream, a reference only matches as a whole token (``"12345"`` does not match inside
``"123456"``).
"""

from __future__ import annotations

import re
from collections.abc import Sequence

__all__ = ["score_retrieval"]

_SCORE_MODES = ("all", "part")

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
