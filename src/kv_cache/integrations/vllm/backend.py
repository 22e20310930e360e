"""The kv_cache attention backend for vLLM (registered as ``AttentionBackendEnum.CUSTOM``).

Cache layout (vLLM's head-major ``LBHNC``; the backend's KV spec is the contract)::

    kv_cache: uint8 [num_blocks, num_kv_heads, block_size, slot_bytes]
    slot:     [ key codes | key metadata | value codes | value metadata ]

``slot_bytes`` is :attr:`PagedCodec.slot_bytes` of the run's codec (``customize_spec`` publishes
it as the spec's ``state_content_bytes``), so the block manager sizes the pool, and reports its
capacity, from the bytes the codec really holds. Codec layouts: :mod:`.codecs`.

Per step: ``do_kv_cache_update`` encodes the step's keys and values into their slots; ``forward``
attends every request over its earlier tokens read from the codes plus the step's own tokens in
full precision (:func:`.attention.attend_batch`): on a CPU one compiled call per layer for the
whole batch, decoding rows and prefill chunks alike.

The codecs storing keys before RoPE (``q4db``, ``q3db``, ``q2db``) encode inside ``forward``
(``forward_includes_kv_cache_update``), where the batch's metadata gives each token's position
(its index in its request): keys are turned back with the layer's rotary frame, read from the
model's config (:func:`kv_cache.cache.rope_frame.rope_frames`; a model without RoPE or with
multimodal RoPE is refused when the layer is built, a layer without RoPE stores its keys as they
arrive).
"""

from __future__ import annotations

from dataclasses import dataclass, replace
from typing import ClassVar

import torch

from vllm.config import get_current_vllm_config, get_current_vllm_config_or_none
from vllm.model_executor.models.utils import extract_layer_index
from vllm.v1.attention.backend import (
    AttentionBackend,
    AttentionImpl,
    AttentionMetadataBuilder,
    AttentionType,
    CommonAttentionMetadata,
    MultipleOf,
)
from vllm.v1.kv_cache_interface import AttentionSpec, KVCacheLayout

from .attention import attend_batch
from .blocks import paged_rope
from .codecs import CODECS, KEY_GROUP, PagedCodec, first_kv_head, value_rotations, write_slots
from .settings import PluginSettings


def run_settings() -> PluginSettings:
    """The settings of the current vLLM run (``additional_config["kv_cache"]``, default q4d)."""
    cfg = get_current_vllm_config()
    return PluginSettings.from_additional_config(cfg.additional_config) or PluginSettings()


class KVCacheCodecBackend(AttentionBackend):
    """kv_cache's packed KV codes in vLLM's paged blocks (see the module docstring).

    ``codec_name`` is fixed by the per-codec subclasses (:data:`BACKEND_CLASSES`), which our CPU
    platform returns for the run's codec: vLLM calls ``customize_spec`` without a config, so the
    class itself must know its slot size. The base class (what ``CUSTOM`` is registered as, for
    platforms that honour ``CUSTOM`` themselves) reads the run's config where vLLM has set it.
    """

    codec_name: ClassVar[str | None] = None

    @classmethod
    def codec(cls, head_size: int) -> PagedCodec:
        name = cls.codec_name
        if name is None:
            cfg = get_current_vllm_config_or_none()
            if cfg is None:
                raise ValueError("the kv_cache backend cannot tell the run's codec here (no current vLLM config); "
                                 "select a per-codec class, e.g. " + BACKEND_CLASSES[CODECS[0]].__qualname__)
            name = (PluginSettings.from_additional_config(cfg.additional_config) or PluginSettings()).codec
        return PagedCodec(name, head_size)

    accept_output_buffer: bool = True
    forward_includes_kv_cache_update: bool = False
    supported_dtypes: ClassVar[list[torch.dtype]] = [torch.float16, torch.bfloat16, torch.float32]
    supported_kv_cache_dtypes: ClassVar[list[str]] = ["auto"]

    @staticmethod
    def get_name() -> str:
        return "CUSTOM"

    @staticmethod
    def get_impl_cls() -> type["KVCacheCodecImpl"]:
        return KVCacheCodecImpl

    @staticmethod
    def get_builder_cls() -> type["KVCacheCodecMetadataBuilder"]:
        return KVCacheCodecMetadataBuilder

    @staticmethod
    def get_supported_kernel_block_sizes(kv_cache_spec=None) -> list[int | MultipleOf]:
        return [MultipleOf(KEY_GROUP)]

    @classmethod
    def supported_kv_cache_layouts(cls) -> tuple[KVCacheLayout, ...]:
        return (KVCacheLayout.LBHNC,)

    @classmethod
    def supports_head_size(cls, head_size: int) -> bool:
        try:
            cls.codec(head_size)
        except ValueError:
            return False
        return True

    @classmethod
    def supports_attn_type(cls, attn_type: str) -> bool:
        return attn_type == AttentionType.DECODER

    @classmethod
    def customize_spec(cls, spec: AttentionSpec) -> AttentionSpec:
        """Declare the codec's bytes per (token, kv head) slot; the page is then uint8."""
        if spec.state_content_bytes is not None:
            return spec
        if spec.head_size_v != spec.head_size:
            raise ValueError(f"the kv_cache backend needs equal key and value head sizes; got "
                             f"{spec.head_size} and {spec.head_size_v}")
        codec = cls.codec(spec.head_size)
        return replace(spec, state_content_bytes=codec.slot_bytes, dtype=torch.uint8)


@dataclass
class KVCacheCodecMetadata:
    """Per-batch metadata (CPU tensors).

    query_start_loc : ``[R + 1]``; seq_lens : ``[R]`` (tokens including the step's);
    block_table : ``[R, max_blocks]``; slot_mapping : ``[N]``.
    """

    num_actual_tokens: int
    query_start_loc: torch.Tensor
    seq_lens: torch.Tensor
    block_table: torch.Tensor
    slot_mapping: torch.Tensor


class KVCacheCodecMetadataBuilder(AttentionMetadataBuilder[KVCacheCodecMetadata]):
    def __init__(self, kv_cache_spec, layer_names, vllm_config, device):
        super().__init__(kv_cache_spec, layer_names, vllm_config, device)

    def build(self, common_prefix_len: int, common_attn_metadata: CommonAttentionMetadata,
              fast_build: bool = False) -> KVCacheCodecMetadata:
        cam = common_attn_metadata
        return KVCacheCodecMetadata(
            num_actual_tokens=cam.num_actual_tokens,
            query_start_loc=cam.query_start_loc_cpu[: cam.num_reqs + 1],
            seq_lens=cam.seq_lens[: cam.num_reqs].cpu(),
            block_table=cam.block_table_tensor[: cam.num_reqs],
            slot_mapping=cam.slot_mapping[: cam.num_actual_tokens],
        )


class KVCacheCodecImpl(AttentionImpl[KVCacheCodecMetadata]):
    def __init__(self, num_heads: int, head_size: int, scale: float, num_kv_heads: int | None = None,
                 alibi_slopes=None, sliding_window=None, kv_cache_dtype: str = "auto", logits_soft_cap=None,
                 attn_type: str = AttentionType.DECODER, kv_sharing_target_layer_name=None, **kwargs) -> None:
        refused = []
        if alibi_slopes is not None:
            refused.append("ALiBi slopes")
        if sliding_window is not None:
            refused.append(f"a sliding window ({sliding_window})")
        if logits_soft_cap:
            refused.append(f"a logits soft cap ({logits_soft_cap})")
        if kwargs.get("sinks") is not None:
            refused.append("attention sinks")
        if kv_sharing_target_layer_name is not None:
            refused.append(f"KV sharing with {kv_sharing_target_layer_name}")
        if attn_type != AttentionType.DECODER:
            refused.append(f"attention type {attn_type}")
        if kv_cache_dtype != "auto":
            refused.append(f"kv_cache_dtype {kv_cache_dtype!r}")
        if refused:
            raise ValueError("the kv_cache attention backend does not support " + ", ".join(refused))
        self.num_heads = num_heads
        self.head_size = head_size
        self.scale = float(scale)
        self.num_kv_heads = num_kv_heads or num_heads
        if self.num_heads % self.num_kv_heads:
            raise ValueError(f"num_heads ({num_heads}) must be a multiple of num_kv_heads ({self.num_kv_heads})")
        self.kv_cache_dtype = kv_cache_dtype
        self.settings = run_settings()
        self.codec = PagedCodec(self.settings.codec, head_size)
        self._rotation: torch.Tensor | None = None
        self._rotation_ready = False
        cfg = get_current_vllm_config_or_none()  # set while vLLM builds the model
        self._total_kv_heads = None if cfg is None else cfg.model_config.get_total_num_kv_heads()
        self._frames = None
        if self.codec.pre_rope:  # refused here (a clear error at build) for models without RoPE
            if cfg is None:
                raise ValueError(f"kv_cache codec {self.codec.name!r} stores keys before RoPE and needs the model's "
                                 "config (no current vLLM config)")
            from ...cache.rope_frame import rope_frames

            self._frames = rope_frames(cfg.model_config.hf_config, head_size)
        self._frame_ready = False
        self._frame = self._key_rope = None

    def _first_head(self) -> int:
        """The model-wide index of this rank's first kv head (0 without tensor parallelism)."""
        from vllm.distributed import get_tensor_model_parallel_rank, get_tensor_model_parallel_world_size

        world = get_tensor_model_parallel_world_size()
        if world == 1:
            return 0
        total = self._total_kv_heads or self.num_kv_heads * world
        return first_kv_head(get_tensor_model_parallel_rank(), world, total)

    def _rot(self, layer, device) -> torch.Tensor | None:
        if not self._rotation_ready:
            index = extract_layer_index(layer.layer_name)
            first = self._first_head() if self.codec.rotated_values else 0
            self._rotation = value_rotations(self.codec, index, self.num_kv_heads, device, first_head=first)
            self._rotation_ready = True
        return self._rotation

    def _layer_frame(self, layer):
        """``(RopeFrame, PagedRope)`` of this layer for pre-RoPE codecs; ``(None, None)`` otherwise
        (and for a layer without RoPE, whose keys are stored as they arrive)."""
        if not self._frame_ready:
            if self._frames is not None:
                index = extract_layer_index(layer.layer_name)
                if not 0 <= index < len(self._frames):
                    raise ValueError(f"layer {layer.layer_name!r} (index {index}) is outside the model config's "
                                     f"{len(self._frames)} layers")
                self._frame = self._frames[index]
                self._key_rope = None if self._frame is None else paged_rope(self._frame)
            self._frame_ready = True
        return self._frame, self._key_rope

    def do_kv_cache_update(self, layer, key: torch.Tensor, value: torch.Tensor, kv_cache: torch.Tensor,
                           slot_mapping: torch.Tensor) -> None:
        n = slot_mapping.shape[0]
        if n == 0:
            return
        if self.codec.pre_rope:
            raise RuntimeError(f"kv_cache codec {self.codec.name!r} encodes inside forward (it needs the tokens' "
                               "positions); vLLM called do_kv_cache_update for it")
        write_slots(kv_cache, key[:n], value[:n], slot_mapping, self.codec, self._rot(layer, key.device))

    @staticmethod
    def positions(query_start_loc: torch.Tensor, seq_lens: torch.Tensor) -> torch.Tensor:
        """Each scheduled token's position, int64 ``[N]``: request ``i``'s ``q_i`` tokens are the
        last of its ``seq_lens[i]`` (``q_i = query_start_loc[i + 1] - query_start_loc[i]``)."""
        qsl = query_start_loc.long()
        qlen = qsl[1:] - qsl[:-1]
        n = int(qsl[-1]) if qsl.numel() else 0
        owner = torch.repeat_interleave(torch.arange(qlen.numel()), qlen, output_size=n)
        return seq_lens.long()[owner] - qlen[owner] + (torch.arange(n) - qsl[:-1][owner])

    def forward(self, layer, query: torch.Tensor, key: torch.Tensor, value: torch.Tensor, kv_cache: torch.Tensor,
                attn_metadata: KVCacheCodecMetadata | None, output: torch.Tensor | None = None,
                output_scale=None, output_block_scale=None) -> torch.Tensor:
        if output_scale is not None or output_block_scale is not None:
            raise NotImplementedError("fused output quantization is not supported by the kv_cache backend")
        if attn_metadata is None:  # profiling run
            return output
        n = attn_metadata.num_actual_tokens
        rot = self._rot(layer, query.device)
        frame, key_rope = self._layer_frame(layer)
        codec = self.codec if frame is not None or not self.codec.pre_rope else PagedCodec(self.codec.name[:-1],
                                                                                          self.head_size)
        if self.codec.pre_rope and n:  # encode here: the metadata gives each token's position
            pos = self.positions(attn_metadata.query_start_loc, attn_metadata.seq_lens)[:n]
            write_slots(kv_cache, key[:n], value[:n], attn_metadata.slot_mapping[:n], codec, rot,
                        rope=frame, positions=pos)
        out = output[:n].view(n, self.num_heads, self.head_size)
        q = query[:n].view(n, self.num_heads, self.head_size)
        k = key[:n].view(n, self.num_kv_heads, self.head_size)
        v = value[:n].view(n, self.num_kv_heads, self.head_size)
        res = attend_batch(q, kv_cache, attn_metadata.block_table, attn_metadata.query_start_loc,
                           attn_metadata.seq_lens, k, v, codec, rot, self.scale, self.settings.blocks_per_step,
                           key_rope=key_rope)
        out.copy_(res)
        return output


class KVCacheQ8Backend(KVCacheCodecBackend):
    codec_name: ClassVar[str | None] = "q8"


class KVCacheQ4dBackend(KVCacheCodecBackend):
    codec_name: ClassVar[str | None] = "q4d"


class KVCacheQ3dBackend(KVCacheCodecBackend):
    codec_name: ClassVar[str | None] = "q3d"


class KVCacheQ2dBackend(KVCacheCodecBackend):
    codec_name: ClassVar[str | None] = "q2d"


class KVCacheQ4Backend(KVCacheCodecBackend):
    codec_name: ClassVar[str | None] = "q4"


class KVCacheQ4dbBackend(KVCacheCodecBackend):
    codec_name: ClassVar[str | None] = "q4db"
    forward_includes_kv_cache_update: bool = True  # positions come with the forward's metadata


class KVCacheQ3dbBackend(KVCacheQ4dbBackend):
    codec_name: ClassVar[str | None] = "q3db"


class KVCacheQ2dbBackend(KVCacheQ4dbBackend):
    codec_name: ClassVar[str | None] = "q2db"


BACKEND_CLASSES: dict[str, type[KVCacheCodecBackend]] = {
    "q8": KVCacheQ8Backend, "q4d": KVCacheQ4dBackend, "q3d": KVCacheQ3dBackend, "q2d": KVCacheQ2dBackend,
    "q4": KVCacheQ4Backend, "q4db": KVCacheQ4dbBackend, "q3db": KVCacheQ3dbBackend, "q2db": KVCacheQ2dbBackend,
}
"""One backend class per codec (``customize_spec`` gets no config, so the class carries the codec)."""
if set(BACKEND_CLASSES) != set(CODECS):
    raise ImportError(f"BACKEND_CLASSES {sorted(BACKEND_CLASSES)} must cover CODECS {sorted(CODECS)}")
