"""Precision tiers by token importance: the evicted tier of a :class:`~kv_cache.cache.layer.CompressedLayer`
(``QuantConfig.evicted_bits``, math dictionary §21).

When a one-shot policy (KVzip, SnapKV) selects the tokens a head keeps, the others are not
dropped: they are re-quantized at ``evicted_bits`` into a second storage, ``layer.demoted``
(:func:`demote`), in the layer's layout without sinks or residual
(:meth:`kv_cache.QuantConfig.evicted_config`). The native attention reads its blocks after
the kept ones, in the same softmax (``CompressedLayer.demoted_blocks``); decoding appends to
the kept tier only.
"""

from __future__ import annotations

import torch

from ..attention.blocks import FullBlock, RaggedBlock
from ..attention.key_offset import unshift_keys
from .packed import gather_tokens
from .packed_ragged import PackedRaggedStorage
from ..compression.positions import slot_positions, unpack_mask
from .ragged import dense_read
from .storage import LayerStorage, make_storage

TIERS_NEED_NATIVE = (
    "QuantConfig.evicted_bits keeps the evicted tokens in a second, lower-precision storage that only the "
    "native attention reads: run the model inside kv_cache.compress(model, cache) (attention='native')"
)


def dropped_slots(masks: torch.Tensor, starts: torch.Tensor | None) -> torch.Tensor:
    """bool ``[batch, kv_heads, T]``: the valid slots (at or after ``starts``) that ``masks`` does
    not keep, the ones the evicted tier holds."""
    drop = ~masks
    if starts is not None:
        drop &= torch.arange(masks.shape[2], device=masks.device) >= starts.unsqueeze(-1).to(masks.device)
    return drop


def demote(storage: LayerStorage, masks: torch.Tensor, starts: torch.Tensor | None, quant, layer_idx: int
           ) -> LayerStorage | None:
    """The evicted tier of a layer: the valid slots of ``storage`` not in ``masks`` (bool
    ``[batch, kv_heads, T]``), re-quantized at ``QuantConfig.evicted_bits`` (math dictionary §21)
    in the layer's layout without sinks or residual (``quant.evicted_config()``), before they are
    dropped from ``storage``. They are re-quantized from what the storage holds (dequantized
    codes, sinks and residual); heads that demote different numbers of tokens share one buffer
    (:class:`~kv_cache.cache.packed_ragged.PackedRaggedStorage`). Left padding (before
    ``starts`` ``[batch, kv_heads]``) is dropped, never demoted. None when nothing is dropped.
    """
    if storage.ragged:
        raise RuntimeError(
            f"layer {layer_idx} already demoted its evicted tokens: QuantConfig.evicted_bits demotes once, "
            "after the prefill (a policy with prefill_only)"
        )
    B, H, T = masks.shape
    drop = dropped_slots(masks, starts)
    counts = drop.sum(-1)
    if not bool(counts.any()):
        return None
    keys, values = storage.read()  # [B, H, T, d] in the model dtype
    evicted = quant.evicted_config()

    def fresh(b: int, h: int) -> LayerStorage:
        return make_storage(evicted, keys.new_empty(b, h, 0, keys.shape[-1]),
                            values.new_empty(b, h, 0, values.shape[-1]), track_groups=False, layer=layer_idx)

    if bool((counts == counts.flatten()[0]).all()):
        idx = drop.nonzero()[:, 2].reshape(B, H, -1)
        low = fresh(B, H)
        low.append(gather_tokens(keys, idx), gather_tokens(values, idx))
        return low
    rows = []
    for b in range(B):
        for h in range(H):
            idx = drop[b, h].nonzero().squeeze(1)
            row = fresh(1, 1)
            row.append(keys[b:b + 1, h:h + 1, idx], values[b:b + 1, h:h + 1, idx])
            rows.append(row)
    return PackedRaggedStorage.from_rows(rows, B, H)


class TiersLayer:
    """The precision-tier methods of :class:`~kv_cache.cache.layer.CompressedLayer` (a mixin over
    its ``quant``, ``storage``, ``demoted``, ``_starts`` and ``layer_idx``)."""

    @property
    def tiered(self) -> bool:
        """True when evicted tokens are demoted, not dropped (``QuantConfig.evicted_bits``)."""
        return self.quant is not None and self.quant.evicted_bits is not None

    def demoted_blocks(self) -> list:
        """The evicted tier's blocks (read after the kept ones; [] when there is none). A layer
        storing keys before RoPE reads them rotated back at their positions (§29.6): one
        full-precision block, or one per row when heads demoted different numbers of tokens."""
        if self.demoted is None:
            return []
        if self.rope_frame is None:
            return self.demoted.blocks()
        keys, values = dense_read(self.demoted)
        n = self.demoted.length
        pos = slot_positions(unpack_mask(self.demoted_arrivals, 8 * self.demoted_arrivals.shape[-1]), n)
        keys = self.rope_frame.apply(unshift_keys(keys, self.key_offset), pos)
        if not self.demoted.ragged:
            return [FullBlock(keys, values)]
        H = self.demoted.heads
        lengths = self.demoted.row_lengths
        rows = [[FullBlock(keys[r // H:r // H + 1, r % H:r % H + 1, n - m:],
                           values[r // H:r // H + 1, r % H:r % H + 1, n - m:])] if m else []
                for r, m in enumerate(lengths)]
        return [RaggedBlock(rows, self.demoted.batch, H, list(lengths))]

    def _demote(self, masks: torch.Tensor) -> None:
        if self.demoted is not None:
            raise RuntimeError(f"layer {self.layer_idx} already demoted its evicted tokens: QuantConfig.evicted_bits "
                               "demotes once, after the prefill (a policy with prefill_only)")
        if self.rope_frame is not None:  # the demoted tokens keep their positions (§29.6)
            self.demoted_arrivals = self.arrivals_of(dropped_slots(masks, self._starts))
        self.demoted = demote(self.storage, masks, self._starts, self.quant, self.layer_idx)
