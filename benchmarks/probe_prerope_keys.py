"""Keys quantized before RoPE: what each key code costs, before any kernel is written (issue 45).

For each model, the keys of every attention layer are quantized and dequantized inside one
teacher-forced forward (an attention function registered in transformers' AttentionInterface;
nothing is patched), values kept in full precision, so the figure is the keys' code alone. The
prompt's ``PREFIX`` keys are coded (the first ``SINKS`` kept exact, as the cache does), as the
evaluation protocol stores them: the prompt's own queries read exact keys (the prefill), the
``SCORED`` next tokens, fed in one step after it, read the prompt's keys coded and their own
exact. They are scored against the same forward with exact keys (Δppl, mean next-token KL). Statistics that a code fits once (static scales, levels, outlier thresholds) are
fitted on the prompt's keys.

Key codes (``b`` = 2, 3, 4 bits), their bits per key element counted as a cache would hold them
(codes, float16 scales and int16 zero points, float16 levels, outliers at 48 bits each: a float16
value, a uint16 token index, a uint8 channel, padding; the sinks at 16 bits):

* ``post-g32``: the default today (math dictionary §25): post-RoPE keys, per channel, a scale
  and zero point per 32-token group, uniform levels;
* ``pre-g32``: the same groups on keys with RoPE removed (§29.2), rotated back before attention;
* ``post-static`` / ``pre-static``: one scale and zero point per layer, KV head and channel,
  fitted on the prompt (its min / max), uniform levels;
* ``pre-static-o<f>``: the range fitted on the prompt's ``f`` / 2 and 1 - ``f`` / 2 quantiles per
  channel, the elements outside it (prompt and later tokens) kept exact as outliers;
* ``pre-nuq-o<f>``: as above with ``2^b`` non-uniform levels per channel (1-D k-means on the
  prompt's inliers, float16 levels);
* ``post-tok`` / ``post-ctok`` / ``pre-ctok``: per token, the values' layout (randomized
  Hadamard, Lloyd-Max levels, one 8-bit norm per vector), uncentered or after subtracting the
  prompt's per-channel mean (``c``), on post- or pre-RoPE keys; ``-g64``: one norm per 64
  rotated channels (the same as one per vector at head_dim 64);
* ``pre-ctok-w`` / ``-h`` / ``-q``: ``pre-ctok`` with each centered channel multiplied by ``a_c``
  before the rotation and divided after (wave 6, issue 62; :func:`channel_weights`): ``w`` the
  inverse of its prompt RMS (``scale_keys=True``), ``h`` the inverse square root of it (half
  whitening: ``scale_keys="sqrt"``, today's default), ``q`` the optimum for the prompt's own
  queries, ``(Q_c / K_c)^(1/4)`` (a bound on what a query-aware scale could add);
  ``-hn`` / ``-wn``: ``-h`` / ``-w`` with no rotation (each scaled channel coded on the vector's
  norm as it is: what a read without an inverse Hadamard transform per key would hold).
* ``pre-ctok-h-vq2`` / ``-vq4``: ``-h`` with the rotated, normalized vector coded by a vector
  quantizer of 2 / 4 channels (``2^(2b)`` / ``2^(4b)`` centroids fitted to a Gaussian: CommVQ's and
  lattice codes' idea at the same bits; issue 62's "2 bits where scalar codes stop");
  ``pre-ctok-h-qjl``: TurboQuant's split, ``b - 1``-bit levels plus a 1-bit QJL sketch of the
  residual (unbiased inner products; one more 8-bit norm per key).

Run: ``python benchmarks/probe_prerope_keys.py --models smollm2,qwen2.5-0.5b --windows 4``.
Writes ``benchmarks/results/probe_prerope_keys.md`` (and ``.json``; rows already there are kept, so
runs of different models or codes add up).
"""

from __future__ import annotations

import argparse
import json
import math
import sys
import time
from dataclasses import dataclass
from pathlib import Path

import torch

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT / "src"))

from kv_cache.compression.rope import apply_rope, remove_rope  # noqa: E402
from kv_cache.models import load_model, shared_data_dir  # noqa: E402

PREFIX, SCORED, SINKS, GROUP = 1792, 256, 4, 32
OUTLIER_BITS, META_BITS, LEVEL_BITS = 48, 32, 16
NAME = "kv_cache_probe_prerope"


# ---------------------------------------------------------------- key codes (pure, float32)
def _uniform(x: torch.Tensor, lo: torch.Tensor, hi: torch.Tensor, bits: int) -> torch.Tensor:
    """Round ``x`` onto ``2^bits`` uniform levels between ``lo`` and ``hi`` (broadcast), clamped."""
    n = 2 ** bits - 1
    scale = ((hi - lo) / n).clamp_min(1e-8)
    return ((x - lo) / scale).round().clamp(0, n) * scale + lo


def code_groups(k: torch.Tensor, bits: int) -> tuple[torch.Tensor, float]:
    """Per channel, one min-max range per 32-token group (the tail group too). ``k`` ``[H, T, D]``."""
    H, T, D = k.shape
    out = torch.empty_like(k)
    for t0 in range(0, T, GROUP):
        g = k[:, t0:t0 + GROUP]
        out[:, t0:t0 + GROUP] = _uniform(g, g.amin(1, keepdim=True), g.amax(1, keepdim=True), bits)
    groups = math.ceil(T / GROUP)
    return out, bits * H * T * D + META_BITS * groups * H * D


def code_static(k: torch.Tensor, bits: int, prompt: int, outliers: float, levels: str) -> tuple[torch.Tensor, float]:
    """One range per channel fitted on the first ``prompt`` tokens; ``outliers`` (a fraction) of
    the prompt's elements (split between both tails) and every later element outside the range
    kept exact; ``levels`` ``uniform`` or ``nuq`` (k-means on the prompt's inliers)."""
    H, T, D = k.shape
    fit = k[:, :prompt].permute(0, 2, 1).reshape(H * D, -1)  # [C, prompt]
    if outliers > 0:
        lo = torch.quantile(fit, outliers / 2, dim=1, keepdim=True)
        hi = torch.quantile(fit, 1 - outliers / 2, dim=1, keepdim=True)
    else:
        lo, hi = fit.amin(1, keepdim=True), fit.amax(1, keepdim=True)
    flat = k.permute(0, 2, 1).reshape(H * D, T)
    if levels == "uniform":
        coded = _uniform(flat, lo, hi, bits)
        meta = META_BITS * H * D
    else:
        centers = _kmeans_levels(fit.clamp(lo, hi), bits)  # [C, 2^b]
        idx = (flat.clamp(lo, hi)[..., None] - centers[:, None, :]).abs().argmin(-1)
        coded = centers.gather(1, idx)
        meta = LEVEL_BITS * (2 ** bits) * H * D
    outside = (flat < lo) | (flat > hi) if outliers > 0 else (flat < lo) | (flat > hi)
    coded = torch.where(outside, flat, coded)
    n_out = int(outside.sum())
    out = coded.reshape(H, D, T).permute(0, 2, 1).contiguous()
    return out, bits * H * T * D + meta + OUTLIER_BITS * n_out


def channel_weights(k: torch.Tensor, prompt: int, weight: str, q_energy: torch.Tensor | None) -> torch.Tensor:
    """Per-channel pre-scale ``a`` ``[H, 1, D]`` of a per-token key code (the key is coded as
    ``a * (k - mu)`` and divided by ``a`` after decoding). ``K_c`` is the centered prompt keys'
    energy per channel, floored at 1% of its mean; ``Q_c`` the prompt queries' (RoPE removed,
    averaged over the GQA group and over each RoPE pair, which turns together).

    * ``w``: ``K_c^(-1/2)`` (whitening: ``scale_keys``);
    * ``h``: ``K_c^(-1/4)`` (the optimum of the logit error for isotropic queries);
    * ``q``: ``(Q_c / K_c)^(1/4)``, the optimum of ``E[(q . e)^2]``: with error spread evenly over
      the scaled channels, ``sum_c Q_c / a_c^2 * sum_c a_c^2 K_c`` is least at
      ``a_c^2 = sqrt(Q_c / K_c)`` (Cauchy-Schwarz)."""
    x = k[:, :prompt] - k[:, :prompt].mean(1, keepdim=True)
    K = x.pow(2).mean(1, keepdim=True)
    K = torch.maximum(K, 0.01 * K.mean(-1, keepdim=True))
    if weight == "w":
        return K.rsqrt()
    if weight == "h":
        return K.pow(-0.25)
    Q = q_energy[:, None, :]
    Q = torch.maximum(Q, 0.01 * Q.mean(-1, keepdim=True))
    a = (Q / K).pow(0.25)
    return a / a.mean(-1, keepdim=True)


def code_tokens(k: torch.Tensor, bits: int, prompt: int, center: bool, group: int = 0,
                scale: torch.Tensor | None = None, rotate: bool = True) -> tuple[torch.Tensor, float]:
    """Per token (the values' layout, §18): with ``center`` the per-channel mean of the prompt's
    keys subtracted first (float16, one per channel; a constant before RoPE, §29.3), then a
    randomized Hadamard rotation, Lloyd-Max levels of N(0, 1) scaled by the vector's norm, the
    norm stored as an 8-bit log code (``2^(c/12 - 13)``); with ``group`` one norm per ``group``
    rotated channels instead of one per vector."""
    from kv_cache.compression import lloyd_max_gaussian
    from kv_cache.compression.rotation import RandomizedHadamard

    H, T, D = k.shape
    mu = k[:, :prompt].mean(1, keepdim=True).half().float() if center else torch.zeros(H, 1, D)
    x = k - mu
    if scale is not None:
        x = x * scale
    out = torch.empty_like(k)
    levels = lloyd_max_gaussian(bits).float()
    for h in range(H):
        R = RandomizedHadamard(D, seed=h).matrix() if rotate else torch.eye(D)  # diag(s) H, orthonormal
        g = group or D
        y = (x[h] @ R).reshape(T, D // g, g)  # [T, D/g, g]
        n = y.norm(dim=-1, keepdim=True).clamp_min(1e-12)
        code = torch.round(12 * (torch.log2(n) + 13)).clamp(0, 255)
        n_hat = torch.exp2(code / 12 - 13)
        z = y / n * math.sqrt(g)
        idx = (z[..., None] - levels).abs().argmin(-1)
        out[h] = (levels[idx] * n_hat / math.sqrt(g)).reshape(T, D) @ R.T
    meta = 8 * H * T * (D // (group or D)) + (16 * H * D if center else 0) + (16 * H * D if scale is not None else 0)
    if scale is not None:
        out = out / scale
    return out + mu, bits * H * T * D + meta


_VQ_BOOKS: dict[tuple[int, int], torch.Tensor] = {}


def gaussian_vq_book(dim: int, bits: int, samples: int = 1 << 17, iters: int = 40) -> torch.Tensor:
    """``2^(bits * dim)`` centroids ``[n, dim]`` of a vector quantizer of ``N(0, I_dim)`` (Lloyd's
    algorithm on seeded Gaussian samples, from a random subset): the ``dim``-channel analogue of the
    Lloyd-Max levels, for rotated coordinates, which are near Gaussian (CommVQ's and lattice codes'
    gain over scalar levels at the same bits is this shaping and space-filling gain)."""
    key = (dim, bits)
    if key not in _VQ_BOOKS:
        g = torch.Generator().manual_seed(1234 + dim * 10 + bits)
        x = torch.randn(samples, dim, generator=g)
        n = 2 ** (bits * dim)
        c = x[torch.randperm(samples, generator=g)[:n]].clone()
        for _ in range(iters):
            idx = torch.cdist(x, c).argmin(1)
            sums = torch.zeros_like(c).index_add_(0, idx, x)
            counts = torch.zeros(n).index_add_(0, idx, torch.ones(samples))
            c = torch.where(counts[:, None] > 0, sums / counts.clamp_min(1)[:, None], c)
        _VQ_BOOKS[key] = c
    return _VQ_BOOKS[key]


def code_tokens_vq(k: torch.Tensor, bits: int, prompt: int, scale: torch.Tensor, dim: int = 0,
                   qjl: bool = False) -> tuple[torch.Tensor, float]:
    """Half-whitened per-token keys (as :func:`code_tokens` with ``scale``), the rotated, normalized
    vector coded below 3 bits by something other than scalar levels:

    * ``dim`` > 1: a vector quantizer over ``dim`` consecutive rotated channels
      (:func:`gaussian_vq_book`, ``bits * dim`` bits an index), one 8-bit norm per vector;
    * ``qjl``: TurboQuant's split, ``bits - 1``-bit Lloyd-Max levels plus a 1-bit QJL sketch of the
      residual ``r`` (``sign(S r)``, ``S`` a seeded Gaussian ``[D, D]``, the residual's norm as an
      8-bit log code), read back as the unbiased estimate ``sqrt(pi / 2) / D * |r| * S^T sign(S r)``
      (so ``q . k`` is unbiased for every query)."""
    from kv_cache.compression import lloyd_max_gaussian
    from kv_cache.compression.rotation import RandomizedHadamard

    H, T, D = k.shape
    mu = k[:, :prompt].mean(1, keepdim=True).half().float()
    x = (k - mu) * scale
    out = torch.empty_like(k)

    def log8(n):
        return torch.exp2(torch.round(12 * (torch.log2(n.clamp_min(1e-12)) + 13)).clamp(0, 255) / 12 - 13)

    for h in range(H):
        R = RandomizedHadamard(D, seed=h).matrix()
        y = x[h] @ R
        n = y.norm(dim=-1, keepdim=True).clamp_min(1e-12)
        n_hat = log8(n)
        z = y / n * math.sqrt(D)
        if dim > 1:
            book = gaussian_vq_book(dim, bits)
            v = z.reshape(-1, dim)
            z_hat = book[torch.cdist(v, book).argmin(1)].reshape(T, D)
        else:
            levels = lloyd_max_gaussian(bits - 1 if qjl else bits).float()
            z_hat = levels[(z[..., None] - levels).abs().argmin(-1)]
            if qjl:
                S = torch.randn(D, D, generator=torch.Generator().manual_seed(77 + h))
                r = z - z_hat
                r_hat = log8(r.norm(dim=-1, keepdim=True))
                z_hat = z_hat + math.sqrt(math.pi / 2) / D * r_hat * (torch.sign(S @ r.T).T @ S)
        out[h] = (z_hat * n_hat / math.sqrt(D)) @ R.T
    meta = 8 * H * T * (2 if qjl else 1) + 32 * H * D
    return out / scale + mu, bits * H * T * D + meta


def _kmeans_levels(x: torch.Tensor, bits: int, iters: int = 12) -> torch.Tensor:
    """``2^bits`` 1-D k-means centers per row of ``x`` ``[C, N]`` (Lloyd's iterations from quantiles)."""
    n = 2 ** bits
    q = (torch.arange(n, dtype=torch.float32) + 0.5) / n
    centers = torch.quantile(x, q, dim=1).T.contiguous()  # [C, n]
    for _ in range(iters):
        idx = (x[..., None] - centers[:, None, :]).abs().argmin(-1)  # [C, N]
        sums = torch.zeros_like(centers).scatter_add_(1, idx, x)
        counts = torch.zeros_like(centers).scatter_add_(1, idx, torch.ones_like(x))
        centers = torch.where(counts > 0, sums / counts.clamp_min(1), centers)
    return centers.half().float()


@dataclass(frozen=True)
class Code:
    name: str
    bits: int
    pre_rope: bool
    kind: str  # groups | static | tokens | centered-tokens | centered-tokens-g64 | vq2 | vq4 | qjl
    outliers: float = 0.0
    levels: str = "uniform"
    weight: str = ""

    def apply(self, k: torch.Tensor, prompt: int, q_energy: torch.Tensor | None = None) -> tuple[torch.Tensor, float]:
        body = k[:, SINKS:]
        if self.kind in ("vq2", "vq4", "qjl"):
            a = channel_weights(body, prompt - SINKS, "h", q_energy)
            coded, bits = code_tokens_vq(body, self.bits, prompt - SINKS, a, dim=int(self.kind[2:] or 0)
                                         if self.kind != "qjl" else 0, qjl=self.kind == "qjl")
            H, T, D = k.shape
            return torch.cat([k[:, :SINKS], coded], 1), bits + 16 * H * SINKS * D
        if self.weight:
            a = channel_weights(body, prompt - SINKS, self.weight.rstrip("n"), q_energy)
            coded, bits = code_tokens(body, self.bits, prompt - SINKS, True, scale=a,
                                      rotate=not self.weight.endswith("n"))
            H, T, D = k.shape
            return torch.cat([k[:, :SINKS], coded], 1), bits + 16 * H * SINKS * D
        if self.kind == "groups":
            coded, bits = code_groups(body, self.bits)
        elif self.kind in ("tokens", "centered-tokens"):
            coded, bits = code_tokens(body, self.bits, prompt - SINKS, self.kind == "centered-tokens")
        elif self.kind == "centered-tokens-g64":
            coded, bits = code_tokens(body, self.bits, prompt - SINKS, True, group=64)
        else:
            coded, bits = code_static(body, self.bits, prompt - SINKS, self.outliers, self.levels)
        H, T, D = k.shape
        return torch.cat([k[:, :SINKS], coded], 1), bits + 16 * H * SINKS * D


def codes(widths: list[int]) -> list[Code]:
    out = []
    for b in widths:
        out += [Code(f"post-g32 {b}b", b, False, "groups"), Code(f"pre-g32 {b}b", b, True, "groups"),
                Code(f"post-static {b}b", b, False, "static"), Code(f"pre-static {b}b", b, True, "static"),
                Code(f"pre-static-o0.2% {b}b", b, True, "static", 0.002),
                Code(f"pre-static-o1% {b}b", b, True, "static", 0.01),
                Code(f"pre-nuq {b}b", b, True, "static", 0.0, "nuq"),
                Code(f"pre-nuq-o0.2% {b}b", b, True, "static", 0.002, "nuq"),
                Code(f"pre-nuq-o1% {b}b", b, True, "static", 0.01, "nuq"),
                Code(f"post-tok {b}b", b, False, "tokens"), Code(f"post-ctok {b}b", b, False, "centered-tokens"),
                Code(f"pre-ctok {b}b", b, True, "centered-tokens"),
                Code(f"pre-ctok-g64 {b}b", b, True, "centered-tokens-g64"),
                Code(f"pre-ctok-w {b}b", b, True, "centered-tokens", weight="w"),
                Code(f"pre-ctok-h {b}b", b, True, "centered-tokens", weight="h"),
                Code(f"pre-ctok-q {b}b", b, True, "centered-tokens", weight="q"),
                Code(f"pre-ctok-hn {b}b", b, True, "centered-tokens", weight="hn"),
                Code(f"pre-ctok-wn {b}b", b, True, "centered-tokens", weight="wn"),
                Code(f"pre-ctok-h-vq2 {b}b", b, True, "vq2"), Code(f"pre-ctok-h-qjl {b}b", b, True, "qjl")]
        if b <= 2:  # 256 centroids of 4 channels; 4,096 at 3 bits is past what this probe searches
            out.append(Code(f"pre-ctok-h-vq4 {b}b", b, True, "vq4"))
    return out


# ---------------------------------------------------------------- the model side
class Probe:
    """The attention function's state: the code in force, the rotary tables per layer, the bits."""

    def __init__(self, model, T: int):
        self.code: Code | None = None
        self.bits = 0.0
        self.elements = 0
        self.tables = _tables(model, T)

    def attention(self, module, query, key, value, attention_mask, scaling=None, **kwargs):
        """The eval's protocol (``kvcache eval --tasks ppl``): the prompt's queries read the exact
        keys (the prefill), the scored tokens read the prompt's keys coded and their own exact
        (they are fed in one step after the compressed prefill)."""
        from transformers.integrations.sdpa_attention import sdpa_attention_forward

        if self.code is None:
            return sdpa_attention_forward(module, query, key, value, attention_mask, scaling=scaling, **kwargs)
        cos, sin = self.tables[module.layer_idx]
        k = key[0, :, :PREFIX].float()  # [H, PREFIX, D]
        c, s = cos[:PREFIX], sin[:PREFIX]
        base = remove_rope(k, c, s) if self.code.pre_rope else k
        q_energy = None
        if self.code.weight == "q":
            H, D = k.shape[0], k.shape[-1]
            qp = remove_rope(query[0, :, :PREFIX].float(), c, s)  # [Hq, PREFIX, D]
            e = qp.pow(2).mean(1).reshape(H, -1, D).mean(1)  # [H, D]: over the GQA group
            half = D // 2
            pair = (e[:, :half] + e[:, half:]) / 2
            q_energy = torch.cat([pair, pair], -1)
        coded, bits = self.code.apply(base, PREFIX, q_energy)
        k_hat = apply_rope(coded, c, s) if self.code.pre_rope else coded
        self.bits += bits
        self.elements += k.numel()
        mixed = torch.cat([k_hat[None].to(key.dtype), key[:, :, PREFIX:]], 2)
        T = key.shape[2]
        if attention_mask is None:  # plain causal
            attention_mask = torch.ones(T, T, dtype=torch.bool).tril()[None, None]
        elif attention_mask.dtype != torch.bool:
            attention_mask = attention_mask == 0
        attention_mask = attention_mask[..., -T:, -T:]  # sliding-window layers come with their window in it
        exact_out, _ = sdpa_attention_forward(module, query[:, :, :PREFIX], key[:, :, :PREFIX], value[:, :, :PREFIX],
                                              attention_mask[..., :PREFIX, :PREFIX], scaling=scaling,
                                              **{**kwargs, "is_causal": False})
        mask = attention_mask[..., PREFIX:, :]
        coded_out, _ = sdpa_attention_forward(module, query[:, :, PREFIX:], mixed, value, mask, scaling=scaling,
                                              **{**kwargs, "is_causal": False})
        return torch.cat([exact_out, coded_out], 1), None


def _tables(model, T: int) -> dict[int, tuple[torch.Tensor, torch.Tensor]]:
    """Each layer's ``cos``/``sin`` ``[T, r]`` at positions 0..T-1, from the model's own rotary embeddings
    (Gemma 3: a local one for sliding layers)."""
    inner = model.model
    pos = torch.arange(T)[None]
    x = torch.zeros(1, T, model.config.hidden_size)
    out = {}
    types = getattr(model.config, "layer_types", None) or ["full_attention"] * model.config.num_hidden_layers
    for i, kind in enumerate(types):
        emb = inner.rotary_emb_local if (kind == "sliding_attention" and hasattr(inner, "rotary_emb_local")) \
            else inner.rotary_emb
        try:  # Gemma 3 (transformers 5): one embedding, a table per layer type
            cos, sin = emb(x, pos, kind)
        except TypeError:
            cos, sin = emb(x, pos)
        out[i] = (cos[0].float(), sin[0].float())
    return out


def moby_windows(tok, n: int) -> list[torch.Tensor]:
    text = (shared_data_dir() / "gutenberg" / "pg2701.txt").read_text(encoding="utf-8").replace("\r\n", "\n")
    out = []
    for j in range(n):
        start = int(len(text) * (0.1 + 0.8 * j / max(1, n - 1)))
        ids = tok(text[start:start + 14000]).input_ids[:PREFIX + SCORED]
        if len(ids) < PREFIX + SCORED:
            raise ValueError(f"window {j} holds {len(ids)} tokens, fewer than {PREFIX + SCORED}")
        out.append(torch.tensor([ids]))
    return out


def run_model(alias: str, widths: list[int], n_windows: int, only: set[str] | None = None) -> list[dict]:
    from transformers import AttentionInterface
    from transformers.masking_utils import AttentionMaskInterface, sdpa_mask

    model, tok = load_model(alias)
    model.eval()
    T = PREFIX + SCORED
    probe = Probe(model, T)
    AttentionInterface.register(NAME, probe.attention)
    AttentionMaskInterface.register(NAME, sdpa_mask)
    previous = model.config._attn_implementation
    model.set_attn_implementation(NAME)
    windows = moby_windows(tok, n_windows)

    def logprobs(ids):
        with torch.no_grad():
            logits = model(ids).logits[0, PREFIX - 1:-1].float()
        return logits.log_softmax(-1)

    try:
        probe.code = None
        full = [logprobs(w) for w in windows]
        nll_full = sum(float(-lp.gather(1, w[0, PREFIX:, None]).sum()) for lp, w in zip(full, windows))
        rows = []
        for code in codes(widths):
            if only and code.name.rsplit(" ", 1)[0] not in only:
                continue
            probe.code, probe.bits, probe.elements = code, 0.0, 0
            t0 = time.perf_counter()
            nll, kl = 0.0, 0.0
            for w, ref in zip(windows, full):
                lp = logprobs(w)
                nll += float(-lp.gather(1, w[0, PREFIX:, None]).sum())
                kl += float((ref.exp() * (ref - lp)).sum())
            n = SCORED * len(windows)
            rows.append({"model": alias, "code": code.name, "bits": code.bits,
                         "key_bits_per_element": probe.bits / probe.elements,
                         "delta_ppl": math.exp((nll - nll_full) / n) - 1, "kl": kl / n,
                         "seconds": time.perf_counter() - t0})
            r = rows[-1]
            print(f"{alias:14s} {code.name:24s} {r['key_bits_per_element']:.3f} b/e  "
                  f"{100 * r['delta_ppl']:+.2f}%  KL {r['kl']:.4f}", flush=True)
    finally:
        model.set_attn_implementation(previous)
    return rows


def write(rows: list[dict], out: Path, n_windows: int) -> None:
    out.with_suffix(".json").write_text(json.dumps(rows, indent=1))
    lines = [f"# Keys quantized before RoPE: the key code alone ({n_windows} *Moby Dick* windows, "
             f"{PREFIX} + {SCORED} tokens, float32, values exact)", "",
             "`python benchmarks/probe_prerope_keys.py` (see its docstring for each code). Bits per key "
             "element count codes, scales, zero points, levels, outliers (48 bits each) and sinks.", ""]
    for model in dict.fromkeys(r["model"] for r in rows):
        lines += [f"## {model}", "", "| key code | key bits / element | Δppl | KL |", "|---|---|---|---|"]
        for r in rows:
            if r["model"] == model:
                lines.append(f"| `{r['code']}` | {r['key_bits_per_element']:.3f} | {100 * r['delta_ppl']:+.2f}% "
                             f"| {r['kl']:.4f} |")
        lines.append("")
    out.with_suffix(".md").write_text("\n".join(lines))


def main() -> None:
    global PREFIX, SCORED
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--models", default="smollm2,qwen2.5-0.5b")
    ap.add_argument("--widths", default="2,3,4")
    ap.add_argument("--windows", type=int, default=4)
    ap.add_argument("--codes", default=None, help="comma-separated code names without the width (e.g. "
                                                  "post-g32,pre-ctok) [every code]")
    ap.add_argument("--prefix", type=int, default=PREFIX, help=f"prompt tokens per window [{PREFIX}]")
    ap.add_argument("--scored", type=int, default=SCORED, help=f"scored tokens per window [{SCORED}]")
    ap.add_argument("--out", default=str(ROOT / "benchmarks" / "results" / "probe_prerope_keys"))
    args = ap.parse_args()
    PREFIX, SCORED = args.prefix, args.scored
    out = Path(args.out)
    rows = json.loads(out.with_suffix(".json").read_text()) if out.with_suffix(".json").exists() else []
    for alias in args.models.split(","):
        only = set(args.codes.split(",")) if args.codes else None
        rows += run_model(alias.strip(), [int(b) for b in args.widths.split(",")], args.windows, only)
        write(rows, out, args.windows)


if __name__ == "__main__":
    main()
