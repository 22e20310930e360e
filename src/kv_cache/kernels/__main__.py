"""``python -m kv_cache.kernels``: build the compiled kernels now and print where they live.

Exit status 0 when the extension is built (or was already), 1 when the build failed (the
library then falls back to torch) or ``KV_CACHE_KERNELS=torch`` (or ``triton``) disables it.
"""

from __future__ import annotations

import sys

from . import _build


def main() -> int:
    if _build.backend() in ("torch", "triton"):
        print(f"{_build.ENV_BACKEND}={_build.backend()}: compiled kernels disabled, nothing built")
        return 1
    try:
        module = _build.load(raise_errors=True)
    except RuntimeError as exc:
        print(f"kv_cache.kernels: {exc}", file=sys.stderr)
        return 1
    print(f"kv_cache.kernels: built {module.__file__} (code path: {_build.isa()})")
    return 0


if __name__ == "__main__":
    sys.exit(main())
