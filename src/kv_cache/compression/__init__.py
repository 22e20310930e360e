"""Pure compression functions: quantization (``quantizer``), bit packing (``packing``),
one-head token selection (``sparsifier``, the seed API) and batched selection (``selection``)."""

from .packing import SUPPORTED_BITS, pack_bits, packed_nbytes, unpack_bits
from .quantizer import (
    QuantizedTensor,
    code_range,
    dequantize,
    metadata_bits_per_element,
    quantization_error,
    quantize,
    quantize_per_channel_asymmetric,
    quantize_per_channel_symmetric,
)
from .selection import (
    check_budget,
    pool_scores,
    reduce_gqa,
    resolve_budget,
    select_tokens,
    snapkv_scores,
    streaming_llm_indices,
    window_attention,
)
from .sparsifier import (
    compression_ratio,
    cumulative_attention_scores,
    keep_recent_and_heavy_hitters,
    snapkv_select,
    total_gain,
)

__all__ = [
    "SUPPORTED_BITS",
    "QuantizedTensor",
    "check_budget",
    "code_range",
    "compression_ratio",
    "cumulative_attention_scores",
    "dequantize",
    "keep_recent_and_heavy_hitters",
    "metadata_bits_per_element",
    "pack_bits",
    "packed_nbytes",
    "pool_scores",
    "quantization_error",
    "quantize",
    "quantize_per_channel_asymmetric",
    "quantize_per_channel_symmetric",
    "reduce_gqa",
    "resolve_budget",
    "select_tokens",
    "snapkv_scores",
    "snapkv_select",
    "streaming_llm_indices",
    "total_gain",
    "unpack_bits",
    "window_attention",
]
