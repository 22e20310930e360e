"""When a :class:`~kv_cache.cache.layer.CompressedLayer`'s policy cannot act: the errors that say how
to fix the setting (no silent no-ops)."""

from __future__ import annotations

from .context_layer import RECONSTRUCTION_MISSING
from .tiers import TIERS_NEED_NATIVE


def check_policy_can_act(layer, batch: int) -> None:
    """Raise unless ``layer``'s policy can act in this setting (never keep everything silently):
    a shared budget, KVzip or tiers outside the native attention, a policy that needs attention
    statistics without an observer, a padded batch without the mask."""
    pol = layer.policy
    if pol is None:
        return
    name = type(pol).__name__
    if layer._awaiting_reconstruction:
        raise RuntimeError(RECONSTRUCTION_MISSING)
    if (pol.scope != "head" or pol.needs_reconstruction) and not layer.native:
        raise RuntimeError(
            f"{name}(scope={pol.scope!r}) keeps a different number of tokens per head, which only the native "
            "attention reads: run the model inside kv_cache.compress(model, cache) (attention='native')"
        )
    if layer.tiered and not layer.native:
        raise RuntimeError(TIERS_NEED_NATIVE)
    if pol.needs_reconstruction and layer._prefill_done:
        return
    if layer._pending is not None:
        raise RuntimeError(
            f"{name} needs attention statistics but none were observed for layer {layer.layer_idx}: "
            "the model's attention modules did not report to `kv_cache.compress` (unsupported architecture?)"
        )
    if pol.needs_attention and not layer.observed:
        raise RuntimeError(
            f"{name} needs attention statistics but none are observed for layer {layer.layer_idx}: "
            "run the model inside `with kv_cache.compress(model, cache):`"
        )
    if not layer.observed and batch > 1:
        raise RuntimeError(
            f"{name} on a batch of {batch} rows needs the attention mask to tell padding from sink tokens: "
            "run the model inside `with kv_cache.compress(model, cache):`"
        )
