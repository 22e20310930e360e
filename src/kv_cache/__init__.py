"""kv_cache: KV-cache compression for transformer LLMs (quantization x eviction)."""

from .cache import CompressedCache, MemoryReport, QuantConfig, compress
from .policies import H2O, EvictionPolicy, SnapKV, StreamingLLM

__all__ = ["CompressedCache", "EvictionPolicy", "H2O", "MemoryReport", "QuantConfig", "SnapKV", "StreamingLLM",
           "compress"]
