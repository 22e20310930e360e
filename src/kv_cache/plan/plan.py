"""``CachePlan``: what a compressed cache holds, per layer, typed and serialisable.

A plan replaces the ad-hoc ``QuantConfig`` + policy + bit-profile triple: per layer it says

* the layer kind (``full_attention`` / ``sliding_attention``, from the model's config);
* the key and value bits (None: full precision) in the plan's layout;
* the token budget and the policy that fills it (full-attention layers only);
* the evicted tier's key and value bits (precision tiers, math dictionary §21), or None.

It is a frozen dataclass with a JSON form (``kv_cache.cache_plan`` format, a version and a
sha256 fingerprint over its content), so a plan file names exactly one cache and an evaluation
resumes by its fingerprint. ``CompressedCache(model.config, plan=plan)`` builds the cache;
``CompressedCache(config, quant=..., eviction=...)`` builds :meth:`CachePlan.uniform`.
"""

from __future__ import annotations

import dataclasses
import hashlib
import json
import os
from collections import Counter
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from ..cache.architecture import FULL, SLIDING, layer_windows
from ..cache.config import QuantConfig
from ..cache.report import kv_geometry
from ..cache.serialize_state import decode_policy, decode_quant, encode_policy, encode_quant
from ..policies.base import EvictionPolicy

PLAN_FORMAT = "kv_cache.cache_plan"
PLAN_VERSION = 1


@dataclass(frozen=True)
class LayerPlan:
    """One layer of a :class:`CachePlan`.

    ``key_bits`` / ``value_bits``: code widths (None: the layer is held in full precision);
    ``budget``: tokens the policy keeps (a fraction of the context or a count; None: all);
    ``evicted_bits``: ``(key, value)`` widths of the evicted tier (None: evicted tokens are dropped).
    """

    kind: str = FULL
    key_bits: int | None = None
    value_bits: int | None = None
    budget: float | int | None = None
    evicted_bits: tuple[int, int] | None = None

    def __post_init__(self) -> None:
        if self.kind not in (FULL, SLIDING):
            raise ValueError(f"LayerPlan.kind must be one of {[FULL, SLIDING]}; got {self.kind!r}")
        if (self.key_bits is None) != (self.value_bits is None):
            raise ValueError(f"LayerPlan: key_bits and value_bits are both set or both None; got "
                             f"{self.key_bits!r} and {self.value_bits!r}")
        if self.kind == SLIDING and (self.budget is not None or self.evicted_bits is not None):
            raise ValueError("a sliding-window layer holds its window: it takes no budget and no evicted tier")


@dataclass(frozen=True)
class CachePlan:
    """Per-layer plan of a compressed cache (see the module docstring).

    Parameters
    ----------
    layers : one :class:`LayerPlan` per model layer
    layout : the quantized layout (rotation, levels, groups, sinks, ...) whose widths the layers
        set; None when every layer is full precision
    policy : the eviction policy whose budget the full-attention layers hold (None: keep all)
    model : ``{"model_type", "layers", "kv_heads", "head_dim"}`` of the model it was made for
    name : a label (e.g. the preset ``"8x"``); not part of the fingerprint
    predicted : what the planner predicted (``bytes_per_token``, ``context_tokens``, ...), or {}
    """

    layers: tuple[LayerPlan, ...]
    layout: QuantConfig | None = None
    policy: EvictionPolicy | None = None
    model: dict = field(default_factory=dict)
    name: str = "custom"
    predicted: dict = field(default_factory=dict)

    def __post_init__(self) -> None:
        if not self.layers:
            raise ValueError("CachePlan needs one LayerPlan per layer; got none")
        quantized = {lp.key_bits is not None for lp in self.layers}
        if quantized == {True} and self.layout is None:
            raise ValueError("CachePlan: layers have code widths but no layout is given")
        if len(quantized) > 1:
            raise ValueError("CachePlan: every layer is quantized or none is (mixed full-precision layers are not "
                             "supported); give every layer bits")
        budgets = {lp.budget for lp in self.layers if lp.kind == FULL}
        if len(budgets) > 1:
            raise ValueError(f"CachePlan: the full-attention layers hold different budgets {sorted(map(str, budgets))};"
                             " one budget per plan is supported")
        budget = next(iter(budgets), None)
        if (budget is None) != (self.policy is None):
            raise ValueError(f"CachePlan: a budget ({budget!r}) needs a policy and a policy needs a budget; "
                             f"got policy {type(self.policy).__name__ if self.policy else None}")
        if self.policy is not None and self.policy.budget != budget:
            raise ValueError(f"CachePlan: the policy's budget ({self.policy.budget!r}) differs from the layers' "
                             f"({budget!r})")
        tiers = {lp.evicted_bits is not None for lp in self.layers if lp.kind == FULL}
        if len(tiers) > 1:
            raise ValueError("CachePlan: every full-attention layer has an evicted tier or none has")

    # ------------------------------------------------------------------ building
    @classmethod
    def uniform(cls, config: Any, quant: QuantConfig | None = None, eviction: EvictionPolicy | None = None,
                name: str = "custom") -> "CachePlan":
        """The plan of ``CompressedCache(config, quant=quant, eviction=eviction)``."""
        windows = layer_windows(config)
        layers = []
        for i, w in enumerate(windows):
            kb = vb = None
            if quant is not None:
                kb, vb = quant.bits_for(i)
            ev = None
            if w is None and quant is not None and quant.evicted_bits is not None:
                ev = tuple(quant.evicted_config().bits_for(i))
            layers.append(LayerPlan(kind=FULL if w is None else SLIDING, key_bits=kb, value_bits=vb,
                                    budget=None if (w is not None or eviction is None) else eviction.budget,
                                    evicted_bits=ev))
        if quant is not None:
            quant = quant.for_model(config)  # what the cache would hold for this model
        layout = None if quant is None else _base_layout(quant)
        return cls(tuple(layers), layout, eviction, model_identity(config), name)

    def quant_config(self) -> QuantConfig | None:
        """The :class:`QuantConfig` with these per-layer widths (the most common as ``bits``)."""
        if self.layout is None:
            return None
        pairs = {i: (lp.key_bits, lp.value_bits) for i, lp in enumerate(self.layers)}
        base_k, base_v = Counter(pairs.values()).most_common(1)[0][0]
        layer_bits = {i: kv for i, kv in pairs.items() if kv != (base_k, base_v)}
        kw: dict[str, Any] = dict(bits=base_v, key_bits=None if base_k == base_v else base_k, value_bits=None,
                                  layer_bits=layer_bits)
        tiers = {i: lp.evicted_bits for i, lp in enumerate(self.layers) if lp.evicted_bits is not None}
        if tiers:
            (ek, ev), _ = Counter(tiers.values()).most_common(1)[0]
            if ek != ev:
                raise ValueError(f"CachePlan: the evicted tier's most common widths differ for keys and values "
                                 f"({ek}, {ev}); the tier takes one base width")
            kw.update(evicted_bits=ev, evicted_layer_bits={i: t for i, t in tiers.items() if t != (ek, ev)})
        return dataclasses.replace(self.layout, **kw)

    def eviction(self) -> EvictionPolicy | None:
        return self.policy

    def check_model(self, config: Any) -> None:
        """Raise unless this plan was made for a model of ``config``'s shape."""
        want = model_identity(config)
        got = {k: self.model.get(k) for k in want}
        if self.model and got != want:
            raise ValueError(f"CachePlan {self.name!r} was made for {self.model}, not for this model ({want})")
        if len(self.layers) != want["layers"]:
            raise ValueError(f"CachePlan has {len(self.layers)} layers; the model has {want['layers']}")

    # ------------------------------------------------------------------ serialisation
    def content(self) -> dict:
        """The JSON content that defines the cache (what the fingerprint hashes)."""
        return {
            "layers": [{"kind": lp.kind, "key_bits": lp.key_bits, "value_bits": lp.value_bits, "budget": lp.budget,
                        "evicted_bits": None if lp.evicted_bits is None else list(lp.evicted_bits)}
                       for lp in self.layers],
            "layout": None if self.layout is None else encode_quant(_base_layout(self.layout)),
            "policy": encode_policy(self.policy),
            "model": dict(self.model),
        }

    @property
    def fingerprint(self) -> str:
        """sha256 (16 hex digits) of :meth:`content` in canonical JSON."""
        return hashlib.sha256(json.dumps(self.content(), sort_keys=True).encode()).hexdigest()[:16]

    def to_json(self) -> str:
        doc = {"format": PLAN_FORMAT, "version": PLAN_VERSION, "name": self.name, "fingerprint": self.fingerprint,
               **self.content(), "predicted": self.predicted}
        return json.dumps(doc, indent=1, sort_keys=True) + "\n"

    @classmethod
    def from_json(cls, text: str, where: str = "plan") -> "CachePlan":
        try:
            doc = json.loads(text)
        except ValueError as exc:
            raise ValueError(f"{where}: not JSON ({exc})") from None
        if not isinstance(doc, dict) or doc.get("format") != PLAN_FORMAT:
            raise ValueError(f"{where}: expected a {PLAN_FORMAT!r} file; found format "
                             f"{doc.get('format') if isinstance(doc, dict) else type(doc).__name__!r}")
        if doc.get("version") != PLAN_VERSION:
            raise ValueError(f"{where}: plan version {doc.get('version')!r}; this kv_cache reads version {PLAN_VERSION}")
        try:
            layers = tuple(LayerPlan(kind=d["kind"], key_bits=d["key_bits"], value_bits=d["value_bits"],
                                     budget=d["budget"],
                                     evicted_bits=None if d["evicted_bits"] is None else tuple(d["evicted_bits"]))
                           for d in doc["layers"])
            plan = cls(layers, decode_quant(doc["layout"]), decode_policy(doc["policy"]), dict(doc["model"]),
                       str(doc.get("name", "custom")), dict(doc.get("predicted") or {}))
        except KeyError as exc:
            raise ValueError(f"{where}: malformed plan (missing field {exc})") from None
        except (TypeError, AttributeError) as exc:  # a field of the wrong type
            raise ValueError(f"{where}: malformed plan ({exc})") from None
        if doc.get("fingerprint") != plan.fingerprint:
            raise ValueError(f"{where}: fingerprint {doc.get('fingerprint')!r} does not match the content "
                             f"({plan.fingerprint}): the file was edited or damaged")
        return plan

    def save(self, path: str | os.PathLike) -> Path:
        p = Path(path)
        tmp = p.with_name(p.name + ".tmp")
        tmp.write_text(self.to_json(), encoding="utf-8")
        os.replace(tmp, p)
        return p

    @classmethod
    def load(cls, path: str | os.PathLike) -> "CachePlan":
        p = Path(path)
        if not p.is_file():
            raise FileNotFoundError(f"no plan file {str(p)!r}")
        return cls.from_json(p.read_text(encoding="utf-8"), where=str(p))

    def describe(self) -> str:
        """One line: name, widths, budget, tiers and the prediction."""
        kv = Counter((lp.key_bits, lp.value_bits) for lp in self.layers)
        widths = ", ".join(f"K{k}V{v} x{n}" if k is not None else f"full x{n}" for (k, v), n in kv.most_common())
        pol = "keep all" if self.policy is None else f"{type(self.policy).__name__}@{self.policy.budget}"
        tier = next((lp.evicted_bits for lp in self.layers if lp.evicted_bits), None)
        pred = self.predicted.get("bytes_per_token")
        return (f"plan {self.name!r} [{self.fingerprint}]: {widths}; {pol}"
                + (f"; evicted tier {tier}" if tier else "")
                + (f"; predicted {pred:,.0f} B/token ({self.predicted.get('ratio', 0):.2f}x fp16)" if pred else ""))


def model_identity(config: Any) -> dict:
    g = kv_geometry(config)
    return {"model_type": g.model_type, "layers": g.layers, "kv_heads": g.kv_heads, "head_dim": g.head_dim}


def _base_layout(quant: QuantConfig) -> QuantConfig:
    """``quant`` without its widths (the plan's layers hold them)."""
    return dataclasses.replace(quant, key_bits=None, value_bits=None, layer_bits=(), evicted_bits=None,
                               evicted_layer_bits=())
