"""The transform-coded payload of a ``.kvc`` file (math dictionary §27): encode the full-precision
K/V tensors of a saved cache state, decode them back, and refuse a damaged or hostile payload
before any large allocation.

What is coded: the full-precision token tensors of each layer's storage as
:mod:`kv_cache.cache.serialize_state` writes them -- a :class:`FullPrecisionStorage`'s
``key_buffer`` / ``value_buffer`` ``[1, H, cap, d]`` (its first ``length`` slots, ``layout
"heads"``) and a :class:`PackedRaggedStorage`'s ``fp_keys`` / ``fp_values`` ``[1, 1, sum T_h, d]``
(KVzip's ragged heads one after another, ``layout "flat"``), found by :func:`.targets.find_targets`.
Every other tensor is stored as is.

Per segment (one KV head's ``T`` tokens of one layer, keys and values alike):

* the first ``exact_sinks`` and last ``exact_window`` tokens are stored exactly (float16; bf16
  / float16 caches: their own dtype), as are segments shorter than ``min_tokens``;
* the others are turned into components ``c = (x - mu_h) U_h`` (:mod:`.transform`, the
  calibrated basis of that layer, head and kind), centred on their mean over the segment
  (stored, float16), and each component is quantized with its own step ``Delta`` (or skipped:
  decoded as its mean) chosen by :func:`.allocation.allocate` for the whole file at once;
* the integers go, per layer, into one range-ANS stream (:mod:`.ans`) with each component's
  Laplace scale.

With a basis fitted on keys before RoPE (``CodecBasis.keys_before_rope``, math dictionary
§27.6), each coded key is first turned back by its position, ``k = R(p)^T k' / s`` (the layer's
:class:`~kv_cache.cache.rope_frame.RopeFrame`), and turned again after decoding; the exact tokens
stay as they are. A token's position is its arrival index, read from the layer's record: the
last ``n`` arrivals before any eviction, the set bits of the kept arrivals' bitmap after it
(``CompressedCache(track_positions=True)``), so nothing is added to the file for them.

Tensors added per coded tensor ``N``: ``N.tc_mean``, ``N.tc_delta``, ``N.tc_scale`` ``[segments,
d]`` float16 and ``N.tc_exact`` ``[exact rows, d]``; per layer ``layer<i>.tc_stream`` (the ANS
words as int32). The header's ``codec`` record names the basis by fingerprint and holds, per
coded tensor, its shape, dtype, layout and segments.
"""

from __future__ import annotations

from dataclasses import asdict, dataclass
from typing import Any, Callable

import numpy as np
import torch

from . import ans
from .allocation import MAX_SYMBOL, MIN_SCALE, allocate, laplace_scale, rd_table, round_half
from .basis_file import CodecBasis
from .targets import ROLES, Target, find_targets, segment_positions, segments, turn
from .transform import to_components

CODEC_VERSION = 2
"""The codec record version files are written with: 2 codes with one table per scale level
(:mod:`.ans` ``"table"``); 1 (read only) with a Laplace model per symbol (``"laplace"``)."""
READ_CODEC_VERSIONS = (1, 2)
_CODER = {1: "laplace", 2: "table"}
_MAX_SCALE = ans.MAX_SCALE


@dataclass(frozen=True)
class CodecSettings:
    """What stays exact: the first ``exact_sinks`` and the last ``exact_window`` tokens of every
    head, and heads with fewer than ``min_tokens`` coded tokens. ``key_weight``: the weight of
    a key segment's relative squared error against a value segment's in the allocation."""

    exact_sinks: int = 4
    exact_window: int = 2
    min_tokens: int = 8
    key_weight: float = 1.0

    def __post_init__(self):
        if isinstance(self.key_weight, bool) or not isinstance(self.key_weight, (int, float)) or \
                not 0 < self.key_weight < 1e6:
            raise ValueError(f"CodecSettings.key_weight must be a number in (0, 1e6); got {self.key_weight!r}")
        for name in ("exact_sinks", "exact_window", "min_tokens"):
            v = getattr(self, name)
            if isinstance(v, bool) or not isinstance(v, int) or v < 0 or v > 1 << 20:
                raise ValueError(f"CodecSettings.{name} must be an int in [0, 2^20]; got {v!r}")


def _split(length: int, settings: CodecSettings) -> tuple[int, int]:
    """Exact tokens ``(head, tail)`` of a segment of ``length`` tokens (all exact when the rest
    would be shorter than ``min_tokens``)."""
    s = min(settings.exact_sinks, length)
    w = min(settings.exact_window, length - s)
    if length - s - w < max(settings.min_tokens, 1):
        return length, 0
    return s, w


def _exact_dtype(dtype: str) -> torch.dtype:
    return torch.bfloat16 if dtype == "bfloat16" else torch.float16


@dataclass
class _Encoded:
    tensors: dict[str, torch.Tensor]
    record: dict[str, Any]
    payload_bits: float
    distortion: float


class Encoder:
    """Encodes the full-precision tensors of a saved cache state for a given payload budget.

    Built once per state (the components and their rate-distortion tables are computed here);
    :meth:`encode` then allocates and codes for any budget (``None``: the finest steps)."""

    def __init__(self, tensors: dict[str, torch.Tensor], layer_recs: list[dict[str, Any]], basis: CodecBasis,
                 settings: CodecSettings | None = None, version: int = CODEC_VERSION, frames: list | None = None):
        if isinstance(version, bool) or version not in READ_CODEC_VERSIONS:
            raise ValueError(f"the codec record version must be one of {READ_CODEC_VERSIONS}; got {version!r}")
        self.version = version
        self.settings = settings or CodecSettings()
        self.basis, self.tensors = basis, tensors
        self.targets = find_targets(layer_recs, tensors)
        if not self.targets:
            raise ValueError("the codec found no full-precision K/V to code: save a cache held in full precision "
                             "(quant=None, with or without eviction); a quantized cache's codes are stored as they are")
        if basis.keys_before_rope and (frames is None or len(frames) < len(layer_recs)):
            raise ValueError("the codec basis was fitted on keys before RoPE: pass each layer's rotary frame "
                             "(kv_cache.cache.rope_frame.rope_frames(model.config, head_dim))")
        self.rows: list[dict[str, Any]] = []  # one per (target, kind, segment)
        rates, dists = [], []
        for ti, tg in enumerate(self.targets):
            if tg.layer not in basis.layers:
                raise ValueError(f"the codec basis has no layer {tg.layer}; it was fitted for layers "
                                 f"{sorted(basis.layers)[:3]}...")
            lb = basis.layers[tg.layer]
            for kind, name in zip(("k", "v"), tg.names):
                mean, U, _ = lb.get(kind)
                forward, _ = lb.matrices(kind)  # A U
                if tensors[name].shape[-1] != U.shape[-1]:
                    raise ValueError(f"the codec basis is for head_dim {U.shape[-1]}; {name} has {tensors[name].shape[-1]}")
                frame = frames[tg.layer] if basis.keys_before_rope and kind == "k" else None
                where = segment_positions(layer_recs[tg.layer], tensors, tg) if frame is not None else None
                for si, seg in enumerate(segments(tensors[name], tg)):
                    h = tg.heads[si]
                    head, tail = _split(seg.shape[0], self.settings)
                    mid = seg[head: seg.shape[0] - tail].float()
                    if frame is not None and mid.shape[0]:  # the keys before RoPE (§27.6)
                        mid = turn(mid, frame, where[si][head: seg.shape[0] - tail], inverse=True)
                    row = {"target": ti, "kind": kind, "seg": si, "exact": (head, tail), "d": seg.shape[1]}
                    if mid.shape[0]:
                        c = to_components(mid, mean[h], forward[h])  # (x - mu) A U: [Tm, d]
                        m = round_half(c.mean(0))
                        x = (c - m).T.contiguous()  # [d, Tm]
                        r, dd, deltas = rd_table(x, param_bits=0)  # parameters: stored for every component
                        row.update(m=m, x=x, deltas=deltas, first=sum(len(q) for q in rates))
                        rates.append(r)
                        # relative error per segment: keys and values, layers and heads on one scale
                        w = self.settings.key_weight if kind == "k" else 1.0
                        dists.append(dd * (w / float(x.pow(2).sum().clamp_min(1e-12))))
                    self.rows.append(row)
        self.rate = torch.cat(rates) if rates else torch.zeros(0, 1)
        self.dist = torch.cat(dists) if dists else torch.zeros(0, 1)

    def fixed_tensors(self) -> dict[str, torch.Tensor]:
        """Everything but the streams: exact rows and per-component parameters (shapes do not
        depend on the budget)."""
        return self.encode(0.0).tensors

    def encode(self, budget_bits: float | None) -> _Encoded:
        choice = (allocate(self.rate, self.dist, budget_bits) if budget_bits is not None
                  else torch.full((self.rate.shape[0],), self.rate.shape[1] - 1, dtype=torch.long))
        out: dict[str, torch.Tensor] = {}
        per_name: dict[str, dict[str, list]] = {}
        streams: dict[int, tuple[list, list]] = {}
        distortion = 0.0
        for row in self.rows:
            tg = self.targets[row["target"]]
            name = tg.names[0 if row["kind"] == "k" else 1]
            acc = per_name.setdefault(name, {"mean": [], "delta": [], "scale": [], "exact": []})
            d = row["d"]
            seg = segments(self.tensors[name], tg)[row["seg"]]
            head, tail = row["exact"]
            ed = _exact_dtype(tg.dtype)
            acc["exact"] += [seg[:head].to(ed), seg[seg.shape[0] - tail:].to(ed)]
            mean = torch.zeros(d)
            delta = torch.zeros(d)
            scale = torch.zeros(d)
            if "x" in row:
                x, f = row["x"], row["first"]
                k = choice[f:f + d]
                mean = row["m"]
                sym, sc = streams.setdefault(tg.layer, ([], []))
                for j in range(d):
                    if int(k[j]) == 0:
                        distortion += float(x[j].pow(2).sum())
                        continue
                    dj = row["deltas"][j, int(k[j]) - 1]
                    xs = x[j] / dj
                    q = torch.round(xs).clamp(-MAX_SYMBOL, MAX_SYMBOL)
                    b = float(ans.snap_scale(float(laplace_scale(xs))))
                    delta[j], scale[j] = dj, b
                    distortion += float((x[j] - q * dj).pow(2).sum())
                    sym.append(q.to(torch.int32).numpy())
                    sc.append(np.full(q.shape[0], float(b), dtype=np.float64))
            acc["mean"].append(mean)
            acc["delta"].append(delta)
            acc["scale"].append(scale)
        for name, acc in per_name.items():
            out[f"{name}.tc_mean"] = torch.stack(acc["mean"]).to(torch.float16)
            out[f"{name}.tc_delta"] = torch.stack(acc["delta"]).to(torch.float16)
            out[f"{name}.tc_scale"] = torch.stack(acc["scale"]).to(torch.float16)
            out[f"{name}.tc_exact"] = torch.cat(acc["exact"]).contiguous()
        bits = 0.0
        digests = {}
        for layer, (sym, sc) in sorted(streams.items()):
            symbols = np.concatenate(sym) if sym else np.zeros(0, np.int32)
            words = ans.encode(symbols, np.concatenate(sc) if sc else np.zeros(0), _CODER[self.version])
            out[f"layer{layer}.tc_stream"] = torch.from_numpy(words.view(np.int32).copy())
            digests[str(layer)] = _symbols_digest(symbols)
            bits += words.size * 32
        record = {"version": self.version, "basis": self.basis.fingerprint, "settings": asdict(self.settings),
                  "symbols_sha256": digests,
                  "targets": [{"layer": t.layer, "names": list(t.names), "layout": t.layout, "shape": list(t.shape),
                               "dtype": t.dtype, "heads": t.heads, "lengths": t.lengths, "role": t.role,
                               "tail": t.tail} for t in self.targets]}
        if self.basis.keys_before_rope:
            record["keys_before_rope"] = True
        return _Encoded(out, record, bits, distortion)


def _symbols_digest(symbols: np.ndarray) -> str:
    """sha256 of a stream's symbols (int32, little-endian): an ANS stream carries no check of its
    own, and a damaged one may decode to other symbols of the right count."""
    import hashlib

    return hashlib.sha256(np.ascontiguousarray(symbols, dtype="<i4").tobytes()).hexdigest()


def encode_state(tensors: dict[str, torch.Tensor], layer_recs: list[dict[str, Any]], basis: CodecBasis,
                 file_bytes: Callable[[dict[str, torch.Tensor], dict[str, Any]], int], target_bytes: int | None,
                 settings: CodecSettings | None = None, version: int = CODEC_VERSION, frames: list | None = None
                 ) -> tuple[dict[str, torch.Tensor], dict[str, Any]]:
    """Replace the coded tensors of ``tensors`` by the codec's payload so the whole file (as
    ``file_bytes(tensors, record)`` measures it) fits ``target_bytes`` with the least squared
    error; ``target_bytes=None``: the finest steps. Returns ``(tensors, codec record)``.
    ``version``: the codec record version to write (1: readable by kv_cache releases that
    know only the per-symbol Laplace coder). ``frames``: each layer's rotary frame, required by a
    basis fitted on keys before RoPE.

    Raises ``ValueError`` when even skipping every component does not fit (the message gives
    the smallest file this state can make)."""
    enc = Encoder(tensors, layer_recs, basis, settings, version, frames)
    coded = {n for t in enc.targets for n in t.names}
    rest = {k: v for k, v in tensors.items() if k not in coded}

    def build(budget):
        e = enc.encode(budget)
        e.record["distortion"] = e.distortion  # in the record measured: the file written is the file sized
        allt = {**rest, **e.tensors}
        return allt, e.record, file_bytes(allt, e.record), e

    if target_bytes is None:
        allt, rec, size, e = build(None)
        return allt, rec
    allt, rec, floor, e = build(0.0)
    if floor > target_bytes:
        raise ValueError(f"a file of {target_bytes:,} bytes cannot hold this context: its exact tokens, per-component "
                         f"parameters and other tensors alone take {floor:,} bytes; keep fewer tokens (a smaller "
                         "eviction budget), fewer exact tokens (CodecSettings), or ask for a smaller ratio")
    # The largest payload budget whose whole file fits: the model's rates are close to what the
    # coder spends, so the first guess or its correction usually fits; otherwise bisect between
    # a budget that fits (0 does) and one that does not. Never fall back to skipping everything.
    best = (allt, rec, floor, e)
    lo, hi = 0.0, None
    budget = float(target_bytes - floor) * 8
    for _ in range(14):
        allt, rec, size, e = build(budget)
        if size <= target_bytes:
            best, lo = (allt, rec, size, e), budget
            if hi is None or target_bytes - size < max(64, target_bytes // 500):
                break
        else:
            hi = budget
        if hi is None:
            break
        guess = budget - (size - target_bytes) * 8 * 1.05 - 256
        budget = guess if lo < guess < hi and size > target_bytes else (lo + hi) / 2
        if hi - lo < 64:
            break
    allt, rec, size, e = best
    return allt, rec


# ------------------------------------------------------------------------------------- decode
def _int(v: Any, what: str, lo: int, hi: int) -> int:
    if isinstance(v, bool) or not isinstance(v, int) or not lo <= v <= hi:
        raise ValueError(f"the codec record's {what} must be an int in [{lo}, {hi}]; got {v!r}")
    return v


def decode_state(tensors: dict[str, torch.Tensor], record: Any, basis: CodecBasis, *, tokens_seen: int,
                 layers: int, kv_heads: int, head_dim: int, where: str = "the file",
                 layer_recs: list[dict[str, Any]] | None = None, frames: list | None = None
                 ) -> dict[str, torch.Tensor]:
    """The inverse of :func:`encode_state`: ``tensors`` with the coded K/V tensors decoded.
    A record coded before RoPE (``keys_before_rope``) needs the file's ``layer_recs`` (the
    positions) and each layer's ``frames``.

    Every count in ``record`` is checked against the model's geometry and ``tokens_seen`` (itself
    checked by the caller) before anything the size of a K/V tensor is allocated: a damaged or
    hostile payload raises ``ValueError`` naming what is wrong."""
    version = record.get("version") if isinstance(record, dict) else record
    if isinstance(version, bool) or version not in READ_CODEC_VERSIONS:
        raise ValueError(f"{where}: codec record version must be one of {READ_CODEC_VERSIONS}; found {version!r}")
    coder = _CODER[version]
    if record.get("basis") != basis.fingerprint:
        raise ValueError(f"{where}: coded with basis {record.get('basis')!r}; the basis given is {basis.fingerprint!r}")
    if (basis.heads, basis.head_dim) != (kv_heads, head_dim):
        raise ValueError(f"{where}: the codec basis has {basis.heads} heads of {basis.head_dim}; the model "
                         f"{kv_heads} of {head_dim}")
    try:
        settings = CodecSettings(**record["settings"])
        targets = record["targets"]
        if not isinstance(targets, list):
            raise TypeError("targets")
    except (KeyError, TypeError) as exc:
        raise ValueError(f"{where}: malformed codec record ({exc})") from None
    digests = record.get("symbols_sha256")
    if not isinstance(digests, dict):
        raise ValueError(f"{where}: malformed codec record (symbols_sha256)")
    before = record.get("keys_before_rope", False)
    if before is not True and before is not False:
        raise ValueError(f"{where}: malformed codec record (keys_before_rope must be true or false; got {before!r})")
    if before != basis.keys_before_rope:
        raise ValueError(f"{where}: coded with keys {'before' if before else 'after'} RoPE; the basis given was "
                         f"fitted {'before' if basis.keys_before_rope else 'after'} it")
    if before and (layer_recs is None or frames is None or len(frames) < layers or len(layer_recs) < layers):
        raise ValueError(f"{where}: coded with keys before RoPE: the layers' records and rotary frames are needed")
    out = dict(tensors)
    plan: dict[int, list] = {}
    seen_layers: set = set()
    for t in targets:
        try:
            layer = _int(t["layer"], "layer", 0, layers - 1)
            names, layout, shape, dtype = t["names"], t["layout"], t["shape"], t["dtype"]
            heads, lengths = list(t["heads"]), list(t["lengths"])
            role, tail_n = t.get("role", "storage"), t.get("tail", 0)
        except (KeyError, TypeError) as exc:
            raise ValueError(f"{where}: malformed codec target ({exc})") from None
        if role not in ROLES:
            raise ValueError(f"{where}: codec target role must be one of {list(ROLES)}; got {role!r}")
        _int(tail_n, "tail", 0, tokens_seen)
        if layer not in basis.layers:
            raise ValueError(f"{where}: the codec basis has no layer {layer}")
        if layout not in ("heads", "flat") or dtype not in ("float32", "float16", "bfloat16"):
            raise ValueError(f"{where}: codec target layout must be 'heads' or 'flat' and dtype float32, float16 or "
                             f"bfloat16; got {layout!r}, {dtype!r}")
        if (not isinstance(names, list) or len(names) != 2 or not all(isinstance(n, str) for n in names)
                or not isinstance(shape, list) or len(shape) != 4):
            raise ValueError(f"{where}: malformed codec target names / shape")
        if len(heads) != len(lengths) or not heads or len(heads) > kv_heads:
            raise ValueError(f"{where}: codec target of layer {layer} has {len(heads)} heads and {len(lengths)} "
                             f"lengths; at most {kv_heads} of each, as many of one as of the other")
        for h in heads:
            _int(h, "head", 0, kv_heads - 1)
        for n in lengths:
            _int(n, "segment length", 0, tokens_seen)
        _int(shape[3], "head_dim", head_dim, head_dim)
        if layout == "heads":
            if shape[:3] != [1, len(heads), lengths[0]] or len(set(lengths)) != 1 or heads != list(range(len(heads))):
                raise ValueError(f"{where}: codec target of layer {layer}: shape {shape} does not match its segments")
        elif shape[:3] != [1, 1, sum(lengths)]:
            raise ValueError(f"{where}: codec target of layer {layer}: shape {shape} does not match its segments")
        for n in names:
            if n in out or any(f"{n}.tc_{s}" not in out for s in ("mean", "delta", "scale", "exact")):
                raise ValueError(f"{where}: codec target {n!r}: its payload tensors are missing (or it is also stored)")
        seen_layers.add(layer)
        plan.setdefault(layer, []).append((names, layout, shape, dtype, heads, lengths, role, tail_n))
    # the streams and the symbols each holds, from the (checked) parameters
    for layer, items in plan.items():
        sname = f"layer{layer}.tc_stream"
        if sname not in out:
            if any(float(out[f"{n}.tc_delta"].float().abs().sum()) > 0 for names, *_ in items for n in names):
                raise ValueError(f"{where}: layer {layer}'s coded stream is missing")
    for layer, items in sorted(plan.items()):
        scales_all, jobs = [], []
        for names, layout, shape, dtype, heads, lengths, *_ in items:
            for kind, n in zip(("k", "v"), names):
                m, dl, sc, ex = (out[f"{n}.tc_{s}"] for s in ("mean", "delta", "scale", "exact"))
                if any(x.shape != (len(lengths), head_dim) for x in (m, dl, sc)) or ex.dim() != 2 or \
                        ex.shape[1] != head_dim:
                    raise ValueError(f"{where}: {n}: codec parameter shapes {tuple(m.shape)}, {tuple(dl.shape)}, "
                                     f"{tuple(sc.shape)}, {tuple(ex.shape)}; expected [{len(lengths)}, {head_dim}]")
                m, dl, sc = m.float(), dl.float(), sc.float()
                if not (torch.isfinite(m).all() and torch.isfinite(dl).all() and torch.isfinite(sc).all()):
                    raise ValueError(f"{where}: {n}: codec parameters hold NaN or Inf")
                used = dl > 0
                if (dl < 0).any() or (used & ((sc < MIN_SCALE) | (sc > _MAX_SCALE))).any() or (~used & (sc != 0)).any():
                    raise ValueError(f"{where}: {n}: codec steps must be >= 0 and the scales of coded components in "
                                     f"[{MIN_SCALE}, {_MAX_SCALE}] (0 for skipped ones)")
                exact_rows = 0
                used_np, sc_np = used.numpy(), sc.numpy().astype(np.float64)
                for si, length in enumerate(lengths):
                    head, tail = _split(length, settings)
                    exact_rows += head + tail
                    tm = length - head - tail
                    coded = sc_np[si][used_np[si]]
                    if coded.size:
                        scales_all.append((tm, coded))
                    jobs.append((kind, n, si, head, tail, tm))
                if ex.shape[0] != exact_rows:
                    raise ValueError(f"{where}: {n}: {ex.shape[0]} exact rows; its segments need {exact_rows}")
        total = sum(tm * s.size for tm, s in scales_all)
        if total > 2 * tokens_seen * kv_heads * head_dim:
            raise ValueError(f"{where}: layer {layer}'s stream would decode {total:,} symbols; at most "
                             f"{2 * tokens_seen * kv_heads * head_dim:,} fit {tokens_seen:,} tokens")
        words = out.pop(f"layer{layer}.tc_stream", torch.zeros(0, dtype=torch.int32))
        if words.dtype != torch.int32 or words.dim() != 1 or words.numel() > total + 64:
            raise ValueError(f"{where}: layer {layer}'s stream must be int32 words, at most one per symbol (+64); "
                             f"got {words.dtype} {tuple(words.shape)} for {total:,} symbols")
        scales = (np.repeat(np.concatenate([s for _, s in scales_all]),
                            np.concatenate([np.full(s.size, tm) for tm, s in scales_all]))
                  if scales_all else np.zeros(0))
        try:
            symbols = ans.decode(words.numpy().view(np.uint32), scales, coder)
        except ans.CodecStreamError as exc:
            raise ValueError(f"{where}: layer {layer}: {exc}") from None
        if symbols.size and _symbols_digest(symbols) != digests.get(str(layer)):
            raise ValueError(f"{where}: layer {layer}: the coded stream does not decode to the symbols its header "
                             "names (sha256): damaged or truncated")
        pos = 0
        for names, layout, shape, dtype, heads, lengths, role, tail_n in items:
            lb = basis.layers[layer]
            target = Target(layer, tuple(names), layout, tuple(shape), dtype, heads, lengths, role, tail_n)
            for kind, n in zip(("k", "v"), names):
                mean_b, _, _ = lb.get(kind)
                _, inverse = lb.matrices(kind)  # U^T A^-1
                m, dl, ex = (out.pop(f"{n}.tc_{s}") for s in ("mean", "delta", "exact"))
                out.pop(f"{n}.tc_scale")
                m, dl = m.float(), dl.float()
                t = torch.empty(shape, dtype=getattr(torch, dtype))
                segs = segments(t, target)
                frame = frames[layer] if before and kind == "k" else None
                at = segment_positions(layer_recs[layer], tensors, target, where) if frame is not None else None
                erow = 0
                for si, length in enumerate(lengths):
                    head, tail = _split(length, settings)
                    tm = length - head - tail
                    seg = segs[si]
                    seg[:head] = ex[erow:erow + head].to(seg.dtype)
                    erow += head
                    if tail:
                        seg[length - tail:] = ex[erow:erow + tail].to(seg.dtype)
                        erow += tail
                    if tm:
                        c = m[si].expand(tm, head_dim).clone()
                        used = torch.nonzero(dl[si] > 0).flatten()
                        nu = used.numel()
                        if nu:  # the coded components, one after another, tm symbols each
                            q = torch.from_numpy(symbols[pos:pos + nu * tm].astype(np.float32)).view(nu, tm)
                            c[:, used] += (q * dl[si, used][:, None]).T
                            pos += nu * tm
                        x = c @ inverse[heads[si]] + mean_b[heads[si]]
                        if frame is not None:  # coded before RoPE: turned to their positions again (§27.6)
                            x = turn(x, frame, at[si][head:length - tail], inverse=False)
                        seg[head:length - tail] = x.to(seg.dtype)
                out[n] = t
    return out


def fp16_bytes(layers: int, kv_heads: int, head_dim: int, tokens: int) -> int:
    """Bytes of the float16 K/V of ``tokens`` tokens: the reference of a file's ratio."""
    return 2 * 2 * layers * kv_heads * head_dim * tokens


__all__ = ["CODEC_VERSION", "READ_CODEC_VERSIONS", "ROLES", "CodecSettings", "Encoder", "decode_state", "encode_state",
           "fp16_bytes", "segment_positions"]
