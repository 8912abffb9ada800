"""moelens: TransformerLens-style hooks, caches and analysis for Mixture-of-Experts language models.

TransformerLens code runs with `moelens` in place of `transformer_lens`: HookedTransformer, ActivationCache,
FactoredMatrix, HookedTransformerConfig (moelens's MoeConfig under TransformerLens's name), and the modules
hook_points, utils and patching are here under the same names."""

from moelens import hook_points, patching, utils
from moelens.cache import ActivationCache
from moelens.config import MoeConfig
from moelens.factored_matrix import FactoredMatrix
from moelens.hook_points import HookedRootModule, HookPoint
from moelens.kernels.expert_parallel import ExpertParallelError
from moelens.kv_cache import KVCache
from moelens.loaders import CheckpointError, CheckpointWarning
from moelens.models import FAMILIES, FAMILY_CLASSES, HookedTransformer

# every family's class, under its name (HookedQwen2Moe, ...): found from the family files, no list to edit
globals().update(FAMILY_CLASSES)

# TransformerLens's name for the config class; see README ("Differences from TransformerLens") for what differs
HookedTransformerConfig = MoeConfig

__all__ = [
    "ActivationCache",
    "CheckpointError",
    "CheckpointWarning",
    "ExpertParallelError",
    "FAMILIES",
    "FactoredMatrix",
    "HookPoint",
    "HookedRootModule",
    "HookedTransformer",
    "HookedTransformerConfig",
    "KVCache",
    "MoeConfig",
    "hook_points",
    "patching",
    "utils",
    *sorted(FAMILY_CLASSES),
]
__version__ = "0.1.0"
