"""kv_cache: KV-cache compression for transformer LLMs (quantization x eviction)."""

from .cache import CompressedCache, FidelityError, FidelityWarning, MemoryReport, QuantConfig, compress
from .context import CompressedContext, PrefillStats, prefill
from .policies import H2O, EvictionPolicy, KVzap, KVzip, SnapKV, StreamingLLM

__all__ = ["CompressedCache", "CompressedContext", "EvictionPolicy", "FidelityError", "FidelityWarning", "H2O", "KVzap", "KVzip", "MemoryReport", "PrefillStats",
           "QuantConfig", "SnapKV", "StreamingLLM", "compress", "prefill"]
