"""The plugin's settings: ``additional_config={"kv_cache": {...}}`` parsed into a frozen object.

Nothing here imports vLLM.
"""

from __future__ import annotations

from dataclasses import asdict, dataclass
from typing import Any

from .codecs import CODECS, DEFAULT_CODEC

KEYS = ("codec", "blocks_per_step")
"""Keys accepted under ``additional_config["kv_cache"]``."""


@dataclass(frozen=True)
class PluginSettings:
    """What a run asked of the plugin.

    Parameters
    ----------
    codec : {"q4d", "q3d", "q2d", "q4", "q8"}, default "q4d"
        The paged codec (:mod:`kv_cache.integrations.vllm.codecs`).
    blocks_per_step : int, default 8
        KV blocks decoded per step of the streaming attention (the working set is
        ``blocks_per_step * block_size`` tokens per request, never a whole sequence).
    """

    codec: str = DEFAULT_CODEC
    blocks_per_step: int = 8

    def __post_init__(self) -> None:
        if self.codec not in CODECS:
            raise ValueError(f'additional_config["kv_cache"]["codec"] must be one of {list(CODECS)}; '
                             f"got {self.codec!r}")
        b = self.blocks_per_step
        if isinstance(b, bool) or not isinstance(b, int) or b < 1:
            raise ValueError(f'additional_config["kv_cache"]["blocks_per_step"] must be an int >= 1; got {b!r}')

    def to_dict(self) -> dict[str, Any]:
        return asdict(self)

    @classmethod
    def from_additional_config(cls, additional_config: Any) -> "PluginSettings | None":
        """``vllm_config.additional_config`` -> settings, or None when it has no ``"kv_cache"`` key.

        Raises
        ------
        ValueError
            ``"kv_cache"`` is not a mapping, has unknown keys, or a bad value.
        """
        if not additional_config or "kv_cache" not in additional_config:
            return None
        raw = additional_config["kv_cache"]
        if raw is None:
            raw = {}
        if not isinstance(raw, dict):
            raise ValueError(f'additional_config["kv_cache"] must be a mapping with keys {list(KEYS)}; '
                             f"got {type(raw).__name__}")
        unknown = sorted(set(raw) - set(KEYS))
        if unknown:
            raise ValueError(f'additional_config["kv_cache"] has unknown keys {unknown}; known: {list(KEYS)}')
        return cls(**raw)
