"""KVzap (Jegou & Jeblick, arXiv 2601.07891): KVzip's scores predicted from hidden states.

A small model per layer (:mod:`kv_cache.compression.scorer`, math dictionary §24) maps the
hidden state entering the layer's attention to the log of the score KVzip's reconstruction pass
would give the token in each KV head. The scores come from the prefill's own forward pass (no
second pass) and from every decoded token as it is appended, so the cache can keep a budget
(or a threshold) at any generation length:

* ``budget``: keep ``budget`` tokens per head (a fraction of the prompt or a count), shared by
  the heads of the whole model by default (``scope="model"``, as KVzip), or of a layer, or per
  head;
* ``threshold``: keep the tokens whose predicted log score is at least ``threshold`` (the
  memory follows the content; heads then hold different numbers of tokens);
* while decoding (``decoding=True``) the cache evicts again every ``evict_every`` tokens, so it
  holds at most ``evict_every - 1`` tokens per head beyond its budget; the last
  ``recent_window`` tokens (default: half the budget, math dictionary §19.5) and the first
  ``sink_tokens`` are always kept;
* ``decoding=False`` acts once, after the prefill: what precision tiers
  (``QuantConfig.evicted_bits``) need of the policy that picks the important tokens.

The per-token scores are kept while decoding (``state["kvzap"]``, float16, counted in the
bytes held) so that later evictions compare old and new tokens.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, ClassVar

import torch

from ..compression.scorer_file import Scorer, ScorerFileError, load_scorer, model_identity, read_header
from ..compression.selection import reduce_gqa, window_attention
from .base import EvictionPolicy, ScoreInputs, check_target_ratio

SCORERS_DIR = Path(__file__).resolve().parent.parent / "assets" / "kvzap_scorers"
"""Scorers shipped with the package (``kv_cache/assets/kvzap_scorers/*.safetensors``), found by model identity."""

SHIPPED = "shipped:"
"""Prefix of a scorer named inside :data:`SCORERS_DIR` (``shipped:presets/<file>``): a plan that
names a shipped file this way does not depend on where the package is installed."""

STATE_DTYPE = torch.float16


def resolve_scorer(name: str | Path) -> Path:
    """The file a ``KVzap.scorer`` names: ``shipped:<relative path>`` inside :data:`SCORERS_DIR`
    (refused outside it), any other string a path as given."""
    text = str(name)
    if not text.startswith(SHIPPED):
        return Path(text)
    path = (SCORERS_DIR / text[len(SHIPPED):]).resolve()
    if SCORERS_DIR.resolve() not in path.parents:
        raise ScorerFileError(f"KVzap.scorer {text!r}: a shipped scorer must name a file inside {SCORERS_DIR}")
    return path


def fitted_on(path: Path, identity: dict[str, Any]) -> bool:
    """Whether ``path`` is a readable scorer file fitted on the model of ``identity``."""
    if not path.is_file():
        return False
    try:
        header = read_header(path)
    except (ScorerFileError, OSError):
        return False
    return all(header["model"].get(k) == v for k, v in identity.items())


def shipped_scorer(identity: dict[str, Any], directory: Path = SCORERS_DIR) -> Path | None:
    """The shipped scorer file fitted on the model of ``identity`` (None: there is none)."""
    for path in sorted(directory.glob("*.safetensors")) if directory.is_dir() else []:
        if fitted_on(path, identity):
            return path
    return None


@dataclass(repr=False)
class KVzap(EvictionPolicy):
    """Learned-scorer eviction, during the prefill and while decoding.

    Parameters (beyond :class:`EvictionPolicy`)
    ----------
    threshold : float or None
        Keep the tokens whose predicted log KVzip score is ``>= threshold`` (``budget`` is then
        not used); None: keep ``budget`` tokens.
    scorer : str or None
        The scorer file (``kvcache calibrate-scorer``); None: the one shipped for this model
        (``kv_cache/assets/kvzap_scorers/``), found by the model's identity.
    evict_every : int, default 16
        While decoding, evict every ``evict_every`` tokens (memory: at most ``evict_every - 1``
        tokens per head over the budget).
    decoding : bool, default True
        Keep evicting while decoding; False acts once after the prefill (precision tiers, and
        ``target_ratio``).
    target_ratio : float, optional
        With ``scope="model"`` and ``decoding=False``: once the scores are known, keep the most
        tokens (never fewer than ``budget``) whose cache still holds at most
        ``fp16 bytes / target_ratio``, measured on the layout itself (math dictionary §19.6, as
        :class:`KVzip`'s). The measured plans set it (:func:`kv_cache.plan.plan_for`).
    continuation_queries : int, default 0
        ``n > 0`` (with ``decoding=False``): a token's log score is the larger of the predicted one
        and the log of the attention the prompt's last ``n`` queries give it (summed over them, the
        largest over the query heads of its KV head), taken from the prefill's own attention call:
        :class:`KVzip`'s continuation score (math dictionary §19.7) on KVzap's log scale (§24.4).
        The presets set it to ``kv_cache.plan.CONTINUATION_QUERIES`` where they evict with KVzap.
        0 (default): the learned scores alone.
    """

    budget: int | float = 0.25
    recent_window: int | float = 0.5
    sink_tokens: int = 4
    scope: str = "model"
    head_floor: float = 0.0
    threshold: float | None = None
    scorer: str | None = None
    evict_every: int = 16
    decoding: bool = True
    target_ratio: float | None = None
    continuation_queries: int = 0
    _bound: Scorer | None = field(default=None, init=False, repr=False, compare=False)

    needs_hidden: ClassVar[bool] = True
    """The layer hands :meth:`score` the hidden states entering its attention (``inputs.hidden``),
    captured by :func:`kv_cache.compress`."""

    def __post_init__(self) -> None:
        super().__post_init__()
        k = self.evict_every
        if isinstance(k, bool) or not isinstance(k, int) or k < 1:
            raise ValueError(f"KVzap.evict_every must be an int >= 1; got {k!r}")
        t = self.threshold
        if t is not None and (isinstance(t, bool) or not isinstance(t, (int, float)) or not math.isfinite(t)):
            raise ValueError(f"KVzap.threshold must be a finite number (a log score, e.g. -6.0) or None; got {t!r}")
        if not isinstance(self.decoding, bool):
            raise ValueError(f"KVzap.decoding must be a bool; got {self.decoding!r}")
        check_target_ratio(self)
        if self.target_ratio is not None and self.decoding:
            raise ValueError("KVzap.target_ratio sizes the eviction after the prefill, which decoding=True would "
                             "shrink back to the budget at the next eviction: pass decoding=False with it")
        n = self.continuation_queries
        if isinstance(n, bool) or not isinstance(n, int) or n < 0:
            raise ValueError(f"KVzap.continuation_queries must be an int >= 0; got {n!r}")
        if n and self.decoding:
            raise ValueError("KVzap.continuation_queries scores the prompt once, after the prefill; while decoding the "
                             "later evictions would compare those scores with learned ones only: pass decoding=False "
                             "with it")
        if self.scorer is not None and not isinstance(self.scorer, (str, Path)):
            raise ValueError(f"KVzap.scorer must be a path (str) or None; got {type(self.scorer).__name__}")

    @property
    def needs_attention(self) -> bool:  # type: ignore[override]
        """True with ``continuation_queries``: the prompt's last queries' attention is observed."""
        return self.continuation_queries > 0

    def query_window(self, q_len: int, budget_tokens: int) -> int:
        """The prompt's last ``continuation_queries`` queries (their attention is the continuation score)."""
        return min(q_len, self.continuation_queries)

    @property
    def prefill_only(self) -> bool:  # type: ignore[override]
        """True with ``decoding=False``: the policy acts once, after the prefill."""
        return not self.decoding

    def eviction_slack(self) -> int:
        return self.evict_every - 1 if self.decoding else 0

    def bind(self, model: Any) -> Scorer:
        """Load the scorer (``scorer`` or the shipped one) and check it was fitted on ``model``;
        called by :func:`kv_cache.compress`. Returns it."""
        identity = model_identity(model)
        if self.scorer is not None:
            found = load_scorer(resolve_scorer(self.scorer))
        else:
            path = shipped_scorer(identity)
            if path is None:
                raise ScorerFileError(
                    f"KVzap: no scorer is shipped for this model ({identity['model_type']}, "
                    f"{identity['num_layers']} layers, hidden size {identity['hidden_size']}): fit one with "
                    "`kvcache calibrate-scorer --model M --text T -o scorer.safetensors` and pass "
                    "KVzap(scorer='scorer.safetensors') (spec: kvzap@0.25[scorer.safetensors])"
                )
            found = load_scorer(path)
        found.check_identity(identity)
        self._bound = found
        return found

    def score(self, inputs: ScoreInputs) -> torch.Tensor:
        """Scores of the ``T`` stored slots: the kept scores of earlier tokens, then the new
        tokens' predicted log scores (``inputs.hidden`` ``[batch, q_len, hidden_size]``)."""
        if self._bound is None:
            raise RuntimeError("KVzap has no scorer bound: run the model inside `with kv_cache.compress(model, cache):`")
        if inputs.hidden is None:
            raise RuntimeError(
                "KVzap scores the hidden states entering each layer's attention, which no hook captured: run the "
                "model inside `with kv_cache.compress(model, cache):` (a model whose attention modules have no "
                "`layer_idx` cannot be scored)"
            )
        b, h, T = inputs.shape
        new = self._bound.score(inputs.layer_idx, inputs.hidden)  # [b, kv_heads, q_len] float32
        if new.shape[:2] != (b, h):
            raise ValueError(f"the scorer predicts {new.shape[1]} KV heads for layer {inputs.layer_idx}; the layer "
                             f"has {h}")
        acc = inputs.state.get("kvzap")
        old = T - new.shape[2]
        if old < 0:
            raise RuntimeError(f"layer {inputs.layer_idx}: {new.shape[2]} new tokens but only {T} slots")
        total = torch.full((b, h, T), -math.inf, dtype=torch.float32, device=new.device)
        if acc is not None and old:
            n = min(old, acc.shape[-1])
            total[..., old - n:old] = acc[..., acc.shape[-1] - n:].to(total.device, torch.float32)
        total[..., old:] = new
        if self.continuation_queries:
            total = torch.maximum(total, self._continuation(inputs, h).to(total.device))
        if self.decoding:
            inputs.state["kvzap"] = total.to(STATE_DTYPE)
        return total

    def _continuation(self, inputs: ScoreInputs, kv_heads: int) -> torch.Tensor:
        """``[batch, kv_heads, T]`` float32: the log of the attention the prompt's last
        ``continuation_queries`` queries give each slot (summed over them, the largest over the
        query heads of its KV head; -inf where none). From the attention call's own sums
        (``inputs.attention``) or, on the reference path, from ``inputs.query`` and ``inputs.keys``."""
        attention = inputs.attention
        if attention is None:
            if inputs.query is None or inputs.keys is None:
                raise RuntimeError("KVzap.continuation_queries needs the prompt's last queries, which no hook "
                                   "observed: run the model inside `with kv_cache.compress(model, cache):`")
            attention = window_attention(inputs.query, inputs.keys, scaling=inputs.scaling,
                                         key_valid=inputs.key_valid).sum(2)  # [b, q_heads, T]
        return reduce_gqa(attention.float(), kv_heads, "max").log()
