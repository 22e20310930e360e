"""Eviction policies: one file per method, each only scores tokens (see ``base.py``)."""

from .base import EvictionPolicy, ScoreInputs
from .h2o import H2O
from .kvzap import KVzap
from .kvzip import KVzip
from .snapkv import SnapKV
from .streaming_llm import StreamingLLM

# The one registry, keyed by the names method specs use (``snapkv@0.5``); its defaults are the
# dataclasses' own. Adding a policy here adds it to the spec parser, its errors and the CLI help.
POLICIES: dict[str, type[EvictionPolicy]] = {"snapkv": SnapKV, "h2o": H2O, "streaming": StreamingLLM, "kvzip": KVzip,
                                            "kvzap": KVzap}

__all__ = ["POLICIES", "EvictionPolicy", "H2O", "KVzap", "KVzip", "ScoreInputs", "SnapKV", "StreamingLLM"]
