"""Lazy, cached JIT build of the compiled kernels (``csrc/kv_kernels.cpp``).

The extension is compiled on first use (never when :mod:`kv_cache` is imported) with
:func:`torch.utils.cpp_extension.load` into ``$KV_CACHE_HOME/ext/<hash>/``, where ``<hash>``
covers the sources, the torch version, the compiler and the flags; a second process imports
the built library from there without recompiling. ``KV_CACHE_KERNELS`` selects the backend:

* unset, ``""`` or ``"auto"``: the compiled kernels (fastest code path the CPU supports),
  falling back to torch with one logged warning if the build fails;
* ``"torch"``: the pure-torch reference only (nothing is compiled);
* ``"generic"``: the compiled kernels restricted to their portable C++ path;
* ``"avx2"``: the compiled kernels restricted to AVX2 at most (no AVX-512);
* ``"triton"``: the Triton kernels on every device (nothing is compiled here; CPU tensors then
  need ``TRITON_INTERPRET=1``, Triton's interpreter: for tests).

``"generic"`` and ``"avx2"`` exist to test, on one machine, the code paths that other CPUs run.
Which backend serves which device is decided in :mod:`._select`.
"""

from __future__ import annotations

import hashlib
import importlib.util
import logging
import os
import sys
import threading
from pathlib import Path
from types import ModuleType

import torch

logger = logging.getLogger(__name__)

ENV_BACKEND = "KV_CACHE_KERNELS"
BACKENDS = ("auto", "torch", "generic", "avx2", "triton")
_ENV_CACHE_HOME = "KV_CACHE_HOME"  # same variable and default as kv_cache.models

CSRC = Path(__file__).resolve().parent / "csrc"
SOURCES = ("kv_kernels.cpp",)
HEADERS = ("kv_kernels_impl.h", "kv_paged.h", "kv_paged_impl.h", "kv_paged_write.h")
# Safe on any x86_64: no -march; the AVX2 code is behind a run-time CPU check in the source.
# -ffp-contract=off keeps the quantizer's rounding bit-exact (no implicit a*b+c fusion).
CFLAGS = ("-O3", "-std=c++17", "-fopenmp", "-ffp-contract=off")
LDFLAGS = ("-fopenmp",)
_NAME = "kv_cache_kernels"

_lock = threading.Lock()
_module: ModuleType | None = None
_error: str | None = None
_tried = False


def backend() -> str:
    """The backend requested by ``$KV_CACHE_KERNELS``: one of :data:`BACKENDS`.

    Raises
    ------
    ValueError
        The variable holds something else.
    """
    value = os.environ.get(ENV_BACKEND, "").strip().lower() or "auto"
    if value not in BACKENDS:
        raise ValueError(f"{ENV_BACKEND} must be one of {list(BACKENDS)} (or unset); got {value!r}")
    return value


def cache_home() -> Path:
    """``$KV_CACHE_HOME`` if set and not empty, else ``~/.cache/kv_cache`` (not created)."""
    env = os.environ.get(_ENV_CACHE_HOME)
    return Path(env).expanduser() if env else Path.home() / ".cache" / "kv_cache"


def build_hash() -> str:
    """Short hash of the sources, the torch version, the compiler and the flags."""
    h = hashlib.sha256()
    for name in SOURCES + HEADERS:
        h.update(name.encode())
        h.update((CSRC / name).read_bytes())
    h.update(torch.__version__.encode())
    h.update(os.environ.get("CXX", "c++").encode())
    h.update(" ".join(CFLAGS + LDFLAGS).encode())
    h.update(f"{sys.version_info[0]}.{sys.version_info[1]}".encode())
    return h.hexdigest()[:16]


def build_dir() -> Path:
    """``$KV_CACHE_HOME/ext/<build_hash()>``: where the library is built and cached."""
    return cache_home() / "ext" / build_hash()


def _library_path(directory: Path) -> Path | None:
    for path in sorted(directory.glob(f"{_NAME}*.so")):
        return path
    return None


def _import_built(directory: Path) -> ModuleType | None:
    """Import an already built library from ``directory`` (None if there is none)."""
    if not (directory / "BUILT").exists():
        return None
    path = _library_path(directory)
    if path is None:
        return None
    spec = importlib.util.spec_from_file_location(_NAME, path)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def _compile(directory: Path) -> ModuleType:
    from torch.utils import cpp_extension  # heavy import; only when building

    directory.mkdir(parents=True, exist_ok=True)
    module = cpp_extension.load(
        name=_NAME,
        sources=[str(CSRC / name) for name in SOURCES],
        extra_cflags=list(CFLAGS),
        extra_ldflags=list(LDFLAGS),
        extra_include_paths=[str(CSRC)],
        build_directory=str(directory),
        verbose=False,
    )
    (directory / "BUILT").write_text(torch.__version__ + "\n")
    return module


def load(*, raise_errors: bool = False) -> ModuleType | None:
    """Return the compiled extension, building it on first use; ``None`` means torch only.

    Thread-safe; the build (or its failure) happens once per process. A failed build logs one
    warning and the ops fall back to :mod:`kv_cache.kernels.reference`.

    Parameters
    ----------
    raise_errors : bool, default False
        Re-raise a build failure instead of returning ``None`` (used by
        ``python -m kv_cache.kernels``).

    Returns
    -------
    module or None
        ``None`` when ``KV_CACHE_KERNELS`` is ``torch`` or ``triton``, or when the build failed.
    """
    global _module, _error, _tried
    if _tried and not (raise_errors and _error):  # _tried is set last, after _module
        return _module
    with _lock:
        if not _tried:
            if backend() not in ("torch", "triton"):
                directory = build_dir()
                try:
                    _module = _import_built(directory) or _compile(directory)
                except Exception as exc:  # noqa: BLE001 - any build failure means "use torch"
                    _error = f"{type(exc).__name__}: {exc}"
                    logger.warning(
                        "kv_cache.kernels: building the compiled kernels in %s failed; falling back "
                        "to the torch reference (slower). Cause: %s", directory, _error)
            _tried = True
        if raise_errors and _error:
            raise RuntimeError(f"building the kv_cache kernels failed: {_error}")
        return _module


def available() -> bool:
    """True when the compiled kernels are in use (builds them on first call)."""
    return load() is not None


def build_error() -> str | None:
    """The reason the last build failed, or ``None``."""
    return _error


def isa() -> str:
    """The code path in use: ``"avx512"``, ``"avx2"``, ``"generic"`` or ``"torch"``."""
    module = load()
    if module is None:
        return "torch"
    return module.isa(isa_flag())


_ISA_FLAGS = {"auto": 0, "torch": 0, "generic": 1, "avx2": 2, "triton": 0}


def isa_flag() -> int:
    """The ``isa`` argument passed to the extension: 0 = best, 1 = portable only, 2 = AVX2 at most."""
    return _ISA_FLAGS[backend()]
