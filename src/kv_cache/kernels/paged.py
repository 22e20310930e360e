"""Attention read from a paged cache in place, through a block table (math dictionary §28.5).

A paged cache is ``uint8 [num_blocks, H, block_size, S]``: one ``S``-byte slot per (block, kv
head, token), laid out as :class:`SlotLayout` says (vLLM's paged KV blocks hold the codecs of
:mod:`kv_cache.integrations.vllm.codecs` this way). :func:`attend_paged` computes, for each
request ``r`` and kv head ``h``, the softmax attention of ``M`` queries over the request's first
``lengths[r]`` tokens, token ``t`` being slot ``t % block_size`` of block
``block_table[r, t // block_size]``. The kernels walk the table and read each tile of 32 slots
where it lies; nothing is gathered or decoded into a new buffer:

* CPU: the compiled kernels (``csrc/kv_paged_impl.h``, per ISA);
* CUDA: the Triton kernel (:mod:`kv_cache.kernels.triton.paged`);
* elsewhere (or ``KV_CACHE_KERNELS=torch``): :func:`reference_attend_paged`, which decodes the
  requests' blocks with torch (the test oracle).

The output is float32 with its log-sum-exp, so it merges with other parts of a softmax (§16).

Keys stored before RoPE (:class:`PagedRope`, math dictionary §29.9): the kernels turn each
decoded key to its position, token ``t`` of a request at position ``t`` (vLLM's positions), the
angles of a tile stepped from its first token by the angle-addition recurrence; no per-sequence
state, so a block stays self-contained. Nothing here imports vLLM.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch

from . import _build, _select
from .qblock import uniform_lut

KEY_KINDS = ("channel_groups", "token_int8")
"""``channel_groups``: uniform codes per channel in groups of 32 slots, ``k = m_c + s_c * code``,
the group's float16 ``[2, D]`` (scales, then minima) spread over its 32 slots' ``4 D / 32`` meta
bytes; ``token_int8``: ``k = s_t * (byte - 128)``, one float16 ``s_t`` per slot."""
VALUE_KINDS = ("levels_token_norm", "token_int8", "token_channel_groups")
"""``levels_token_norm``: ``v = norm[byte] * levels[code]`` (an 8-bit log-coded norm per slot);
``token_int8`` as for keys; ``token_channel_groups``: ``v = m_j + s_j * code`` per 32-channel group
``j``, float16 scales then minima in the slot's meta bytes."""
GROUP = 32
"""Slots per key group, channels per value group, tokens per kernel tile."""


@dataclass(frozen=True, eq=False)
class SlotLayout:
    """What one ``S``-byte slot holds, for one kv head and token.

    Attributes
    ----------
    head_dim : int
        ``D``, a multiple of 32, at most 1024.
    key_kind, value_kind : str
        One of :data:`KEY_KINDS` / :data:`VALUE_KINDS`.
    key_bits, value_bits : int
        Code widths (2, 3, 4; 8 for the int8 kinds).
    offsets : tuple of 5 ints
        Byte offsets of key codes, key metadata, value codes, value metadata, and the slot's end
        (``S``).
    value_levels : torch.Tensor or None
        float32 ``[2**value_bits]`` codebook of ``levels_token_norm``.
    norm_table : torch.Tensor or None
        float32 ``[256]``: the norm of each 8-bit norm code (``levels_token_norm``).
    """

    head_dim: int
    key_kind: str
    key_bits: int
    value_kind: str
    value_bits: int
    offsets: tuple[int, int, int, int, int]
    value_levels: torch.Tensor | None = None
    norm_table: torch.Tensor | None = None

    def __post_init__(self) -> None:
        d = self.head_dim
        if isinstance(d, bool) or not isinstance(d, int) or d <= 0 or d % GROUP or d > 1024:
            raise ValueError(f"head_dim must be a multiple of {GROUP} in [32, 1024]; got {d!r}")
        if self.key_kind not in KEY_KINDS:
            raise ValueError(f"key_kind must be one of {list(KEY_KINDS)}; got {self.key_kind!r}")
        if self.value_kind not in VALUE_KINDS:
            raise ValueError(f"value_kind must be one of {list(VALUE_KINDS)}; got {self.value_kind!r}")
        for name, kind, bits in (("key_bits", self.key_kind, self.key_bits),
                                 ("value_bits", self.value_kind, self.value_bits)):
            allowed = (8,) if kind == "token_int8" else (2, 3, 4)
            if bits not in allowed or isinstance(bits, bool):
                raise ValueError(f"{name} must be one of {list(allowed)} for {kind!r}; got {bits!r}")
        o = tuple(self.offsets)
        if len(o) != 5 or any(not isinstance(x, int) for x in o) or list(o) != sorted(o) or o[0] < 0:
            raise ValueError(f"offsets must be 5 increasing byte offsets (key codes, key meta, value codes, "
                             f"value meta, end); got {self.offsets!r}")
        need = (d * self.key_bits // 8, 4 * d // GROUP if self.key_kind == "channel_groups" else 2,
                d * self.value_bits // 8, {"levels_token_norm": 1, "token_int8": 2}.get(self.value_kind, 4 * d // GROUP))
        have = tuple(o[i + 1] - o[i] for i in range(4))
        if have != need:
            raise ValueError(f"offsets give fields of {have} bytes; this layout needs {need}")
        if self.value_kind == "levels_token_norm":
            for name, t, n in (("value_levels", self.value_levels, 1 << self.value_bits),
                               ("norm_table", self.norm_table, 256)):
                if not isinstance(t, torch.Tensor) or t.dtype != torch.float32 or t.shape != (n,):
                    raise ValueError(f"{name} must be a float32 [{n}] tensor for 'levels_token_norm'; got "
                                     f"{getattr(t, 'dtype', type(t).__name__)} {tuple(getattr(t, 'shape', ()))}")

    @property
    def slot_bytes(self) -> int:
        return self.offsets[4]

    def luts(self, device) -> tuple[torch.Tensor, torch.Tensor]:
        """The kernels' code -> level tables ``(keys, values)``, float32 (built once per device)."""
        cache = self.__dict__.setdefault("_luts", {})
        key = str(torch.device(device))
        if key not in cache:
            cache[key] = self._build_luts(device)
        return cache[key]

    def _build_luts(self, device) -> tuple[torch.Tensor, torch.Tensor]:
        k = uniform_lut(8, True, device) if self.key_kind == "token_int8" else uniform_lut(self.key_bits, False, device)
        if self.value_kind == "token_int8":
            v = uniform_lut(8, True, device)
        elif self.value_kind == "levels_token_norm":
            v = self.value_levels.to(device).contiguous()
        else:
            v = uniform_lut(self.value_bits, False, device)
        return k.contiguous(), v.contiguous()


@dataclass(frozen=True, eq=False)
class PagedRope:
    """Keys stored before RoPE in a paged cache, turned at read (math dictionary §29.9)::

        k[t] = scaling * R(t) k_stored[t]      (token t of a request at position t)

    ``R(p)`` turns channel pair ``i`` by ``p * inv_freq[i]`` (``layout`` ``"half"``: channels ``i``
    and ``i + r/2``; ``"interleaved"``: ``2i`` and ``2i + 1``); channels past ``r = 2 len(inv_freq)``
    pass through unscaled (partial rotary), as in :class:`~kv_cache.kernels.KeyRope`.

    Attributes
    ----------
    inv_freq : torch.Tensor, float32, ``[r/2]``
    layout : {"half", "interleaved"}
    scaling : float
        The rope type's attention scaling (1 for plain RoPE), > 0.
    """

    inv_freq: torch.Tensor
    layout: str = "half"
    scaling: float = 1.0

    def check(self, d: int) -> None:
        """Raise ``TypeError``/``ValueError`` unless the frame fits ``d``-channel keys."""
        from .qblock import ROPE_LAYOUTS

        if self.layout not in ROPE_LAYOUTS:
            raise ValueError(f"PagedRope.layout must be one of {list(ROPE_LAYOUTS)}; got {self.layout!r}")
        w = self.inv_freq
        if not isinstance(w, torch.Tensor) or w.dtype != torch.float32 or w.dim() != 1 or w.numel() == 0 \
                or 2 * w.numel() > d:
            raise ValueError(f"PagedRope.inv_freq must be float32 [r/2] with 2 <= r <= head_dim {d}; got "
                             f"{getattr(w, 'dtype', type(w).__name__)} {tuple(getattr(w, 'shape', ()))}")
        if not bool(torch.isfinite(w).all()):
            raise ValueError("PagedRope.inv_freq must be finite")
        f = self.scaling
        if isinstance(f, bool) or not isinstance(f, (int, float)) or not math.isfinite(f) or f <= 0:
            raise ValueError(f"PagedRope.scaling must be a finite number > 0; got {f!r}")


def kind_ids(layout: SlotLayout) -> tuple[int, int]:
    """The compiled kernels' ids of ``layout``'s key and value kinds (indices in :data:`KEY_KINDS` /
    :data:`VALUE_KINDS`)."""
    return KEY_KINDS.index(layout.key_kind), VALUE_KINDS.index(layout.value_kind)


def check_paged_args(q, cache, block_table, lengths, layout, key_rope=None) -> None:
    """Validate a paged read's arguments (:func:`attend_paged`'s; ``q`` ``[R, H, M, D]``): types,
    the cache's shape and slot bytes against ``layout``, the block size, the table and lengths
    against ``R``, and ``key_rope`` against the head size. Raises ``TypeError``/``ValueError``."""
    if not isinstance(layout, SlotLayout):
        raise TypeError(f"layout must be a SlotLayout; got {type(layout).__name__}")
    if key_rope is not None:
        if not isinstance(key_rope, PagedRope):
            raise TypeError(f"key_rope must be a PagedRope or None; got {type(key_rope).__name__}")
        key_rope.check(layout.head_dim)
    for name, t in (("q", q), ("cache", cache), ("block_table", block_table), ("lengths", lengths)):
        if not isinstance(t, torch.Tensor):
            raise TypeError(f"{name} must be a torch.Tensor; got {type(t).__name__}")
    if cache.dtype != torch.uint8 or cache.dim() != 4 or cache.shape[-1] != layout.slot_bytes:
        raise ValueError(f"cache must be uint8 [blocks, H, block_size, {layout.slot_bytes}]; got {cache.dtype} "
                         f"{tuple(cache.shape)}")
    if cache.shape[2] % GROUP:
        raise ValueError(f"block_size must be a multiple of {GROUP}; got {cache.shape[2]}")
    h = cache.shape[1]
    if q.dim() != 4 or q.shape[1] != h or q.shape[3] != layout.head_dim:
        raise ValueError(f"q must be [R, {h}, M, {layout.head_dim}]; got {tuple(q.shape)}")
    if not q.dtype.is_floating_point:
        raise ValueError(f"q must be a floating tensor; got {q.dtype}")
    if block_table.dim() != 2 or block_table.shape[0] != q.shape[0] or block_table.dtype not in (torch.int32,
                                                                                               torch.int64):
        raise ValueError(f"block_table must be an int32/int64 [R={q.shape[0]}, max_blocks] tensor; got "
                         f"{block_table.dtype} {tuple(block_table.shape)}")
    if lengths.dim() != 1 or lengths.shape[0] != q.shape[0] or lengths.dtype.is_floating_point:
        raise ValueError(f"lengths must be an int [R={q.shape[0]}] tensor; got {lengths.dtype} {tuple(lengths.shape)}")


def attend_paged(q: torch.Tensor, cache: torch.Tensor, block_table: torch.Tensor, lengths: torch.Tensor,
                 layout: SlotLayout, scale: float, key_rope: PagedRope | None = None
                 ) -> tuple[torch.Tensor, torch.Tensor]:
    """Softmax attention of each request's queries over its paged tokens, read in place.

    Parameters
    ----------
    q : torch.Tensor, ``[R, H, M, D]``
        ``M`` queries per request and kv head (GQA: the query heads of kv head ``h`` side by side).
    cache : torch.Tensor, uint8, ``[num_blocks, H, block_size, S]``
        ``block_size`` a multiple of 32.
    block_table : torch.Tensor, int32 or int64, ``[R, max_blocks]``
    lengths : torch.Tensor, int, ``[R]``
        Tokens of each request (clipped to ``[0, max_blocks * block_size]``).
    layout : SlotLayout
    scale : float
        Softmax scale.
    key_rope : PagedRope, optional
        Keys are stored before RoPE: token ``t`` is turned to position ``t`` at read.

    Returns
    -------
    out : torch.Tensor, float32, ``[R, H, M, D]``
        0 for a request with no token.
    lse : torch.Tensor, float32, ``[R, H, M]``
        Log-sum-exp of the scaled scores; ``-inf`` for a request with no token.

    Raises
    ------
    ValueError
        Shapes or dtypes that do not match, or a block id outside the cache.
    """
    check_paged_args(q, cache, block_table, lengths, layout, key_rope)
    r, h, m, d = q.shape
    ext = _select.compiled_for((q, cache, block_table, lengths))
    if ext is not None:
        qf = q.float().contiguous().view(r * h, m, d)
        out = torch.empty_like(qf)
        lse = torch.empty(r * h, m, dtype=torch.float32)
        klut, vlut = layout.luts("cpu")
        kk, vk = kind_ids(layout)
        ext.attend_paged(qf, cache.contiguous(), block_table.to(torch.int32), lengths.long().contiguous(), kk,
                         layout.key_bits, klut, vk, layout.value_bits, vlut, layout.norm_table,
                         list(layout.offsets[:4]), float(scale), out, lse, _build.isa_flag(),
                         None if key_rope is None else key_rope.inv_freq.contiguous(),
                         int(key_rope is not None and key_rope.layout == "interleaved"),
                         1.0 if key_rope is None else float(key_rope.scaling))
        return out.view(r, h, m, d), lse.view(r, h, m)
    tri = _select.triton_for((q, cache, block_table, lengths))
    if tri is not None:
        return tri.attend_paged(q, cache, block_table, lengths, layout, float(scale), key_rope=key_rope)
    return reference_attend_paged(q, cache, block_table, lengths, layout, scale, key_rope)


def write_paged(cache: torch.Tensor, key: torch.Tensor, value: torch.Tensor, slots: torch.Tensor,
                layout: SlotLayout) -> bool:
    """Encode tokens into their slots in place with the compiled kernel (one call per layer and step).

    The arithmetic is the torch encoder's (:func:`kv_cache.integrations.vllm.codecs.write_slots`),
    in the same order: per-channel key groups re-encoded from their stored tokens plus the new
    ones (§28.2), int8 per token, Lloyd-Max codes of ``value / norm`` with the 8-bit log-coded RMS
    norm (§28.3; float32 sums in another order may move a norm code at a rounding tie), KIVI
    values per 32 channels.

    Parameters
    ----------
    cache : torch.Tensor, uint8, ``[num_blocks, H, block_size, S]`` (contiguous, CPU)
    key, value : torch.Tensor, ``[N, H, D]``
        Values already rotated for ``levels_token_norm`` layouts.
    slots : torch.Tensor, int, ``[N]``
        ``block * block_size + offset``; no padding (negative) entries.
    layout : SlotLayout

    Returns
    -------
    bool
        True when the compiled kernel wrote the slots; False when it does not serve these tensors
        (not on the CPU, ``KV_CACHE_KERNELS=torch`` or ``triton``, or no build): the caller encodes
        with torch then.

    Raises
    ------
    ValueError
        A slot outside the cache.
    """
    ext = _select.compiled_for((cache, key, value, slots))
    if ext is None or not cache.is_contiguous():
        return False
    from ..compression.codebook import LOG_SCALE_MIN_EXP, LOG_SCALE_STEP, log_scale_range

    kk, vk = kind_ids(layout)
    mids = None
    if layout.value_kind == "levels_token_norm":
        lv = layout.value_levels
        mids = ((lv[:-1] + lv[1:]) * 0.5).contiguous()
    lo, hi = log_scale_range()
    ext.write_paged(cache, key.float().contiguous(), value.float().contiguous(), slots.long().contiguous(), kk,
                    layout.key_bits, vk, layout.value_bits, list(layout.offsets[:4]), mids, layout.norm_table,
                    [lo, hi, LOG_SCALE_MIN_EXP, LOG_SCALE_STEP], _build.isa_flag())
    return True


# ---------------------------------------------------------------------------------------------
# The torch reference: decode, then attend.


def _f16(b: torch.Tensor) -> torch.Tensor:
    """``[..., 2 n]`` uint8 -> ``[..., n]`` float32 (little-endian float16 pairs)."""
    return b.contiguous().view(torch.float16).float()


def _codes(b: torch.Tensor, bits: int, d: int) -> torch.Tensor:
    """``[..., D * bits / 8]`` packed bytes -> ``[..., D]`` int64 codes (pack_bits' little-endian layout)."""
    if bits == 8:
        return b.long()
    words = b.long()
    if bits == 3:  # 8 codes per 3 bytes
        w = words.view(*b.shape[:-1], -1, 3)
        word = w[..., 0] | (w[..., 1] << 8) | (w[..., 2] << 16)
        shifts = 3 * torch.arange(8, device=b.device)
        return ((word[..., None] >> shifts) & 7).view(*b.shape[:-1], d)
    per = 8 // bits
    shifts = bits * torch.arange(per, device=b.device)
    return ((words[..., None] >> shifts) & ((1 << bits) - 1)).view(*b.shape[:-1], d)


def decode_slots(raw: torch.Tensor, layout: SlotLayout) -> tuple[torch.Tensor, torch.Tensor]:
    """Keys and values of whole groups of slots.

    Parameters
    ----------
    raw : torch.Tensor, uint8, ``[..., T, S]``
        ``T`` a multiple of 32, group-aligned (e.g. whole blocks).

    Returns
    -------
    keys, values : torch.Tensor, float32, ``[..., T, D]``
    """
    d, o = layout.head_dim, layout.offsets
    lead, t = raw.shape[:-2], raw.shape[-2]
    kc = _codes(raw[..., o[0]:o[1]], layout.key_bits, d).float()
    if layout.key_kind == "token_int8":
        k = (kc - 128.0) * _f16(raw[..., o[1]:o[2]])
    else:
        g = t // GROUP
        meta = _f16(raw[..., o[1]:o[2]].reshape(*lead, g, GROUP * (o[2] - o[1])))  # [..., g, 2D]
        s, mn = meta[..., None, :d], meta[..., None, d:]
        k = (mn + kc.view(*lead, g, GROUP, d) * s).view(*lead, t, d)
    vc = _codes(raw[..., o[2]:o[3]], layout.value_bits, d)
    vm = raw[..., o[3]:o[4]]
    if layout.value_kind == "token_int8":
        v = (vc.float() - 128.0) * _f16(vm)
    elif layout.value_kind == "levels_token_norm":
        v = layout.value_levels.to(raw.device)[vc] * layout.norm_table.to(raw.device)[vm.long()]
    else:
        n = d // GROUP
        meta = _f16(vm)
        s, mn = meta[..., :n, None], meta[..., n:, None]
        v = (mn + vc.float().view(*vc.shape[:-1], n, GROUP) * s).view(*vc.shape)
    return k, v


def turn_keys(k: torch.Tensor, first: int, key_rope: PagedRope) -> torch.Tensor:
    """Keys stored before RoPE ``[..., T, D]`` of consecutive positions ``first .. first + T - 1``
    -> the keys the model rotated (float32; :func:`kv_cache.compression.rope.rotate`)."""
    from ..compression.rope import rotate

    pos = first + torch.arange(k.shape[-2], device=k.device)
    return rotate(k.float(), pos, key_rope.inv_freq, float(key_rope.scaling), key_rope.layout)


def reference_attend_paged(q: torch.Tensor, cache: torch.Tensor, block_table: torch.Tensor, lengths: torch.Tensor,
                           layout: SlotLayout, scale: float, key_rope: PagedRope | None = None
                           ) -> tuple[torch.Tensor, torch.Tensor]:
    """:func:`attend_paged` in torch: each request's blocks decoded (:func:`decode_slots`, keys
    turned by :func:`turn_keys` under ``key_rope``), then attended in float32. Same arguments and
    returns."""
    check_paged_args(q, cache, block_table, lengths, layout, key_rope)
    r, h, m, d = q.shape
    bs = cache.shape[2]
    out = torch.zeros(r, h, m, d, dtype=torch.float32, device=q.device)
    lse = torch.full((r, h, m), float("-inf"), dtype=torch.float32, device=q.device)
    for i in range(r):
        n = max(0, min(int(lengths[i]), block_table.shape[1] * bs))
        if n == 0:
            continue
        blocks = block_table[i, :-(-n // bs)].long()
        if bool((blocks < 0).any()) or bool((blocks >= cache.shape[0]).any()):
            raise ValueError(f"block_table: request {i} names a block outside the cache's {cache.shape[0]} blocks")
        k, v = decode_slots(cache[blocks], layout)  # [nb, H, bs, D]
        k = k.permute(1, 0, 2, 3).reshape(h, -1, d)[:, :n]
        v = v.permute(1, 0, 2, 3).reshape(h, -1, d)[:, :n]
        if key_rope is not None:
            k = turn_keys(k, 0, key_rope)
        s = torch.einsum("hmd,htd->hmt", q[i].float(), k) * scale
        lse[i] = torch.logsumexp(s, dim=-1)
        out[i] = torch.einsum("hmt,htd->hmd", torch.softmax(s, dim=-1), v)
    return out, lse


__all__ = ["GROUP", "KEY_KINDS", "VALUE_KINDS", "PagedRope", "SlotLayout", "attend_paged", "check_paged_args",
           "decode_slots", "kind_ids", "reference_attend_paged", "turn_keys", "write_paged"]
