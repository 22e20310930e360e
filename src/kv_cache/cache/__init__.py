"""The transformers integration: ``CompressedCache``, its layers, ``compress`` and the report."""

from .cache import TESTED_MODEL_TYPES, CompressedCache, FidelityError, FidelityWarning, PerformanceWarning
from .config import QuantConfig
from .hooks import compress
from .layer import CompressedLayer
from .report import MemoryReport

__all__ = ["TESTED_MODEL_TYPES", "CompressedCache", "FidelityError", "FidelityWarning", "PerformanceWarning", "CompressedLayer", "MemoryReport", "QuantConfig", "compress"]
