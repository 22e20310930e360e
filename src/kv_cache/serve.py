"""The old import path of :mod:`kv_cache.integrations.serve` (``kvcache serve``'s server):
its public names stay importable from here."""

from .integrations.serve import *  # noqa: F401,F403
from .integrations.serve import __all__  # noqa: F401
