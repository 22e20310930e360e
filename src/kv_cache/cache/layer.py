"""One layer of :class:`kv_cache.CompressedCache`: packed append-only storage plus eviction.

Storage of one layer, in token order (every tensor ``[batch, kv_heads, n, ...]``)::

    [ full-precision sinks | packed quantized tokens | full-precision residual ]

* New tokens enter the residual. Once it holds ``max(residual_length, group_size)`` tokens, all
  its whole blocks of ``group_size`` tokens are quantized once and appended packed (KIVI); stored codes are
  never re-quantized. Keys are per-channel (one scale per ``group_size`` tokens and channel),
  values per-token (one scale per token and ``group_size`` channels), as in KIVI.
* Codes are packed token-major (``head_dim * bits / 8`` bytes per token and head), so evicting a
  token is a gather of whole bytes: no unpacking, no re-quantization, and the old tensors are
  released. With eviction on, each quantized key records its scale group (``k_group``).
* Attention gets the stored tokens dequantized plus this call's new tokens as given, built
  during ``update`` and released with the layer's attention call; nothing full-precision
  outlives it except the residual and sinks.

Positions: ``get_seq_length`` is the number of tokens *seen*, so ``cache_position`` and RoPE
stay absolute after eviction; ``get_mask_sizes`` returns ``kv_length = kept + q_len`` and
``kv_offset = seen - kept``, so the kept tokens line up with the last ``kept`` columns of the
2-D attention mask (exact for left padding, see ``docs/``).
"""

from __future__ import annotations

from typing import Any

import torch
from transformers.cache_utils import CacheLayerMixin

from ..compression.quantizer import QuantizedTensor, dequantize, quantize
from ..compression.selection import select_tokens
from ..policies.base import EvictionPolicy, ScoreInputs
from .config import QuantConfig

_FORCE = torch.finfo(torch.float32).max


class CompressedLayer(CacheLayerMixin):
    """Cache layer with quantized storage (``quant``) and eviction (``policy``), both optional."""

    is_sliding = False
    is_compileable = False

    def __init__(self, layer_idx: int, quant: QuantConfig | None, policy: EvictionPolicy | None):
        super().__init__()
        self.layer_idx = layer_idx
        self.quant = quant
        self.policy = policy
        self.seen = 0
        self.prompt_len: int | None = None
        self.sink_keys: torch.Tensor | None = None
        self.sink_values: torch.Tensor | None = None
        self.packed: dict[str, torch.Tensor] = {}
        self.state: dict[str, torch.Tensor] = {}
        self._pending: torch.Tensor | None = None
        self._prefill_done = False

    # ------------------------------------------------------------------ transformers API
    def lazy_initialization(self, key_states: torch.Tensor, value_states: torch.Tensor) -> None:
        self.dtype, self.device = key_states.dtype, key_states.device
        b, h, _, d = key_states.shape
        if self.quant is not None:
            self.quant.check_head_dim(d)
        self.keys = key_states.new_empty((b, h, 0, d))
        self.values = value_states.new_empty((b, h, 0, value_states.shape[-1]))
        self.is_initialized = True

    def update(
        self,
        key_states: torch.Tensor,
        value_states: torch.Tensor,
        cache_kwargs: dict[str, Any] | None = None,
        **kwargs: Any,  # newer transformers pass `kwargs=`; nothing in it is needed here
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """Append ``[batch, kv_heads, q_len, head_dim]`` states; return all kept states.

        Previously stored tokens come back dequantized; the ``q_len`` new ones come back exactly
        as given, so a prefill attends to its own full-precision states.
        """
        if not self.is_initialized:
            self.lazy_initialization(key_states, value_states)
        if self._pending is not None and self.policy is not None and self.policy.needs_attention:
            raise RuntimeError(
                f"{type(self.policy).__name__} needs attention statistics but none were observed for layer "
                f"{self.layer_idx}: run the model inside `with kv_cache.compress(model, cache):`"
            )
        q_len = key_states.shape[2]
        if self.prompt_len is None:
            self.prompt_len = q_len
        self.seen += q_len
        if self.quant is None:
            self.keys = torch.cat([self.keys, key_states], dim=2)
            self.values = torch.cat([self.values, value_states], dim=2)
            keys, values = self.keys, self.values
        else:
            # This call's own tokens reach attention in full precision (as in KIVI and transformers'
            # QuantizedCache): only what was stored before is dequantized.
            keys, values = self._materialize(key_states, value_states)
            self.keys = torch.cat([self.keys, key_states], dim=2)
            self.values = torch.cat([self.values, value_states], dim=2)
            self._flush()
        if self.policy is not None and not (self.policy.prefill_only and self._prefill_done):
            self._pending = keys
        return keys, values

    def get_seq_length(self) -> int:
        """Tokens seen (absolute length), not tokens kept: positions stay absolute after eviction."""
        return self.seen

    def get_mask_sizes(self, cache_position: torch.Tensor | int) -> tuple[int, int]:
        # transformers <= 5.2x passes cache_position; newer releases pass the query length.
        q_len = cache_position if isinstance(cache_position, int) else cache_position.shape[0]
        kept = self.kept_length()
        return kept + q_len, self.seen - kept

    def get_max_cache_shape(self) -> int:
        return -1

    def get_max_length(self) -> int:  # the name of get_max_cache_shape in newer transformers
        return -1

    def reset(self) -> None:
        self.__init__(self.layer_idx, self.quant, self.policy)

    def crop(self, max_length: int) -> None:
        raise RuntimeError(
            "CompressedCache cannot be cropped (evicted and quantized tokens cannot be restored); "
            "assisted decoding and contrastive search are not supported"
        )

    def reorder_cache(self, beam_idx: torch.LongTensor) -> None:
        self.batch_select_indices(beam_idx)

    def batch_select_indices(self, indices: torch.Tensor) -> None:
        """Keep rows ``indices`` of the batch in every held tensor."""
        for name, t in self._tensor_slots():
            self._set(name, t.index_select(0, indices.to(t.device)))

    def batch_repeat_interleave(self, repeats: int) -> None:
        for name, t in self._tensor_slots():
            self._set(name, t.repeat_interleave(repeats, dim=0))

    # ------------------------------------------------------------------ storage
    def kept_length(self) -> int:
        """Tokens currently stored (sinks + quantized + residual)."""
        if not self.is_initialized:
            return 0
        n = self.keys.shape[2]
        if self.sink_keys is not None:
            n += self.sink_keys.shape[2]
        if self.packed:
            n += self.packed["k_codes"].shape[2]
        return n

    def _flush(self) -> None:
        q = self.quant
        if q.sink_tokens:
            have = 0 if self.sink_keys is None else self.sink_keys.shape[2]
            take = min(q.sink_tokens - have, self.keys.shape[2]) if self.packed == {} else 0
            if take > 0:
                sk, sv = self.keys[:, :, :take], self.values[:, :, :take]
                self.sink_keys = sk if self.sink_keys is None else torch.cat([self.sink_keys, sk], 2)
                self.sink_values = sv if self.sink_values is None else torch.cat([self.sink_values, sv], 2)
                self.keys, self.values = self.keys[:, :, take:], self.values[:, :, take:]
            if (0 if self.sink_keys is None else self.sink_keys.shape[2]) < q.sink_tokens:
                return  # sinks fill first; nothing is quantized before them
        g = q.group_size
        # KIVI: once the residual reaches max(R, g) tokens, all its whole groups are quantized.
        if self.keys.shape[2] < max(q.residual_length, g):
            return
        blocks = self.keys.shape[2] // g
        n = blocks * g
        k_blk, v_blk = self.keys[:, :, :n], self.values[:, :, :n]
        self.keys, self.values = self.keys[:, :, n:].contiguous(), self.values[:, :, n:].contiguous()
        b, h, _, d = k_blk.shape
        qk = quantize(k_blk, q.bits, axis=-2, group_size=g, symmetric=q.symmetric, scale_dtype=q.scale_dtype)
        qv = quantize(v_blk, q.bits, axis=-1, group_size=min(g, d), symmetric=q.symmetric,
                      scale_dtype=q.scale_dtype)
        new = {
            "k_codes": qk.data.view(b, h, n, -1),
            "k_scale": qk.scale,  # [b, h, blocks, d]
            "k_zero": qk.zero_point,
            "v_codes": qv.data.view(b, h, n, -1),
            "v_scale": qv.scale,  # [b, h, n, d / gv]
            "v_zero": qv.zero_point,
        }
        if self.policy is not None:  # groups become ragged once tokens are evicted
            first = 0 if "k_scale" not in self.packed else self.packed["k_scale"].shape[2]  # table index
            gid = torch.arange(first, first + blocks, device=k_blk.device, dtype=torch.int32)
            new["k_group"] = gid.repeat_interleave(g).expand(b, h, n).contiguous()
        for name, t in new.items():
            if t.numel() == 0 and name.endswith("zero"):
                self.packed.setdefault(name, t)
                continue
            old = self.packed.get(name)
            self.packed[name] = t if old is None else torch.cat([old, t], dim=2)

    def _dequantized(self) -> tuple[torch.Tensor, torch.Tensor]:
        q, p = self.quant, self.packed
        b, h, n, _ = p["k_codes"].shape
        d = self.keys.shape[-1]
        shape = (b, h, n, d)
        if "k_group" in p:
            gid = p["k_group"].long()
            k_scale = _gather_tokens(p["k_scale"], gid)
            k_zero = _gather_tokens(p["k_zero"], gid) if p["k_zero"].numel() else p["k_zero"]
            k_group_size = 1
        else:
            k_scale, k_zero, k_group_size = p["k_scale"], p["k_zero"], q.group_size
        qk = QuantizedTensor(p["k_codes"].reshape(-1), k_scale, k_zero, q.bits, shape, self.dtype, 2,
                             k_group_size, q.symmetric)
        qv = QuantizedTensor(p["v_codes"].reshape(-1), p["v_scale"], p["v_zero"], q.bits, shape, self.dtype, 3,
                             min(q.group_size, d), q.symmetric)
        return dequantize(qk), dequantize(qv)

    def _materialize(
        self, new_keys: torch.Tensor | None = None, new_values: torch.Tensor | None = None
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """Stored tokens in order (sinks, dequantized, residual), then ``new_*``: one concatenation."""
        ks, vs = [], []
        if self.sink_keys is not None:
            ks.append(self.sink_keys)
            vs.append(self.sink_values)
        if self.packed:
            k, v = self._dequantized()
            ks.append(k)
            vs.append(v)
        ks.append(self.keys)
        vs.append(self.values)
        if new_keys is not None:
            ks.append(new_keys)
            vs.append(new_values)
        if len(ks) == 1:
            return ks[0], vs[0]
        return torch.cat(ks, dim=2), torch.cat(vs, dim=2)

    # ------------------------------------------------------------------ eviction
    def observe(self, query: torch.Tensor | None, attention_mask: torch.Tensor | None, scaling: float) -> None:
        """Post-attention step (called by :func:`kv_cache.compress`'s hook): score and evict."""
        keys, self._pending = self._pending, None
        if keys is None or self.policy is None:
            return
        pol = self.policy
        T = keys.shape[2]
        valid = _key_valid(attention_mask, keys)
        budget = pol.budget_tokens(self.layer_idx, self.prompt_len)
        all_valid = bool(valid.all())
        inputs = ScoreInputs(keys=keys, query=query, key_valid=None if all_valid else valid, scaling=scaling,
                             state=self.state)
        # H2O must accumulate every step, even before the budget is reached.
        scores = pol.score(inputs) if not pol.prefill_only else None
        if pol.prefill_only:
            self._prefill_done = True
        if T <= budget:
            return
        if scores is None:
            scores = pol.score(inputs)
        scores = scores.float().clone()
        # Tokens held in full precision (quantization sinks, the residual) are never evicted:
        # it keeps every head's quantized part rectangular and the residual append-only.
        n_sink = 0 if self.sink_keys is None else self.sink_keys.shape[2]
        n_res = self.keys.shape[2] if self.packed else 0
        window = pol.window_tokens(budget)
        if self.quant is not None:
            if n_sink + n_res + window + pol.sink_tokens > budget:
                raise ValueError(
                    f"budget of layer {self.layer_idx} ({budget} tokens) must be >= quantization sinks "
                    f"({n_sink}) + full-precision residual ({n_res}) + recent_window ({window}) "
                    f"+ sink_tokens ({pol.sink_tokens}); raise the budget or lower QuantConfig.residual_length"
                )
            scores[..., :n_sink] = _FORCE
            if n_res:
                scores[..., T - n_res:] = _FORCE
        keep = select_tokens(scores, budget, recent_window=window, sink_tokens=pol.sink_tokens,
                             valid=valid[:, None, :])
        self._evict(keep, n_sink, n_res)

    def _evict(self, keep: torch.Tensor, n_sink: int, n_res: int) -> None:
        """Physically keep ``keep`` (``[batch, kv_heads, K]`` sorted slot indices)."""
        for name, t in list(self.state.items()):
            self.state[name] = _gather_tokens(t, keep)
        if not self.packed:
            self.keys, self.values = _gather_tokens(self.keys, keep), _gather_tokens(self.values, keep)
            return
        K = keep.shape[-1]
        qidx = keep[..., n_sink: K - n_res] - n_sink  # same count in every row: forced slots are shared
        p = self.packed
        for name in ("k_codes", "v_codes", "v_scale", "v_zero", "k_group"):
            t = p[name]
            if t.numel():
                p[name] = _gather_tokens(t, qidx)
        # Drop key scale groups that no head references any more.
        used = torch.unique(p["k_group"])
        if used.numel() < p["k_scale"].shape[2]:
            remap = torch.full((p["k_scale"].shape[2],), -1, dtype=torch.int32, device=used.device)
            remap[used.long()] = torch.arange(used.numel(), dtype=torch.int32, device=used.device)
            p["k_scale"] = p["k_scale"].index_select(2, used.long())
            if p["k_zero"].numel():
                p["k_zero"] = p["k_zero"].index_select(2, used.long())
            p["k_group"] = remap[p["k_group"].long()]

    # ------------------------------------------------------------------ accounting
    def _tensor_slots(self) -> list[tuple[str, torch.Tensor]]:
        out = []
        if self.is_initialized:
            out += [("keys", self.keys), ("values", self.values)]
        if self.sink_keys is not None:
            out += [("sink_keys", self.sink_keys), ("sink_values", self.sink_values)]
        out += [(f"packed.{k}", v) for k, v in self.packed.items()]
        out += [(f"state.{k}", v) for k, v in self.state.items()]
        return out

    def _set(self, name: str, t: torch.Tensor) -> None:
        if name.startswith("packed."):
            self.packed[name[7:]] = t
        elif name.startswith("state."):
            self.state[name[6:]] = t
        else:
            setattr(self, name, t)

    def held_tensors(self) -> dict[str, torch.Tensor]:
        """Every tensor this layer holds, by slot name."""
        return dict(self._tensor_slots())


def _gather_tokens(t: torch.Tensor, idx: torch.Tensor) -> torch.Tensor:
    """``t[b, h, idx[b, h, j], ...]`` for ``t`` ``[B, H, n, ...]`` and ``idx`` ``[B, H, k]``.

    One ``index_select`` over flattened rows: much cheaper than ``gather`` with an index
    expanded to the trailing dims.
    """
    b, h, n = t.shape[:3]
    k = idx.shape[2]
    rows = (idx.reshape(b * h, k) + torch.arange(b * h, device=t.device).unsqueeze(1) * n).reshape(-1)
    return t.reshape(b * h * n, *t.shape[3:]).index_select(0, rows).reshape(b, h, k, *t.shape[3:])


def _key_valid(mask: torch.Tensor | None, keys: torch.Tensor) -> torch.Tensor:
    """``[batch, T]`` bool: keys the last query may attend to (False = padding)."""
    b, T = keys.shape[0], keys.shape[2]
    if mask is None:
        return torch.ones(b, T, dtype=torch.bool, device=keys.device)
    row = mask[:, 0, -1, :T]
    if row.dtype == torch.bool:
        valid = row
    else:
        valid = row > torch.finfo(row.dtype).min / 2
    return valid.expand(b, T)
