"""Method specs: the short strings every entry point takes to name a cache (``q4d``,
``q4+kvzip@0.3``, ``8x``, ``plan[NAME]``, ``hf-quanto-int4``, ``kvpress-snapkv@0.5``, ...).

The CLI (``kvcache eval --methods``, ``kvcache compress --method``), the server's ``method``, the
lm-eval model and the evaluation harness all parse specs here, so none of them reaches into
another's package for it.

* :mod:`.grammar`: the grammar table :data:`METHOD_GRAMMAR`, our quantization letters
  :data:`QUANT_OPTIONS`, :func:`parse_method`, :func:`parse_quant`, :func:`grammar_help`;
* :mod:`.method`: :class:`Method` (a parsed spec: how to make its cache);
* :mod:`.settings`: :func:`method_settings`, the ``(quant, eviction)`` of one of ours;
* :mod:`.plans`: presets ``<r>x`` and plan files ``plan[<path>]``;
* :mod:`.peers` and :mod:`.hf_fp8`: the peers' caches (transformers' ``QuantizedCache``, kvpress).
"""

from .grammar import (DEFAULTS_FLAG, EXAMPLES, METHOD_GRAMMAR, QUANT_OPTIONS, MethodForm, QuantOption, grammar_help,
                      parse_method, parse_methods, parse_quant)
from .method import MAX_SPEC_CHARS, REFERENCE_SPEC, Method, MethodUnavailable
from .peers import HF_BACKENDS, KVPRESS_PRESSES
from .settings import method_settings, parse_ours

__all__ = ["DEFAULTS_FLAG", "EXAMPLES", "HF_BACKENDS", "KVPRESS_PRESSES", "MAX_SPEC_CHARS", "METHOD_GRAMMAR",
           "QUANT_OPTIONS", "REFERENCE_SPEC", "Method", "MethodForm", "MethodUnavailable", "QuantOption",
           "grammar_help", "method_settings", "parse_method", "parse_methods", "parse_ours", "parse_quant"]
