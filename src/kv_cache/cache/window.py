"""A sliding-window layer's storage: the last ``W - 1`` tokens (math dictionary §22).

Query ``i`` at position ``p_i`` sees the keys at positions ``p_i - W < p <= p_i``: itself and the
``W - 1`` before it. Between calls a sliding layer therefore holds at most ``W - 1`` tokens, as
transformers' ``DynamicSlidingWindowLayer`` does; within a call it also holds the call's tokens
until the attention function has read them.
"""

from __future__ import annotations

import torch

from .storage import LayerStorage


def slide(storage: LayerStorage, starts: torch.Tensor | None, window: int, device: torch.device
          ) -> torch.Tensor | None:
    """Keep the last ``window - 1`` tokens of ``storage`` (a gather of token-major codes, never a
    re-quantization); return the leading padding slots ``starts`` ``[batch, kv_heads]`` int32
    shifted to match (None: no padding left).

    The storage's protected slots (full-precision residual) are always among the last tokens: a
    sliding layer has no quantization sinks (``QuantConfig.sliding_config``) and the cache refuses
    a window shorter than the residual.
    """
    keep_n, T = window - 1, storage.length
    if T <= keep_n:
        return starts
    dropped = T - keep_n
    keep = torch.arange(dropped, T, device=device)
    storage.gather(keep.expand(storage.batch, storage.heads, keep_n), in_place=False)
    if starts is None:
        return None
    starts = (starts - dropped).clamp_(min=0).to(torch.int32)
    return starts if bool(starts.any()) else None
