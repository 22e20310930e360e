"""The method grammar: short strings that build a compressed cache (ours or a peer's).

Specs are case-insensitive. Their grammar is the table :data:`METHOD_GRAMMAR` (one row per form:
``full``, ``q4g64``, ``h2o@0.5w32``, ``q4+h2o@0.5``, ``hf-quanto-int4``, ``kvpress-snapkv@0.5``,
...); :func:`grammar_help` renders it, and that text is also ``kvcache eval --help`` and the list
of known forms in the error for an unknown spec. The tables the rows draw on:

* :data:`QUANT_OPTIONS`: the letters of our quantization part, ``q<bits>[g<group>]...``, each
  setting one :class:`kv_cache.QuantConfig` field (its default is the dataclass's);
* :data:`kv_cache.policies.POLICIES`: the eviction policies, ``<policy>@<budget>[w<window>][e<steps>]``
  (their defaults are the policy dataclasses');
* :data:`HF_BACKENDS` and :data:`KVPRESS_PRESSES`: the peers.

A :class:`Method` knows how to make a fresh cache and the context manager that must be active
while the context is prefilled (our ``compress`` hooks, a kvpress press, or nothing).
"""

from __future__ import annotations

import contextlib
import dataclasses
import functools
import re
import textwrap
from typing import Any, Callable, NamedTuple

import torch

from ..cache import CompressedCache, QuantConfig, compress
from ..cache.config import KIVI_LAYOUT
from ..compression.packing import SUPPORTED_BITS
from ..plan.bit_allocation import load_bit_profile
from ..policies import POLICIES, EvictionPolicy
from ..policies.base import SCOPES
from .method import MAX_SPEC_CHARS, REFERENCE_SPEC, Method, MethodUnavailable
from .peers import (HF_BACKENDS, HF_QUANT_KWARGS, KVPRESS_PRESSES, KVPRESS_WRAPPERS, HFBackend,  # noqa: F401 (old names)
                    hf_method, hf_fp8_method, kvpress_method)
from .plans import plan_file as _plan_file, preset as _preset


class QuantOption(NamedTuple):
    """One row of :data:`QUANT_OPTIONS`: ``<letter><value>`` sets ``QuantConfig.<field>``."""

    letter: str
    field: str  # a QuantConfig field; also the regex group name
    placeholder: str  # shown in the grammar: ``g<group>``
    about: str  # shown in the help, followed by the field's default
    value: str = r"\d+"  # regex of the value; "" makes the letter a flag (convert then gets "")
    convert: Callable[[str], Any] = int


# Our quantization part: the first row is its required head (q<bits>), the others optional
# suffixes in this order. The regex, the parser, the help and the errors are generated from it.
QUANT_OPTIONS: tuple[QuantOption, ...] = (
    QuantOption("q", "bits", "bits", f"bits {'/'.join(map(str, SUPPORTED_BITS))}"),
    QuantOption("g", "group_size", "group", "group"),
    QuantOption("r", "residual_length", "residual", "full-precision residual"),
    QuantOption("s", "sink_tokens", "sinks", "full-precision sinks"),
    QuantOption("k", "key_bits", "bits", "key bits (e.g. q2k3 = K3V2)"),
    QuantOption("v", "value_bits", "bits", "value bits"),
    QuantOption("h", "rotation", "", "randomized Hadamard rotation per KV head", "", lambda _: "hadamard"),
    QuantOption("t", "key_grouping", "", "keys grouped per token (after a rotation)", "", lambda _: "token"),
    QuantOption("c", "channel_group", "channels", "channels per scale of per-token groups (up to head_dim)"),
    QuantOption("l", "levels", "", "Lloyd-Max levels, one norm per group, no zero point", "", lambda _: "lloyd_max"),
    QuantOption("xk", "clip_keys", "ratio", "key range clipping ratio (uniform levels)", r"0?\.\d+|1(?:\.0+)?",
                float),
    QuantOption("xv", "clip_values", "ratio", "value range clipping ratio (uniform levels)", r"0?\.\d+|1(?:\.0+)?",
                float),
    QuantOption("z", "zero_dtype", "", "8-bit (uint8) zero points", "", lambda _: torch.uint8),
    QuantOption("f", "residual_dtype", "", "float16 full-precision residual and sinks", "", lambda _: torch.float16),
    QuantOption("e", "scale_dtype", "", "8-bit log-coded norms (Lloyd-Max levels; half the fp16 norm bytes)", "",
                lambda _: torch.uint8),
    QuantOption("p", "layer_bits", "[profile]", "key/value bits per layer from a `kvcache allocate` JSON file",
                r"\[[^\],+\s]+\]", lambda v: load_bit_profile(v[1:-1])),
    QuantOption("o", "evicted_bits", "bits", "tokens a one-shot policy (kvzip, snapkv) does not keep, stored at "
                "these bits instead of dropped (precision tiers)"),
    QuantOption("u", "evicted_layer_bits", "[profile]", "bits per layer of those tokens (o<bits>) from a "
                "`kvcache allocate` JSON file", r"\[[^\],+\s]+\]", lambda v: load_bit_profile(v[1:-1])),
    QuantOption("n", "center_keys", "", "no per-channel key offset (keys stored as computed, not k - mu; §25)", "",
                lambda _: False),
    QuantOption("b", "pre_rope", "", "keys stored before RoPE, rotated back at read (§29)", "", lambda _: True),
    QuantOption("w", "scale_keys", "", "centered key channels divided by their prompt scale (with b; §29.7)", "",
                lambda _: True),
    QuantOption("a", "pre_rope", "", "keys stored after RoPE, as the model hands them (pre_rope=False; per-channel "
                "key groups unless t)", "", lambda _: False),
    QuantOption("m", "key_grouping", "", "keys grouped per channel (KIVI's 32-token groups)", "",
                lambda _: "channel"),
    QuantOption("i", "scale_keys", "", "no per-channel key scale (scale_keys=False)", "", lambda _: False),
)


def _default(cls: type, name: str) -> Any:
    """The default of dataclass field ``name`` of ``cls``."""
    return next(f.default for f in dataclasses.fields(cls) if f.name == name)


def _number(text: str) -> float | int:
    return float(text) if "." in text else int(text)


_HEAD, *_SUFFIXES = QUANT_OPTIONS
DEFAULTS_FLAG = "d"
"""``q<bits>d...``: start from ``QuantConfig(bits=b)``'s defaults (the best measured layout)
instead of the KIVI layout that plain ``q<bits>...`` specs start from."""

_QUANT = re.compile(f"^{_HEAD.letter}(?P<{_HEAD.field}>{_HEAD.value})(?P<_defaults>{DEFAULTS_FLAG})?"
                    + "".join(f"(?:{o.letter}(?P<_o{i}>{o.value}))?" for i, o in enumerate(_SUFFIXES)) + "$")
_QUANT_GRAMMAR = f"{_HEAD.letter}<{_HEAD.placeholder}>[{DEFAULTS_FLAG}]" + "".join(
    f"[{o.letter}<{o.placeholder}>]" if o.placeholder else f"[{o.letter}]" for o in _SUFFIXES)
_FILE = re.compile(r"^file(?P<ratio>\d+(?:\.\d+)?)$")
_POLICY = re.compile(r"^(?P<name>[a-z0-9_]+)@(?:t(?P<threshold>-?\d+(?:\.\d+)?)|(?P<budget>\d+(?:\.\d+)?))"
                     r"(?:w(?P<w>\d+(?:\.\d+)?))?(?:e(?P<e>\d+))?(?::(?P<scope>[a-z]+))?(?:\[(?P<path>[^\]]+)\])?$")


def _quant_config(m: re.Match[str]) -> QuantConfig:
    """``q<bits>...``: the KIVI layout plus the letters; ``q<bits>d...``: ``QuantConfig``'s
    defaults (the best measured layout for the widths) plus the letters."""
    groups = [_HEAD.field, *(f"_o{i}" for i in range(len(_SUFFIXES)))]  # one group per option (two may share a field)
    kw = {o.field: o.convert(m[g]) for o, g in zip(QUANT_OPTIONS, groups) if m[g] is not None}
    return QuantConfig(**kw) if m["_defaults"] else QuantConfig.kivi(**kw)


def parse_quant(spec: str) -> QuantConfig:
    """The :class:`QuantConfig` of our quantization part alone (``q4d``, ``q4``, ``q3htc64l``; no
    ``+policy``; the grammar of ``kvcache eval --methods``); raises ``ValueError`` naming the form."""
    m = _QUANT.match(spec.strip().lower()) if isinstance(spec, str) else None
    if m is None:
        raise ValueError(f"not one of our quantization specs ({_QUANT_GRAMMAR}): {spec!r}")
    return _quant_config(m)


def _policy(m: re.Match[str], original: str = "") -> EvictionPolicy:
    cls = POLICIES[m["name"]]
    names = {f.name for f in dataclasses.fields(cls)}
    kw: dict[str, Any] = {}
    if m["threshold"] is not None:
        if "threshold" not in names:
            raise ValueError(f"@t<threshold> (keep what scores above it) applies to kvzap only; got {m.string!r}")
        kw["threshold"] = float(m["threshold"])
    else:
        kw["budget"] = _number(m["budget"])
    budget = kw.get("budget", _default(cls, "budget"))
    if m["path"] is not None:
        if "scorer" not in names:
            raise ValueError(f"[<path>] (a scorer file) applies to kvzap only; got {m.string!r}")
        # the path as typed (specs are matched in lower case)
        kw["scorer"] = original[original.index("[") + 1:original.rindex("]")] if "[" in original else m["path"]
    if m["scope"] is not None:
        kw["scope"] = m["scope"]  # the policy validates it (and says which scopes exist)
    if m["e"] is not None:
        if "evict_every" not in names:
            raise ValueError(f"e<steps> (evict every k decoding steps) applies to h2o and kvzap only; got {m.string!r}")
        kw["evict_every"] = int(m["e"])
    if m["w"] is not None:
        kw["recent_window"] = _number(m["w"])
    else:
        window = _default(cls, "recent_window")
        if isinstance(window, int) and isinstance(budget, int):
            # A small token budget must still hold more than its window: cap it at a quarter.
            kw["recent_window"] = min(window, max(1, budget // 4))
    return cls(**kw)


def _ours(spec: str, parts: list[str]) -> Method:
    quant, policy, file_ratio = None, None, None
    originals = spec.strip().split("+")
    for n, part in enumerate(parts):
        if part == REFERENCE_SPEC:
            continue
        m = _FILE.match(part)
        if m:
            if file_ratio is not None:
                raise unknown_spec(spec, "two file parts")
            file_ratio = float(m["ratio"])
            if file_ratio < 1:
                raise unknown_spec(spec, f"file<R> needs R >= 1 (fp16 K/V bytes over file bytes); got {file_ratio:g}")
            continue
        m = _QUANT.match(part)
        if m:
            if quant is not None:
                raise unknown_spec(spec, "two quantization parts")
            quant = _quant_config(m)
            continue
        m = _POLICY.match(part)
        if m and m["name"] in POLICIES:
            if policy is not None:
                raise unknown_spec(spec, "two eviction parts")
            policy = _policy(m, originals[n] if len(originals) == len(parts) else part)
            continue
        raise unknown_spec(spec, f"cannot parse {part!r}")

    load_quant = None
    if file_ratio is not None and quant is not None:
        # the codec codes full-precision K/V: prefill in full precision, load the file into this layout
        if quant.evicted_bits is not None:
            raise unknown_spec(spec, "file<R> stores the kept tokens only: o<bits> (the evicted tier) cannot be loaded")
        load_quant, quant = quant, None
    if quant is not None and quant.evicted_bits is not None and getattr(policy, "decoding", False):
        policy = dataclasses.replace(policy, decoding=False)  # kvzap picks the tiers once, after the prefill
    if quant is not None and quant.evicted_bits is not None and (policy is None or not policy.prefill_only):
        raise unknown_spec(spec, "o<bits> (the evicted tier) needs a one-shot policy: add +kvzip@<kept> or +snapkv@<kept>")

    def make(model):
        if quant is None and policy is None:  # the reference: transformers' own cache and attention
            from transformers import DynamicCache

            return DynamicCache(), contextlib.nullcontext
        # file<R>: the kept tokens' positions travel, so the codec may code keys before RoPE (§27.6)
        cache = CompressedCache(model.config, quant=quant, eviction=policy, track_positions=file_ratio is not None)
        # Always inside compress(): attention reads the compressed storage (and feeds the policy).
        return cache, lambda: compress(model, cache)

    budget = None if policy is None or getattr(policy, "threshold", None) is not None else policy.budget
    if file_ratio is not None and policy is None:
        def make(model):  # noqa: F811  (file<R> alone: the full cache, coded; ours, not DynamicCache)
            cache = CompressedCache(model.config)
            return cache, lambda: compress(model, cache)
    shown = quant if load_quant is None else load_quant
    return Method(spec, "ours", None if shown is None else shown.bits, budget,
                  make, resolved=f"kv_cache quant={quant!r} eviction={policy!r}"
                  + ("" if file_ratio is None else f" file_ratio={file_ratio:g} codec={_codec_settings()!r}")
                  + ("" if load_quant is None else f" loaded_into={load_quant!r}"),
                  needs_tokenizer=policy is not None and policy.needs_reconstruction, file_ratio=file_ratio,
                  load_quant=load_quant)


def _codec_settings() -> Any:
    """The storage codec's default settings (named in ``resolved``: a changed default is a new run)."""
    from ..codec import CodecSettings

    return CodecSettings()


def _choices(names) -> str:
    return "{" + ", ".join(names) + "}"


def _quant_about() -> str:
    def base(field: str) -> Any:  # what a plain q<bits> spec starts from: the KIVI layout
        return KIVI_LAYOUT.get(field, _default(QuantConfig, field))

    suffixes = ", ".join(f"{o.letter}<{o.placeholder}>: {o.about} (default {base(o.field)})"
                         if o.placeholder else f"{o.letter}: {o.about} (flag)" for o in _SUFFIXES)
    return (f"kv_cache quantized storage: {_HEAD.about}, from the KIVI layout; {DEFAULTS_FLAG}: from "
            f"QuantConfig(bits)'s defaults instead (the best measured layout: rotation, per-token keys, "
            f"Lloyd-Max levels, 8-bit norms, 4 sinks), {suffixes}")


def _policy_about() -> str:
    defaults = []
    for name, cls in POLICIES.items():
        sinks = _default(cls, "sink_tokens")
        defaults.append(f"{name} {_default(cls, 'recent_window')}" + (f" after {sinks} sinks" if sinks else ""))
    scopes = ", ".join(f"{name} {_default(cls, 'scope')}" for name, cls in POLICIES.items())
    return ("kv_cache eviction keeping <budget>: a fraction of the context (0.5) or a token count (512); <window>: the "
            "always-kept recent tokens, a count (w32) or a fraction of the budget (w0.5); default window: "
            + ", ".join(defaults) + " (see each policy's docstring for why); <scope> "
            + _choices(SCOPES) + ": who shares the budget, each KV head its own, the heads of a layer, or every head "
            "of every layer (one top-k; heads then hold different numbers of tokens); default scope: " + scopes
            + "; e<steps> (h2o, kvzap): evict every <steps> decoding steps, holding up to budget + steps - 1 tokens; "
            "kvzap@t<threshold> keeps the tokens whose predicted log KVzip score is >= threshold (e.g. kvzap@t-6); "
            "kvzap...[<path>]: its scorer file (`kvcache calibrate-scorer`; default: the one shipped for the model); "
            "with o<bits> (tiers) kvzap acts once, after the prefill (decoding=False)")


class MethodForm(NamedTuple):
    """One row of :data:`METHOD_GRAMMAR`."""

    family: str  # Method.family; peers' specs start with "<family>-"
    grammar: str
    about: str
    examples: tuple[str, ...]
    pattern: re.Pattern[str] | None = None  # a whole peer spec (lower case); None: a part of ours
    build: Callable[[str, re.Match[str]], Method] | None = None  # (spec as given, match) -> Method


# Every form a spec can take, in the order of the help. Ours ('+'-joined parts) is parsed by
# `_ours`; a peer by the first row whose pattern matches.
METHOD_GRAMMAR: tuple[MethodForm, ...] = (
    MethodForm("ours", REFERENCE_SPEC, "the uncompressed cache (always run, as the reference)", (REFERENCE_SPEC,)),
    MethodForm("ours", _QUANT_GRAMMAR, _quant_about(), ("q8", "q4", "q2", "q4g64r128", "q2k3", "q2s4htc64l")),
    MethodForm("ours", f"{_choices(POLICIES)}@<budget>[w<window>][e<steps>][:<scope>], kvzap@t<threshold>[...]"
               "[[<scorer>]]", _policy_about(),
               ("snapkv@0.5", "h2o@0.25", "h2o@0.5w32", "h2o@0.5e32", "streaming@512", "kvzip@0.3",
                "snapkv@0.5:layer", "kvzap@0.25", "kvzap@t-6")),
    MethodForm("ours", "<quantization>+<eviction>", "both levers in one cache", ("q4+h2o@0.5",)),
    MethodForm("ours", "[<quantization>+]<eviction>+file<R>", "the cache saved transform-coded at R times smaller "
               "than its fp16 K/V (kv_cache.codec, the model's basis) and loaded back before scoring; the prefill is "
               "full precision and <quantization> is the layout the file is loaded into", ("kvzip@0.25+file20",
                                                                                             "q4d+kvzip@0.5+file10")),
    MethodForm("ours", "<ratio>x", "a preset: the documented default plan for that ratio vs fp16 (4-bit codes, "
               "plus KVzip keeping the largest fraction of tokens that reaches it; on a model with sliding-window "
               "layers, first the widest of 4, K4V3, 3, K3V2 bits that reaches it with no eviction, then K3V2 + KVzip; "
               "kv_cache.plan.preset_plan)",
               ("4x", "8x", "16x"), re.compile(r"^\d+(?:\.\d+)?x$"), _preset),
    MethodForm("ours", "plan[<path>]", "a plan file written by `kvcache plan` (per-layer widths, budget, tiers)",
               ("plan[plan.json]",), re.compile(r"^plan\[[^\]]+\]$"), _plan_file),
    *(MethodForm("hf", f"hf-{key}-int<{'|'.join(map(str, hf.bits))}>",
                 f"transformers' QuantizedCache, {hf.name} backend (pip install {hf.package})",
                 (f"hf-{key}-int{hf.example_bits}",), re.compile(rf"^hf-{key}-int(?P<bits>\d+)$"),
                 functools.partial(hf_method, key))
      for key, hf in HF_BACKENDS.items()),
    MethodForm("hf", "hf-fp8", "transformers' QuantizedCache, fp8 e4m3 backend with a per-tensor scale (on "
               "transformers releases without it, a line-for-line backport)", ("hf-fp8",), re.compile("^hf-fp8$"),
               hf_fp8_method),
    MethodForm("kvpress", f"kvpress-[adakv-]{_choices(KVPRESS_PRESSES)}@<kept>",
               "a kvpress press at prefill, keeping that fraction of the context (pip install kvpress); adakv- wraps "
               "it in kvpress' AdaKVPress (head-wise budget, simulated by masking)",
               ("kvpress-snapkv@0.5", "kvpress-streamingllm@0.75", "kvpress-kvzip@0.5", "kvpress-adakv-snapkv@0.5"),
               re.compile(r"^kvpress-(?P<press>[a-z]+(?:-[a-z]+)?)@(?P<kept>\d+(?:\.\d+)?|\.\d+)$"), kvpress_method),
)
EXAMPLES = tuple(e for form in METHOD_GRAMMAR for e in form.examples)
_PEER_PREFIXES = tuple(dict.fromkeys(f"{form.family}-" for form in METHOD_GRAMMAR if form.pattern
                                     and form.family != "ours"))


def grammar_help(width: int = 100, column: int = 33) -> str:
    """The method grammar as help text: one row of :data:`METHOD_GRAMMAR` per entry."""
    lines = ["method specs (comma-separated, case-insensitive):"]
    for form in METHOD_GRAMMAR:
        head = f"  {form.grammar}"
        body = textwrap.wrap(form.about, width - column, break_on_hyphens=False) or [""]
        if len(head) < column:
            lines.append(head.ljust(column) + body.pop(0))
        else:
            lines.append(head)
        lines += [" " * column + line for line in body]
    lines.append("examples: " + ", ".join(EXAMPLES))
    return "\n".join(lines) + "\n"


def unknown_spec(spec: str, why: str) -> ValueError:
    return ValueError(f"unknown method {spec!r} ({why}); known forms: "
                      f"{', '.join(form.grammar for form in METHOD_GRAMMAR)}; examples: {', '.join(EXAMPLES)}")


def _require(module: str, spec: str, package: str) -> None:
    import importlib.util

    try:
        found = importlib.util.find_spec(module) is not None
    except ModuleNotFoundError:
        found = False
    if not found:
        raise MethodUnavailable(f"{spec} needs the package {package!r}: pip install {package}")


def parse_method(spec: str, *, check_packages: bool = True) -> Method:
    """Parse one method spec (see :data:`METHOD_GRAMMAR`).

    Parameters
    ----------
    spec : str
    check_packages : bool, default True
        Raise :class:`MethodUnavailable` for a peer whose package is missing. False parses it
        anyway (its ``resolved`` settings are known; ``make`` needs the package).

    Raises
    ------
    ValueError
        Unknown spec; the message lists the known forms.
    MethodUnavailable
        A peer whose optional package is not installed.
    """
    if not isinstance(spec, str) or not spec.strip():
        raise unknown_spec(str(spec), "empty")
    if len(spec) > MAX_SPEC_CHARS:
        raise ValueError(f"a method spec is at most {MAX_SPEC_CHARS:,} characters; got one of {len(spec):,}")
    s = spec.strip().lower()
    for form in METHOD_GRAMMAR:
        m = form.pattern.match(s) if form.pattern is not None else None
        if m:
            method = form.build(spec, m)
            if check_packages and method.requires is not None:
                _require(method.requires[0], spec, method.requires[1])
            return method
    if s.startswith(_PEER_PREFIXES):
        raise unknown_spec(spec, "malformed peer spec")
    return _ours(spec, s.split("+"))


def parse_methods(specs: list[str]) -> tuple[list[Method], dict[str, str]]:
    """Parse the specs of a run: the reference (``full``) first, given or not, then the others in order.

    Returns
    -------
    methods : list of Method
    skipped : dict
        Spec -> why, for each peer whose package is missing.

    Raises
    ------
    ValueError
        An unknown spec (before anything is run).
    """
    methods: list[Method] = [parse_method(REFERENCE_SPEC)]
    skipped: dict[str, str] = {}
    for spec in specs:
        try:
            method = parse_method(spec)
        except MethodUnavailable as exc:
            skipped[spec] = str(exc)
            continue
        if not method.is_reference:
            methods.append(method)
    return methods, skipped


__all__ = ["EXAMPLES", "HF_BACKENDS", "KVPRESS_PRESSES", "METHOD_GRAMMAR", "QUANT_OPTIONS", "REFERENCE_SPEC", "Method",
           "MethodForm", "MethodUnavailable", "QuantOption", "grammar_help", "parse_method", "parse_methods",
           "parse_quant"]

_unknown, _hf, _hf_fp8, _kvpress = unknown_spec, hf_method, hf_fp8_method, kvpress_method  # old private names
