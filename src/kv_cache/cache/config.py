"""Quantized-storage settings of :class:`kv_cache.CompressedCache`."""

from __future__ import annotations

import os
import warnings
from dataclasses import dataclass, fields, replace
from pathlib import Path
from typing import Any

import torch

from ..compression.codebook import LLOYD_MAX_BITS
from ..compression.packing import SUPPORTED_BITS

ROTATIONS = (None, "hadamard", "calibrated")
ZERO_DTYPES = (torch.int16, torch.int8, torch.uint8)
RESIDUAL_DTYPES = (None, torch.float16, torch.bfloat16, torch.float32)
KEY_GROUPINGS = ("channel", "token")
LEVELS = ("uniform", "lloyd_max")

AUTO = "auto"
"""Default of the layout fields: resolved from the bit widths in use (see :class:`QuantConfig`)."""

KIVI_LAYOUT: dict[str, Any] = {
    "group_size": 32, "residual_length": 32, "sink_tokens": 0, "scale_dtype": torch.float16, "rotation": None,
    "key_grouping": "channel", "channel_group": None, "levels": "uniform", "residual_dtype": None,
    "center_keys": False, "pre_rope": False, "scale_keys": False,
}
"""The original layout (KIVI: per-channel keys in groups of 32 tokens, per-token values, uniform
asymmetric levels, fp16 scales, int16 zero points, a 32-token residual): the defaults of 8-bit
caches, :meth:`QuantConfig.kivi`, and the base of ``kvcache eval``'s ``q<bits>`` specs."""

BEST_LAYOUT: dict[str, Any] = {
    "group_size": 32, "residual_length": 32, "sink_tokens": 4, "scale_dtype": torch.uint8, "rotation": "hadamard",
    "key_grouping": "channel", "channel_group": "head", "levels": "lloyd_max", "residual_dtype": torch.float16,
    "center_keys": False,
}
"""The default layout at 2-4 bits before wave 6, now ``QuantConfig(bits=b, pre_rope=False)`` (and
what a model whose RoPE cannot be removed gets; math dictionary §25): keys per channel in groups of 32 tokens with uniform levels, a float16
scale and a zero point per group (KIVI's keys, never rotated: a channel's offset, such as
Qwen2's key bias, is absorbed by its zero point); values rotated by a randomized Hadamard
rotation, Lloyd-Max levels with one 8-bit log-coded norm per vector; 4 float16 sinks and a
float16 residual of up to 31 tokens (keys are quantized 32 tokens at a time)."""

PER_TOKEN_LAYOUT: dict[str, Any] = {
    "group_size": 4, "residual_length": 4, "sink_tokens": 4, "scale_dtype": torch.uint8, "rotation": "hadamard",
    "key_grouping": "token", "channel_group": "head", "levels": "lloyd_max", "residual_dtype": torch.float16,
    "center_keys": True,
}
"""The previous 2-4-bit default (``QuantConfig(bits, key_grouping="token")``): keys rotated too,
one 8-bit norm per key, flush blocks of 4 tokens, and the per-channel key offset subtracted
(§25). Fewer bytes (4.2 bits at 4 bits), but on Qwen2.5 +60% perplexity even so."""

PRE_ROPE_LAYOUT: dict[str, Any] = {
    **PER_TOKEN_LAYOUT, "group_size": 1, "residual_length": 0, "pre_rope": True, "scale_keys": False,
}
"""Per-token keys stored before RoPE (``QuantConfig(bits, pre_rope=True, key_grouping="token")``,
math dictionary §29.5): the per-token layout (a randomized Hadamard rotation, Lloyd-Max levels, one 8-bit norm per key and
value vector) on keys with RoPE removed and the prompt's per-channel mean subtracted, which is a
constant before RoPE (Qwen2's key bias included), so the offset that broke per-token keys on
Qwen2.5 is gone. Every token is quantized on arrival (no residual); 4 float16 sinks."""

SCALE_KEYS = (False, True, "sqrt")
"""Values of ``QuantConfig.scale_keys``: no per-channel key scale, the channel's RMS (whitening),
or its square root (half-whitening, the default of per-token keys before RoPE; §29.7)."""

DEFAULT_LAYOUT: dict[str, Any] = {**PRE_ROPE_LAYOUT, "scale_keys": "sqrt"}
"""The default layout at 2-4 bits since wave 6 (``QuantConfig(bits=b)``; math dictionary §29.7):
:data:`PRE_ROPE_LAYOUT` with each centered key channel divided by the square root of its RMS
over the prompt before the per-token code (half-whitening). Every key is coded on arrival: a
randomized Hadamard rotation, Lloyd-Max levels, one 8-bit log-coded norm per key and per value
vector; 4 float16 sinks and no residual, so the bytes are ``b + 8 / head_dim`` bits per element
plus the sinks and the per-channel mean and scale (4.17 / 3.18 / 2.18 at head_dim 64 and 1,792
tokens). Keys before RoPE hold a constant per-channel offset and spread (a QK-norm gain, Qwen2's
key bias), which the centering removes and the scale evens out; a model whose RoPE cannot be
removed keeps :data:`BEST_LAYOUT` (:meth:`QuantConfig.after_rope`)."""

MIN_TOKEN_CODE_HEAD_DIM = 64
"""The default's rule read from the model (:class:`~kv_cache.CompressedCache`): per-token codes
before RoPE (:data:`DEFAULT_LAYOUT`) need heads of at least this many channels (measured at 64,
SmolLM2 and Qwen2.5, and 256, Gemma 3); narrower heads (a tiny test model's 8) spend too much
on each vector's norm and leave a Lloyd-Max code too few channels to average over, so they keep
:data:`BEST_LAYOUT`, per-channel groups after RoPE (:meth:`QuantConfig.after_rope`)."""

LATER_FIELDS: dict[str, Any] = {"pre_rope": False, "scale_keys": False}
"""Fields added after layouts were first saved, at the value that means "as before": left out of
saved files and plan fingerprints when equal (``encode_quant``), so a plan or ``.kvc`` file
written before them loads with the same fingerprint (and ``repr`` hides them, like every field
at its default)."""

_KIVI_FIELDS = ("bits", "group_size", "residual_length", "sink_tokens", "symmetric", "scale_dtype")
"""Fields shown by ``repr`` always (the original layout); the others only when they differ from
:data:`KIVI_LAYOUT` (or their default), so a KIVI configuration prints exactly as before
(``kvcache eval`` resumes by it)."""


def _normalize_layer_bits(layer_bits: Any, name: str = "layer_bits") -> tuple[tuple[int, tuple[int, int]], ...]:
    """``{layer: bits}`` / ``{layer: (key_bits, value_bits)}`` (or pairs) as sorted
    ``((layer, (key_bits, value_bits)), ...)``: hashable, and one form for every reader."""
    if not layer_bits:
        return ()
    try:
        items = dict(layer_bits).items()
    except (TypeError, ValueError):
        raise ValueError(f"QuantConfig.{name} must be a mapping {{layer: bits}} or {{layer: (key_bits, "
                         f"value_bits)}}; got {layer_bits!r}") from None
    out = []
    for layer, b in items:
        kv = tuple(b) if isinstance(b, (tuple, list)) else (b, b)
        ok = len(kv) == 2 and all(not isinstance(x, bool) and x in SUPPORTED_BITS for x in kv)
        if isinstance(layer, bool) or not isinstance(layer, int) or layer < 0 or not ok:
            raise ValueError(
                f"QuantConfig.{name} maps layer indices (int >= 0) to bits in {list(SUPPORTED_BITS)} "
                f"or to (key_bits, value_bits) pairs of them; got {layer!r}: {b!r}"
            )
        out.append((layer, (int(kv[0]), int(kv[1]))))
    return tuple(sorted(out))


@dataclass(frozen=True, repr=False)
class QuantConfig:
    """How cached tokens are stored.

    **Defaults: the best measured layout for the widths in use.** Every layout field left at
    ``"auto"`` is resolved in ``__post_init__`` (the stored config holds concrete values):

    * 2-4 bits (keys, values and every ``layer_bits`` entry): :data:`DEFAULT_LAYOUT` (since wave 6,
      math dictionary §29.7): keys stored before RoPE, centered and each channel divided by the
      square root of its RMS over the prompt (``scale_keys="sqrt"``), then coded per token like the
      values (a randomized Hadamard rotation, Lloyd-Max levels, one 8-bit log-coded norm per
      vector), quantized on arrival; 4 float16 sinks. 4.17 / 3.18 / 2.18 bits per element on
      SmolLM2 and Qwen2.5, 4.10 / 3.10 / 2.10 on Gemma 3, below the per-channel layout's
      4.77 / 3.79 / 2.80 at a lower KL for the same bytes on all three (``docs/results/``).
      The cache reads the model (:meth:`for_model`): heads under 64 channels, or a RoPE it cannot
      remove, keep :data:`BEST_LAYOUT` (per-channel key groups after RoPE, ``pre_rope=False``).
    * any 8-bit width: :data:`KIVI_LAYOUT` (per-channel keys in groups of 32 tokens, per-token
      values, uniform asymmetric levels, a 32-token residual), also :meth:`kivi` at any width.

    An explicit argument wins, and the fields that depend on it follow (``key_grouping=
    "channel"`` keeps 32-token groups and uniform levels; ``levels="uniform"`` keeps fp16 scales).

    Parameters
    ----------
    bits : {2, 3, 4, 8}
        Bits of keys and values unless ``key_bits`` / ``value_bits`` / ``layer_bits`` say otherwise.
    group_size : int, default "auto" (4 per-token / 32 per-channel)
        Keys stored per channel: tokens per group of a per-channel scale, and the flush block
        (the residual is quantized ``group_size`` tokens at a time). Values (and keys stored per
        token): channels per group of a per-token scale unless ``channel_group`` is set; must
        divide ``head_dim`` (or be >= it).
    residual_length : int, default "auto" (4 per-token / 32 per-channel)
        Full-precision residual: when it reaches ``max(residual_length, group_size)`` tokens,
        all its whole groups are quantized (KIVI), so between 0 and
        ``max(residual_length, group_size) - 1`` of the most recent tokens are full precision.
    sink_tokens : int, default "auto" (4 at 2-4 bits, 0 with 8 bits)
        The first tokens of every sequence kept in full precision, never quantized (the prompt
        is never quantized in one shot with its sink tokens).
    symmetric : bool, default False
    scale_dtype : {torch.float16, torch.bfloat16, torch.float32, torch.uint8}, default "auto"
        (torch.uint8 with Lloyd-Max levels, else torch.float16)
        Storage dtype of scales (zero points: ``zero_dtype``). ``torch.uint8`` (Lloyd-Max levels
        only) stores each norm as an 8-bit log code (``2**(-13 + (c - 1) / 12)``, within 2.9%;
        math dictionary §18.8): half the metadata of fp16 norms, 0.125 bits per element at one
        norm per 64 channels.
    key_bits, value_bits : {2, 3, 4, 8} or None
        Separate precisions for keys and values (e.g. K3V2); None: ``bits``.
    layer_bits : mapping or tuple of pairs, default ()
        Overrides for chosen layers: ``{layer: bits}`` (keys and values) or
        ``{layer: (key_bits, value_bits)}``, e.g. the first layer at 4 bits in a 2-bit cache,
        or a per-layer allocation from :func:`kv_cache.plan.bit_allocation.allocate_bits`
        (``kvcache allocate``; :func:`load_bit_profile` reads its file).
    rotation : {None, "hadamard", "calibrated"}, default "auto" ("hadamard" at 2-4 bits, None with 8)
        ``"hadamard"``: a randomized Hadamard rotation per layer and KV head (seeded, no
        calibration), applied to keys (post-RoPE) and values before quantization; attention
        undoes it by rotating the query once and the output once (math dictionary §17).
        ``"calibrated"``: the per-layer, per-KV-head matrices ``R = V H`` of ``rotation_path``
        (``V`` the eigenvectors of the calibration queries' covariance, §17.7), applied to keys
        and values the same way (values share the key's ``R``: its Hadamard factor spreads
        their outliers too, and one rotation keeps one query and one output rotation per call).
    rotation_path : str or os.PathLike or None
        The calibration file of ``rotation="calibrated"`` (``kvcache calibrate``; a safetensors
        file read by :func:`kv_cache.compression.rotation_file.load_calibration`). It must exist;
        its shapes are checked against the model at first use.
    rotation_seed : int, default 0
    key_grouping : {"channel", "token"}, default "auto" ("token" with keys before RoPE, else "channel":
        32-token groups)
        Keys quantized per channel (KIVI) or per token (after a rotation spreads the channel
        outliers that made per-channel grouping necessary).
    channel_group : int, "head" or None, default "auto" ("head" with Lloyd-Max levels; 32 with
        uniform levels and per-token keys at 2-4 bits; else None)
        Channels per scale of per-token groups (values, and keys with ``key_grouping="token"``),
        up to ``head_dim``; ``"head"``: one scale per vector; None: ``min(group_size, head_dim)``.
    levels : {"uniform", "lloyd_max"}, default "auto" ("lloyd_max" with per-token keys at 2-4 bits)
        ``lloyd_max``: the Lloyd-Max levels of N(0, 1) with one RMS scale per group and no zero
        point (norm-only; needs per-token groups for keys, 2-4 bits; math dictionary §18).
    clip_keys, clip_values : float in (0, 1], default 1.0
        Uniform levels only: each group's range ``[min, max]`` is shrunk about its midpoint to
        this fraction before quantizing (OSCAR uses 0.96 for keys, 0.92 for values); values
        outside are clamped. Trades the few extreme values for a finer grid for the rest.
    zero_dtype : {torch.int16, torch.int8, torch.uint8}, default torch.int16
        Storage dtype of zero points (asymmetric uniform levels only). 8-bit zero points halve
        their bytes; a group whose zero point does not fit (its range does not come close to
        0) gets the nearest one that does and a scale widened so its whole range is still
        covered (math dictionary §18.7). ``torch.int8`` cannot hold the zero points 0..255 of
        8-bit codes, so it is refused when any layer uses 8 bits (use ``torch.uint8``).
    residual_dtype : {None, torch.float16, torch.bfloat16, torch.float32}, default "auto"
        (torch.float16 at 2-4 bits, None with 8)
        Storage dtype of the full-precision residual and sink tokens; None: the model's dtype.
        Attention reads them in float32 either way.
    evicted_bits : {2, 3, 4, 8} or None, default None
        Token-importance precision tiers (math dictionary §21): the tokens a one-shot eviction
        policy (KVzip, SnapKV) does not keep are stored at this width instead of being dropped,
        in the same layout without sinks or a residual (:meth:`evicted_config`); the kept ones
        stay at ``bits`` / ``layer_bits``. Every token is still represented, and attention reads
        both tiers in one softmax. Needs an eviction policy with ``prefill_only`` and the native
        attention (:func:`kv_cache.compress`). None: evicted tokens are dropped.
    center_keys : bool, default "auto" (True with per-token keys, False with per-channel keys)
        Store every key of a layer as ``k - mu``, ``mu`` the per-channel mean of the prompt's
        keys (one per batch row and KV head, taken at the first ``update``, sinks left out;
        math dictionary §25). Exact for softmax attention (every logit a query sees shifts by
        the same ``q . mu``); soft-capping and learned sinks get the shift added back. It keeps
        a per-token layout from spending its range on a channel offset (Qwen2's key bias:
        +62% perplexity at 4 bits without it). Per-channel key groups absorb such an offset
        in their zero points already. Costs ``4 * head_dim`` bytes per batch row and KV head.
    pre_rope : bool, default "auto" (True at 2-4 bits unless ``key_grouping="channel"`` or
        ``levels="uniform"`` is given; the cache may still turn an "auto" True into False for a
        model, :meth:`for_model`)
        Store keys before RoPE (math dictionary §29): each key the model hands over rotated is
        turned back (``k = R(p)^T k' / s``, the layer's own frequencies read from the config,
        :mod:`kv_cache.cache.rope_frame`) before it is centered and quantized, and rotated again
        at read time with its position, which every stored token keeps (after eviction too).
        Before RoPE a channel's offset is a constant, so per-channel statistics and the key
        offset (``center_keys``) stay still. The layout is otherwise unchanged (per-channel key
        groups by default); with ``key_grouping="token"`` and the other fields at "auto" it is
        :data:`PRE_ROPE_LAYOUT`: per-token keys quantized on arrival, one 8-bit norm per vector.
        Read by the reference attention path and the native one; positions travel through every
        eviction (shared budgets and the evicted tier included). Models without RoPE and
        multimodal RoPE are refused.
    scale_keys : {False, True, "sqrt"}, default "auto" ("sqrt" with per-token keys before RoPE, else False)
        With ``pre_rope`` and ``center_keys``: also divide each centered key channel by its RMS
        over the prompt (``True``; one per batch row, KV head and channel, taken with the mean;
        floored at 1% of the row's mean) or by the square root of it (``"sqrt"``, half-whitening:
        the least logit error when nothing is known of the queries), so that a per-token code
        spends its error on each channel according to the channel's own spread (math dictionary
        §29.7); multiplied back at read.
    evicted_layer_bits : mapping or tuple of pairs, default ()
        Per-layer widths of the evicted tier, in the form of ``layer_bits`` (e.g. a
        ``kvcache allocate`` profile at a low mean width): the sensitive layers' evicted keys at
        3 bits, the rest at ``evicted_bits``. Needs ``evicted_bits``.
    """

    bits: int = 4
    group_size: Any = AUTO
    residual_length: Any = AUTO
    sink_tokens: Any = AUTO
    symmetric: bool = False
    scale_dtype: Any = AUTO
    key_bits: int | None = None
    value_bits: int | None = None
    layer_bits: Any = ()
    rotation: Any = AUTO
    rotation_seed: int = 0
    key_grouping: Any = AUTO
    channel_group: Any = AUTO
    levels: Any = AUTO
    clip_keys: float = 1.0
    clip_values: float = 1.0
    rotation_path: Any = None
    zero_dtype: Any = torch.int16
    residual_dtype: Any = AUTO
    evicted_bits: int | None = None
    evicted_layer_bits: Any = ()
    center_keys: Any = AUTO
    pre_rope: Any = AUTO
    scale_keys: Any = AUTO

    @classmethod
    def kivi(cls, **kwargs: Any) -> "QuantConfig":
        """The original KIVI layout (:data:`KIVI_LAYOUT`) at any width; ``kwargs`` override it."""
        return cls(**{**KIVI_LAYOUT, **kwargs})

    def _resolve_layout(self) -> None:
        """Replace every ``"auto"`` layout field by its value for the widths in use.

        2-4 bits everywhere (Lloyd-Max levels exist): :data:`BEST_LAYOUT`; any 8-bit width:
        :data:`KIVI_LAYOUT`. An explicit field wins, and the fields that depend on it follow it:
        per-channel keys keep KIVI's 32-token groups and uniform levels; uniform levels keep
        fp16 scales and 32-channel groups per token (KIVI's value groups).
        """
        best = self._all_bits() <= set(LLOYD_MAX_BITS) - {1}

        def put(name: str, value: Any) -> None:
            if isinstance(getattr(self, name), str) and getattr(self, name) == AUTO:
                object.__setattr__(self, name, value)

        layout = BEST_LAYOUT if best else KIVI_LAYOUT
        # Keys before RoPE in per-token codes unless per-channel keys or uniform levels were asked for.
        put("pre_rope", best and self.key_grouping != "channel" and self.levels != "uniform")
        put("rotation", layout["rotation"])
        put("key_grouping", "token" if best and self.pre_rope is True else layout["key_grouping"])
        per_token = self.key_grouping == "token"
        put("levels", "lloyd_max" if best else "uniform")
        norm_only = self.levels == "lloyd_max"
        put("channel_group", "head" if norm_only else 32 if best and per_token else None)
        put("scale_dtype", torch.uint8 if norm_only else torch.float16)
        token_layout = PRE_ROPE_LAYOUT if self.pre_rope is True else PER_TOKEN_LAYOUT
        for name in ("group_size", "residual_length"):
            put(name, token_layout[name] if best and per_token else KIVI_LAYOUT[name])
        put("sink_tokens", layout["sink_tokens"])
        put("residual_dtype", layout["residual_dtype"])
        put("center_keys", per_token)
        put("scale_keys", "sqrt" if best and per_token and self.pre_rope is True and self.center_keys is True
            else False)

    def __post_init__(self) -> None:
        # The fields left at "auto" (a record, not a field): the cache re-resolves them for a model
        # whose RoPE cannot be removed (:meth:`after_rope`).
        object.__setattr__(self, "_auto", frozenset(f.name for f in fields(self)
                                                    if isinstance(getattr(self, f.name), str)
                                                    and getattr(self, f.name) == AUTO))
        for name in ("bits", "key_bits", "value_bits", "evicted_bits"):
            b = getattr(self, name)
            if name != "bits" and b is None:
                continue
            if isinstance(b, bool) or b not in SUPPORTED_BITS:
                raise ValueError(f"QuantConfig.{name} must be one of {list(SUPPORTED_BITS)}; got {b!r}")
        object.__setattr__(self, "layer_bits", _normalize_layer_bits(self.layer_bits))
        object.__setattr__(self, "evicted_layer_bits", _normalize_layer_bits(self.evicted_layer_bits,
                                                                             "evicted_layer_bits"))
        if self.evicted_layer_bits and self.evicted_bits is None:
            raise ValueError("QuantConfig.evicted_layer_bits sets widths of the evicted tier, which needs evicted_bits "
                             "(the width of the layers it does not name); got evicted_bits=None")
        self._resolve_layout()
        for name in ("group_size", "residual_length", "sink_tokens", "rotation_seed", "channel_group"):
            v = getattr(self, name)
            if name == "channel_group" and (v is None or v == "head"):
                continue
            low = 1 if name in ("group_size", "channel_group") else 0
            if isinstance(v, bool) or not isinstance(v, int) or v < low:
                extra = ', "head" or None' if name == "channel_group" else ""
                raise ValueError(f"QuantConfig.{name} must be an int >= {low}{extra}; got {v!r}")
        if self.scale_dtype not in (torch.float16, torch.bfloat16, torch.float32, torch.uint8):
            raise ValueError(
                "QuantConfig.scale_dtype must be one of torch.float16, torch.bfloat16, torch.float32, torch.uint8; "
                f"got {self.scale_dtype!r}"
            )
        for name, allowed in (("rotation", ROTATIONS), ("key_grouping", KEY_GROUPINGS), ("levels", LEVELS)):
            if getattr(self, name) not in allowed:
                raise ValueError(f"QuantConfig.{name} must be one of {list(allowed)}; got {getattr(self, name)!r}")
        for name in ("clip_keys", "clip_values"):
            v = getattr(self, name)
            if isinstance(v, bool) or not isinstance(v, (int, float)) or not 0.0 < v <= 1.0:
                raise ValueError(f"QuantConfig.{name} must be a float in (0, 1]; got {v!r}")
            if v != 1.0 and self.levels != "uniform":
                raise ValueError(f"QuantConfig.{name} applies to uniform levels only; got levels={self.levels!r}")
        if not isinstance(self.center_keys, bool):
            raise ValueError(f"QuantConfig.center_keys must be True, False or 'auto'; got {self.center_keys!r}")
        if not isinstance(self.pre_rope, bool):
            raise ValueError(f"QuantConfig.pre_rope must be True or False; got {self.pre_rope!r}")
        if not any(self.scale_keys is v or (isinstance(v, str) and self.scale_keys == v) for v in SCALE_KEYS):
            raise ValueError(f"QuantConfig.scale_keys must be one of {list(SCALE_KEYS)} or 'auto'; "
                             f"got {self.scale_keys!r}")
        if self.scale_keys and not (self.pre_rope and self.center_keys):
            raise ValueError("QuantConfig.scale_keys divides each centered key channel by its scale, which only a "
                             "layer storing keys before RoPE and centering them undoes at read: it needs "
                             f"pre_rope=True and center_keys=True; got pre_rope={self.pre_rope!r}, "
                             f"center_keys={self.center_keys!r}")
        self._check_rotation_path()
        self._check_metadata_dtypes()
        if self.levels == "lloyd_max":
            used = self._all_bits()
            if not used <= set(LLOYD_MAX_BITS):
                raise ValueError(
                    f"QuantConfig.levels='lloyd_max' supports bits {list(LLOYD_MAX_BITS)}; got {sorted(used)}"
                )
        if self.scale_dtype == torch.uint8 and self.levels != "lloyd_max":
            raise ValueError(
                "QuantConfig.scale_dtype=torch.uint8 (8-bit log-coded norms) needs norm-only scales: "
                f"levels='lloyd_max' and key_grouping='token'; got levels={self.levels!r}"
            )
        if self.zero_dtype == torch.int8 and 8 in self._all_bits():
            raise ValueError(
                "QuantConfig.zero_dtype=torch.int8 cannot hold the zero points (0..255) of 8-bit codes; "
                f"use torch.uint8 or torch.int16 (bits in use: {sorted(self._all_bits())})"
            )
        if self.evicted_bits is not None:
            self.evicted_config()  # the evicted tier's layout must be valid at its width

    def for_model(self, config: Any) -> "QuantConfig":
        """This layout as a cache for the model of ``config`` holds it: the default's keys before
        RoPE (``pre_rope`` left at "auto") stay there when its heads have at least
        :data:`MIN_TOKEN_CODE_HEAD_DIM` channels and its RoPE can be removed; otherwise the
        per-channel layout after RoPE (:meth:`after_rope`; with a ``UserWarning`` when the RoPE is
        the reason). Anything asked for explicitly is kept (and refused later if it cannot be
        served)."""
        if not (self.pre_rope and "pre_rope" in self._auto):
            return self
        from .rope_frame import rope_frames
        from .report import kv_geometry

        head_dim = kv_geometry(config).head_dim
        if head_dim < MIN_TOKEN_CODE_HEAD_DIM:
            return self.after_rope()
        try:
            rope_frames(config, head_dim)
        except ValueError as err:
            warnings.warn(f"QuantConfig(bits={self.bits}) stores keys before RoPE by default, which this model "
                          f"does not allow ({err}); its keys are stored as computed, per channel "
                          "(QuantConfig(pre_rope=False)), at about 0.6 more bits per element", UserWarning,
                          stacklevel=3)
            return self.after_rope()
        return self

    def after_rope(self) -> "QuantConfig":
        """This layout with keys stored as the model hands them (``pre_rope=False``), the fields
        the user left at "auto" resolved again (per-channel key groups at 2-4 bits): what the
        cache holds for a model whose RoPE it cannot remove (none, or multimodal) when
        ``pre_rope`` was the default rather than asked for. Raises if ``pre_rope=True`` was
        given explicitly."""
        if "pre_rope" not in self._auto:
            raise ValueError("QuantConfig(pre_rope=True) was asked for explicitly; it is not replaced")
        explicit = {f.name: getattr(self, f.name) for f in fields(self) if f.name not in self._auto}
        return QuantConfig(**{**explicit, "pre_rope": False})

    def evicted_config(self) -> "QuantConfig":
        """The layout of the evicted tier: this layout at ``evicted_bits`` for keys and values
        (``evicted_layer_bits`` for the layers it names), with no sinks and no residual (every
        token is quantized at once; per-token layouts flush one token at a time). Raises if
        ``evicted_bits`` is None or the layout does not exist at that width (e.g. Lloyd-Max
        levels at 8 bits)."""
        b = self.evicted_bits
        if b is None:
            raise ValueError("QuantConfig.evicted_bits is None: evicted tokens are dropped, there is no evicted tier")
        per_token_flush = self.key_grouping == "token" and self.channel_group is not None
        try:
            return replace(self, bits=b, key_bits=None, value_bits=None, layer_bits=self.evicted_layer_bits,
                           sink_tokens=0, residual_length=0, group_size=1 if per_token_flush else self.group_size,
                           evicted_bits=None, evicted_layer_bits=())
        except ValueError as err:
            raise ValueError(f"QuantConfig.evicted_bits={b}: the evicted tier keeps this layout, where {err}") from None

    def sliding_config(self) -> "QuantConfig":
        """The layout of a sliding-window layer: this one with no full-precision sinks (the
        window drops the first tokens like any other) and no evicted tier (a window is not a
        policy's choice). Bits, rotation, levels, residual and bits per layer are kept."""
        return replace(self, sink_tokens=0, evicted_bits=None, evicted_layer_bits=())

    def _all_bits(self) -> set[int]:
        return {self.bits, self.key_bits or self.bits, self.value_bits or self.bits,
                *(b for _, kv in self.layer_bits for b in kv)}

    def _check_rotation_path(self) -> None:
        path = self.rotation_path
        if self.rotation != "calibrated":
            if path is not None:
                raise ValueError(
                    f"QuantConfig.rotation_path is read only with rotation='calibrated'; got "
                    f"rotation={self.rotation!r}, rotation_path={path!r}"
                )
            return
        if path is None:
            raise ValueError("QuantConfig.rotation='calibrated' needs rotation_path (a file written by "
                             "`kvcache calibrate`); got None")
        if isinstance(path, bytes) or not isinstance(path, (str, os.PathLike)):
            raise TypeError(f"QuantConfig.rotation_path must be a str or os.PathLike; got {type(path).__name__}")
        path = os.fspath(path)
        if not Path(path).is_file():
            raise FileNotFoundError(f"QuantConfig.rotation_path: no calibration file at {path!r}")
        object.__setattr__(self, "rotation_path", path)  # a str: hashable, and printed as given

    def _check_metadata_dtypes(self) -> None:
        if not isinstance(self.zero_dtype, torch.dtype) or self.zero_dtype not in ZERO_DTYPES:
            raise ValueError(
                "QuantConfig.zero_dtype must be one of torch.int16, torch.int8, torch.uint8; "
                f"got {self.zero_dtype!r}"
            )
        if self.zero_dtype != torch.int16 and (self.symmetric or (self.levels != "uniform"
                                                                  and self.key_grouping != "channel")):
            raise ValueError(
                "QuantConfig.zero_dtype applies to asymmetric uniform levels only (the others store no "
                f"zero point); got symmetric={self.symmetric!r}, levels={self.levels!r}"
            )
        rd = self.residual_dtype
        if rd is not None and (not isinstance(rd, torch.dtype) or rd not in RESIDUAL_DTYPES):
            raise ValueError(
                "QuantConfig.residual_dtype must be one of None, torch.float16, torch.bfloat16, torch.float32; "
                f"got {rd!r}"
            )

    def __repr__(self) -> str:
        base = {**LATER_FIELDS, **KIVI_LAYOUT}  # fields added later print only when not "as before"
        shown = [f.name for f in fields(self)
                 if f.name in _KIVI_FIELDS or getattr(self, f.name) != base.get(f.name, f.default)]
        return f"QuantConfig({', '.join(f'{n}={getattr(self, n)!r}' for n in shown)})"

    def bits_for(self, layer: int) -> tuple[int, int]:
        """``(key_bits, value_bits)`` of layer ``layer``."""
        override = dict(self.layer_bits).get(layer)
        if override is not None:
            return override
        return self.key_bits or self.bits, self.value_bits or self.bits

    def channel_group_for(self, head_dim: int) -> int:
        """Channels per scale of per-token groups for a ``head_dim``-channel head."""
        if self.channel_group == "head":
            return head_dim
        return min(self.channel_group or self.group_size, head_dim)

    def check_layers(self, num_layers: int) -> None:
        """Raise if ``layer_bits`` names a layer the model does not have (a profile of another model)."""
        extra = sorted({layer for layer, _ in self.layer_bits + self.evicted_layer_bits if layer >= num_layers})
        if extra:
            raise ValueError(
                f"QuantConfig.layer_bits (or evicted_layer_bits) names layers {extra} but the model has {num_layers} layers "
                f"(0..{num_layers - 1}); was the bit profile measured on another model?"
            )

    def check_head_dim(self, head_dim: int) -> None:
        """Raise if channel groups, the packing or the rotation cannot tile ``head_dim``."""
        if self.evicted_bits is not None:
            self.evicted_config().check_head_dim(head_dim)
        gc = self.channel_group_for(head_dim)
        if head_dim % gc:
            name = "channel_group" if self.channel_group else "group_size"
            raise ValueError(
                f"QuantConfig.{name} ({gc}) must divide head_dim ({head_dim}) "
                "for per-token groups (or be >= head_dim)"
            )
        for b in self._all_bits():
            if (head_dim * b) % 8:
                raise ValueError(
                    f"head_dim * bits must be a multiple of 8 so each token's codes fill whole bytes; "
                    f"got head_dim={head_dim}, bits={b}"
                )
        if self.rotation == "hadamard" and head_dim % 2:
            raise ValueError(
                f"QuantConfig.rotation='hadamard' needs an even head_dim (power-of-two blocks); got {head_dim}"
            )
