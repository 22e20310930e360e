"""Eviction policies: one file per method, each only scores tokens (see ``base.py``)."""

from .base import EvictionPolicy, ScoreInputs
from .h2o import H2O
from .snapkv import SnapKV
from .streaming_llm import StreamingLLM

POLICIES = {"h2o": H2O, "snapkv": SnapKV, "streaming_llm": StreamingLLM}

__all__ = ["POLICIES", "EvictionPolicy", "H2O", "ScoreInputs", "SnapKV", "StreamingLLM"]
