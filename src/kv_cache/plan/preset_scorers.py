"""Which eviction scores a preset uses on a model: KVzip, or KVzap where it measured as well.

KVzip's scores need a second pass over the context (its repeat chunks, math dictionary §19.3):
the presets that evict with it prefill at 2.4-3x a plain prefill. KVzap's learned scores come
from the prefill's own pass (1.0x, §24). Each ranks tokens differently, so a preset evicts with
KVzap on a model only where KVzap was measured, on calibration text (never an evaluation text),
to cost no more than KVzip there (:func:`choose`), and the measurement is shipped with the
package next to the model's KVzap scorer (:data:`RECORD`, written by ``kvcache preset-scorers``).

* :func:`measure` builds each preset with both scorers (:func:`~kv_cache.plan.planner.preset_plan`'s
  ``scorer=``), runs both over the same calibration windows
  (:func:`~kv_cache.plan.measure.continuation_cost`) and returns the record's entry;
* :func:`choose` is the rule: KVzap where its perplexity over the full cache's is within
  :data:`TOLERANCE` of KVzip's and neither the fidelity nor the eviction check warned on it;
* :func:`preset_scorer` reads the record for a model: the scorer chosen at the measured ratio
  nearest to the one asked (on a log scale), ``"kvzip"`` for a model with no entry or no shipped
  scorer; :func:`model_preset_plan` is the preset built with it, what every caller holding a
  model runs (``kvcache eval``'s ``<r>x``, the server, ``kvcache compress --ratio``);
* where a preset evicts heavily (4-bit codes would keep under a quarter of the tokens,
  :func:`~kv_cache.plan.planner.heavy_evicting`), :func:`measure` also measures each of
  :data:`~kv_cache.plan.planner.HEAVY_LAYOUTS` with the chosen scorer and records the one of lower
  perplexity (:func:`choose_layout`); :func:`preset_layout` reads it and :func:`model_preset_plan`
  evicts from it (Qwen2.5's ``16x``: K3V2 codes keeping 36% where K4V3 keeps 26%);
* a row may name the scorer file it was measured with (:func:`merge_entry`, :func:`scorer_file`):
  each preset then evicts with the scorer that passed for it (Qwen2.5: the linear scorer at
  ``4x``, the per-head static score at ``8x``).
"""

from __future__ import annotations

import json
import math
import os
import tempfile
import time
from pathlib import Path
from typing import Any, Sequence

from ..compression.scorer_file import model_identity
from ..policies.kvzap import SCORERS_DIR, SHIPPED, KVzap, fitted_on, shipped_scorer

RECORD = SCORERS_DIR / "presets.json"
"""The shipped measurements: one entry per model (matched by its identity, as the scorer files)."""

FORMAT = 1
TOLERANCE = 0.003
"""How much higher KVzap's continuation perplexity (over the full cache's) may be than KVzip's on
the calibration windows for a preset to use it: 0.3 points, the tolerance the presets' quality
is held to when the way they evict changes."""

MEASURED_TARGETS = ("4x", "8x", "16x")
"""The presets, each of which evicts at 4K tokens on an all-global model (``4x`` keeps about 79%:
4-bit codes alone hold about 3.5x)."""


def choose(kvzip: dict[str, Any], kvzap: dict[str, Any]) -> str:
    """``"kvzap"`` or ``"kvzip"`` from two :func:`~kv_cache.plan.measure.continuation_cost` results
    of the same preset on the same windows (see :data:`TOLERANCE`)."""
    for name, cost in (("kvzip", kvzip), ("kvzap", kvzap)):
        missing = [k for k in ("delta_ppl", "warned") if k not in cost]
        if missing:
            raise ValueError(f"the {name} cost lacks {missing}; pass continuation_cost()'s result")
    if kvzap["warned"]:
        return "kvzip"
    return "kvzap" if kvzap["delta_ppl"] <= kvzip["delta_ppl"] + TOLERANCE else "kvzip"


def measure(model: Any, tokenizer: Any, calibration_text: str, *, source: str,
            targets: Sequence[str] = MEASURED_TARGETS, context_tokens: int = 4096, continuation: int = 256,
            windows: int = 2, scorer_path: str | os.PathLike | None = None, prior: dict[str, Any] | None = None,
            progress=None) -> dict[str, Any]:
    """The record's entry for ``model``: every preset of ``targets`` built with each scorer and
    measured on the same windows of ``calibration_text`` (``source`` names it in the entry).
    ``scorer_path``: KVzap's scorer file (None: the one shipped for the model); the record is then
    kept in the same directory (:func:`preset_scorer` looks for it there).

    ``prior``: an earlier entry for the same model (:func:`read_record`). KVzip's half of a
    preset does not depend on KVzap's scorer, so where ``prior`` was measured on the same model,
    text, windows and sizes and its KVzip plan has the same fingerprint as this one, its KVzip cost
    is taken over (the row says ``"kvzip_reused": true``) and only KVzap runs: a new scorer is
    compared at a third of the time. Anything else in ``prior`` is ignored.

    Returns ``{"model": identity, "scorer_file", "calibration": {...}, "targets": {target:
    {"kvzip": cost, "kvzap": cost, "seconds": {...}, "scorer": choice}}}`` where each cost holds the
    mean KL, the perplexity over the full cache's and the checks' figures, and ``seconds`` the
    time each took over the windows (prefill, eviction and the scored continuation).
    """
    from .measure import calibration_windows, continuation_cost, reference_log_probs
    from .planner import heavy_evicting, parse_target, preset_plan

    identity = model_identity(model)
    path = shipped_scorer(identity) if scorer_path is None else Path(scorer_path)
    if path is None:
        raise ValueError(f"no KVzap scorer is shipped for this model ({identity['model_type']}, "
                         f"{identity['num_layers']} layers): fit one with `kvcache calibrate-scorer` into "
                         f"{SCORERS_DIR} first; until then the presets evict with KVzip")
    KVzap(scorer=str(path)).bind(model)  # refuses a scorer fitted on another model, naming the fix
    names = [f"{parse_target(t):g}x" for t in targets]
    if not names:
        raise ValueError("targets must name at least one preset, e.g. ['8x', '16x']")
    wins = calibration_windows(tokenizer, calibration_text, context_tokens, continuation, windows)
    reference = reference_log_probs(model, tokenizer, wins, context_tokens)
    dtype = next(model.parameters()).dtype
    calibration = {"text": source, "windows": len(wins), "context_tokens": context_tokens,
                   "continuation": continuation, "tolerance": TOLERANCE}
    same = prior is not None and prior.get("model") == identity and \
        not _window_changes(prior, {"calibration": calibration})
    reusable = prior.get("targets", {}) if same else {}
    out: dict[str, Any] = {}
    for name in names:
        row: dict[str, Any] = {"seconds": {}}
        for scorer in ("kvzip", "kvzap"):
            plan = preset_plan(model.config, name, context_tokens=context_tokens, dtype=dtype, scorer=scorer,
                               scorer_path=None if scorer_path is None else str(path))
            old = reusable.get(name, {})
            if scorer == "kvzip" and old.get("kvzip", {}).get("fingerprint") == plan.fingerprint:
                row["kvzip"] = dict(old["kvzip"])
                row["seconds"]["kvzip"] = old.get("seconds", {}).get("kvzip")
                row["kvzip_reused"] = True
                if progress is not None:
                    progress(name, scorer, row[scorer])
                continue
            t0 = time.perf_counter()
            cost = continuation_cost(model, tokenizer, plan, wins, context_tokens, reference)
            row["seconds"][scorer] = round(time.perf_counter() - t0, 2)
            row[scorer] = {**cost, "budget": None if plan.policy is None else plan.policy.budget,
                           "fingerprint": plan.fingerprint}
            if progress is not None:
                progress(name, scorer, row[scorer])
        if row["kvzip"]["budget"] is None:  # the preset evicts nothing here: there is no scorer to choose
            row["scorer"] = "kvzip"
        else:
            row["scorer"] = choose(row["kvzip"], row["kvzap"])
        if heavy_evicting(model.config, name, context_tokens=context_tokens, dtype=dtype):
            _measure_heavy_layouts(row, model, tokenizer, name, wins, context_tokens, reference, dtype,
                                   None if scorer_path is None else str(path), progress)
        out[name] = row
    return {"model": identity, "scorer_file": path.name, "calibration": calibration, "targets": out}


def _measure_heavy_layouts(row: dict[str, Any], model: Any, tokenizer: Any, name: str, wins: Any,
                           context_tokens: int, reference: Any, dtype: Any, scorer_path: str | None,
                           progress) -> None:
    """Fill ``row["layouts"]`` and ``row["layout"]`` for a preset that evicts heavily: each of
    :data:`~kv_cache.plan.planner.HEAVY_LAYOUTS` with the scorer chosen for the row, measured on the
    same windows; the layout is :data:`~kv_cache.plan.planner.HEAVY_LAYOUT` unless another one's
    perplexity is lower with both checks quiet (:func:`choose_layout`)."""
    from .measure import continuation_cost
    from .planner import HEAVY_LAYOUT, HEAVY_LAYOUTS, preset_plan

    scorer = row["scorer"]
    costs: dict[str, Any] = {}
    for n in dict.fromkeys((HEAVY_LAYOUT, *HEAVY_LAYOUTS)):
        plan = preset_plan(model.config, name, context_tokens=context_tokens, dtype=dtype, scorer=scorer,
                           scorer_path=scorer_path if scorer == "kvzap" else None, heavy_layout=n)
        if plan.fingerprint == row[scorer]["fingerprint"]:  # the preset measured above: not run twice
            costs[n] = row[scorer]
            continue
        t0 = time.perf_counter()
        cost = continuation_cost(model, tokenizer, plan, wins, context_tokens, reference)
        row["seconds"][f"{scorer}+{n}"] = round(time.perf_counter() - t0, 2)
        costs[n] = {**cost, "budget": None if plan.policy is None else plan.policy.budget,
                    "fingerprint": plan.fingerprint}
        if progress is not None:
            progress(name, f"{scorer}+{n}", costs[n])
    row["layouts"] = costs
    row["layout"] = choose_layout(costs)


def choose_layout(costs: dict[str, dict[str, Any]]) -> str:
    """The heavy layout a preset records from the costs of each (:func:`_measure_heavy_layouts`):
    :data:`~kv_cache.plan.planner.HEAVY_LAYOUT` unless another layout's perplexity over the full
    cache's is lower and neither check warned on it."""
    from .planner import CANDIDATE_LAYOUTS, HEAVY_LAYOUT

    bad = [n for n in costs if n not in CANDIDATE_LAYOUTS]
    if bad or HEAVY_LAYOUT not in costs:
        raise ValueError(f"costs must name layouts among {list(CANDIDATE_LAYOUTS)}, {HEAVY_LAYOUT!r} included; "
                         f"got {list(costs)}")
    best = HEAVY_LAYOUT
    for n, cost in costs.items():
        if not cost["warned"] and cost["delta_ppl"] < costs[best]["delta_ppl"]:
            best = n
    return best


def read_record(path: str | os.PathLike = RECORD) -> list[dict[str, Any]]:
    """The entries of a record file (none when the file does not exist); raises on a malformed one."""
    path = Path(path)
    if not path.is_file():
        return []
    data = json.loads(path.read_text())
    if not isinstance(data, dict) or data.get("format") != FORMAT or not isinstance(data.get("entries"), list):
        raise ValueError(f"{path}: not a preset-scorer record of format {FORMAT} "
                         "(rewrite it with `kvcache preset-scorers`)")
    return data["entries"]


def _window_changes(a: dict[str, Any], b: dict[str, Any]) -> list[str]:
    """The calibration settings (text, windows, sizes) in which entries ``a`` and ``b`` differ."""
    keys = ("text", "windows", "context_tokens", "continuation")
    return [k for k in keys if a.get("calibration", {}).get(k) != b.get("calibration", {}).get(k)]


def merge_entry(old: dict[str, Any], new: dict[str, Any]) -> dict[str, Any]:
    """``old`` with ``new``'s targets added or replaced, each row naming the scorer file it was
    measured with (``scorer_file``): a preset may then use the scorer that measured best for it
    (e.g. the linear scorer at ``4x``, the per-head static score at ``8x``). The entry's own
    ``scorer_file`` stays ``old``'s. Both must be of the same model and calibration windows.

    Raises ``ValueError`` otherwise, naming what differs."""
    if old.get("model") != new.get("model"):
        raise ValueError("merging preset-scorer entries of two different models; measure the model's presets anew")
    diff = _window_changes(old, new)
    if diff:
        raise ValueError(f"the entries were measured on different calibration windows ({', '.join(diff)} differ): "
                         "measure every preset on the same text, windows and sizes, or write a new entry")
    targets = {t: {"scorer_file": old.get("scorer_file"), **row} for t, row in old.get("targets", {}).items()}
    targets.update({t: {**row, "scorer_file": new.get("scorer_file")} for t, row in new.get("targets", {}).items()})
    return {**old, "targets": targets}


def write_entry(entry: dict[str, Any], path: str | os.PathLike = RECORD, *, merge: bool = False) -> Path:
    """Add ``entry`` to the record (replacing the one of the same model; ``merge``: merged into it
    with :func:`merge_entry`), written atomically."""
    path = Path(path)
    if merge:
        old = next((e for e in read_record(path) if e.get("model") == entry["model"]), None)
        entry = entry if old is None else merge_entry(old, entry)
    entries = [e for e in read_record(path) if e.get("model") != entry["model"]] + [entry]
    fd, tmp = tempfile.mkstemp(dir=path.parent, suffix=".tmp")
    with os.fdopen(fd, "w") as f:
        json.dump({"format": FORMAT, "entries": entries}, f, indent=1, sort_keys=True)
        f.write("\n")
    os.replace(tmp, path)
    return path


def _chosen(model: Any, target: Any, record: str | os.PathLike,
            prompt_tokens: int | None = None) -> tuple[str, Path | None, str | None]:
    """``(scorer, scorer file, heavy layout)`` for ``target`` on ``model`` (see :func:`preset_scorer`
    and :func:`preset_layout`)."""
    from .planner import CANDIDATE_LAYOUTS, parse_target

    ratio = parse_target(target)
    if prompt_tokens is not None and (isinstance(prompt_tokens, bool) or not isinstance(prompt_tokens, int)
                                      or prompt_tokens < 1):
        raise ValueError(f"prompt_tokens must be a positive int or None; got {prompt_tokens!r}")
    identity = model_identity(model)
    entry = next((e for e in read_record(record) if e.get("model") == identity), None)
    if entry is None or not entry.get("targets"):
        return "kvzip", None, None
    if prompt_tokens is None:
        from .planner import default_context
        prompt_tokens = default_context(model.config)  # what a preset is sized for by default
    if prompt_tokens < calibrated_context(entry):
        return "kvzip", None, None  # shorter than measured: at 1,024 tokens KVzap's 8x lost 1.6 points (make demo)
    nearest = min(entry["targets"], key=lambda t: abs(math.log(parse_target(t) / ratio)))
    row = entry["targets"][nearest]
    scorer = row.get("scorer")
    if scorer not in ("kvzip", "kvzap"):
        raise ValueError(f"{record}: the {nearest} entry names scorer {scorer!r}; expected 'kvzip' or 'kvzap'")
    layout = row.get("layout")
    if layout is not None and layout not in CANDIDATE_LAYOUTS:
        raise ValueError(f"{record}: the {nearest} entry names layout {layout!r}; expected one of "
                         f"{list(CANDIDATE_LAYOUTS)}")
    if scorer == "kvzip":
        return "kvzip", None, layout
    path = scorer_file(record, entry, nearest)
    if path is None or not fitted_on(path, identity):
        return "kvzip", None, None  # the measured scorer is not beside the record (or not this model's)
    return scorer, path, layout


def scorer_file(record: str | os.PathLike, entry: dict[str, Any], target: str) -> Path | None:
    """The KVzap scorer file ``target``'s row of ``entry`` was measured with: the row's own
    ``scorer_file`` (a path relative to the record's directory, at or below it) or else the
    entry's; None when it names none or a path outside the record's directory."""
    name = entry["targets"].get(target, {}).get("scorer_file") or entry.get("scorer_file")
    if not isinstance(name, str) or not name:
        return None
    root = Path(record).resolve().parent
    path = (root / name).resolve()
    return path if root in path.parents else None


def calibrated_context(entry: dict[str, Any]) -> int:
    """The context length (tokens) an entry's choices were measured at: the shortest prompt they
    hold for (a shorter prompt evicts with KVzip; math dictionary §23.5)."""
    n = entry.get("calibration", {}).get("context_tokens")
    if isinstance(n, bool) or not isinstance(n, int) or n < 1:
        raise ValueError(f"a preset-scorer entry must name its calibration context_tokens (a positive int); got {n!r} "
                         "(rewrite the record with `kvcache preset-scorers`)")
    return n


def preset_scorer(model: Any, target: Any, record: str | os.PathLike = RECORD, *,
                  prompt_tokens: int | None = None) -> str:
    """The eviction scorer (``"kvzip"`` or ``"kvzap"``) a preset of ``target`` uses on ``model``
    for a prompt of ``prompt_tokens`` tokens (None: the context a preset is sized for by default,
    4,096 tokens or half the model's positions): the one chosen at the recorded
    ratio nearest to ``target`` (log scale) for this model; ``"kvzip"`` when the record holds no
    entry for it, its scorer file is not beside the record, or the prompt is shorter than the
    calibration windows' context (the choice was not measured there)."""
    return _chosen(model, target, record, prompt_tokens)[0]


def preset_layout(model: Any, target: Any, record: str | os.PathLike = RECORD, *,
                  prompt_tokens: int | None = None) -> str | None:
    """The layout a preset of ``target`` evicts from on ``model`` where it evicts heavily (a
    :data:`~kv_cache.plan.planner.CANDIDATE_LAYOUTS` name), as recorded at the ratio nearest to
    ``target`` with the scorer :func:`preset_scorer` returns; None (the planner's
    :data:`~kv_cache.plan.planner.HEAVY_LAYOUT`) when the record names none, the prompt is shorter
    than the calibration windows' context, or the recorded scorer is not available."""
    return _chosen(model, target, record, prompt_tokens)[2]


def model_preset_plan(model: Any, target: Any, *, context_tokens: int | None = None,
                      prompt_tokens: int | None = None, record: str | os.PathLike = RECORD):
    """:func:`~kv_cache.plan.planner.preset_plan` for ``model`` in its dtype, sized for
    ``context_tokens``, evicting with the scorer :func:`preset_scorer` reads for it at
    ``prompt_tokens`` (default: ``context_tokens``, or the plan's default context when both are
    None). What ``kvcache eval``'s ``<r>x`` (sized for the default context, chosen for each
    prompt), the server's presets and ``kvcache compress --ratio`` run. With the shipped record
    the plan names no scorer file (KVzap finds the shipped one); with another record, the file
    beside it."""
    from .planner import preset_plan

    scorer, path, layout = _chosen(model, target, record, context_tokens if prompt_tokens is None else prompt_tokens)
    name = None
    if scorer == "kvzap" and path is not None:
        if Path(record).resolve() != RECORD.resolve():
            name = str(path)
        elif shipped_scorer(model_identity(model)) != path:  # not the one KVzap() finds by itself
            name = SHIPPED + path.relative_to(SCORERS_DIR.resolve()).as_posix()  # install-independent
    return preset_plan(model.config, target, context_tokens=context_tokens, dtype=next(model.parameters()).dtype,
                       scorer=scorer, scorer_path=name, heavy_layout=layout)


__all__ = ["FORMAT", "MEASURED_TARGETS", "RECORD", "TOLERANCE", "calibrated_context", "choose", "choose_layout",
           "measure", "merge_entry", "model_preset_plan", "preset_layout", "preset_scorer", "read_record",
           "scorer_file", "write_entry"]
