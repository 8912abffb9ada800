"""moelens: TransformerLens-style hooks, caches and analysis for Mixture-of-Experts language models.

TransformerLens code runs with `moelens` in place of `transformer_lens`: HookedTransformer, ActivationCache,
FactoredMatrix, HookedTransformerConfig (TransformerLens's constructor of a config, giving a MoeConfig), and the modules
hook_points, utils, patching and evals are here under the same names."""

from moelens import evals, hook_points, patching, utils
from moelens.cache import ActivationCache
from moelens.config import MoeConfig
from moelens.factored_matrix import FactoredMatrix
from moelens.hook_points import HookedRootModule, HookPoint
from moelens.kernels.expert_parallel import ExpertParallelError
from moelens.kv_cache import KVCache
from moelens.loaders import CheckpointError, CheckpointWarning
from moelens.models import (
    FAMILIES,
    HookedDeepseekV3,
    HookedDeepseekV32,
    HookedGlm4Moe,
    HookedGlmMoeDsa,
    HookedGptOss,
    HookedHunyuanMoe,
    HookedLlama4,
    HookedMiniMaxM2,
    HookedMixtral,
    HookedOlmoe,
    HookedQwen2Moe,
    HookedQwen3Moe,
    HookedQwen3Next,
    HookedQwen3_5Moe,
    HookedSolarOpen,
    HookedTransformer,
)
from moelens.tl_config import HookedTransformerConfig


__all__ = [
    "ActivationCache",
    "CheckpointError",
    "CheckpointWarning",
    "ExpertParallelError",
    "FAMILIES",
    "FactoredMatrix",
    "HookPoint",
    "HookedDeepseekV3",
    "HookedDeepseekV32",
    "HookedGlm4Moe",
    "HookedGlmMoeDsa",
    "HookedGptOss",
    "HookedHunyuanMoe",
    "HookedLlama4",
    "HookedMiniMaxM2",
    "HookedMixtral",
    "HookedOlmoe",
    "HookedQwen2Moe",
    "HookedQwen3Moe",
    "HookedQwen3Next",
    "HookedQwen3_5Moe",
    "HookedRootModule",
    "HookedSolarOpen",
    "HookedTransformer",
    "HookedTransformerConfig",
    "KVCache",
    "MoeConfig",
    "evals",
    "hook_points",
    "patching",
    "utils",
]
__version__ = "0.1.0"
