"""Per-layer evidence for the key layout: channel statistics and attention-output error.

For one window of a held-out text (Moby Dick, pg2701, never used for calibration), runs the
model with a plain ``DynamicCache`` and, per layer:

* key and value channel statistics before and after the layout's rotation: the largest
  per-channel ``|mean| / std`` (an offset that is the same for every token), the largest
  ``|mean|``, and the share of the keys' energy held by the per-channel mean
  (``||mean||^2 / mean_t ||k_t||^2``);
* the relative attention-output error ``||o_hat - o|| / ||o||`` of the last ``--queries``
  queries over the whole prefix when the prefix's keys and values are stored in each layout
  (:class:`kv_cache.cache.packed.PackedKV`, the cache's own quantizer), with and without the
  per-channel key offset subtracted first (math dictionary §25).

Usage::

    python benchmarks/diagnose_layout.py --model qwen2.5-0.5b --out docs/results/layout_diagnosis_qwen.md
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "src"))

from transformers import DynamicCache  # noqa: E402

from kv_cache import QuantConfig  # noqa: E402
from kv_cache.cache.hooks import attention_modules, post_rope_queries  # noqa: E402
from kv_cache.attention.key_offset import key_offset  # noqa: E402
from kv_cache.cache.packed import PackedKV  # noqa: E402
from kv_cache.models import load_model, shared_data_dir  # noqa: E402

LAYOUTS = {
    "q4 per-token (before)": QuantConfig(bits=4, key_grouping="token", center_keys=False),
    "+offset": QuantConfig(bits=4, key_grouping="token", center_keys=True),
    "+offset+scale": (QuantConfig(bits=4, key_grouping="token", center_keys=True), 1.0),
    "q4d (now)": QuantConfig(bits=4),
    "q4 (KIVI)": QuantConfig.kivi(bits=4),
    "q2 per-token (before)": QuantConfig(bits=2, key_grouping="token", center_keys=False),
    "q2d (now)": QuantConfig(bits=2),
}
"""The layouts compared: the previous per-token default (and the two repairs tried on it: the
per-channel key offset, then channels scaled to unit RMS before the rotation), the current
default (per-channel keys, §25.3) and KIVI."""


def channel_stats(x: torch.Tensor) -> tuple[float, float, float]:
    """``x`` ``[h, n, d]`` float32 -> (max |mean|/std, max |mean|, mean-energy share)."""
    mu = x.mean(1)
    sd = x.std(1).clamp_min(1e-6)
    share = (mu.square().sum(-1) / x.square().sum(-1).mean(1)).mean()
    return float((mu.abs() / sd).max()), float(mu.abs().max()), float(share)


def attention_error(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, kh: torch.Tensor, vh: torch.Tensor,
                    scaling: float) -> float:
    """``q`` ``[Hq, m, d]``; ``k, v, kh, vh`` ``[Hkv, n, d]``: relative output error, float64."""
    g = q.shape[0] // k.shape[0]
    k, v, kh, vh = (t.double().repeat_interleave(g, 0) for t in (k, v, kh, vh))
    q = q.double()
    o = torch.softmax(q @ k.transpose(-1, -2) * scaling, -1) @ v
    oh = torch.softmax(q @ kh.transpose(-1, -2) * scaling, -1) @ vh
    return float((oh - o).norm() / o.norm())


def stored(quant, layer: int, k: torch.Tensor, v: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Keys and values ``[1, h, n, d]`` as the layout stores them (sinks full precision), read back."""
    quant, alpha = quant if isinstance(quant, tuple) else (quant, 0.0)
    s = quant.sink_tokens
    mu = key_offset(k, s) if quant.center_keys else torch.zeros_like(k[:, :, :1])
    n = (k.shape[2] - s) // quant.group_size * quant.group_size
    body = k[:, :, s:s + n] - mu
    sc = body.square().mean(2, keepdim=True).sqrt().clamp_min(1e-6) ** alpha
    sc = sc / sc.square().mean(-1, keepdim=True).sqrt()
    pk = PackedKV(quant, k.dtype, k.shape[-1], track_groups=False, layer=layer)
    pk.append(body / sc, v[:, :, s:s + n])
    kh, vh = pk.dequantize()
    kh = kh * sc
    return torch.cat([k[:, :, :s], kh + mu, k[:, :, s + n:]], 2), torch.cat([v[:, :, :s], vh, v[:, :, s + n:]], 2)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--model", default="qwen2.5-0.5b")
    ap.add_argument("--tokens", type=int, default=1024)
    ap.add_argument("--queries", type=int, default=32)
    ap.add_argument("--out", type=Path, default=None)
    args = ap.parse_args()
    torch.manual_seed(0)
    model, tok = load_model(args.model)
    text = (shared_data_dir() / "gutenberg" / "pg2701.txt").read_text(encoding="utf-8").replace("\r\n", "\n")
    ids = torch.tensor([tok(text[20000:200000]).input_ids[: args.tokens]])
    captured: dict[int, torch.Tensor] = {}
    hooks = []
    for idx, module in attention_modules(model).items():
        def hook(mod, a, kw, out, idx=idx):
            captured[idx] = post_rope_queries(mod, kw["hidden_states"], kw["position_embeddings"], args.queries)[0]
        hooks.append(module.register_forward_hook(hook, with_kwargs=True))
    cache = DynamicCache(config=model.config)
    with torch.no_grad():
        model(input_ids=ids, past_key_values=cache, use_cache=True)
    for h in hooks:
        h.remove()
    scaling = model.config.head_dim ** -0.5 if getattr(model.config, "head_dim", None) else \
        (model.config.hidden_size // model.config.num_attention_heads) ** -0.5
    rows = []
    for i, layer in enumerate(cache.layers):
        k, v = layer.keys.float(), layer.values.float()  # [1, h, n, d] post-RoPE
        rot = PackedKV(LAYOUTS["+offset"], k.dtype, k.shape[-1], False, i)
        rot.append(k[:, :, :4], v[:, :, :4])
        kr = rot.rotation.forward(k)
        stats = channel_stats(k[0, :, 4:]) + channel_stats(kr[0, :, 4:]) + channel_stats(v[0, :, 4:])[:1]
        errs = []
        for name, quant in LAYOUTS.items():
            kh, vh = stored(quant, i, k, v)
            errs.append(attention_error(captured[i], k[0], v[0], kh[0], vh[0], scaling))
        rows.append((i, *stats, *errs))
    head = ("| layer | K max abs(mean)/std | K max abs(mean) | K mean-energy share | rotated K max abs(mean)/std "
            "| rotated K max abs(mean) | rotated K mean share | V max abs(mean)/std | "
            + " | ".join(f"err {n}" for n in LAYOUTS) + " |")
    lines = [f"# Layout diagnosis: {args.model}, {args.tokens} tokens of pg2701, last {args.queries} queries", "",
             head, "|" + "---|" * (head.count("|") - 1)]
    for r in rows:
        lines.append("| " + " | ".join([str(r[0])] + [f"{x:.3g}" for x in r[1:]]) + " |")
    means = [sum(r[j] for r in rows) / len(rows) for j in range(1, len(rows[0]))]
    lines.append("| mean | " + " | ".join(f"{x:.3g}" for x in means) + " |")
    report = "\n".join(lines) + "\n"
    print(report)
    if args.out:
        args.out.parent.mkdir(parents=True, exist_ok=True)
        args.out.write_text(report, encoding="utf-8")


if __name__ == "__main__":
    main()
