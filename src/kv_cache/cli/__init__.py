"""The ``kvcache`` command line: one module per subcommand group.

==============  ==========================================================================
module          subcommands
==============  ==========================================================================
``main``        the parser, ``eval``, ``demo`` (the README's main job), ``bill``
``calibrate``   ``calibrate``: calibrated KV rotations
``scorer``      ``calibrate-scorer``: a KVzap scorer
``codec``       ``calibrate-codec``: the storage codec's per-model bases
``allocate``    ``allocate``: key/value bits per layer under an average budget
``plan``        ``plan``: a cache plan from a byte target
``context``     ``compress``, ``ask``: compress a document once, ask it many times
``serve``       ``serve``, ``contexts``: the OpenAI-compatible server and its store's tool
==============  ==========================================================================

``kvcache`` (the console script) and ``python -m kv_cache.cli`` both run :func:`main`.
"""

from .main import build_parser, main

__all__ = ["build_parser", "main"]
