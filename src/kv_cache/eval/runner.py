"""Run a grid of methods x tasks on one model, on identical samples, with identical byte counting.

Every method sees the same token ids. Per sample the context (the prefix) is prefilled with the
method's cache (inside its context manager), the bytes the cache holds are counted right after
prefill with :func:`held_nbytes` (the sum of ``nbytes`` of every tensor reachable from the
cache's layers, quantized subclasses included), then:

* ``ppl``: the continuation is scored with teacher forcing against the compressed cache,
  ``ppl = exp(mean NLL)``; ``agreement`` is the fraction of continuation positions whose greedy
  (arg-max) token equals the full cache's; ``kl`` is the mean over continuation positions of
  ``KL(P_full || P_method)`` of the next-token distribution (:func:`next_token_kl`). The full
  cache's log-probabilities are too large for ``results.json``; they are kept in
  ``<out>/reference/ppl-<index>.safetensors`` (:class:`ReferenceLogProbs`);
* every task: ``bits_per_element = 16 * kv_bytes / fp16_bytes`` (:func:`bits_per_element`), the
  bytes held per K/V element of the context prefilled (tokens seen, so eviction counts in it);
* retrieval tasks: the question is appended and the answer decoded greedily, scored with
  :func:`kv_cache.eval.tasks.score_retrieval`; decode tokens/s are timed here, and the prefill
  cost (the method's prefill over a plain prefill of the same ids, :mod:`.prefill_cost`);
* ``longgen``: the continuation fed one token per step over the bounded cache (:mod:`.longgen`).

Positions are passed explicitly (``position_ids`` absolute, ``cache_position`` from the cache's
own length), so peers whose caches report the kept length after eviction decode correctly too.
"""

from __future__ import annotations

import hashlib
import json
import logging
import math
import os
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Callable

import torch
import torch.nn.functional as F

from ..cache.report import fp16_kv_bytes
from ..context import forward_at
from ..generation import SamplingParams, generate_tokens
from .accounting import held_nbytes, walked_nbytes  # noqa: F401  (re-exported: runner's public API)
from .longgen import TASK as LONGGEN, check_longgen, run_longgen_sample, summarize_longgen
from .metrics import ReferenceLogProbs, bits_per_element, next_token_kl
from ..spec import REFERENCE_SPEC, Method, MethodUnavailable, parse_methods
from .prefill_cost import plain_prefill_seconds, prefill_cost  # noqa: F401
from .prefilled import Prefilled, prefill_method, sample_cost  # noqa: F401 (Prefilled: re-exported)

_prefill, _cost = prefill_method, sample_cost  # the names longgen, lm-eval and benchmarks used before
from .tasks import (TASKS, TaskRequest, build_prompt, build_task, check_context_fits, perplexity_windows,
                    score_retrieval)

log = logging.getLogger(__name__)

TASK_ALIASES = {"needle": "niah_single", "multikey": "niah_multikey", "multivalue": "niah_multivalue",
                "multiquery": "niah_multiquery"}
KNOWN_TASKS = ("ppl", *TASKS, LONGGEN)
DECODE_TIMING_TOKENS = 8


SHIPPED_TEXT = Path(__file__).resolve().parent / "data" / "wikitext-2-test-excerpt.raw"
"""The first 240 KB of the wikitext-2 test split, shipped with the package (CC BY-SA 3.0, see
``data/SOURCE.txt``): the demo's text, and ``kvcache eval``'s where no shared data folder is."""


def default_text() -> Path:
    """The wikitext-2 test split of the shared data folder, else the excerpt shipped with the
    package (:data:`SHIPPED_TEXT`; a bare clone has no shared folder)."""
    from ..models import shared_data_dir

    try:
        path = shared_data_dir() / "wikitext-2-raw" / "wiki.test.raw"
    except FileNotFoundError:
        return SHIPPED_TEXT
    return path if path.is_file() else SHIPPED_TEXT


def resolve_task(name: str) -> str:
    """Map a task name or alias to its canonical name; unknown names list the known ones."""
    key = name.strip().lower()
    key = TASK_ALIASES.get(key, key)
    if key not in KNOWN_TASKS:
        raise ValueError(
            f"unknown task {name!r}; known tasks: {', '.join(KNOWN_TASKS)} "
            f"(aliases: {', '.join(f'{a}={t}' for a, t in TASK_ALIASES.items())})"
        )
    return key


def _greedy(model, cache, logits: torch.Tensor, pos: int, n: int, eos: set[int]) -> tuple[list[int], float]:
    """Greedy decode up to ``n`` tokens after ``logits`` ``[vocab]`` with the shared loop
    (:func:`kv_cache.generation.generate_tokens`, as ``CompressedContext.ask`` and the server):
    it stops before an ``eos`` token (not returned). Returns the tokens and decode tokens/s: the
    forward passes run (one per token fed back) over the time they took."""
    t0 = time.perf_counter()
    out = list(generate_tokens(model, cache, logits, pos, max_new_tokens=n, params=SamplingParams(), eos=eos))
    dt = time.perf_counter() - t0
    # Every yielded token is fed back except the last one of a full-length answer.
    steps = len(out) if len(out) < n else n - 1
    return out, (steps / dt if steps and dt > 0 else float("nan"))


def run_ppl_sample(model, method: Method, sample, full_argmax: list[int] | None,
                   reference: torch.Tensor | Callable[[], torch.Tensor] | None = None,
                   tokenizer=None) -> tuple[dict, torch.Tensor]:
    """One perplexity window: compressed prefix, teacher-forced continuation.

    ``reference`` is the full cache's log-probabilities ``[n, vocab]`` of this window (or a
    callable that returns them, called only once the method has run); None skips the KL.
    Returns the sample's results and its own log-probabilities ``[n, vocab]`` (float32).
    """
    prefix = torch.tensor([sample.prefix_ids])
    cont = torch.tensor([sample.continuation_ids])
    with torch.no_grad():
        # the last position's logits only: the T x vocab logits of a 16K window are ~10 GB (Qwen2.5)
        pre = prefill_method(model, method, prefix, tokenizer, last_only=True)
        try:
            logits = forward_at(model, pre.cache, cont[:, :-1], prefix.shape[1])
            all_logits = torch.cat([pre.logits[:, -1:], logits], dim=1)[0]  # predicts every continuation token
            nll = F.cross_entropy(all_logits, cont[0], reduction="mean").item()
            argmax = all_logits.argmax(-1).tolist()
            checks = pre.checks()
            _, tps = _greedy(model, pre.cache, all_logits[-1], prefix.shape[1] + cont.shape[1],
                             DECODE_TIMING_TOKENS, set())
        finally:
            pre.scope.close()
        # a plan that ran no reconstruction pass (evicting with KVzap): its prefill over a plain one
        plain_s = (plain_prefill_seconds(model, prefix, last_only=True)
                   if method.needs_tokenizer and pre.prefill_cost is None and not method.is_reference else None)
        # float32, as stored for the reference: the full cache's own KL is then exactly 0.
        log_probs = torch.log_softmax(all_logits.float(), dim=-1)
        ref = reference() if callable(reference) else reference
        kl = None if ref is None else float(next_token_kl(ref, log_probs).mean())
    agreement = None if full_argmax is None else sum(a == b for a, b in zip(argmax, full_argmax)) / len(argmax)
    return {"index": sample.index, "nll": nll, "ppl": math.exp(nll), "agreement": agreement, "kl": kl,
            "argmax": argmax, "kv_bytes": pre.kv_bytes, "fp16_bytes": fp16_kv_bytes(model.config, prefix.shape[1]),
            "decode_tokens_per_s": tps, **checks, **sample_cost(pre, plain_s)}, log_probs


def run_retrieval_sample(model, tok, method: Method, sample, query_aware: bool, max_new_tokens: int) -> dict:
    """One retrieval sample: compressed context, then question and greedy answer."""
    context_text, question_text = build_prompt(sample, tok, query_aware=query_aware)
    ctx_ids = tok(context_text, return_tensors="pt").input_ids
    q_ids = tok(question_text, return_tensors="pt", add_special_tokens=False).input_ids
    n_new = int(sample.metadata.get("max_new_tokens", max_new_tokens) or max_new_tokens)
    n_new = min(n_new, max_new_tokens)
    eos = {t for t in [tok.eos_token_id, getattr(model.generation_config, "eos_token_id", None)]
           if isinstance(t, int)}
    with torch.no_grad():
        # The reference is the plain prefill (cost 1); KVzip times its own pass (Prefilled.prefill_cost).
        plain_s = None if method.is_reference or method.needs_tokenizer else plain_prefill_seconds(model, ctx_ids)
        pre = prefill_method(model, method, ctx_ids, tok)
        plain_s = pre.prefill_s if method.is_reference else plain_s
        try:
            logits = forward_at(model, pre.cache, q_ids, ctx_ids.shape[1])
            out, tps = _greedy(model, pre.cache, logits[0, -1], ctx_ids.shape[1] + q_ids.shape[1], n_new, eos)
        finally:
            pre.scope.close()
        if plain_s is None and pre.prefill_cost is None and not method.is_reference:
            plain_s = plain_prefill_seconds(model, ctx_ids)  # a plan that ran no reconstruction pass (KVzap)
    prediction = tok.decode(out, skip_special_tokens=True)
    return {"index": sample.metadata.get("index", 0), "prediction": prediction, "expected": list(sample.expected),
            "score": score_retrieval(prediction, sample.expected), "depth": sample.depth,
            "kv_bytes": pre.kv_bytes, "fp16_bytes": fp16_kv_bytes(model.config, ctx_ids.shape[1]),
            "context_tokens": int(ctx_ids.shape[1]), "decode_tokens_per_s": tps,
            **pre.checks(), **sample_cost(pre, plain_s)}


def _option(default: Any, help_text: str) -> Any:
    """A field of :class:`EvalConfig`: its default and its help (``kvcache eval --help`` shows both)."""
    if isinstance(default, list):
        return field(default_factory=default.copy, metadata={"help": help_text})
    return field(default=default, metadata={"help": help_text})


EVAL_DTYPES = ("float32", "bfloat16", "float16")
"""Model dtypes ``kvcache eval --dtype`` loads."""


@dataclass
class EvalConfig:
    """Everything that defines a run (and decides whether saved samples can be reused).

    The defaults are ``kvcache eval``'s, and each field's ``metadata["help"]`` is its option's
    help. ``text`` None (or empty) is the wikitext-2 test split in the shared data folder.
    """

    model: str = _option("smollm2", "alias (smollm2, stories260K), local HF directory, .gguf file or hub id")
    dtype: str = _option("float32", "model dtype: float32, bfloat16 or float16 (the cache keeps it; statistics "
                                    "stay float32)")
    text: str | None = _option(None, "haystack / perplexity text file [wikitext-2 test from ../shared/data, else "
                                     "the excerpt shipped with the package]")
    tasks: list[str] = _option(["ppl"], "comma-separated tasks")
    methods: list[str] = _option(["full", "q4"], "comma-separated method specs")
    samples: int = _option(8, "samples per task")
    context: int = _option(2048, "context length in tokens")
    continuation: int = _option(256, "ppl: tokens scored after the compressed prefix; longgen: tokens fed one per "
                                     "step (teacher forcing) after the context - continuation tokens of the "
                                     "compressed prefix")
    query_aware: bool = _option(False, "retrieval: compress the question together with the context, so "
                                       "compression can see it")
    haystack: str = _option("text", "retrieval haystack")
    seed: int = _option(0, "task seed")
    max_new_tokens: int = _option(32, "retrieval answer length cap")
    depths: list[float] | None = _option(None, "retrieval: comma-separated needle depths in [0, 1], sample i "
                                               "uses depths[i % len]; default: a seeded random depth per sample")

    def __post_init__(self) -> None:
        if self.dtype not in EVAL_DTYPES:
            raise ValueError(f"dtype must be one of {list(EVAL_DTYPES)}; got {self.dtype!r}")
        if not self.text:
            self.text = str(default_text())

    def fingerprint(self, text_sha: str) -> str:
        d = {k: getattr(self, k) for k in ("model", "samples", "context", "continuation", "query_aware",
                                            "haystack", "seed", "max_new_tokens")}
        if self.query_aware:  # the question now ends the compressed part (it preceded the context before)
            d["query_layout"] = "question-last"
        if self.depths is not None:  # absent from runs that drew depths at random
            d["depths"] = list(self.depths)
        if self.dtype != "float32":  # absent from the float32 runs that predate the option
            d["dtype"] = self.dtype
        d["text_sha256"] = text_sha
        return hashlib.sha256(json.dumps(d, sort_keys=True).encode()).hexdigest()[:16]


def check_out_dir(out: str | os.PathLike[str]) -> Path:
    """Create ``out`` and check it is writable; raise a clear error otherwise."""
    path = Path(out)
    try:
        path.mkdir(parents=True, exist_ok=True)
        probe = path / ".kvcache_write_test"
        probe.write_text("ok")
        probe.unlink()
    except OSError as exc:
        raise PermissionError(f"output directory {str(path)!r} is not writable: {exc.strerror or exc}") from exc
    return path


def _atomic_write(path: Path, text: str) -> None:
    tmp = path.with_suffix(path.suffix + ".tmp")
    tmp.write_text(text)
    os.replace(tmp, path)


def run_eval(cfg: EvalConfig, out: str | os.PathLike[str], *, model=None, tokenizer=None,
             progress: Callable[[int, str], Any] | None = None) -> dict:
    """Run ``cfg`` and write ``out/results.json`` (updated after every sample; reused on restart).

    Returns
    -------
    dict
        The results document (see ``results.json``).
    """
    from ..models import load_model
    from .tasks import read_text

    out_dir = check_out_dir(out)
    tasks = [resolve_task(t) for t in cfg.tasks]
    # The reference runs first: every delta and greedy agreement is measured against it.
    methods, skipped = parse_methods(cfg.methods)
    for why in skipped.values():
        log.warning("skipping %s", why)
    text = read_text(cfg.text)
    text_sha = hashlib.sha256(text.encode()).hexdigest()
    if model is None:
        model, tokenizer = load_model(cfg.model, dtype=cfg.dtype)
    max_pos = int(getattr(model.config, "max_position_embeddings", 0) or 0)
    if max_pos:
        check_context_fits(cfg.context, max_pos, max_new_tokens=cfg.max_new_tokens)

    samples: dict[str, list] = {}
    for task in tasks:
        if task == LONGGEN:
            check_longgen(cfg.context, cfg.continuation)
        if task in ("ppl", LONGGEN):
            if not 0 < cfg.continuation < cfg.context:
                raise ValueError(f"continuation must be in (0, context={cfg.context}); got {cfg.continuation}")
            samples[task] = perplexity_windows(tokenizer, text, context=cfg.context,
                                               prefix_len=cfg.context - cfg.continuation, num_windows=cfg.samples)
        else:
            request = TaskRequest(tokenizer, text if cfg.haystack == "text" else None, context=cfg.context,
                                  num_samples=cfg.samples, depths=cfg.depths, seed=cfg.seed,
                                  haystack=cfg.haystack, query_aware=cfg.query_aware)
            samples[task] = build_task(task, request)

    fp = cfg.fingerprint(text_sha)
    results_path = out_dir / "results.json"
    doc: dict[str, Any] = {"config": {**cfg.__dict__, "text_sha256": text_sha, "fingerprint": fp},
                           "skipped": skipped, "methods": {}}
    if results_path.exists():
        try:
            old = json.loads(results_path.read_text())
            if old.get("config", {}).get("fingerprint") == fp:
                doc["methods"] = old.get("methods", {})
        except (OSError, json.JSONDecodeError):
            log.warning("ignoring unreadable %s", results_path)

    total = len(methods) * sum(len(v) for v in samples.values())
    done_count = 0
    full_argmax: dict[tuple[str, int], list[int]] = {}  # (task, sample) -> the reference's arg-max tokens
    reference = next(m for m in methods if m.is_reference)
    ref_store = ReferenceLogProbs(out_dir / "reference", fp, reference.resolved)

    def reference_log_probs(i: int) -> torch.Tensor:
        """The full cache's log-probabilities of ppl window ``i``: saved, or recomputed and saved."""
        sample = samples["ppl"][i]
        lp = ref_store.load(i, len(sample.continuation_ids))
        if lp is None:
            log.warning("reference log-probabilities of ppl window %d not in %s; recomputing them with %s",
                        i, ref_store.directory, reference.spec)
            _, lp = run_ppl_sample(model, reference, sample, None)
            ref_store.save(i, lp)
        return lp

    # the prompt a plan is built for (a preset chooses its scorer by it): a ppl window's prefix
    prompt = cfg.context - cfg.continuation if 0 < cfg.continuation < cfg.context else cfg.context
    for method in methods:
        entry = doc["methods"].get(method.spec)
        plan = _plan_fingerprint(model, method, prompt)
        if entry is not None and plan is not None and "plan" in entry:
            same, was, now = entry["plan"] == plan, f"plan {entry['plan']}", f"plan {plan}"
        elif entry is not None:  # a peer, or a row saved before plans: by its resolved settings
            same, was, now = entry.get("resolved") == method.resolved, entry.get("resolved"), method.resolved
        if entry is not None and not same:
            log.info("%s: settings changed (%s -> %s); its saved samples are not reused", method.spec, was, now)
            entry = None
        if entry is None:
            entry = doc["methods"][method.spec] = {
                "spec": method.spec, "family": method.family, "bits": method.bits, "budget": method.budget,
                "resolved": method.resolved, "tasks": {}}
            if plan is not None:
                entry["plan"] = plan
        entry.pop("error", None)
        for task in tasks:
            tentry = entry["tasks"].setdefault(task, {"metric": "ppl" if task in ("ppl", LONGGEN) else "accuracy",
                                                      "samples": []})
            finished = {s["index"]: s for s in tentry["samples"]}
            for i, sample in enumerate(samples[task]):
                if i in finished:
                    if task in ("ppl", LONGGEN) and method.is_reference:
                        full_argmax[task, i] = finished[i]["argmax"]
                    done_count += 1
                    if progress:
                        progress(1, f"{method.spec} {task} (cached)")
                    continue
                try:
                    if task == "ppl":
                        if method.is_reference:
                            res, log_probs = run_ppl_sample(model, method, sample, None)
                            res["kl"] = float(next_token_kl(log_probs, log_probs).mean())  # 0: the check
                            ref_store.save(i, log_probs)
                            full_argmax[task, i] = res["argmax"]
                        else:
                            res, _ = run_ppl_sample(model, method, sample, full_argmax.get((task, i)),
                                                    tokenizer=tokenizer, reference=lambda i=i: reference_log_probs(i))
                        res["index"] = i
                    elif task == LONGGEN:
                        res = run_longgen_sample(model, method, sample, full_argmax.get((task, i)), tokenizer)
                        if method.is_reference:
                            full_argmax[task, i] = res["argmax"]
                    else:
                        res = run_retrieval_sample(model, tokenizer, method, sample, cfg.query_aware,
                                                   cfg.max_new_tokens)
                        res["index"] = i
                except MethodUnavailable as exc:
                    entry["error"] = str(exc)
                    break
                except Exception as exc:  # a peer that crashes must not lose the other results
                    if method.family == "ours":
                        raise
                    log.warning("%s failed on %s: %s", method.spec, task, exc)
                    entry["error"] = f"{type(exc).__name__}: {exc}"
                    break
                tentry["samples"].append(res)
                done_count += 1
                _summarize(entry, doc["methods"].get(REFERENCE_SPEC))
                _atomic_write(results_path, json.dumps(doc, indent=1))
                if progress:
                    progress(1, f"{method.spec} {task}")
            if "error" in entry:
                break
        _summarize(entry, doc["methods"].get(REFERENCE_SPEC))
    # Rows in the order asked for, then any kept from earlier runs of the same configuration.
    order = [m.spec for m in methods if m.spec in doc["methods"]]
    doc["methods"] = {k: doc["methods"][k] for k in order + [k for k in doc["methods"] if k not in order]}
    for entry in doc["methods"].values():
        _summarize(entry, doc["methods"].get(REFERENCE_SPEC))
    _atomic_write(results_path, json.dumps(doc, indent=1))
    log.info("%d/%d samples done", done_count, total)
    return doc


def _plan_fingerprint(model, method: Method, prompt_tokens: int | None = None) -> str | None:
    """The fingerprint of the cache plan one of our methods builds for this model
    (:class:`kv_cache.plan.CachePlan`): a run resumes a method's saved samples only when it is
    unchanged. None for peers and the reference (they resume by ``Method.resolved``)."""
    from ..cache import CompressedCache
    from ..plan import CachePlan

    if method.family != "ours" or method.is_reference:
        return None
    cache, _ = method.build(model, prompt_tokens)
    if not isinstance(cache, CompressedCache):
        return None
    plan = cache.plan if cache.plan is not None else CachePlan.uniform(model.config, cache.quant, cache.eviction)
    return plan.fingerprint


def _mean(xs: list[float]) -> float | None:
    xs = [x for x in xs if x is not None and not (isinstance(x, float) and math.isnan(x))]
    return sum(xs) / len(xs) if xs else None


def _summarize(entry: dict, full: dict | None) -> None:
    """Fill the per-method summary fields from its samples."""
    all_samples = [s for t in entry["tasks"].values() for s in t["samples"]]
    entry["kv_bytes"] = _mean([s["kv_bytes"] for s in all_samples])
    entry["fp16_bytes"] = _mean([s["fp16_bytes"] for s in all_samples])
    entry["ratio"] = (entry["fp16_bytes"] / entry["kv_bytes"]) if entry["kv_bytes"] else None
    # Means of equal-count lists, so this is all bytes held / all elements represented.
    entry["bits_per_element"] = bits_per_element(entry["kv_bytes"], entry["fp16_bytes"])
    entry["decode_tokens_per_s"] = _mean([s.get("decode_tokens_per_s") for s in all_samples])
    errors = [s["attention_error"] for s in all_samples if s.get("attention_error") is not None]
    entry["attention_error"] = max(errors) if errors else None  # the fidelity check, worst layer and sample
    shares = [s["evicted_attention"] for s in all_samples if s.get("evicted_attention") is not None]
    entry["evicted_attention"] = max(shares) if shares else None  # the eviction check, worst sample
    costs = [s["prefill_cost"] for s in all_samples if s.get("prefill_cost") is not None]
    if costs:  # samples that measured it (retrieval; KVzip's own pass in every task)
        entry["prefill_cost"] = _mean(costs)
    for name, t in entry["tasks"].items():
        if t["metric"] == "ppl":
            nll = _mean([s["nll"] for s in t["samples"]])
            t["score"] = math.exp(nll) if nll is not None else None
            t["agreement"] = _mean([s["agreement"] for s in t["samples"]])
            # Every window scores the same number of positions: the mean over windows is the mean
            # over all positions. Samples saved before KL existed have none (old results.json).
            kls = [s["kl"] for s in t["samples"] if s.get("kl") is not None]
            t["kl"] = _mean(kls)
            t["kl_samples"] = len(kls)
            ref = (full or {}).get("tasks", {}).get(name, {}).get("score")
            t["delta"] = (t["score"] - ref) if (t["score"] is not None and ref is not None) else None
            if name == LONGGEN:
                summarize_longgen(t)
        else:
            t["score"] = _mean([s["score"] for s in t["samples"]])
        t["kv_bytes"] = _mean([s["kv_bytes"] for s in t["samples"]])
        t["bits_per_element"] = bits_per_element(t["kv_bytes"], _mean([s["fp16_bytes"] for s in t["samples"]]))


__all__ = ["EvalConfig", "KNOWN_TASKS", "TASK_ALIASES", "ReferenceLogProbs", "bits_per_element", "check_out_dir",
           "held_nbytes", "next_token_kl", "walked_nbytes", "resolve_task", "run_eval"]
