"""The old import path of :mod:`kv_cache.integrations.lm_eval` (``lm_eval --model kv_cache``
after ``import kv_cache.lm_eval_model``, and the ``kvcache-lm-eval`` script): it stays."""

from .integrations.lm_eval import *  # noqa: F401,F403
from .integrations.lm_eval import __all__  # noqa: F401

if __name__ == "__main__":  # python -m kv_cache.lm_eval_model: lm-eval's CLI with our model
    from .integrations.lm_eval import cli_main

    cli_main()
