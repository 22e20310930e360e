"""Where models and data live: the cache directory and the project's ``shared/data`` folder.

``$KV_CACHE_HOME`` overrides the cache directory (``~/.cache/kv_cache``) and
``$KV_CACHE_SHARED_DATA`` overrides the search for ``shared/data``.
"""

from __future__ import annotations

import os
from pathlib import Path

ENV_CACHE_HOME = "KV_CACHE_HOME"
ENV_SHARED_DATA = "KV_CACHE_SHARED_DATA"

#: Name of the float32 SmolLM2 conversion's folder inside the cache directory.
SMOLLM2_HF_DIRNAME = "smollm2-135m-instruct-hf"


def default_cache_dir() -> Path:
    """Return the directory where downloaded and converted models are kept.

    Returns
    -------
    pathlib.Path
        ``$KV_CACHE_HOME`` if that variable is set and not empty, else
        ``~/.cache/kv_cache``. The directory is not created.
    """
    env = os.environ.get(ENV_CACHE_HOME)
    if env:
        return Path(env).expanduser()
    return Path.home() / ".cache" / "kv_cache"


def resolve_cache_dir(cache_dir: str | os.PathLike[str] | None) -> Path:
    """Return ``cache_dir`` as a path, or :func:`default_cache_dir` when it is None."""
    return default_cache_dir() if cache_dir is None else Path(cache_dir).expanduser()


def smollm2_converted_dir(cache_dir: str | os.PathLike[str] | None = None) -> Path:
    """Return the folder that holds the float32 conversion of SmolLM2-135M-Instruct.

    Parameters
    ----------
    cache_dir : str or os.PathLike, optional
        Cache directory; defaults to :func:`default_cache_dir`.

    Returns
    -------
    pathlib.Path
        ``<cache_dir>/smollm2-135m-instruct-hf``. It exists only after a first
        ``load_model("smollm2")``.
    """
    return resolve_cache_dir(cache_dir) / SMOLLM2_HF_DIRNAME


def shared_data_dir() -> Path:
    """Find the project's ``shared/data`` folder (evaluation texts and small models).

    Returns
    -------
    pathlib.Path
        ``$KV_CACHE_SHARED_DATA`` if set; otherwise the first ``shared/data`` folder
        found walking up from the ``kv_cache`` package's directory, then from the
        working directory.

    Raises
    ------
    FileNotFoundError
        If ``$KV_CACHE_SHARED_DATA`` names a missing folder, or no folder is found.
    """
    env = os.environ.get(ENV_SHARED_DATA)
    if env:
        path = Path(env).expanduser()
        if not path.is_dir():
            raise FileNotFoundError(f"${ENV_SHARED_DATA} is set to {env!r}, which is not a directory")
        return path
    starts = [Path(__file__).resolve().parents[1], Path.cwd().resolve()]
    for start in starts:
        for folder in (start, *start.parents):
            candidate = folder / "shared" / "data"
            if candidate.is_dir():
                return candidate
    raise FileNotFoundError(
        "could not find a shared/data folder above "
        + " or ".join(str(s) for s in starts)
        + f"; set ${ENV_SHARED_DATA} to its path"
    )
