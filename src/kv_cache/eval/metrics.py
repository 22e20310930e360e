"""Per-sample metrics of ``kvcache eval`` beyond perplexity: next-token KL from the full cache
and bits per element (math dictionary §13), and the on-disk reference log-probabilities KL needs."""

from __future__ import annotations

import logging
import os
from pathlib import Path

import torch

log = logging.getLogger(__name__)


def next_token_kl(ref_logits: torch.Tensor, logits: torch.Tensor, chunk: int = 64) -> torch.Tensor:
    """KL divergence of the next-token distribution from the reference, per position.

    ``KL(P || Q) = sum_v P_v (log P_v - log Q_v)`` with ``P = softmax(ref_logits)`` and
    ``Q = softmax(logits)`` over the last axis, exact over the whole vocabulary (math dictionary
    §13, "Next-token KL"). Log-probabilities are valid logits (``log_softmax`` is invariant to an
    additive constant), so either input may be logits or log-probabilities.

    Parameters
    ----------
    ref_logits, logits : torch.Tensor
        shape: ``[..., vocab]``, the same for both; any floating dtype.
    chunk : int
        Rows handled at once (bounds the float64 temporaries of a ``256 x 49152`` window).

    Returns
    -------
    torch.Tensor
        float64, shape ``ref_logits.shape[:-1]``; always computed in float64 from
        ``log_softmax``. Terms with ``P_v = 0`` count 0; ``P_v > 0 = Q_v`` gives ``inf``; NaN in
        either input gives NaN. Values are clamped at 0 (float64 rounding can leave ``-1e-17``
        where ``P`` and ``Q`` nearly agree); ``KL(P || P)`` is exactly 0.

    Raises
    ------
    ValueError
        If the shapes differ or the vocabulary axis is empty.

    Examples
    --------
    >>> p, q = torch.tensor([0.0, 0.0]), torch.log(torch.tensor([0.25, 0.75]))
    >>> round(float(next_token_kl(p, q)), 6)  # 0.5 ln(0.5/0.25) + 0.5 ln(0.5/0.75)
    0.143841
    """
    if ref_logits.shape != logits.shape:
        raise ValueError(f"reference and method logits must have the same shape; got {tuple(ref_logits.shape)} "
                         f"and {tuple(logits.shape)}")
    if ref_logits.dim() == 0 or ref_logits.shape[-1] == 0:
        raise ValueError(f"logits need a non-empty vocabulary axis; got shape {tuple(ref_logits.shape)}")
    vocab = ref_logits.shape[-1]
    p_rows, q_rows = ref_logits.reshape(-1, vocab), logits.reshape(-1, vocab)
    out = torch.empty(p_rows.shape[0], dtype=torch.float64)
    for a in range(0, p_rows.shape[0], chunk):
        lp = torch.log_softmax(p_rows[a:a + chunk].double(), dim=-1)
        lq = torch.log_softmax(q_rows[a:a + chunk].double(), dim=-1)
        p = lp.exp()
        # 0 * log 0 = 0: a token the reference rules out costs nothing (-inf - -inf must not give
        # NaN); a NaN in either input still does (``p == 0`` is False for NaN).
        terms = torch.where(p == 0, torch.zeros((), dtype=torch.float64), p * (lp - lq))
        out[a:a + chunk] = terms.sum(-1).clamp_min(0.0)
    return out.reshape(ref_logits.shape[:-1])


def bits_per_element(kv_bytes: float | None, fp16_bytes: float | None) -> float | None:
    """Bits held per K/V element represented: ``16 * kv_bytes / fp16_bytes``.

    ``fp16_bytes`` is :func:`kv_cache.cache.report.fp16_kv_bytes` of the tokens prefilled (2
    bytes for each of ``2 * layers * kv_heads * head_dim * tokens`` elements), so this is
    ``8 * kv_bytes / elements`` over the tokens seen: an eviction method's bits are spread over
    the whole context, which is what the user pays per token of context. None when either is
    missing or ``fp16_bytes`` is 0.
    """
    if kv_bytes is None or not fp16_bytes:
        return None
    return 16.0 * kv_bytes / fp16_bytes


class ReferenceLogProbs:
    """The full cache's next-token log-probabilities of each perplexity window, on disk.

    ``<dir>/ppl-<index>.safetensors`` holds one float32 tensor ``[continuation, vocab]`` (the
    exact ``log_softmax`` of the reference's float32 logits, so a resumed run computes the same
    KL as an uninterrupted one) and, as metadata, the run's fingerprint and the reference's
    ``resolved`` settings: a file of another configuration is never used.
    """

    def __init__(self, directory: Path, fingerprint: str, resolved: str) -> None:
        self.directory, self.fingerprint, self.resolved = Path(directory), fingerprint, resolved

    def path(self, index: int) -> Path:
        return self.directory / f"ppl-{index}.safetensors"

    def save(self, index: int, log_probs: torch.Tensor) -> None:
        from safetensors.torch import save_file

        self.directory.mkdir(parents=True, exist_ok=True)
        path = self.path(index)
        tmp = path.with_suffix(".tmp")
        save_file({"log_probs": log_probs.detach().float().contiguous()}, str(tmp),
                  metadata={"fingerprint": self.fingerprint, "resolved": self.resolved, "index": str(index)})
        os.replace(tmp, path)

    def load(self, index: int, positions: int) -> torch.Tensor | None:
        """The saved tensor of window ``index``, or None if absent, unreadable, not this run's or
        not ``positions`` rows long."""
        from safetensors import safe_open

        path = self.path(index)
        if not path.exists():
            return None
        try:
            with safe_open(str(path), framework="pt") as f:
                meta = f.metadata() or {}
                lp = f.get_tensor("log_probs")
        except Exception as exc:  # a truncated or foreign file is recomputed, not fatal
            log.warning("ignoring unreadable %s: %s", path, exc)
            return None
        if (meta.get("fingerprint"), meta.get("resolved")) != (self.fingerprint, self.resolved) \
                or lp.dim() != 2 or lp.shape[0] != positions:
            return None
        return lp


__all__ = ["ReferenceLogProbs", "bits_per_element", "next_token_kl"]
