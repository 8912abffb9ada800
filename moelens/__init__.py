"""moelens: TransformerLens-style hooks, caches and analysis for Mixture-of-Experts language models."""

from moelens.cache import ActivationCache
from moelens.config import MoeConfig
from moelens.hooks import HookedRootModule, HookPoint
from moelens.kernels.expert_parallel import ExpertParallelError
from moelens.kv_cache import KVCache
from moelens.loaders import CheckpointError, CheckpointWarning
from moelens.models import (
    FAMILIES,
    HookedDeepseekV3,
    HookedGlm4Moe,
    HookedGptOss,
    HookedHunyuanMoe,
    HookedMiniMaxM2,
    HookedMixtral,
    HookedOlmoe,
    HookedQwen2Moe,
    HookedQwen3Moe,
    HookedSolarOpen,
    HookedTransformer,
)

__all__ = [
    "ActivationCache",
    "CheckpointError",
    "CheckpointWarning",
    "ExpertParallelError",
    "FAMILIES",
    "HookPoint",
    "HookedDeepseekV3",
    "HookedGlm4Moe",
    "HookedGptOss",
    "HookedHunyuanMoe",
    "HookedMiniMaxM2",
    "HookedMixtral",
    "HookedOlmoe",
    "HookedQwen2Moe",
    "HookedQwen3Moe",
    "HookedSolarOpen",
    "HookedRootModule",
    "HookedTransformer",
    "KVCache",
    "MoeConfig",
]
__version__ = "0.1.0"
