"""vLLM's CPU platform, honouring ``attention_backend="CUSTOM"`` for the kv_cache backend.

Why a platform plugin: vLLM 0.32's ``CpuPlatform.get_attn_backend_cls`` logs "Cannot use CUSTOM
backend on CPU" and returns ``CPU_ATTN``, so a user who asked for 4-bit codes would silently get
the bf16 cache. The alternatives were worse: re-pointing the registry's ``CPU_ATTN`` member at our
class would change every CPU run, selected or not. This subclass differs from ``CpuPlatform`` only
when a run selects ``CUSTOM`` or carries ``additional_config["kv_cache"]``; it is registered
through vLLM's official ``vllm.platform_plugins`` group (``kv_cache.integrations.vllm:cpu_platform``).

Start-up refusals (``ValueError``, before any weight is loaded where vLLM allows):

* ``additional_config["kv_cache"]`` without ``attention_backend="CUSTOM"`` (the settings would
  be ignored) or with ``CUSTOM`` naming another plugin's backend;
* bad settings (unknown codec or key);
* a kv-cache dtype other than ``auto`` (the codec already defines the stored bytes);
* a block size that is not a multiple of 32 (a key group is 32 slots of one block);
* per layer, through the backend's ``validate_configuration``: MLA, sliding windows, attention
  sinks, encoder or cross attention, a head size the codec cannot pack.
"""

from __future__ import annotations

import logging

from vllm.platforms.cpu import CpuPlatform
from vllm.v1.attention.backends.registry import AttentionBackendEnum

from . import BACKEND_PATH, CONFIG_KEY
from .codecs import KEY_GROUP
from .settings import PluginSettings

logger = logging.getLogger(__name__)


def _selected(vllm_config) -> bool:
    return vllm_config.attention_config.backend == AttentionBackendEnum.CUSTOM


def check_selection(vllm_config) -> PluginSettings | None:
    """Validate a run's selection; return its settings, or None when the run does not select us.

    Raises
    ------
    ValueError
        Any refusal listed in the module docstring that the whole-run config shows.
    """
    settings = PluginSettings.from_additional_config(vllm_config.additional_config)
    selected = _selected(vllm_config)
    if not selected:
        if settings is not None:
            raise ValueError(
                f'additional_config["{CONFIG_KEY}"] is set but attention_backend is '
                f"{vllm_config.attention_config.backend!r}: the kv_cache codecs only run with "
                '--attention-backend CUSTOM; without it vLLM would store its own uncompressed cache')
        return None
    path = AttentionBackendEnum.CUSTOM.get_path() if AttentionBackendEnum.CUSTOM.is_overridden() else None
    if path != BACKEND_PATH:
        if settings is not None:
            raise ValueError(f"attention_backend CUSTOM is registered as {path!r}, not the kv_cache backend "
                             f"{BACKEND_PATH!r} (another plugin took it); cannot apply "
                             f'additional_config["{CONFIG_KEY}"]')
        return None
    settings = settings or PluginSettings()
    cache_dtype = vllm_config.cache_config.cache_dtype
    if cache_dtype != "auto":
        raise ValueError(f"the kv_cache backend stores its own codes (codec {settings.codec!r}); kv_cache_dtype "
                         f"must be 'auto', got {cache_dtype!r}")
    return settings


class KVCacheCpuPlatform(CpuPlatform):
    """``CpuPlatform`` plus the ``CUSTOM`` kv_cache backend (see the module docstring)."""

    @classmethod
    def check_and_update_config(cls, vllm_config) -> None:
        settings = check_selection(vllm_config)
        super().check_and_update_config(vllm_config)
        if settings is None:
            return
        block_size = vllm_config.cache_config.block_size
        if block_size is not None and block_size % KEY_GROUP:
            raise ValueError(f"the kv_cache backend needs a block size that is a multiple of {KEY_GROUP} "
                             f"(a key group is {KEY_GROUP} slots of one block); got {block_size}")
        logger.info("kv_cache: attention backend CUSTOM with codec %s", settings.codec)

    @classmethod
    def get_attn_backend_cls(cls, selected_backend, attn_selector_config, num_heads=None) -> str:
        if selected_backend != AttentionBackendEnum.CUSTOM or not AttentionBackendEnum.CUSTOM.is_overridden():
            return super().get_attn_backend_cls(selected_backend, attn_selector_config, num_heads)
        path = AttentionBackendEnum.CUSTOM.get_path()
        if path != BACKEND_PATH:
            return path  # another plugin's CUSTOM backend: vLLM's CPU platform would drop it too
        from vllm.config import get_current_vllm_config

        from .backend import BACKEND_CLASSES

        settings = check_selection(get_current_vllm_config()) or PluginSettings()
        backend = BACKEND_CLASSES[settings.codec]
        c = attn_selector_config
        reasons = backend.validate_configuration(
            head_size=c.head_size, dtype=c.dtype, kv_cache_dtype=c.kv_cache_dtype, block_size=c.block_size,
            use_mla=c.use_mla, has_sink=c.has_sink, use_sparse=c.use_sparse, use_mm_prefix=c.use_mm_prefix,
            use_per_head_quant_scales=c.use_per_head_quant_scales, device_capability=None,
            attn_type=c.attn_type, has_sliding_window=c.has_sliding_window, use_non_causal=c.use_non_causal,
            use_batch_invariant=c.use_batch_invariant, use_kv_connector=c.use_kv_connector, use_pcp=c.use_pcp,
            use_adaptive_verification=c.use_adaptive_verification, use_dcp=c.use_dcp, use_rswa=c.use_rswa)
        if reasons:
            raise ValueError(f"the kv_cache attention backend cannot serve this model/config: {'; '.join(reasons)} "
                             f"({c!r})")
        return f"{backend.__module__}.{backend.__qualname__}"
