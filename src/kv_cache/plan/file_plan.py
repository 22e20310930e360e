"""Tokens and bits together for a file-size target (``kvcache compress --file-ratio R``, math
dictionary §27.4).

A ``.kvc`` file of ratio ``R`` holds ``fp16 bytes / R``: few tokens coded finely, or many coded
coarsely. :func:`plan_file` measures it on the document itself: its last ``probe_tokens``
tokens are held out, the rest is compressed with KVzip at each candidate budget (``3 / R``,
``4 / R``, ``5 / R`` and ``8 / R``: ``5 / R`` was the best point on SmolLM2's wikitext windows
of 1,792 tokens; at 4,096 tokens and 20x, ``3 / R`` keeps every single needle and ``4 / R`` has
the least perplexity; on Qwen2.5 at 1,792 tokens ``8 / R`` is far better than ``5 / R``, math
dictionary §27.4), saved through the codec at ratio
``R``, loaded back, and the held-out tokens are scored teacher-forced; the budget of least loss
wins. The whole document is then compressed with it. Given several bases (the model's fitted
before and after RoPE, math dictionary §27.6), every budget is measured with each, and the pair
of least loss wins.
"""

from __future__ import annotations

import math
import tempfile
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Sequence

import torch
import torch.nn.functional as F

DEFAULT_FACTORS = (0.6, 0.8, 1.0, 1.6)
"""Candidate budgets: ``5 / R`` times these (clipped to [0.03, 1])."""


@dataclass
class FilePlan:
    """The chosen KVzip budget (None: every token) and basis, and what each candidate measured:
    ``(budget, held-out NLL per token, file bytes)``, with the basis of each in ``measured_bases``
    (``"before RoPE"`` / ``"after RoPE"``)."""

    budget: float | None
    file_ratio: float
    measured: list[tuple[float | None, float, int]] = field(default_factory=list)
    basis: Any = None
    measured_bases: list[str] = field(default_factory=list)

    def describe(self) -> str:
        several = len(set(self.measured_bases)) > 1
        rows = ", ".join(f"{'all' if b is None else f'kvzip@{b:g}'}{f' {k}' if several else ''}: nll {n:.3f} "
                         f"({s:,} B)" for (b, n, s), k in zip(self.measured, self.measured_bases or [""] * len(self.measured)))
        chosen = "all tokens" if self.budget is None else f"KVzip keeping {self.budget:g}"
        if several and self.basis is not None:
            chosen += f", keys coded {_kind(self.basis)}"
        return f"file ratio {self.file_ratio:g}: {chosen} (held-out tail of the document, {rows})"


def _kind(basis: Any) -> str:
    return "before RoPE" if getattr(basis, "keys_before_rope", False) else "after RoPE"


def candidate_budgets(file_ratio: float, factors: Sequence[float] = DEFAULT_FACTORS) -> list[float | None]:
    """The KVzip budgets tried for ``file_ratio`` (None: no eviction)."""
    out: list[float | None] = []
    for f in factors:
        b = min(1.0, max(0.03, 5.0 / file_ratio * f))
        b = None if b >= 1.0 else round(b, 3)
        if b not in out:
            out.append(b)
    return out


def plan_file(model: torch.nn.Module, tokenizer: Any, ids: Sequence[int], file_ratio: float, *, basis: Any,
              probe_tokens: int = 64, candidates: Sequence[float | None] | None = None,
              settings: Any = None) -> FilePlan:
    """Measure each candidate budget on ``ids`` (see the module docstring); the best one.
    ``basis``: a :class:`~kv_cache.codec.CodecBasis`, or several (each budget measured with each).

    Raises ``ValueError`` for a ratio below 1, a document too short to hold out ``probe_tokens``
    (fewer than 4 times that many tokens), or a target no candidate fits."""
    from ..cache import CompressedCache, compress
    from ..cache.report import fp16_kv_bytes
    from ..cache.serialize import load_cache, save_cache
    from ..context import forward_at, prefill
    from ..policies import KVzip

    if isinstance(file_ratio, bool) or not isinstance(file_ratio, (int, float)) or not 1 <= file_ratio < math.inf:
        raise ValueError(f"file_ratio must be a finite number >= 1; got {file_ratio!r}")
    cands = list(candidates) if candidates is not None else candidate_budgets(file_ratio)
    bases = list(basis) if isinstance(basis, (list, tuple)) else [basis]
    if not bases or any(b is None for b in bases):
        raise ValueError("plan_file needs a codec basis (or several); got none")
    if len(ids) < 4 * probe_tokens:
        return FilePlan(cands[len(cands) // 2], float(file_ratio), basis=bases[0])
    prefix = torch.tensor([list(ids[:-probe_tokens])])
    tail = torch.tensor([list(ids[-probe_tokens:])])
    target = int(fp16_kv_bytes(model.config, prefix.shape[1]) / file_ratio)
    measured, used, errors = [], [], []
    with tempfile.TemporaryDirectory() as tmp:
        path = Path(tmp) / "probe.kvc"
        for b in cands:
            cache = CompressedCache(model.config, eviction=None if b is None else KVzip(budget=b),
                                    track_positions=b is not None)  # a basis fitted before RoPE needs them (§27.6)
            with torch.no_grad():
                last, _ = prefill(model, cache, prefix, tokenizer=tokenizer, last_only=True)
            for basis_ in bases:
                try:
                    size = save_cache(cache, path, model_config=model.config, codec=basis_, file_bytes=target,
                                      codec_settings=settings)
                except ValueError as exc:  # this budget's exact tokens alone overflow the target
                    errors.append(f"{b}: {exc}")
                    continue
                loaded, _ = load_cache(path, model_config=model.config, codec=basis_)
                with compress(model, loaded), torch.no_grad():
                    logits = forward_at(model, loaded, tail[:, :-1], prefix.shape[1])
                all_logits = torch.cat([last[:, -1:].float(), logits], dim=1)[0]
                measured.append((b, F.cross_entropy(all_logits, tail[0]).item(), size))
                used.append(basis_)
    if not measured:
        raise ValueError(f"no candidate budget fits a file ratio of {file_ratio:g}: {'; '.join(errors)}")
    i = min(range(len(measured)), key=lambda j: measured[j][1])
    return FilePlan(measured[i][0], float(file_ratio), measured, used[i], [_kind(u) for u in used])


__all__ = ["DEFAULT_FACTORS", "FilePlan", "candidate_budgets", "plan_file"]
