"""Pure compression functions: quantization (``quantizer``), bit packing (``packing``),
one-head token selection (``sparsifier``, the seed API) and batched selection (``selection``),
randomized Hadamard rotations (``rotation``) and Lloyd-Max norm-only codebooks (``codebook``)."""

from .codebook import (
    LLOYD_MAX_BITS,
    dequantize_norm_codebook,
    lloyd_max_gaussian,
    lloyd_max_mse,
    norm_codebook_bits_per_element,
    quantize_norm_codebook,
)
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
from .rotation import RandomizedHadamard, fwht, pow2_blocks, seed_for
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
    "LLOYD_MAX_BITS",
    "SUPPORTED_BITS",
    "QuantizedTensor",
    "RandomizedHadamard",
    "check_budget",
    "code_range",
    "compression_ratio",
    "cumulative_attention_scores",
    "dequantize",
    "dequantize_norm_codebook",
    "fwht",
    "keep_recent_and_heavy_hitters",
    "lloyd_max_gaussian",
    "lloyd_max_mse",
    "metadata_bits_per_element",
    "norm_codebook_bits_per_element",
    "pack_bits",
    "packed_nbytes",
    "pool_scores",
    "pow2_blocks",
    "quantization_error",
    "quantize",
    "quantize_norm_codebook",
    "quantize_per_channel_asymmetric",
    "quantize_per_channel_symmetric",
    "reduce_gqa",
    "resolve_budget",
    "seed_for",
    "select_tokens",
    "snapkv_scores",
    "snapkv_select",
    "streaming_llm_indices",
    "total_gain",
    "unpack_bits",
    "window_attention",
]
