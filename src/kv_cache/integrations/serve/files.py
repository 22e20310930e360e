"""The files ``kvcache serve`` reads for a request: only the ones its operator registered.

A request is data, never a path. Over HTTP, a method is

* a method spec without file references (``q4+kvzip@0.3``, ``kvzap@0.25``: the scorer shipped
  with the package for the model), or one whose file references are *names* the operator
  registered at start-up: ``plan[NAME]`` (``--plan NAME=PATH``), ``kvzap@0.25[NAME]``
  (``--scorer NAME=PATH``), ``q4p[NAME]`` / ``...u[NAME]`` (``--bit-profile NAME=PATH``, loaded
  at start-up: its widths are set on the quantization, its path never reaches the parser);
* a preset (``"8x"``);
* a plan as a JSON object that names no file (``layout.rotation_path`` and the policy's
  ``scorer`` null: a plan with a calibrated rotation or its own scorer is registered with
  ``--plan``).

Anything else inside ``[...]`` is refused with ``invalid_method`` (400) before the filesystem is
touched, so the answer is the same whether such a file exists or not. The registered files are
read and checked once, at start-up (:meth:`ServedFiles.register`); a request then only picks a
name. The command line (``kvcache compress``, ``kvcache eval``) keeps paths.
"""

from __future__ import annotations

import os
import re
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Iterable, Mapping

from .errors import ApiError

NAME_RE = re.compile(r"^[A-Za-z0-9][A-Za-z0-9_.-]{0,63}$")
"""A registered name: letters, digits, ``_``, ``.``, ``-``; no ``/``, at most 64 characters."""

KINDS = {"plan": "--plan", "scorer": "--scorer", "bit_profile": "--bit-profile"}
"""Kind of registered file -> the ``kvcache serve`` flag that registers it."""

FILE_FIELDS = (("layout", "rotation_path"), ("policy", "fields", "scorer"))
"""The fields of a plan object (``kvcache plan``'s JSON) that name files."""

_GROUP = re.compile(r"\[([^\[\]]*)\]")


def parse_registration(item: str | tuple[str, str], kind: str = "plan") -> tuple[str, str]:
    """``"NAME=PATH"`` or ``"PATH"`` (the name is the file's stem) -> ``(name, path)``."""
    if isinstance(item, tuple):
        name, path = item
    else:
        name, sep, path = str(item).partition("=")
        if not sep:
            name, path = Path(item).stem, item
    if not NAME_RE.match(name or ""):
        raise ValueError(f"{KINDS.get(kind, kind)}: a name is letters, digits, '_', '.' or '-' (at most 64, no '/'), "
                         f"as NAME=PATH; got name {name!r}")
    if not path:
        raise ValueError(f"{KINDS.get(kind, kind)} {name}: the path is empty")
    return name, str(path)


@dataclass(frozen=True)
class ServedFiles:
    """The registered files: plans (loaded), scorers and bit profiles (checked), by name."""

    plans: Mapping[str, Any] = field(default_factory=dict)  # name -> kv_cache.plan.CachePlan
    scorers: Mapping[str, str] = field(default_factory=dict)  # name -> path
    bit_profiles: Mapping[str, Any] = field(default_factory=dict)  # name -> {layer: (key_bits, value_bits)}
    paths: tuple[str, ...] = ()  # every registered file (absolute), for kv_cache.integrations.serve.errors.redact

    @classmethod
    def register(cls, plans: Iterable[str | tuple[str, str]] = (), scorers: Iterable[str | tuple[str, str]] = (),
                 bit_profiles: Iterable[str | tuple[str, str]] = (), model_config: Any = None) -> "ServedFiles":
        """Read and check each file now (start-up): a plan must load (and fit ``model_config`` when
        given), a scorer's header must read, a bit profile must load. Raises ``ValueError`` naming
        the flag and the file (for the operator), ``FileNotFoundError`` for a missing one."""
        from ...compression.scorer_file import read_header
        from ...plan import CachePlan
        from ...plan.bit_allocation import load_bit_profile

        out: dict[str, dict[str, Any]] = {"plan": {}, "scorer": {}, "bit_profile": {}}
        paths = []
        for kind, items in (("plan", plans), ("scorer", scorers), ("bit_profile", bit_profiles)):
            for item in items:
                name, path = parse_registration(item, kind)
                if name in out[kind]:
                    raise ValueError(f"{KINDS[kind]}: the name {name!r} is registered twice")
                if not Path(path).is_file():
                    raise FileNotFoundError(f"{KINDS[kind]} {name}={path}: no such file")
                if kind == "plan":
                    plan = CachePlan.load(path)
                    if model_config is not None:
                        plan.check_model(model_config)
                    out[kind][name] = plan
                elif kind == "scorer":
                    read_header(path)
                    full = str(Path(path).resolve())
                    if any(c in full for c in "+[],"):  # it goes into a spec: kvzap@<budget>[<path>]
                        raise ValueError(f"--scorer {name}={path}: the file's path may not hold '+', ',', '[' or "
                                         "']' (move or link the file)")
                    out[kind][name] = full
                else:  # loaded now: a request's spec never carries its path into the parser
                    out[kind][name] = load_bit_profile(path)
                paths.append(str(Path(path).resolve()))
        return cls(out["plan"], out["scorer"], out["bit_profile"], tuple(paths))

    def names(self, kind: str) -> list[str]:
        return sorted({"plan": self.plans, "scorer": self.scorers, "bit_profile": self.bit_profiles}[kind])

    # ------------------------------------------------------------------ requests
    def _refuse(self, spec: str, what: str, kind: str) -> ApiError:
        names = self.names(kind)
        return ApiError("invalid_method", f"method {spec!r} names a file ({what}): over HTTP a method names no "
                                          f"files, only {kind.replace('_', ' ')}s the operator registered by name "
                                          f"({KINDS[kind]} NAME=PATH); registered: {names}", param="method")

    def resolve_spec(self, spec: str) -> tuple[str, Any, dict[str, Any]]:
        """``(spec for the parser, plan, quant overrides)`` of a request's method spec, by the
        registered names it holds: ``plan`` is the registered :class:`~kv_cache.plan.CachePlan`
        of ``plan[NAME]`` (else None); a scorer's name becomes its file; a bit profile's
        ``p[NAME]`` / ``u[NAME]`` is taken out of the spec and returned as the
        ``layer_bits`` / ``evicted_layer_bits`` override of its :class:`~kv_cache.QuantConfig`.
        :class:`ApiError` ``invalid_method`` for a spec that names anything else inside
        brackets; nothing is read from the filesystem here."""
        whole = re.fullmatch(r"\s*plan\[([^\[\]]*)\]\s*", spec, flags=re.IGNORECASE)
        if whole:
            name = whole[1]
            if NAME_RE.match(name) and name in self.plans:
                return spec, self.plans[name], {}
            raise self._refuse(spec, whole[0].strip(), "plan")
        overrides: dict[str, Any] = {}

        def substitute(m: re.Match[str]) -> str:
            start = max(spec.rfind("+", 0, m.start()), spec.rfind(",", 0, m.start())) + 1
            head = spec[start:m.start()].strip().lower()
            kind = "plan" if head == "plan" else "bit_profile" if re.match(r"q\d", head) else "scorer"
            table = self.bit_profiles if kind == "bit_profile" else self.scorers if kind == "scorer" else {}
            name = m[1]
            if kind == "plan" or not NAME_RE.match(name) or name not in table:
                raise self._refuse(spec, m[0], kind)
            if kind == "scorer":
                return f"[{table[name]}]"
            letter = head[-1:]  # p: the widths per layer; u: the evicted tier's
            if letter not in ("p", "u"):
                raise self._refuse(spec, m[0], kind)
            overrides["layer_bits" if letter == "p" else "evicted_layer_bits"] = table[name]
            return "\x00"  # the letter and its bracket are taken out below

        resolved = _GROUP.sub(substitute, spec)
        resolved = re.sub(r"[pPuU]\x00", "", resolved)
        leftover = _GROUP.sub("", resolved)
        if "[" in leftover or "]" in leftover or "\x00" in resolved:
            raise ApiError("invalid_method", f"method {spec!r}: unbalanced brackets (a bracket holds the name of a "
                                             "registered file)", param="method")
        return resolved, None, overrides

    @staticmethod
    def check_plan_object(doc: Any) -> None:
        """Refuse (``invalid_method``) a plan object whose fields name files (:data:`FILE_FIELDS`),
        before it is decoded (decoding would look the files up)."""
        for trail in FILE_FIELDS:
            node: Any = doc
            for key in trail:
                node = node.get(key) if isinstance(node, dict) else None
            if node is not None:
                where = ".".join(trail)
                raise ApiError("invalid_method", f"plan.{where} names a file: a plan object given over HTTP names no "
                                                 f"files ({where} must be null); a plan that needs its own file is "
                                                 "registered by the operator (--plan NAME=PATH) and asked as "
                                                 "method 'plan[NAME]'", param="plan")


def absolute(path: str | os.PathLike) -> str:
    return str(Path(path).expanduser().resolve())
