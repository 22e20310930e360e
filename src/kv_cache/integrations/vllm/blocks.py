"""Paged codecs as the kernels' slot layouts: what the paged attention kernels need to read a
vLLM block in place (:func:`kv_cache.kernels.paged.attend_paged`, math dictionary §28.5).

Each :class:`~.codecs.PagedCodec` maps to a :class:`~kv_cache.kernels.paged.SlotLayout`:

* per-channel key groups (§28.2) -> ``channel_groups``: ``k = m_c + s_c * code``, the group's
  float16 scales and minima spread over its 32 slots;
* q8 keys and values -> ``token_int8``: ``s_t * (byte - 128)``;
* rotated Lloyd-Max values (§28.3) -> ``levels_token_norm``: the Lloyd-Max levels times the
  slot's 8-bit log-coded norm (§18.8), in the rotated basis;
* KIVI values -> ``token_channel_groups``: ``m_j + s_j * code`` per 32 channels.

The kernels then walk the block table and read the codes where vLLM keeps them. The ``*b``
codecs' keys stored before RoPE are turned at read by the layer's :func:`paged_rope`. Nothing
here imports vLLM.
"""

from __future__ import annotations

from functools import lru_cache

from ...kernels.paged import PagedRope, SlotLayout
from .codecs import PagedCodec, log_norm_table, value_levels

_KEYS = {"channel": "channel_groups", "token_int8": "token_int8"}
_VALUES = {"rotated_lloyd_max": "levels_token_norm", "token_int8": "token_int8",
           "uniform_channel_groups": "token_channel_groups"}


@lru_cache(maxsize=32)
def slot_layout(codec: PagedCodec) -> SlotLayout:
    """The kernels' :class:`SlotLayout` of ``codec``'s slots (values rotated for rotated codecs)."""
    levels = norms = None
    if codec.value_layout == "rotated_lloyd_max":
        levels, norms = value_levels(codec.value_bits)[0].contiguous(), log_norm_table().contiguous()
    return SlotLayout(codec.head_dim, _KEYS[codec.key_layout], codec.key_bits, _VALUES[codec.value_layout],
                      codec.value_bits, codec.offsets(), levels, norms)


def paged_rope(frame) -> PagedRope:
    """The kernels' :class:`PagedRope` of a layer's :class:`~kv_cache.cache.rope_frame.RopeFrame`."""
    return PagedRope(frame.inv_freq.float().contiguous(), frame.layout, float(frame.scaling))


__all__ = ["paged_rope", "slot_layout"]
