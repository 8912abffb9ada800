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
from moelens.models import FAMILIES, FAMILY_CLASSES, HookedTransformer
from moelens.tl_config import HookedTransformerConfig

# every family's class, under its name (HookedQwen2Moe, ...): found from the family files, no list to edit
globals().update(FAMILY_CLASSES)


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
    "evals",
    "hook_points",
    "patching",
    "utils",
    *sorted(FAMILY_CLASSES),
]
__version__ = "0.1.0"
