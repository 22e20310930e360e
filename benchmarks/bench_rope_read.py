"""Keys stored before RoPE, read: turn each key into the query's frame, or each query into the key's.

A cache that stores keys before RoPE (math dictionary §29) must apply ``R(p)`` at read. Two ways
give the same logits, ``q . R(p) k = (R(p)^T q) . k``:

* ``key turn`` (what the library's kernels do, §29.8): each stored key is turned once by its
  position, then every query of its KV head (``G`` of them) is dotted with it: per key ``D / 2``
  complex products and ``G D`` multiply-adds;
* ``query turn`` (KVQuant's choice): each query is turned into every key's frame, ``R(p)^T q``,
  and dotted with the stored key: per key ``G D / 2`` complex products and ``G D`` multiply-adds
  (the angles are shared by the ``G`` queries).

And two ways to get the angles ``p w_j`` of every key and pair:

* ``sincos``: a cosine and a sine per key and pair (``cosf`` / ``sinf`` of ``p w_j``);
* ``recurrence``: the angle-addition recurrence over a tile of 32 consecutive positions,
  ``e^{i(p+1)w} = e^{ipw} e^{iw}``: one sine and cosine per pair at the tile's first position and
  one complex product per key and pair after it, re-anchored every tile so the error does not grow
  with the context (the library's tile decoder composes the same products from a doubling table,
  which also serves positions with gaps).

The four variants are compiled C++ loops (``torch.utils.cpp_extension.load_inline``, ``-O3
-march=native``, one thread), the same loop structure as the tile decoder's inner loop, over
per-channel 4-bit codes before RoPE (groups of 32 tokens, float16 scales and minima) dequantized
the same way in every variant, so they differ only in the turn and the angles. Each variant's
logits are checked against float64, and the variants alternate round by round in one process (the
figure is each one's median; ratios are to ``key turn + recurrence``).

Run: ``python benchmarks/bench_rope_read.py [--tokens 1024,4096,16384] [--groups 1,3,7]
[--out benchmarks/results]``; writes ``bench_rope_read_d<D>_N<...>_G<...>.md`` (``G`` = queries
per KV head: SmolLM2 3, Gemma 3 270M 4, Qwen2.5-0.5B 7).
"""

from __future__ import annotations

import argparse
import platform
import statistics
import sys
from pathlib import Path

import torch

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT / "src"))

TILE = 32
VARIANTS = ("key turn + recurrence", "key turn + sincos", "query turn + recurrence", "query turn + sincos")

CPP = r"""
#include <torch/extension.h>
#include <chrono>
#include <cmath>
#include <vector>

// logits [G, N] of queries q [G, D] against keys k [N, D] stored before RoPE (half layout) at
// positions pos [N] (consecutive within each 32-key tile); variant: 0 key turn + recurrence,
// 1 key turn + sincos, 2 query turn + recurrence, 3 query turn + sincos. Returns nanoseconds.
// Laid out as the tile decoder reads a tile: its keys transposed [D][32], the angles [D/2][32],
// the logits accumulated across the tile's 32 keys (vectorized over keys, no horizontal sums).
int64_t turned_logits(const at::Tensor& q, const at::Tensor& k, const at::Tensor& pos, const at::Tensor& w,
                      at::Tensor& out, int64_t variant) {
  constexpr int T = 32;
  const int G = q.size(0), D = q.size(1), N = k.size(0), H = D / 2;
  const float* Q = q.data_ptr<float>();
  const float* K = k.data_ptr<float>();
  const int64_t* P = pos.data_ptr<int64_t>();
  const float* W = w.data_ptr<float>();
  float* O = out.data_ptr<float>();
  std::vector<float> ct(H * T), st(H * T), kt(D * T), kr(D * T), acc(G * T), cs(H), ss(H);
  for (int j = 0; j < H; ++j) { cs[j] = std::cos(W[j]); ss[j] = std::sin(W[j]); }
  const bool recur = variant == 0 || variant == 2, keyturn = variant <= 1;
  auto t0 = std::chrono::steady_clock::now();
  for (int b = 0; b < N; b += T) {
    // the tile's keys, transposed (the tile decoder decodes its codes into such a tile)
    for (int i = 0; i < T; ++i)
      for (int e = 0; e < D; ++e) kt[e * T + i] = K[static_cast<int64_t>(b + i) * D + e];
    // the angles of the tile's 32 positions
    if (recur) {
      for (int j = 0; j < H; ++j) {
        const float a = static_cast<float>(P[b]) * W[j];
        ct[j * T] = std::cos(a);
        st[j * T] = std::sin(a);
      }
      for (int i = 1; i < T; ++i)
        for (int j = 0; j < H; ++j) {  // e^{i(p+1)w} = e^{ipw} e^{iw}, vectorized over pairs
          const float c = ct[j * T + i - 1], s = st[j * T + i - 1];
          ct[j * T + i] = c * cs[j] - s * ss[j];
          st[j * T + i] = s * cs[j] + c * ss[j];
        }
    } else {
      for (int j = 0; j < H; ++j)
        for (int i = 0; i < T; ++i) {
          const float a = static_cast<float>(P[b + i]) * W[j];
          ct[j * T + i] = std::cos(a);
          st[j * T + i] = std::sin(a);
        }
    }
    std::fill(acc.begin(), acc.end(), 0.f);
    if (keyturn) {
      for (int j = 0; j < H; ++j)
        for (int i = 0; i < T; ++i) {  // each key turned once
          const float a = kt[j * T + i], bb = kt[(j + H) * T + i], c = ct[j * T + i], s = st[j * T + i];
          kr[j * T + i] = a * c - bb * s;
          kr[(j + H) * T + i] = a * s + bb * c;
        }
      for (int g = 0; g < G; ++g)
        for (int e = 0; e < D; ++e) {
          const float qe = Q[g * D + e];
          for (int i = 0; i < T; ++i) acc[g * T + i] += qe * kr[e * T + i];
        }
    } else {
      for (int g = 0; g < G; ++g)
        for (int j = 0; j < H; ++j) {  // each query turned into every key's frame
          const float qa = Q[g * D + j], qb = Q[g * D + j + H];
          for (int i = 0; i < T; ++i) {
            const float c = ct[j * T + i], s = st[j * T + i];
            acc[g * T + i] += (qa * c + qb * s) * kt[j * T + i] + (qb * c - qa * s) * kt[(j + H) * T + i];
          }
        }
    }
    for (int g = 0; g < G; ++g)
      for (int i = 0; i < T; ++i) O[static_cast<int64_t>(g) * N + b + i] = acc[g * T + i];
  }
  auto t1 = std::chrono::steady_clock::now();
  return std::chrono::duration_cast<std::chrono::nanoseconds>(t1 - t0).count();
}

PYBIND11_MODULE(TORCH_EXTENSION_NAME, m) { m.def("turned_logits", &turned_logits); }
"""


def _ext():
    from torch.utils.cpp_extension import load_inline

    return load_inline("kv_cache_bench_rope_read_v2", cpp_sources=CPP, extra_cflags=["-O3", "-march=native"],
                       verbose=False)


def frequencies(d: int, base: float = 10000.0) -> torch.Tensor:
    """``w_j = base^(-2j/d)``, ``[d/2]`` float32 (the default RoPE)."""
    return base ** (-torch.arange(0, d, 2, dtype=torch.float32) / d)


def codes_before_rope(n: int, d: int, bits: int = 4, seed: int = 0) -> torch.Tensor:
    """``n`` keys ``[n, d]`` with a constant offset per channel (as before RoPE), coded per channel
    in groups of 32 tokens (float16 scale and minimum) and dequantized: what every variant reads."""
    g = torch.Generator().manual_seed(seed)
    k = torch.randn(n, d, generator=g) + 3.0 * torch.randn(1, d, generator=g)
    top = (1 << bits) - 1
    out = torch.empty_like(k)
    for t0 in range(0, n, TILE):
        x = k[t0:t0 + TILE]
        mn, mx = x.amin(0), x.amax(0)
        s = ((mx - mn) / top).half().float().clamp_min(2.0 ** -24)
        m = mn.half().float()
        out[t0:t0 + TILE] = m + ((x - m) / s).round().clamp(0, top) * s
    return out


def reference(q: torch.Tensor, k: torch.Tensor, positions: torch.Tensor, w: torch.Tensor) -> torch.Tensor:
    """float64 logits ``[G, n]``: ``q . R(p) k``."""
    a = positions.double()[:, None] * w.double()
    c, s = a.cos(), a.sin()
    h = k.shape[1] // 2
    kd = k.double()
    kr = torch.cat((kd[:, :h] * c - kd[:, h:] * s, kd[:, :h] * s + kd[:, h:] * c), dim=1)
    return q.double() @ kr.T


def run(tokens: list[int], groups: list[int], d: int, repeats: int, start: int) -> list[dict]:
    ext = _ext()
    w = frequencies(d)
    rows = []
    for n in tokens:
        positions = torch.arange(start, start + n)
        k = codes_before_rope(n, d)
        for G in groups:
            q = torch.randn(G, d, generator=torch.Generator().manual_seed(G))
            ref = reference(q, k, positions, w)
            out = torch.empty(G, n)
            times: dict[int, list[float]] = {v: [] for v in range(len(VARIANTS))}
            errs = {}
            for v in range(len(VARIANTS)):  # warm-up and check
                ext.turned_logits(q, k, positions, w, out, v)
                errs[v] = float((out.double() - ref).abs().max() / ref.abs().max())
            for _ in range(repeats):  # variants alternate round by round
                for v in range(len(VARIANTS)):
                    times[v].append(ext.turned_logits(q, k, positions, w, out, v) / 1e3)
            base = statistics.median(times[0])
            for v, name in enumerate(VARIANTS):
                us = statistics.median(times[v])
                turns = n if name.startswith("key") else G * n
                rows.append({"tokens": n, "G": G, "variant": name, "us": us, "ratio": us / base, "turns": turns,
                             "rel_err": errs[v]})
                print(f"N={n:>6} G={G} {name:<24} {us:10.1f} us  {us / base:5.2f}x  turns {turns:>7}  "
                      f"max rel err {errs[v]:.1e}", flush=True)
    return rows


def to_markdown(rows: list[dict], args: argparse.Namespace) -> str:
    lines = [
        "# Keys before RoPE at read: key turn or query turn, recurrence or sincos",
        "",
        f"`python benchmarks/bench_rope_read.py --tokens {args.tokens} --groups {args.groups} --head-dim "
        f"{args.head_dim}`; torch {torch.__version__}, {platform.machine()}, one thread, C++ `-O3 -march=native`; "
        f"median of {args.repeats} calls per figure, the variants alternating round by round in one process. Keys: "
        f"per-channel 4-bit codes before RoPE (groups of 32 tokens), dequantized alike for every variant, at "
        f"positions {args.start} onward; `G` queries per KV head; `turns`: complex rotations of `d / 2` pairs per "
        "call; error: largest logit error over the largest logit, against float64.",
        "",
        "| tokens | G | variant | µs per call | vs key turn + recurrence | turns | max rel. error |",
        "|---:|---:|---|---:|---:|---:|---:|",
    ]
    for r in rows:
        lines.append(f"| {r['tokens']:,} | {r['G']} | {r['variant']} | {r['us']:,.1f} | {r['ratio']:.2f}x | "
                     f"{r['turns']:,} | {r['rel_err']:.1e} |")
    return "\n".join(lines) + "\n"


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--tokens", default="1024,4096,16384")
    ap.add_argument("--groups", default="1,3,7", help="queries per KV head")
    ap.add_argument("--head-dim", type=int, default=64)
    ap.add_argument("--repeats", type=int, default=31)
    ap.add_argument("--start", type=int, default=1000, help="the first key's position")
    ap.add_argument("--out", default=str(ROOT / "benchmarks" / "results"))
    args = ap.parse_args(argv)
    tokens = [int(x) for x in args.tokens.split(",")]
    groups = [int(x) for x in args.groups.split(",")]
    if any(n <= 0 or n % TILE for n in tokens):
        raise ValueError(f"--tokens must be positive multiples of {TILE}; got {args.tokens!r}")
    if any(g <= 0 for g in groups) or args.head_dim <= 0 or args.head_dim % 2:
        raise ValueError(f"--groups must be positive and --head-dim even; got {args.groups!r}, {args.head_dim}")
    if args.repeats < 1 or args.start < 0:
        raise ValueError(f"--repeats must be >= 1 and --start >= 0; got {args.repeats}, {args.start}")
    torch.set_num_threads(1)
    rows = run(tokens, groups, args.head_dim, args.repeats, args.start)
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    path = out / f"bench_rope_read_d{args.head_dim}_N{'-'.join(map(str, tokens))}_G{'-'.join(map(str, groups))}.md"
    path.write_text(to_markdown(rows, args))
    print(f"wrote {path}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
