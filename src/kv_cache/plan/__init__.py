"""The plan layer, between :mod:`kv_cache.cache` and :mod:`kv_cache.eval`: what runs a model to
decide how a cache is laid out.

* :mod:`.calibration`: fitting calibrated KV rotations on a model (math dictionary §17.7);
* :mod:`.sensitivity`: what quantizing each layer's keys or values costs (next-token KL, §20);
* :mod:`.bit_allocation`: the exact allocation of bits per layer under a mean, bit-profile files (§20).

Nothing in :mod:`kv_cache.compression` or :mod:`kv_cache.kernels` imports from here.
"""

from .plan import CachePlan, LayerPlan  # noqa: E402
from .planner import PRESETS, parse_target, plan_for, predict_bytes, preset_plan  # noqa: E402
from .preset_scorers import model_preset_plan, preset_scorer  # noqa: E402

__all__ = ["PRESETS", "CachePlan", "LayerPlan", "model_preset_plan", "parse_target", "plan_for", "predict_bytes",
           "preset_plan", "preset_scorer"]
