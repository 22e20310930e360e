"""``longgen``: a long continuation, teacher-forced one token per step over a bounded cache.

Each sample is a window of ``context`` tokens of the text (the windows of the ``ppl`` task): its
first ``context - continuation`` tokens are the prompt, prefilled into the method's cache inside
its context manager (as every task does), and the ``continuation`` tokens that follow are fed
**one per forward call** (:func:`kv_cache.context.forward_at`), so that a policy that evicts
while decoding (H2O, StreamingLLM) acts at every step, exactly as in a long generation. The
tokens fed are the text's (teacher forcing), so every method is scored on the same sequence:

* ``nll`` / ``ppl``: the mean NLL of the continuation tokens (the first one predicted by the
  prompt's last logits) and its exponential, the perplexity of the generated part;
  ``agreement``: the fraction of those positions whose arg-max token equals the full cache's;
* memory: :func:`~kv_cache.eval.accounting.held_nbytes` (the bytes of the tensors the cache
  really holds) after the prefill (step 0) and after every step. The sample keeps every
  ``memory_every``-th step (plus steps 0, 1 and the last) in ``memory``, and from all steps
  ``end_bytes``, ``max_bytes`` and ``growth``: the largest bytes over the second half of the
  steps over the bytes at the half-way step (1.0: memory flat once the budget is reached; the
  full cache grows by a third over its second half at 2K prompt + 2K continuation).

Budgets given as fractions (``h2o@0.25``) resolve against the prompt length, so the cache keeps
25% of the prompt's tokens for the whole generation.
"""

from __future__ import annotations

import math
import time
from typing import Any

import torch
import torch.nn.functional as F

from ..cache.report import fp16_kv_bytes
from ..generation import forward_at
from .accounting import held_nbytes
from .prefilled import prefill_method, sample_cost
from ..spec import REFERENCE_SPEC

TASK = "longgen"
MEMORY_EVERY = 64
"""Default step interval of the memory trace kept per sample (steps 0, 1 and the last are always kept)."""


def check_longgen(context: int, continuation: int) -> None:
    """Raise a clear error unless ``0 < continuation < context`` (the prompt is the rest)."""
    for name, value in (("context", context), ("continuation", continuation)):
        if isinstance(value, bool) or not isinstance(value, int):
            raise TypeError(f"{TASK}: {name} must be an int; got {type(value).__name__} {value!r}")
    if not 0 < continuation < context:
        raise ValueError(f"{TASK}: continuation must be in (0, context={context}) so the prompt "
                         f"(context - continuation tokens) and the generated part are both non-empty; "
                         f"got continuation={continuation}")


def _kept_steps(n_steps: int, every: int) -> list[int]:
    """Steps of the stored trace: 0 (after the prefill), 1, every ``every``-th, and the last."""
    return sorted({0, min(1, n_steps), n_steps, *range(every, n_steps, every)})


def memory_summary(step_bytes: list[int]) -> dict[str, Any]:
    """``end_bytes``, ``max_bytes`` and ``growth`` of held bytes per step (index 0: after the prefill).

    ``growth`` = the largest bytes over steps ``n // 2 .. n`` over the bytes at step ``n // 2``
    (``n`` = the last step): 1.0 when memory is flat over the second half of the generation.
    """
    if not step_bytes:
        raise ValueError("step_bytes must hold at least the bytes after the prefill; got an empty list")
    mid = (len(step_bytes) - 1) // 2
    return {"end_bytes": step_bytes[-1], "max_bytes": max(step_bytes),
            "growth": max(step_bytes[mid:]) / step_bytes[mid] if step_bytes[mid] else None}


def run_longgen_sample(model, method, sample, full_argmax: list[int] | None = None, tokenizer=None,
                       memory_every: int = MEMORY_EVERY) -> dict:
    """One long-generation sample (a :class:`~kv_cache.eval.tasks.PplSample`): prefill the
    prompt with ``method``'s cache, then feed the continuation one token per forward call.

    ``full_argmax``: the full cache's arg-max tokens of the same sample (None: no agreement).
    Returns the sample's results (see the module docstring).
    """

    if isinstance(memory_every, bool) or not isinstance(memory_every, int) or memory_every < 1:
        raise ValueError(f"memory_every must be an int >= 1 (steps between kept memory samples); got {memory_every!r}")
    prompt = torch.tensor([sample.prefix_ids])
    cont = list(sample.continuation_ids)
    if prompt.shape[1] < 1 or not cont:
        raise ValueError(f"{TASK} needs a non-empty prompt and continuation; got {prompt.shape[1]} prompt and "
                         f"{len(cont)} continuation tokens")
    p = prompt.shape[1]
    nll_sum, argmax, step_bytes = 0.0, [], []
    with torch.no_grad():
        pre = prefill_method(model, method, prompt, tokenizer, last_only=True)
        try:
            step_bytes.append(pre.kv_bytes)
            logits = pre.logits[0, -1].float()
            t0 = time.perf_counter()
            for i, target in enumerate(cont):
                nll_sum += float(F.cross_entropy(logits[None], torch.tensor([target])))
                argmax.append(int(logits.argmax()))
                if i == len(cont) - 1:
                    break  # the last token predicts nothing that is scored: it is not fed
                logits = forward_at(model, pre.cache, torch.tensor([[target]]), p + i)[0, -1]
                step_bytes.append(held_nbytes(pre.cache))
            dt = time.perf_counter() - t0
        finally:
            pre.scope.close()
    steps = len(step_bytes) - 1
    kept = _kept_steps(steps, memory_every)
    nll = nll_sum / len(cont)
    agreement = None if full_argmax is None else sum(a == b for a, b in zip(argmax, full_argmax)) / len(argmax)
    return {"index": sample.index, "nll": nll, "ppl": math.exp(nll), "agreement": agreement, "kl": None,
            "argmax": argmax, "kv_bytes": pre.kv_bytes, "fp16_bytes": fp16_kv_bytes(model.config, p),
            "prompt_tokens": p, "continuation_tokens": len(cont), "steps": steps,
            "memory": {"every": memory_every, "steps": kept, "bytes": [step_bytes[s] for s in kept]},
            **memory_summary(step_bytes),
            "decode_tokens_per_s": steps / dt if steps and dt > 0 else float("nan"), **sample_cost(pre)}


def _mean(xs: list[Any]) -> float | None:
    xs = [x for x in xs if x is not None]
    return sum(xs) / len(xs) if xs else None


def summarize_longgen(t: dict) -> None:
    """Add the memory summary of a ``longgen`` task entry: means over its samples of
    ``end_bytes``, ``max_bytes`` and ``growth`` (the ppl fields are the runner's)."""
    for key in ("end_bytes", "max_bytes", "growth"):
        t[key] = _mean([s.get(key) for s in t["samples"]])


def _fmt_bytes(n: float | None) -> str:
    from .report import fmt_bytes as fmt

    return fmt(n)


def longgen_table(doc: dict) -> str:
    """The ``longgen`` rows of a results document as Markdown (``""`` when it has none)."""
    rows = [(m, m["tasks"][TASK]) for m in doc["methods"].values() if m.get("tasks", {}).get(TASK)]
    if not rows:
        return ""
    full = doc["methods"].get(REFERENCE_SPEC, {}).get("tasks", {}).get(TASK, {})
    cfg = doc.get("config", {})
    head = ["method", "budget", "ppl (generated)", "Δppl vs full", "Δ%", "greedy agree", "bytes after prefill",
            "bytes at end", "max bytes", "max vs full", "growth, 2nd half", "decode tok/s"]
    lines = [f"Long generation (`{TASK}`): prompt of {_tokens(cfg, 'prompt')} tokens prefilled, then "
             f"{_tokens(cfg, 'continuation')} tokens fed one per step (teacher forcing):", "",
             "| " + " | ".join(head) + " |", "|" + "---|" * len(head)]
    for m, t in rows:
        sc, d, ref = t.get("score"), t.get("delta"), full.get("score")
        agree = t.get("agreement")
        mx, full_mx = t.get("max_bytes"), full.get("max_bytes")
        growth = t.get("growth")
        tps = _mean([s.get("decode_tokens_per_s") for s in t.get("samples", [])
                     if not math.isnan(s.get("decode_tokens_per_s", float("nan")))])
        n, want = len(t.get("samples", [])), cfg.get("samples")
        partial = f" (n={n})" if want and 0 < n < want else ""
        lines.append("| " + " | ".join([
            f"`{m['spec']}`" + partial, "-" if m.get("budget") is None else str(m["budget"]),
            "-" if sc is None else f"{sc:.3f}", "-" if d is None else f"{d:+.3f}",
            "-" if d is None or not ref else f"{100 * d / ref:+.2f}%", "-" if agree is None else f"{agree:.1%}",
            _fmt_bytes(t.get("kv_bytes")), _fmt_bytes(t.get("end_bytes")), _fmt_bytes(mx),
            "-" if mx is None or not full_mx else f"{mx / full_mx:.2f}x", "-" if growth is None else f"{growth:.2f}",
            "-" if tps is None else f"{tps:.1f}"]) + " |")
    lines.append("\nppl (generated) = exp(mean NLL) of the continuation tokens, each predicted with the cache as it "
                 "stands at that step; bytes = the sum of tensor nbytes the cache holds (after the prefill, after "
                 "the last step, and the largest over every step), means over samples; growth, 2nd half = largest "
                 "bytes over the second half of the steps / bytes at the half-way step (1.00: flat). Fractional "
                 "budgets resolve against the prompt length.")
    return "\n".join(lines)


def _tokens(cfg: dict, part: str) -> str:
    context, cont = cfg.get("context"), cfg.get("continuation")
    if not isinstance(context, int) or not isinstance(cont, int):
        return "?"
    return f"{(context - cont if part == 'prompt' else cont):,}"


def plot_memory(ax: Any, doc: dict) -> None:
    """Held bytes (MiB, mean over samples) against the decoding step, one line per method."""
    for m in doc["methods"].values():
        samples = m.get("tasks", {}).get(TASK, {}).get("samples", [])
        traces = [s["memory"] for s in samples if s.get("memory")]
        if not traces:
            continue
        steps = traces[0]["steps"]
        same = [tr["bytes"] for tr in traces if tr["steps"] == steps]
        mib = [sum(col) / len(col) / 2**20 for col in zip(*same)]
        peer = m.get("family", "ours") != "ours"
        ax.plot(steps, mib, marker="^" if peer else "o", markersize=3, lw=1.2, label=m["spec"],
                color="black" if m["spec"] == "full" else None)
    ax.set_xlabel("decoding step (tokens fed after the prompt)")
    ax.set_ylabel("KV bytes held (MiB)")
    ax.set_title(f"{TASK}: memory over the steps")
    ax.grid(True, alpha=0.3)
    ax.legend(fontsize=7)


__all__ = ["MEMORY_EVERY", "TASK", "check_longgen", "longgen_table", "memory_summary", "plot_memory",
           "run_longgen_sample", "summarize_longgen"]
