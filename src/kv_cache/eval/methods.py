"""Method specs for evaluation: short strings that build a compressed cache (ours or a peer's).

Grammar (case-insensitive)::

    full                          the uncompressed DynamicCache
    q<bits>[g<group>][r<residual>][s<sinks>]     our quantized storage, e.g. q4, q2g64r128
    <policy>@<budget>[w<window>]  our eviction; policy in {snapkv, h2o, streaming};
                                  budget: a fraction of the context (0.5) or a token count (512);
                                  window: the always-kept recent tokens, a count (w32) or a
                                  fraction of the budget (w0.5). Defaults: h2o 0.5 of the budget
                                  (the H2O paper's even heavy/recent split), snapkv 32 (its
                                  observation window), streaming: all but the 4 sinks
    q4+h2o@0.5                    both levers in one cache
    hf-quanto-int<2|4>            transformers' QuantizedCache, quanto backend (optimum-quanto)
    hf-hqq-int<2|4|8>             transformers' QuantizedCache, HQQ backend (hqq)
    hf-fp8                        transformers' QuantizedCache, fp8 e4m3 backend (per-tensor scale);
                                  on transformers releases without it, a line-for-line backport
    kvpress-<press>@<kept>        a kvpress press at prefill, keeping that fraction of the context;
                                  press in {snapkv, streamingllm, knorm, expectedattention, tova,
                                  observedattention}

A :class:`Method` knows how to make a fresh cache and the context manager that must be active
while the context is prefilled (our ``compress`` hooks, a kvpress press, or nothing).
"""

from __future__ import annotations

import contextlib
import re
from dataclasses import dataclass, field
from typing import Any, Callable

from ..cache import CompressedCache, QuantConfig, compress
from ..policies import H2O, SnapKV, StreamingLLM

POLICY_NAMES = {"snapkv": SnapKV, "h2o": H2O, "streaming": StreamingLLM}
KVPRESS_PRESSES = {
    "snapkv": "SnapKVPress",
    "streamingllm": "StreamingLLMPress",
    "knorm": "KnormPress",
    "expectedattention": "ExpectedAttentionPress",
    "tova": "TOVAPress",
    "observedattention": "ObservedAttentionPress",
}
HF_BACKENDS = {  # spec name -> (transformers backend, bits, pip package, import name)
    "quanto": ("quanto", (2, 4), "optimum-quanto", "optimum.quanto"),
    "hqq": ("HQQ", (2, 4, 8), "hqq", "hqq"),
}
EXAMPLES = ("full", "q8", "q4", "q2", "q4g64r128", "snapkv@0.5", "h2o@0.25", "h2o@0.5w32", "streaming@512", "q4+h2o@0.5",
            "hf-quanto-int4", "hf-hqq-int2", "hf-fp8", "kvpress-snapkv@0.5", "kvpress-streamingllm@0.75")

_QUANT = re.compile(r"^q(?P<bits>\d+)(?:g(?P<g>\d+))?(?:r(?P<r>\d+))?(?:s(?P<s>\d+))?$")
_POLICY = re.compile(r"^(?P<name>[a-z0-9_]+)@(?P<budget>\d+(?:\.\d+)?)(?:w(?P<w>\d+(?:\.\d+)?))?$")


class MethodUnavailable(RuntimeError):
    """A peer baseline whose package is missing; the message says what to install."""


@dataclass
class Method:
    """A parsed method spec.

    Attributes
    ----------
    spec : str
        The string as given.
    family : {"ours", "hf", "kvpress"}
    bits : int or None
        Quantization bits (None: full precision).
    budget : float or int or None
        Kept fraction/count of the context (None: all tokens).
    make : callable ``(model) -> (cache, context_manager_factory)``
    prefill_only_context : bool
        True when the context manager must wrap only the prefill (kvpress presses); ours
        wraps every forward call (H2O observes decoding too).
    resolved : str
        Every setting the spec expands to (defaults included). Saved samples are reused on a
        restart only when it is unchanged, so a changed default never mixes into old results.
    """

    spec: str
    family: str
    bits: int | None
    budget: float | int | None
    make: Callable[[Any], tuple[Any, Callable[[], Any]]] = field(repr=False)
    prefill_only_context: bool = False
    resolved: str = ""

    @property
    def is_peer(self) -> bool:
        return self.family != "ours"


def _budget(text: str) -> float | int:
    return float(text) if "." in text else int(text)


def _unknown(spec: str, why: str) -> ValueError:
    return ValueError(
        f"unknown method {spec!r} ({why}); known forms: full, q<bits>[g<group>][r<residual>][s<sinks>], "
        f"{{{', '.join(POLICY_NAMES)}}}@<budget>[w<window>], their '+' combination, hf-quanto-int<2|4>, hf-hqq-int<2|4|8>, hf-fp8, "
        f"kvpress-{{{', '.join(KVPRESS_PRESSES)}}}@<kept fraction>; examples: {', '.join(EXAMPLES)}"
    )


def _ours(spec: str, parts: list[str]) -> Method:
    quant, policy = None, None
    for part in parts:
        if part == "full":
            continue
        m = _QUANT.match(part)
        if m:
            if quant is not None:
                raise _unknown(spec, "two quantization parts")
            kw = {"bits": int(m["bits"])}
            for key, name in (("g", "group_size"), ("r", "residual_length"), ("s", "sink_tokens")):
                if m[key] is not None:
                    kw[name] = int(m[key])
            quant = QuantConfig(**kw)
            continue
        m = _POLICY.match(part)
        if m and m["name"] in POLICY_NAMES:
            if policy is not None:
                raise _unknown(spec, "two eviction parts")
            cls = POLICY_NAMES[m["name"]]
            b = _budget(m["budget"])
            kw: dict[str, Any] = {"budget": b}
            if m["w"] is not None:
                kw["recent_window"] = _budget(m["w"])
            elif cls is not H2O:  # H2O keeps its own default: half the budget (the paper's split)
                kw["recent_window"] = 32 if not isinstance(b, int) else min(32, max(1, b // 4))
            if cls is StreamingLLM:
                kw["sink_tokens"] = 4
            policy = cls(**kw)
            continue
        raise _unknown(spec, f"cannot parse {part!r}")

    def make(model):
        cache = CompressedCache(model.config, quant=quant, eviction=policy)
        ctx = (lambda: compress(model, cache)) if policy is not None else contextlib.nullcontext
        return cache, ctx

    return Method(spec, "ours", None if quant is None else quant.bits, None if policy is None else policy.budget,
                  make, resolved=f"kv_cache quant={quant!r} eviction={policy!r}")


def _hf(spec: str, backend: str, bits: int) -> Method:
    name, allowed, package, module = HF_BACKENDS[backend]
    if bits not in allowed:
        raise _unknown(spec, f"{backend} supports int{list(allowed)}")

    def make(model):
        from transformers import QuantizedCache

        # transformers' documented defaults: per-channel keys and values, group 64, residual 128.
        cache = QuantizedCache(name, model.config, nbits=bits, axis_key=0, axis_value=0, q_group_size=64,
                               residual_length=128)
        return cache, contextlib.nullcontext

    _require(module, spec, package)
    return Method(spec, "hf", bits, None, make,
                  resolved=f"transformers QuantizedCache({name!r}, nbits={bits}, axis_key=0, axis_value=0, "
                           f"q_group_size=64, residual_length=128)")


def _hf_fp8(spec: str) -> Method:
    def make(model):
        from .fp8 import make_fp8_cache

        return make_fp8_cache(model.config), contextlib.nullcontext

    return Method(spec, "hf", 8, None, make, resolved="transformers QuantizedCache('fp8') (per-tensor e4m3)")


def _kvpress(spec: str, press: str, kept: float) -> Method:
    if press not in KVPRESS_PRESSES:
        raise _unknown(spec, f"kvpress press must be one of {list(KVPRESS_PRESSES)}")
    if not 0.0 < kept <= 1.0:
        raise _unknown(spec, "kvpress specs take the kept fraction in (0, 1]")
    _require("kvpress", spec, "kvpress")

    def make(model):
        import kvpress
        from transformers import DynamicCache

        press_obj = getattr(kvpress, KVPRESS_PRESSES[press])(compression_ratio=1.0 - kept)
        return DynamicCache(), lambda: press_obj(model)

    return Method(spec, "kvpress", None, kept, make, prefill_only_context=True,
                  resolved=f"kvpress {KVPRESS_PRESSES[press]}(compression_ratio={1.0 - kept!r})")


def _require(module: str, spec: str, package: str) -> None:
    import importlib.util

    try:
        found = importlib.util.find_spec(module) is not None
    except ModuleNotFoundError:
        found = False
    if not found:
        raise MethodUnavailable(f"{spec} needs the package {package!r}: pip install {package}")


def parse_method(spec: str) -> Method:
    """Parse one method spec (see the module docstring).

    Raises
    ------
    ValueError
        Unknown spec; the message lists the known forms.
    MethodUnavailable
        A peer whose optional package is not installed.
    """
    if not isinstance(spec, str) or not spec.strip():
        raise _unknown(str(spec), "empty")
    s = spec.strip().lower()
    if s == "hf-fp8":
        return _hf_fp8(spec)
    m = re.match(r"^hf-(quanto|hqq)-int(\d+)$", s)
    if m:
        return _hf(spec, m[1], int(m[2]))
    m = re.match(r"^kvpress-([a-z]+)@(\d*\.?\d+)$", s)
    if m:
        return _kvpress(spec, m[1], float(m[2]))
    if s.startswith(("hf-", "kvpress-")):
        raise _unknown(spec, "malformed peer spec")
    return _ours(spec, s.split("+"))


__all__ = ["EXAMPLES", "KVPRESS_PRESSES", "Method", "MethodUnavailable", "POLICY_NAMES", "parse_method"]
