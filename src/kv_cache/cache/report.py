"""Byte accounting of a :class:`kv_cache.CompressedCache`: the sum of tensors actually held."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, NamedTuple


class KVGeometry(NamedTuple):
    """The K/V cache shape of a model: ``layers`` x ``kv_heads`` x ``head_dim`` per token."""

    model_type: str | None
    layers: int
    kv_heads: int
    head_dim: int


def kv_geometry(config: Any) -> KVGeometry:
    """Read the K/V shape from a transformers config (a multimodal config's text part)."""
    text = config.get_text_config() if hasattr(config, "get_text_config") else config
    head_dim = getattr(text, "head_dim", None) or text.hidden_size // text.num_attention_heads
    kv_heads = getattr(text, "num_key_value_heads", None) or text.num_attention_heads
    return KVGeometry(getattr(text, "model_type", None), text.num_hidden_layers, kv_heads, head_dim)


def fp16_kv_bytes(config: Any, tokens: int, batch: int = 1, layers: int | None = None) -> int:
    """Bytes of an fp16 full K/V cache holding ``tokens`` tokens of ``batch`` rows:
    ``2 (K, V) * 2 bytes * batch * kv_heads * head_dim * tokens * layers``.

    ``layers`` defaults to every layer of ``config``. This is the reference of every ratio
    the library reports (``MemoryReport``, ``kvcache eval``, ``kvcache bill``).
    """
    g = kv_geometry(config)
    return 2 * 2 * batch * g.kv_heads * g.head_dim * tokens * (g.layers if layers is None else layers)


@dataclass(frozen=True)
class MemoryReport:
    """What the cache holds, in bytes, and what an fp16 full cache would hold.

    Every ``*_bytes`` field is a sum of ``tensor.nbytes`` over tensors the cache holds;
    ``total_bytes`` is their sum. ``fp16_bytes = 2 (K, V) * 2 bytes * batch * kv_heads *
    head_dim * tokens_seen * layers``. ``ratio = fp16_bytes / total_bytes`` is the seed's total
    gain, measured; it factors as ``token_ratio * bits_ratio`` up to index/score overhead.
    ``budget_raised``: ``{layer: (requested, kept)}`` tokens for the layers whose fractional
    eviction budget, resolved against a short prompt, was below the slots every head keeps anyway
    (quantization sinks, residual, recent window, policy sinks) and was raised to them.
    ``notes``: what the numbers alone do not say, one line each (e.g. a fractional eviction
    budget raised to the slots every head keeps anyway on a short prompt); ``str()`` prints them.
    ``bytes_by_layer_kind``: bytes held by ``"full_attention"`` and ``"sliding_attention"``
    layers (hybrid models); ``window_saved_fp16_bytes``: the fp16 bytes of the tokens seen that
    sliding layers no longer hold because their window passed them (math dictionary §22).
    ``attention_errors``: the fidelity check's relative attention-output error per layer,
    measured at prefill on the prompt's last queries (math dictionary §26), and the
    ``fidelity_threshold`` past which the cache warned (or raised with ``strict=True``).
    ``evicted_attention``: the eviction check's share of those queries' attention on the slots
    KVzip dropped, per evicting layer (math dictionary §26.1); its mean
    (``mean_evicted_attention``) past ``eviction_threshold`` (the cache's limit, scaled on hybrid
    models) made the cache warn (or raise).
    """

    codes_bytes: int
    scales_bytes: int
    zero_points_bytes: int
    residual_bytes: int
    indices_bytes: int
    scores_bytes: int
    fp16_bytes: int
    tokens_seen: int
    tokens_kept: float
    elements_kept: int
    per_layer_bytes: list[int] = field(default_factory=list)
    tables_bytes: int = 0
    budget_raised: dict[int, tuple[int, int]] = field(default_factory=dict)
    notes: list[str] = field(default_factory=list)
    bytes_by_layer_kind: dict[str, int] = field(default_factory=dict)
    window_saved_fp16_bytes: int = 0
    attention_errors: dict[int, float] = field(default_factory=dict)
    """``{layer: e}``: the fidelity check's relative attention-output error at prefill (§26)."""
    fidelity_threshold: float | None = None
    evicted_attention: dict[int, float] = field(default_factory=dict)
    """``{layer: x}``: the eviction check's dropped share of the last queries' attention (§26.1)."""
    eviction_threshold: float | None = None

    @property
    def mean_evicted_attention(self) -> float | None:
        """The eviction check's figure: the mean over the evicting layers (None: not measured)."""
        v = self.evicted_attention
        return sum(v.values()) / len(v) if v else None

    @property
    def max_attention_error(self) -> float | None:
        """The largest per-layer error of the fidelity check (None: not measured)."""
        return max(self.attention_errors.values()) if self.attention_errors else None

    @property
    def total_bytes(self) -> int:
        return (self.codes_bytes + self.scales_bytes + self.zero_points_bytes + self.residual_bytes
                + self.indices_bytes + self.scores_bytes + self.tables_bytes)

    @property
    def ratio(self) -> float:
        return self.fp16_bytes / self.total_bytes if self.total_bytes else float("inf")

    @property
    def token_ratio(self) -> float:
        """``T / K``: tokens seen per token kept (mean over layers)."""
        return self.tokens_seen / self.tokens_kept if self.tokens_kept else float("inf")

    @property
    def bits_per_element(self) -> float:
        """Bytes held (all categories) * 8 per kept K/V element."""
        return 8 * self.total_bytes / self.elements_kept if self.elements_kept else 0.0

    @property
    def bits_ratio(self) -> float:
        """``16 / bits_per_element``: the bytes-per-token lever of the total gain."""
        return 16 / self.bits_per_element if self.bits_per_element else float("inf")

    def as_dict(self) -> dict:
        d = {k: getattr(self, k) for k in self.__dataclass_fields__}
        d.update(total_bytes=self.total_bytes, ratio=self.ratio, token_ratio=self.token_ratio,
                 bits_per_element=self.bits_per_element, bits_ratio=self.bits_ratio,
                 mean_evicted_attention=self.mean_evicted_attention)
        return d

    def __str__(self) -> str:
        return (f"{self.total_bytes:,} B held (codes {self.codes_bytes:,}, scales {self.scales_bytes:,}, "
                f"zero points {self.zero_points_bytes:,}, full-precision {self.residual_bytes:,}, "
                f"indices {self.indices_bytes:,}, scores {self.scores_bytes:,}, tables {self.tables_bytes:,}) "
                f"vs fp16 {self.fp16_bytes:,} B: "
                f"{self.ratio:.2f}x = {self.token_ratio:.2f}x tokens * {self.bits_ratio:.2f}x bits"
                + (f"\nby layer kind: " + ", ".join(f"{k} {v:,} B" for k, v in self.bytes_by_layer_kind.items())
                   + f"; sliding windows saved {self.window_saved_fp16_bytes:,} fp16 B"
                   if len(self.bytes_by_layer_kind) > 1 else "")
                + "".join(f"\nnote: {line}" for line in self.notes)
                + (f"\nattention-output error at prefill (fidelity check): max {self.max_attention_error:.3f} "
                   f"(layer {max(self.attention_errors, key=self.attention_errors.get)}), threshold "
                   f"{self.fidelity_threshold}" if self.attention_errors else "")
                + (f"\nattention dropped by the eviction (eviction check): mean {self.mean_evicted_attention:.3f} over "
                   f"{len(self.evicted_attention)} layers, threshold {self.eviction_threshold}"
                   if self.evicted_attention else ""))


def layer_tensors(storage, demoted, tail, state: dict, starts, key_offset=None, positions=None, rope=None) -> dict:
    """Every tensor a :class:`~kv_cache.cache.layer.CompressedLayer` holds, by slot name: its
    storage's, ``demoted.*`` (the evicted tier), ``tail.*`` (a session's tokens), ``state.*``
    (the policy's per-token state), ``starts`` (each head's first valid slot) and
    ``key_offset`` (the per-channel key offset, §25), ``positions`` (by name, the bitmaps of the
    arrivals each head keeps and demoted under keys stored before RoPE, after an eviction, §29.6) and
    ``rope.inv_freq`` (their frequencies, §29)."""
    out = {} if storage is None else dict(storage.named_tensors())
    for prefix, part in (("demoted", demoted), ("tail", tail)):
        if part is not None:
            out.update({f"{prefix}.{k}": v for k, v in part.named_tensors().items()})
    out.update({f"state.{k}": v for k, v in state.items()})
    if starts is not None:
        out["starts"] = starts
    if key_offset is not None:
        out["key_offset"] = key_offset
    out.update(positions or {})
    if rope is not None:
        out["rope.inv_freq"] = rope.inv_freq
    return out


def layer_nbytes(storage, demoted, tail, state: dict, starts, key_offset=None, positions=None,
                 rope=None) -> dict[str, int]:
    """Bytes of :func:`layer_tensors` by category: the storages' categories, ``scores`` (the
    policy's state), ``indices`` (the starts and positions included) and ``tables`` (the key
    offset, the RoPE frequencies)."""
    out = {} if storage is None else storage.nbytes_by_category()
    for part in (demoted, tail):
        if part is not None:
            for k, v in part.nbytes_by_category().items():
                out[k] = out.get(k, 0) + v
    out["scores"] = sum(t.nbytes for t in state.values())
    if starts is not None:  # each head's first valid slot (padding, ragged heads)
        out["indices"] = out.get("indices", 0) + starts.nbytes
    if key_offset is not None:
        out["tables"] = out.get("tables", 0) + key_offset.nbytes
    for bitmap in (positions or {}).values():  # the arrivals' bitmaps (keys before RoPE, §29.6)
        out["indices"] = out.get("indices", 0) + bitmap.nbytes
    if rope is not None:
        out["tables"] = out.get("tables", 0) + rope.inv_freq.nbytes
    return out
