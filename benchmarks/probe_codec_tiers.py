"""Does the storage codec lose needles on the tokens KVzip ranks highest? (issue 30)

At 20x (``kvzip@0.25+file20``) SmolLM2 loses single needles at 4K that KVzip keeping the same
tokens uncoded retains (``docs/results/smollm2_niah_kvzip_inmemory_ctx4096.md``). If the loss
sat in the few tokens the reconstruction attends to most, coding those finer would fix it. This
probe tests that directly: it codes a sample's kept K/V at 20x, then writes back a share ``q``
of each coded segment's tokens *exactly* (their original float16 K and V) and answers the
question from the patched cache:

* ``top``: the ``q`` of each segment's tokens with the highest KVzip scores;
* ``random``: a random ``q`` (the control);
* ``keys exact`` / ``values exact``: every key (value) row written back exactly, the other kind
  as coded (which of the two the needles need);
* ``--budget shared``: the exact rows count inside the 20x file (the rest is coded coarser);
  ``--budget free``: on top of it (the codec keeps the whole 20x budget for the rest: an upper
  bound on what any importance weighting could buy).

The kept tokens' scores come from ``kv_cache.context.reconstruct(..., finish=False)`` (the
layer's ``state["kvzip"]``) and are matched to the kept rows through their keys (a kept key is
an exact copy of the plain prefill's key at its position). Patching writes into the cache's
full-precision storage; it is a probe, not a library path.

Run: ``python benchmarks/probe_codec_tiers.py --samples 1,4 --shares 0.05,0.15,0.5 --budget free``;
results go to ``benchmarks/results/probe_codec_tiers_<budget>.{json,md}``.
"""

from __future__ import annotations

import argparse
import json
from pathlib import Path

import torch

import kv_cache
from kv_cache import CompressedCache, KVzip
from kv_cache.cache.report import fp16_kv_bytes
from kv_cache.cache.serialize import _encode_layer
from kv_cache.cache.serialize_state import _Writer
from kv_cache.codec import basis_for_model, decode_state, encode_state
from kv_cache.codec.targets import find_targets, segments
from kv_cache.context import forward_at, reconstruct
from kv_cache.eval.runner import _greedy
from kv_cache.eval.tasks import build_task, read_text
from kv_cache.eval.tasks.prompts import build_prompt
from kv_cache.eval.tasks.request import TaskRequest
from kv_cache.eval.tasks.scoring import score_retrieval
from kv_cache.models import load_model, shared_data_dir


def _live(cache, name: str) -> torch.Tensor:
    """The cache's own tensor that the saved tensor ``name`` (``layer<i>.<field>...``) copies."""
    parts = name.split(".")
    o = cache.layers[int(parts[0][5:])].storage
    for p in parts[1:]:
        o = getattr(o, type(o).FIELDS[p])
    return o


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--model", default="smollm2")
    ap.add_argument("--samples", default="1,4", help="niah_single sample indices (the eval's, seed 0)")
    ap.add_argument("--context", type=int, default=4096)
    ap.add_argument("--budget-kept", type=float, default=0.25, help="KVzip budget [0.25]")
    ap.add_argument("--file-ratio", type=float, default=20.0)
    ap.add_argument("--shares", default="0.05,0.15,0.5")
    ap.add_argument("--budget", choices=("shared", "free"), default="free")
    ap.add_argument("--out", default=str(Path(__file__).resolve().parent / "results"))
    args = ap.parse_args()
    model, tok = load_model(args.model)
    cfg = model.config
    text = read_text(str(shared_data_dir() / "wikitext-2-raw" / "wiki.test.raw"))
    n = max(int(x) for x in args.samples.split(",")) + 1
    samples = build_task("niah_single", TaskRequest(tok, text, context=args.context, num_samples=max(n, 6), depths=None,
                                                    seed=0, haystack="text", query_aware=False))
    basis = basis_for_model(model)
    eos = {t for t in [tok.eos_token_id, getattr(model.generation_config, "eos_token_id", None)] if isinstance(t, int)}
    shares = [float(x) for x in args.shares.split(",")]
    rows = []
    for i in (int(x) for x in args.samples.split(",")):
        s = samples[i]
        ctx_text, q_text = build_prompt(s, tok, query_aware=False)
        ids = tok(ctx_text, return_tensors="pt").input_ids
        q_ids = tok(q_text, return_tensors="pt", add_special_tokens=False).input_ids
        T = ids.shape[1]
        cache = CompressedCache(cfg, eviction=KVzip(budget=args.budget_kept))
        with torch.no_grad(), kv_cache.compress(model, cache):
            model(input_ids=ids, past_key_values=cache, use_cache=True, logits_to_keep=1)
            reconstruct(model, cache, ids[0], tok, finish=False)
            scores = [layer.state["kvzip"][0].clone() if "kvzip" in layer.state else None for layer in cache.layers]
            cache.finish_reconstruction()
            plain = model(ids, use_cache=True).past_key_values
        keys = [plain.layers[j].keys[0].float() for j in range(cfg.num_hidden_layers)]
        w = _Writer(cache.quant, None)
        layers = [_encode_layer(layer, j, w) for j, layer in enumerate(cache.layers)]
        orig = dict(w.tensors)
        targets = find_targets(layers, orig)
        seg_scores = {}
        for t in targets:
            for si, x in enumerate(segments(orig[t.names[0]], t)):
                pos = torch.cdist(x.float(), keys[t.layer][t.heads[si]]).argmin(-1)
                seg_scores[(t.names[0], si)] = scores[t.layer][t.heads[si]][pos]
        target = int(fp16_kv_bytes(cfg, T) / args.file_ratio)
        size = lambda tensors, rec: sum(x.nbytes for x in tensors.values()) + len(json.dumps(rec)) + 30000  # noqa: E731

        def answer() -> str:
            with torch.no_grad(), kv_cache.compress(model, cache):
                logits = forward_at(model, cache, q_ids, T)
                out, _ = _greedy(model, cache, logits[0, -1], T + q_ids.shape[1], 32, eos)
            return tok.decode(out, skip_special_tokens=True)

        def put(tensors) -> None:
            for t in targets:
                for name in t.names:
                    live = _live(cache, name)
                    (live[:, :, :tensors[name].shape[2]] if t.layout == "heads" else live).copy_(tensors[name])

        def coded(variant: str, q: float) -> dict:
            if variant in ("keys exact", "values exact"):  # one kind exact, the other as coded at the target
                enc, rec = encode_state(dict(orig), layers, basis, size, target)
                dec = decode_state(enc, rec, basis, tokens_seen=T, layers=cfg.num_hidden_layers,
                                   kv_heads=cfg.num_key_value_heads, head_dim=cfg.head_dim)
                j = 0 if variant == "keys exact" else 1
                for t in targets:
                    dec[t.names[j]] = orig[t.names[j]].to(torch.float16).to(orig[t.names[j]].dtype)
                put(dec)
                pred = answer()
                put(orig)
                return {"sample": i, "variant": variant, "share": 1.0, "exact_rows": None,
                        "exact_share_of_file": None, "prediction": pred, "score": score_retrieval(pred, s.expected)}
            g = torch.Generator().manual_seed(i)
            masks, n_exact = {}, 0
            for t in targets:
                for si, x in enumerate(segments(orig[t.names[0]], t)):
                    m = torch.zeros(x.shape[0], dtype=torch.bool)
                    k = int(round(q * x.shape[0]))
                    if k:
                        sc = seg_scores[(t.names[0], si)]
                        m[sc.topk(k).indices if variant == "top" else torch.randperm(x.shape[0], generator=g)[:k]] = True
                    masks[(t.names[0], si)] = m
                    n_exact += int(m.sum())
            exact_bytes = n_exact * 2 * cfg.head_dim * 2  # float16 K and V per exact row
            budget = target - (exact_bytes if args.budget == "shared" else 0)
            enc, rec = encode_state(dict(orig), layers, basis, size, budget)
            dec = decode_state(enc, rec, basis, tokens_seen=T, layers=cfg.num_hidden_layers,
                               kv_heads=cfg.num_key_value_heads, head_dim=cfg.head_dim)
            for t in targets:
                for name in t.names:
                    exact = segments(orig[name].to(torch.float16).to(orig[name].dtype), t)
                    for si, seg in enumerate(segments(dec[name], t)):
                        m = masks[(t.names[0], si)]
                        seg[m] = exact[si][m]
            put(dec)
            pred = answer()
            put(orig)
            return {"sample": i, "variant": variant, "share": q, "exact_rows": n_exact,
                    "exact_share_of_file": exact_bytes / target, "prediction": pred,
                    "score": score_retrieval(pred, s.expected)}

        base = answer()
        rows.append({"sample": i, "variant": "uncoded", "share": 1.0, "exact_rows": None, "exact_share_of_file": None,
                     "prediction": base, "score": score_retrieval(base, s.expected)})
        print(json.dumps(rows[-1]), flush=True)
        kinds = [("keys exact", 1.0), ("values exact", 1.0)] if args.budget == "free" else []
        for variant, q in [("uniform", 0.0)] + kinds + [(v, q) for q in shares for v in ("top", "random")]:
            rows.append(coded(variant, q))
            print(json.dumps(rows[-1]), flush=True)
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    stem = out / f"probe_codec_tiers_{args.budget}"
    stem.with_suffix(".json").write_text(json.dumps({"args": vars(args), "rows": rows}, indent=1) + "\n")
    lines = [f"# Exact rows by KVzip score inside a {args.file_ratio:g}x file ({args.model}, niah_single, "
             f"{args.context} tokens, kvzip@{args.budget_kept:g}, exact rows {args.budget} with the file)", "",
             "| sample | variant | share exact | exact bytes / file target | answer | correct |", "|---|---|---|---|---|---|"]
    for r in rows:
        share = "-" if r["variant"] in ("uncoded", "uniform", "keys exact", "values exact") else f"{r['share']:g}"
        frac = "-" if r["exact_share_of_file"] is None else f"{r['exact_share_of_file']:.0%}"
        lines.append(f"| {r['sample']} | {r['variant']} | {share} | {frac} | `{r['prediction'][:24].strip()}` | "
                     f"{'yes' if r['score'] else 'no'} |")
    lines += ["", f"Produced by `benchmarks/probe_codec_tiers.py --samples {args.samples} --shares {args.shares} "
              f"--budget {args.budget}`. `uncoded`: the same kept tokens in memory; `uniform`: the codec as "
              "shipped; `top` / `random`: that share of every coded segment written back exactly.", ""]
    stem.with_suffix(".md").write_text("\n".join(lines))
    print(f"wrote {stem}.{{json,md}}")


if __name__ == "__main__":
    main()
