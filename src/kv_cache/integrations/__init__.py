"""kv_cache inside other engines and behind other interfaces.

* :mod:`.vllm`: the vLLM plugin (an attention backend over our codes in vLLM's paged blocks);
* :mod:`.lm_eval`: the ``kv_cache`` model of lm-evaluation-harness;
* :mod:`.serve`: ``kvcache serve``, the OpenAI-compatible server over compressed contexts.

Each imports the library downward; nothing in ``compression/``, ``kernels/``, ``cache/`` or
``attention/`` imports them, and importing this package imports no engine. The old import
paths ``kv_cache.lm_eval_model`` and ``kv_cache.serve`` still work.
"""
