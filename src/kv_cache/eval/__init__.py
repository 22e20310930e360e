"""Offline evaluation: task builders (:mod:`kv_cache.eval.tasks`) for ``kvcache eval``."""

from kv_cache.eval import tasks
from kv_cache.eval.tasks import *  # noqa: F403 - the names are exactly tasks.__all__

__all__ = [*tasks.__all__]
