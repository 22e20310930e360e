"""Precision tiers by token importance: the evicted tier of a :class:`~kv_cache.cache.layer.CompressedLayer`
(``QuantConfig.evicted_bits``, math dictionary §21).

When a one-shot policy (KVzip, SnapKV) selects the tokens a head keeps, the others are not
dropped: they are re-quantized at ``evicted_bits`` into a second storage, ``layer.demoted``
(:meth:`TiersMixin._demote`), in the layer's layout without sinks or residual
(:meth:`kv_cache.QuantConfig.evicted_config`). The native attention reads its blocks after
the kept ones, in the same softmax (:meth:`TiersMixin.demoted_blocks`); decoding appends to
the kept tier only.
"""

from __future__ import annotations

import torch

from .packed import gather_tokens
from .packed_ragged import PackedRaggedStorage
from .storage import LayerStorage, make_storage

TIERS_NEED_NATIVE = (
    "QuantConfig.evicted_bits keeps the evicted tokens in a second, lower-precision storage that only the "
    "native attention reads: run the model inside kv_cache.compress(model, cache) (attention='native')"
)


class TiersMixin:
    """The evicted tier; mixed into ``CompressedLayer`` (which owns ``storage``, ``demoted``,
    ``quant``, ``layer_idx`` and ``_starts``)."""

    @property
    def tiered(self) -> bool:
        """True when evicted tokens are demoted, not dropped (``QuantConfig.evicted_bits``)."""
        return self.quant is not None and self.quant.evicted_bits is not None

    def demoted_blocks(self) -> list:
        """The evicted tier's blocks (read after the kept ones; [] when there is none)."""
        return [] if self.demoted is None else self.demoted.blocks()

    def _demote(self, masks: torch.Tensor) -> None:
        """Move the valid slots not in ``masks`` (bool ``[batch, kv_heads, T]``) to the evicted
        tier at ``QuantConfig.evicted_bits`` (math dictionary §21), before they are dropped from
        :attr:`storage`. They are re-quantized from what the storage holds (dequantized codes,
        sinks and residual), one row per head when heads demote different numbers of tokens."""
        if self.demoted is not None or self.storage.ragged:
            raise RuntimeError(
                f"layer {self.layer_idx} already demoted its evicted tokens: QuantConfig.evicted_bits demotes once, "
                "after the prefill (a policy with prefill_only)"
            )
        B, H, T = masks.shape
        drop = ~masks
        if self._starts is not None:  # left padding is dropped, never demoted
            drop &= torch.arange(T, device=masks.device) >= self._starts.unsqueeze(-1).to(masks.device)
        counts = drop.sum(-1)
        if not bool(counts.any()):
            return
        keys, values = self.storage.read()  # [B, H, T, d] in the model dtype
        quant = self.quant.evicted_config()

        def fresh(b: int, h: int) -> LayerStorage:
            return make_storage(quant, keys.new_empty(b, h, 0, keys.shape[-1]),
                                values.new_empty(b, h, 0, values.shape[-1]), track_groups=False, layer=self.layer_idx)

        if bool((counts == counts.flatten()[0]).all()):
            idx = drop.nonzero()[:, 2].reshape(B, H, -1)
            low = fresh(B, H)
            low.append(gather_tokens(keys, idx), gather_tokens(values, idx))
        else:
            rows = []
            for b in range(B):
                for h in range(H):
                    idx = drop[b, h].nonzero().squeeze(1)
                    row = fresh(1, 1)
                    row.append(keys[b:b + 1, h:h + 1, idx], values[b:b + 1, h:h + 1, idx])
                    rows.append(row)
            low = PackedRaggedStorage.from_rows(rows, B, H)
        self.demoted = low
