"""The compression bill of a captured KV cache (``kvcache bill``).

Runs a prompt through a real model, captures its full-precision KV cache, and for several
configurations reports bytes before/after, bits per element including metadata, the byte and
token compression ratios, the seed's total gain and the reconstruction error. (The main job,
``kvcache demo``, runs the compressed cache inside ``generate`` instead; see :mod:`kv_cache.cli.main`.)
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from .cache.report import fp16_kv_bytes
from .compression import dequantize, quantize, resolve_budget, select_tokens, total_gain
from .compression.selection import snapkv_scores, window_attention


@dataclass(frozen=True)
class DemoConfig:
    """One row of the bill: quantization bits (None = fp16) and a SnapKV budget fraction."""

    name: str
    bits: int | None
    budget: float | None = None
    group_size: int = 32


CONFIGS = (
    DemoConfig("fp16 (reference)", None),
    DemoConfig("8-bit", 8),
    DemoConfig("4-bit", 4),
    DemoConfig("3-bit", 3),
    DemoConfig("2-bit", 2),
    DemoConfig("SnapKV 50%", None, 0.5),
    DemoConfig("4-bit + SnapKV 50%", 4, 0.5),
    DemoConfig("2-bit + SnapKV 25%", 2, 0.25),
)


def capture_kv(model, input_ids: torch.Tensor):
    """Run one forward pass and return per-layer ``(keys, values)``, each
    ``[batch, kv_heads, T, head_dim]`` float32."""
    from transformers import DynamicCache

    cache = DynamicCache()
    with torch.no_grad():
        model(input_ids, past_key_values=cache, use_cache=True)
    return [(layer.keys.float(), layer.values.float()) for layer in cache.layers]


def bill(model, input_ids: torch.Tensor, window: int = 16) -> list[dict]:
    """Compress the captured cache under every :data:`CONFIGS` entry; return one dict per row."""
    kv = capture_kv(model, input_ids)
    cfg = model.config
    n_kv = cfg.num_key_value_heads
    T = input_ids.shape[1]
    fp16_bytes = fp16_kv_bytes(cfg, T, batch=input_ids.shape[0])
    rows = []
    for c in CONFIGS:
        held = 0
        sq_err = 0.0
        n_el = 0
        max_err = 0.0
        kept_tokens = T
        for k, v in kv:
            if c.budget is not None:
                # Score with the keys' own last-window self-similarity (query-free proxy:
                # the window's keys stand in for its queries, a documented approximation
                # of SnapKV for this cache-only demo; the model-integrated SnapKV uses queries).
                kq = k.repeat_interleave(cfg.num_attention_heads // n_kv, dim=1)[:, :, -window:]
                scores = snapkv_scores(window_attention(kq, k), n_kv)
                keep = select_tokens(scores, resolve_budget(c.budget, T), recent_window=window)
                idx = keep.unsqueeze(-1).expand(-1, -1, -1, k.shape[-1])
                k, v = k.gather(2, idx), v.gather(2, idx)
                kept_tokens = keep.shape[-1]
            if c.bits is None:
                held += 2 * (k.numel() + v.numel()) + (0 if c.budget is None else keep.numel() * 8)
                continue
            qk = quantize(k, c.bits, axis=-2, group_size=c.group_size, scale_dtype=torch.float16)
            qv = quantize(v, c.bits, axis=-1, group_size=c.group_size, scale_dtype=torch.float16)
            held += qk.nbytes + qv.nbytes + (0 if c.budget is None else keep.numel() * 8)
            for orig, qt in ((k, qk), (v, qv)):
                err = (orig - dequantize(qt, dtype=torch.float32)).abs()
                sq_err += float((err**2).sum())
                max_err = max(max_err, float(err.max()))
                n_el += err.numel()
        elements = sum(k.numel() + v.numel() for k, v in kv) * kept_tokens // T
        rows.append({
            "config": c.name,
            "fp16_bytes": fp16_bytes,
            "held_bytes": held,
            "bits_per_element": 8 * held / elements,
            "byte_ratio": fp16_bytes / held,
            "token_ratio": T / kept_tokens,
            "total_gain": total_gain(2 * 8 * 2 * sum(k.shape[1] * k.shape[3] for k, _ in kv) / 8,
                                     held / kept_tokens, T, kept_tokens),
            "rmse": (sq_err / n_el) ** 0.5 if n_el else 0.0,
            "max_abs_error": max_err,
        })
    return rows


def format_bill(rows: list[dict]) -> str:
    """Render :func:`bill` rows as a Markdown table."""
    head = ("| config | bytes held | fp16 bytes | bits/elem (incl. metadata) | byte ratio "
            "| token ratio T/K | total gain | RMSE | max abs err |")
    lines = [head, "|" + "---|" * 9]
    for r in rows:
        lines.append(
            f"| {r['config']} | {r['held_bytes']:,} | {r['fp16_bytes']:,} | {r['bits_per_element']:.3f} "
            f"| {r['byte_ratio']:.2f}x | {r['token_ratio']:.2f}x | {r['total_gain']:.2f}x "
            f"| {r['rmse']:.4f} | {r['max_abs_error']:.4f} |"
        )
    return "\n".join(lines)
