"""Offline evaluation task builders for KV-cache compression.

Two families of tasks are built from any local text file (the *haystack*) and
a Hugging Face tokenizer, with no network access:

* **Continuation perplexity** (:func:`perplexity_windows`, in :mod:`.perplexity`):
  fixed-length token windows cut from the text; the first ``prefix_len`` tokens
  of each window are the part whose KV cache gets compressed, the rest is the
  continuation whose perplexity is measured.
* **RULER-style synthetic retrieval** (:func:`build_task` and the :data:`TASKS`
  table, in :mod:`.builders`, for a :class:`TaskRequest`): needle-in-a-haystack
  variants, variable tracking, common-words extraction and the classic pass-key
  task, following NVIDIA's RULER benchmark (https://github.com/NVIDIA/RULER,
  arXiv:2404.06654).  Prompts (:mod:`.prompts`) are fitted by tokens so that the
  rendered prompt is at most ``context`` tokens long and at most
  :data:`CONTEXT_SLACK` tokens shorter.

Deviations from upstream RULER (deliberate, for an offline library):

* Keys are ``adjective-noun`` pairs from a built-in list (upstream draws them
  from the ``wonderwords`` package); see :mod:`.specs`.
* The haystack (:mod:`.haystack`) is either any text file (upstream's "essay"
  type uses Paul Graham essays) or upstream's repeated "noise" sentences.
* Needles are placed at a requested depth, snapped to a sentence boundary,
  instead of at uniformly random positions; extra needles (distractors, extra
  values or keys, later variable-tracking hops) are placed at random depths.
* Common-words extraction (:mod:`.cwe`) has no in-context worked example, draws
  its words from the haystack text's vocabulary (``haystack="text"``) or from
  seeded pseudo-words (``haystack="noise"``), and scales the frequency of the
  common words down when the context is too small for upstream's 30 repetitions.
* Seeding uses a private :class:`random.Random` per call, never the global RNG.

Scoring (:func:`score_retrieval`, in :mod:`.scoring`) is RULER's
``string_match_all`` / ``string_match_part`` per sample, except that a reference
only matches as a whole token (``"12345"`` does not match inside ``"123456"``).
"""

from .builders import TASKS, build_task
from .haystack import HAYSTACK_KINDS, NOISE_HAYSTACK, SNAP_CHARS, SNAP_FRACTION
from .perplexity import PplSample, perplexity_windows
from .prompts import (
    CONTEXT_SLACK,
    RetrievalSample,
    build_prompt,
    count_prompt_tokens,
    format_chat,
    has_chat_template,
)
from .request import TaskRequest, check_context_fits, check_depths
from .scoring import score_retrieval
from .text import normalize_text, read_text

__all__ = [
    "CONTEXT_SLACK",
    "HAYSTACK_KINDS",
    "NOISE_HAYSTACK",
    "SNAP_CHARS",
    "SNAP_FRACTION",
    "TASKS",
    "PplSample",
    "RetrievalSample",
    "TaskRequest",
    "build_prompt",
    "build_task",
    "check_context_fits",
    "check_depths",
    "count_prompt_tokens",
    "format_chat",
    "has_chat_template",
    "normalize_text",
    "perplexity_windows",
    "read_text",
    "score_retrieval",
]
