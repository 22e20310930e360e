"""The peers a method spec can name: transformers' ``QuantizedCache`` backends (``hf-<backend>-int<bits>``,
``hf-fp8``) and kvpress presses (``kvpress-[adakv-]<press>@<kept>``), rows of
:data:`kv_cache.spec.grammar.METHOD_GRAMMAR`."""

from __future__ import annotations

import contextlib
import re
from typing import NamedTuple

from .method import Method


def _unknown(spec: str, why: str) -> ValueError:
    from .grammar import unknown_spec  # the message lists every form of the grammar, which imports this module

    return unknown_spec(spec, why)


KVPRESS_PRESSES = {  # spec name -> kvpress class
    "snapkv": "SnapKVPress",
    "streamingllm": "StreamingLLMPress",
    "knorm": "KnormPress",
    "expectedattention": "ExpectedAttentionPress",
    "tova": "TOVAPress",
    "observedattention": "ObservedAttentionPress",
    "kvzip": "KVzipPress",
}
KVPRESS_WRAPPERS = {"adakv": "AdaKVPress"}
"""``kvpress-adakv-<press>@<kept>``: the press wrapped in kvpress' head-wise budget (simulated:
kvpress masks evicted keys, it does not free them)."""


class HFBackend(NamedTuple):
    """One row of :data:`HF_BACKENDS`: a backend of transformers' ``QuantizedCache``."""

    name: str  # transformers' backend name
    bits: tuple[int, ...]
    package: str  # pip package
    module: str  # its import name
    example_bits: int


HF_BACKENDS = {  # spec name (hf-<name>-int<bits>) -> backend
    "quanto": HFBackend("quanto", (2, 4), "optimum-quanto", "optimum.quanto", 4),
    "hqq": HFBackend("HQQ", (2, 4, 8), "hqq", "hqq", 2),
}
# transformers' documented defaults: per-channel keys and values, group 64, residual 128.
HF_QUANT_KWARGS = {"axis_key": 0, "axis_value": 0, "q_group_size": 64, "residual_length": 128}


def hf_method(backend: str, spec: str, m: re.Match[str]) -> Method:
    hf = HF_BACKENDS[backend]
    bits = int(m["bits"])
    if bits not in hf.bits:
        raise _unknown(spec, f"{backend} supports int{list(hf.bits)}")

    def make(model):
        from transformers import QuantizedCache

        return QuantizedCache(hf.name, model.config, nbits=bits, **HF_QUANT_KWARGS), contextlib.nullcontext

    settings = ", ".join(f"{k}={v!r}" for k, v in HF_QUANT_KWARGS.items())
    return Method(spec, "hf", bits, None, make, resolved=f"transformers QuantizedCache({hf.name!r}, nbits={bits}, "
                  f"{settings})", requires=(hf.module, hf.package))


def hf_fp8_method(spec: str, m: re.Match[str]) -> Method:
    def make(model):
        from .hf_fp8 import make_fp8_cache

        return make_fp8_cache(model.config), contextlib.nullcontext

    return Method(spec, "hf", 8, None, make, resolved="transformers QuantizedCache('fp8') (per-tensor e4m3)")


def kvpress_method(spec: str, m: re.Match[str]) -> Method:
    press, kept = m["press"], float(m["kept"])
    wrapper = None
    head, _, rest = press.partition("-")
    if rest and head in KVPRESS_WRAPPERS:
        wrapper, press = KVPRESS_WRAPPERS[head], rest
    if press not in KVPRESS_PRESSES:
        raise _unknown(spec, f"kvpress press must be one of {list(KVPRESS_PRESSES)}, optionally wrapped as "
                             f"{'/'.join(KVPRESS_WRAPPERS)}-<press>")
    if not 0.0 < kept <= 1.0:
        raise _unknown(spec, "kvpress specs take the kept fraction in (0, 1]")

    def make(model):
        import kvpress
        from transformers import DynamicCache

        press_obj = getattr(kvpress, KVPRESS_PRESSES[press])(compression_ratio=1.0 - kept)
        if wrapper is not None:
            press_obj = getattr(kvpress, wrapper)(press_obj)
        return DynamicCache(), lambda: press_obj(model)

    inner = f"{KVPRESS_PRESSES[press]}(compression_ratio={1.0 - kept!r})"
    return Method(spec, "kvpress", None, kept, make, prefill_only_context=True,
                  resolved=f"kvpress {inner if wrapper is None else f'{wrapper}({inner})'}",
                  requires=("kvpress", "kvpress"))
