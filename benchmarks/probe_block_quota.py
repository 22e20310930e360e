"""Block-local eviction quotas, before any vLLM code: what keeping the top ``k`` of every ``B``
tokens per KV head costs (issue 63, design §6.1, ``docs/vllm-eviction-design.md``).

vLLM allocates KV memory per block of ``B`` logical tokens; the design gives each block a page of
``k < B`` slots per KV head, filled with the ``k`` tokens of the block that KVzap scores highest
(streaming top-k: the kept set depends only on the block's own tokens, so prefix caching stays
correct). That is a stricter rule than the library's, which keeps the top fraction of a head's
whole context: a block whose tokens all matter loses some, a block of filler keeps ``k`` anyway.
This probe measures the difference on real models, with no cache code in the way:

* one forward over each window captures every layer's attention input (after its input norm,
  :func:`kv_cache.cache.hooks.hidden_state_hooks`) and scores the prompt's tokens with the model's
  shipped KVzap scorer (log scores ``[kv_heads, T]`` per layer, §24);
* a rule turns the scores into a keep mask per layer and KV head over the prompt;
* a second forward runs an attention function registered in transformers' ``AttentionInterface``
  (nothing patched): the prompt's own queries read every prompt key (the prefill), the scored
  continuation reads only the kept prompt keys and its own (the eval protocol of ``kvcache eval
  --tasks ppl``); it is scored against the full forward (Δppl, mean next-token KL).

Rules, at the same kept fraction ``k / B`` of the prompt (the first 4 tokens, the sinks, always kept):

* ``head``: the top ``k / B`` of each KV head's prompt (the library's per-head budget); ``head ... w64``
  plus the prompt's last 64 tokens;
* ``block B/k``: the top ``k`` of each ``B``-token block per KV head (the design);
* ``block B/k t<t>``: ``t`` of the ``k`` slots reserved for the block's last ``t`` tokens, the rest by score
  (the design's in-pool tail variant);
* ``block B/k w<W>``: the top ``k`` per block plus the prompt's last ``W`` tokens (the design's
  optional recent overlay, counted outside the pool);
* ``random B/k``: ``k`` random tokens per block (what the scores are worth).

With ``--observed``, the scores a backend can compute while it writes a prefill chunk's pages
instead: ``obs``, the largest attention the chunk's last 32 queries give each of its tokens (256-token
chunks, :meth:`Probe.observe`), and ``zap|obs``, the larger of it and KVzap's (``exp`` of its log
score): the library's continuation score (§19.7) made chunk-local. Rows accumulate in the results
file (runs of other models or rules add up).

Codes are not applied (eviction only; quantization composes on top, §23). The continuation's own
tokens read each other exactly, as a vLLM block still filling would with the overlay.

Run: ``python benchmarks/probe_block_quota.py --models smollm2,qwen2.5-0.5b --windows 4``.
Writes ``benchmarks/results/probe_block_quota.md`` (and ``.json``).
"""

from __future__ import annotations

import argparse
import json
import math
import sys
import time
from pathlib import Path

import torch

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT / "src"))

from kv_cache.cache.hooks import hidden_state_hooks  # noqa: E402
from kv_cache.compression.scorer_file import load_scorer, model_identity  # noqa: E402
from kv_cache.models import load_model, shared_data_dir  # noqa: E402
from kv_cache.policies.kvzap import shipped_scorer  # noqa: E402

PREFIX, SCORED, SINKS = 2048, 256, 4
CHUNK, OBS_QUERIES = 256, 32
"""The simulated prefill chunk (vLLM's chunked prefill) and how many of its last queries score it."""
NAME = "kv_cache_probe_block_quota"


# ---------------------------------------------------------------- rules (pure: scores -> keep masks)
def keep_head(scores: torch.Tensor, fraction: float) -> torch.Tensor:
    """``[H, T]`` bool: each row's top ``round(fraction * T)`` scores (sinks included in the count)."""
    H, T = scores.shape
    s = scores.clone()
    s[:, :SINKS] = math.inf
    n = max(SINKS, round(fraction * T))
    keep = torch.zeros(H, T, dtype=torch.bool)
    keep.scatter_(1, s.topk(n, dim=1).indices, True)
    return keep


def keep_blocks(scores: torch.Tensor, block: int, k: int, tail: int = 0, window: int = 0,
                generator: torch.Generator | None = None) -> torch.Tensor:
    """``[H, T]`` bool: per ``block``-token block and row, the top ``k`` scores (ties to the earlier
    token), ``tail`` of them the block's last tokens; sinks always; the last ``window`` tokens too.
    With ``generator``, ``k`` random tokens per block instead of the top ones."""
    H, T = scores.shape
    if T % block:
        raise ValueError(f"the prompt ({T} tokens) must be a whole number of blocks of {block}")
    if not 0 <= tail <= k <= block:
        raise ValueError(f"need 0 <= tail <= k <= block; got tail={tail}, k={k}, block={block}")
    s = scores.clone() if generator is None else torch.rand(H, T, generator=generator)
    s = s - 1e-6 * torch.arange(T) / T  # ties go to the earlier token
    s[:, :SINKS] = math.inf
    b = s.reshape(H, T // block, block)
    if tail:
        b[..., block - tail:] = math.inf
    keep = torch.zeros_like(b, dtype=torch.bool)
    keep.scatter_(2, b.topk(k, dim=2).indices, True)
    keep = keep.reshape(H, T)
    if window:
        keep[:, T - window:] = True
    return keep


def rules(block_sizes: list[int], k: int, observed: bool = False) -> list[tuple[str, dict]]:
    out = []
    for B in block_sizes:
        if observed:  # the observation scores of each prefill chunk (OBS_QUERIES, CHUNK)
            out += [(f"head {k}/{B} obs w64", {"kind": "head", "fraction": k / B, "window": 64, "score": "obs"}),
                    (f"block {B}/{k} obs w64", {"kind": "block", "block": B, "k": k, "window": 64, "score": "obs"}),
                    (f"block {B}/{k} zap|obs w64", {"kind": "block", "block": B, "k": k, "window": 64,
                                                    "score": "max"}),
                    (f"block {B}/{k} zap|obs t8 w64", {"kind": "block", "block": B, "k": k, "tail": 8,
                                                       "window": 64, "score": "max"})]
            continue
        out += [(f"head {k}/{B}", {"kind": "head", "fraction": k / B}),
                (f"head {k}/{B} w64", {"kind": "head", "fraction": k / B, "window": 64}),
                (f"block {B}/{k}", {"kind": "block", "block": B, "k": k}),
                (f"block {B}/{k} t8", {"kind": "block", "block": B, "k": k, "tail": 8}),
                (f"block {B}/{k} w64", {"kind": "block", "block": B, "k": k, "window": 64}),
                (f"random {B}/{k}", {"kind": "random", "block": B, "k": k})]
    return out


def masks_for(rule: dict, scores: dict[int, torch.Tensor], seed: int,
              observed: dict[int, torch.Tensor] | None = None) -> dict[int, torch.Tensor]:
    """Keep masks per layer; ``rule["score"]``: ``"zap"`` (KVzap's log scores, the default),
    ``"obs"`` (the chunk's last queries' attention) or ``"max"`` (the larger of ``exp(zap)`` and it:
    the library's continuation score, §19.7, made chunk-local)."""
    g = torch.Generator().manual_seed(seed)
    out = {}
    for layer, s in scores.items():
        kind = rule.get("score", "zap")
        if kind == "obs":
            s = observed[layer]
        elif kind == "max":
            s = torch.maximum(s.exp(), observed[layer])
        if rule["kind"] == "head":
            out[layer] = keep_head(s, rule["fraction"])
            if rule.get("window"):
                out[layer][:, -rule["window"]:] = True
        else:
            out[layer] = keep_blocks(s, rule["block"], rule["k"], rule.get("tail", 0), rule.get("window", 0),
                                     g if rule["kind"] == "random" else None)
    return out


# ---------------------------------------------------------------- the model side
class Probe:
    """The attention function's state: the keep masks in force (None: full attention)."""

    def __init__(self):
        self.masks: dict[int, torch.Tensor] | None = None
        self.observed: dict[int, torch.Tensor] | None = None

    def observe(self, layer: int, query: torch.Tensor, key: torch.Tensor, scaling: float | None) -> None:
        """``observed[layer]`` ``[H_kv, PREFIX]``: for each prompt token, the largest attention the
        last :data:`OBS_QUERIES` queries of its :data:`CHUNK`-token prefill chunk give it (softmax over
        the keys up to the chunk's end), averaged over each KV head's query group: what an attention
        backend sees when it writes the chunk's pages."""
        H_kv, Hq, D = key.shape[1], query.shape[1], key.shape[-1]
        group = Hq // H_kv
        scale = scaling if scaling is not None else D ** -0.5
        obs = torch.zeros(H_kv, PREFIX)
        for c0 in range(0, PREFIX, CHUNK):
            c1 = min(c0 + CHUNK, PREFIX)
            q0 = max(c0, c1 - OBS_QUERIES)
            qs = query[0, :, q0:c1].float()  # [Hq, n, D]
            ks = key[0, :, :c1].float().repeat_interleave(group, 0)  # [Hq, c1, D]
            logits = qs @ ks.transpose(1, 2) * scale
            causal = torch.arange(c1)[None] <= torch.arange(q0, c1)[:, None]  # [n, c1]
            p = logits.masked_fill(~causal, -math.inf).softmax(-1)[..., c0:c1]  # [Hq, n, c1 - c0]
            obs[:, c0:c1] = p.amax(1).reshape(H_kv, group, -1).mean(1)
        self.observed[layer] = obs

    def attention(self, module, query, key, value, attention_mask, scaling=None, **kwargs):
        from transformers.integrations.sdpa_attention import sdpa_attention_forward

        if self.masks is None:
            if self.observed is not None:
                self.observe(module.layer_idx, query, key, scaling)
            return sdpa_attention_forward(module, query, key, value, attention_mask, scaling=scaling, **kwargs)
        T = key.shape[2]
        keep = self.masks[module.layer_idx]  # [H_kv, PREFIX]
        H_kv, Hq = key.shape[1], query.shape[1]
        causal = torch.ones(T, T, dtype=torch.bool).tril()
        mask = causal[None].repeat(H_kv, 1, 1)  # [H_kv, T, T]
        mask[:, PREFIX:, :PREFIX] &= keep[:, None, :]  # the continuation reads the kept prompt
        mask = mask.repeat_interleave(Hq // H_kv, 0)[None]  # [1, Hq, T, T]
        out, _ = sdpa_attention_forward(module, query, key, value, mask, scaling=scaling,
                                        **{**kwargs, "is_causal": False})
        return out, None


def moby_windows(tok, n: int) -> list[torch.Tensor]:
    text = (shared_data_dir() / "gutenberg" / "pg2701.txt").read_text(encoding="utf-8").replace("\r\n", "\n")
    out = []
    for j in range(n):
        start = int(len(text) * (0.1 + 0.8 * j / max(1, n - 1)))
        ids = tok(text[start:start + 20000]).input_ids[:PREFIX + SCORED]
        if len(ids) < PREFIX + SCORED:
            raise ValueError(f"window {j} holds {len(ids)} tokens, fewer than {PREFIX + SCORED}")
        out.append(torch.tensor([ids]))
    return out


def run_model(alias: str, n_windows: int, block_sizes: list[int], k: int, observed: bool = False) -> list[dict]:
    from transformers import AttentionInterface
    from transformers.masking_utils import AttentionMaskInterface, sdpa_mask

    model, tok = load_model(alias)
    model.eval()
    path = shipped_scorer(model_identity(model))
    if path is None:
        raise ValueError(f"no KVzap scorer is shipped for {alias}")
    scorer = load_scorer(str(path))
    layers = sorted(scorer.layers)
    probe = Probe()
    AttentionInterface.register(NAME, probe.attention)
    AttentionMaskInterface.register(NAME, sdpa_mask)
    previous = model.config._attn_implementation
    model.set_attn_implementation(NAME)
    windows = moby_windows(tok, n_windows)
    rows: list[dict] = []
    try:
        refs, scores, seen = [], [], []
        for w in windows:
            hidden: dict[int, torch.Tensor] = {}
            probe.masks = None
            probe.observed = {} if observed else None
            with torch.no_grad(), hidden_state_hooks(model, lambda i, h: hidden.__setitem__(i, h), layers):
                logits = model(w).logits[0, PREFIX - 1:-1].float()
            refs.append(logits.log_softmax(-1))
            scores.append({i: scorer.score(i, hidden[i][:, :PREFIX])[0] for i in layers})
            seen.append(probe.observed)
            probe.observed = None
        nll_full = sum(float(-lp.gather(1, w[0, PREFIX:, None]).sum()) for lp, w in zip(refs, windows))
        for name, rule in rules(block_sizes, k, observed):
            t0 = time.perf_counter()
            nll, kl, kept = 0.0, 0.0, 0.0
            for j, (w, ref, sc, ob) in enumerate(zip(windows, refs, scores, seen)):
                probe.masks = masks_for(rule, sc, seed=j, observed=ob)
                kept += sum(float(m.float().mean()) for m in probe.masks.values()) / len(probe.masks)
                with torch.no_grad():
                    lp = model(w).logits[0, PREFIX - 1:-1].float().log_softmax(-1)
                nll += float(-lp.gather(1, w[0, PREFIX:, None]).sum())
                kl += float((ref.exp() * (ref - lp)).sum())
            n = SCORED * len(windows)
            rows.append({"model": alias, "rule": name, "kept": kept / len(windows),
                         "delta_ppl": math.exp((nll - nll_full) / n) - 1, "kl": kl / n,
                         "seconds": time.perf_counter() - t0})
            r = rows[-1]
            print(f"{alias:14s} {name:20s} kept {100 * r['kept']:.1f}%  {100 * r['delta_ppl']:+.2f}%  "
                  f"KL {r['kl']:.4f}", flush=True)
    finally:
        probe.masks = None
        model.set_attn_implementation(previous)
    return rows


def write(rows: list[dict], out: Path, n_windows: int) -> None:
    out.with_suffix(".json").write_text(json.dumps(rows, indent=1))
    lines = [f"# Block-local eviction quotas ({n_windows} *Moby Dick* windows, {PREFIX} + {SCORED} tokens, "
             "float32, no codes)", "",
             "`python benchmarks/probe_block_quota.py` (see its docstring for each rule). `kept` is the share "
             "of the prompt's keys the continuation reads (sinks, tails and windows included), averaged over "
             "layers, heads and windows.", ""]
    for model in dict.fromkeys(r["model"] for r in rows):
        lines += [f"## {model}", "", "| rule | kept | Δppl | KL |", "|---|---|---|---|"]
        for r in rows:
            if r["model"] == model:
                lines.append(f"| `{r['rule']}` | {100 * r['kept']:.1f}% | {100 * r['delta_ppl']:+.2f}% | "
                             f"{r['kl']:.4f} |")
        lines.append("")
    out.with_suffix(".md").write_text("\n".join(lines))


def main() -> None:
    global PREFIX, SCORED
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--models", default="smollm2,qwen2.5-0.5b")
    ap.add_argument("--windows", type=int, default=4)
    ap.add_argument("--blocks", default="64,128,256", help="block sizes B [64,128,256]")
    ap.add_argument("--keep", type=int, default=32, help="slots k per block and KV head [32]")
    ap.add_argument("--prefix", type=int, default=PREFIX, help=f"prompt tokens per window, a multiple of each B [{PREFIX}]")
    ap.add_argument("--scored", type=int, default=SCORED, help=f"scored tokens per window [{SCORED}]")
    ap.add_argument("--observed", action="store_true",
                    help="the rules scored by each prefill chunk's last queries (alone, or with KVzap's) instead")
    ap.add_argument("--out", default=str(ROOT / "benchmarks" / "results" / "probe_block_quota"))
    args = ap.parse_args()
    PREFIX, SCORED = args.prefix, args.scored
    out = Path(args.out)
    rows = json.loads(out.with_suffix(".json").read_text()) if out.with_suffix(".json").exists() else []
    for alias in args.models.split(","):
        rows += run_model(alias.strip(), args.windows, [int(b) for b in args.blocks.split(",")], args.keep,
                          args.observed)
        write(rows, out, args.windows)


if __name__ == "__main__":
    main()
