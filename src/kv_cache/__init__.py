"""kv_cache: KV-cache compression for transformer LLMs (quantization x eviction).

The packages, in layers: each imports only the layers below it (``[tool.importlinter]`` in
pyproject.toml; ``tests/test_architecture.py`` fails on an import that climbs). Top to bottom:

=====================================  ==============================================================
``cli``                                the ``kvcache`` commands
``serve``, ``lm_eval_model``           old paths of two integrations
``integrations``                       the server, lm-eval, vLLM
``eval``                               the evaluation harness (tasks, runner, reports)
``spec``                               the method grammar every entry point parses (``q4+kvzip@0.3``)
``plan``, ``bill``                     plans and presets, calibration, the byte bill
``context``                            prefill, KVzip's repeat pass, compress-once contexts, ``.kvc`` I/O
``generation``, ``chat``               the decoding loop, chat templates
``cache``                              ``CompressedCache`` and its layers, storage, serialization
``codec``, ``attention``               the storage codec of ``.kvc`` files; attention over compressed
                                       blocks and its checks
``policies``, ``kernels``              eviction policies; compiled and Triton kernels
``compression``, ``models``            the pure formulas; model loading
``assets``                             shipped data files: codec bases, KVzap scorers (no code)
=====================================  ==============================================================

Names in one row do not import each other.
"""

from .cache import CompressedCache, FidelityError, FidelityWarning, MemoryReport, PerformanceWarning, QuantConfig, compress
from .context import CompressedContext, PrefillStats, prefill
from .policies import H2O, EvictionPolicy, KVzap, KVzip, SnapKV, StreamingLLM

__all__ = ["CompressedCache", "CompressedContext", "EvictionPolicy", "FidelityError", "FidelityWarning", "H2O", "KVzap", "KVzip", "MemoryReport", "PerformanceWarning", "PrefillStats",
           "QuantConfig", "SnapKV", "StreamingLLM", "compress", "prefill"]
