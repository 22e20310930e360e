"""kv_cache inside vLLM: packed KV codes in vLLM's own paged blocks (``pip install kv_cache[vllm]``).

Select it with vLLM's own flags::

    LLM(model, attention_backend="CUSTOM", additional_config={"kv_cache": {"codec": "q4d"}})
    vllm serve MODEL --attention-backend CUSTOM --additional-config '{"kv_cache": {"codec": "q4d"}}'

Two entry points (``pyproject.toml``), both inert unless a run selects the backend:

* ``vllm.general_plugins`` -> :func:`register`: registers the backend class as vLLM's
  ``AttentionBackendEnum.CUSTOM`` through ``vllm.v1.attention.backends.registry.register_backend``.
* ``vllm.platform_plugins`` -> :func:`cpu_platform`: on a CPU build of vLLM, a subclass of vLLM's
  ``CpuPlatform`` that honours ``CUSTOM`` (vLLM's CPU platform ignores it and would silently use
  its bf16 cache) and refuses, at start-up, settings the codecs cannot serve. Without our
  selection it answers exactly as ``CpuPlatform``.

See ``docs/vllm.md``. Importing this package imports neither vLLM nor torch.
"""

from __future__ import annotations

BACKEND_PATH = "kv_cache.integrations.vllm.backend.KVCacheCodecBackend"
PLATFORM_PATH = "kv_cache.integrations.vllm.platform.KVCacheCpuPlatform"
CONFIG_KEY = "kv_cache"
"""The key of vLLM's ``additional_config`` that holds this plugin's settings."""

__all__ = ["BACKEND_PATH", "CONFIG_KEY", "PLATFORM_PATH", "cpu_platform", "register"]


def register() -> None:
    """``vllm.general_plugins`` entry point: make ``CUSTOM`` name our backend (idempotent).

    A ``CUSTOM`` backend already registered by another plugin is left alone (and a run that
    selects ``CUSTOM`` then gets that one; our platform refuses a ``kv_cache`` setting for it).
    """
    from vllm.v1.attention.backends.registry import AttentionBackendEnum, register_backend

    member = AttentionBackendEnum.CUSTOM
    if member.is_overridden() and member.get_path() != BACKEND_PATH:
        return
    register_backend(member, BACKEND_PATH)


def cpu_platform() -> str | None:
    """``vllm.platform_plugins`` entry point: our CPU platform where vLLM would pick its CPU one.

    Returns None (not activated) where vLLM's own detection would not pick ``CpuPlatform``: a
    CUDA build (whose platform honours ``CUSTOM`` itself), or AMD's ``ZenCpuPlatform``.
    """
    from vllm.platforms import cpu_platform_plugin

    if cpu_platform_plugin() != "vllm.platforms.cpu.CpuPlatform":
        return None
    return PLATFORM_PATH
