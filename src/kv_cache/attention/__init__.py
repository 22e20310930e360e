"""Attention over the compressed cache: blocks merged by log-sum-exp, read from the codes.

* :mod:`.blocks` - attention over one block (full precision, packed codes, this call's tokens)
  and the log-sum-exp merge;
* :mod:`.function` - :func:`compressed_attention`, registered in transformers'
  ``AttentionInterface`` as ``"kv_cache"``.
"""

from .function import ATTENTION_NAME, activate, active_cache, compressed_attention, register

__all__ = ["ATTENTION_NAME", "activate", "active_cache", "compressed_attention", "register"]
