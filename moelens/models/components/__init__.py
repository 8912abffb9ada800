"""Building blocks shared by the hooked MoE models; a family picks the classes each layer is built from (moelens.models.recipe)."""

from moelens.models.components.attention import Attention, QKNormAfterRotaryAttention
from moelens.models.components.block import Block
from moelens.models.components.embed import Embed
from moelens.models.components.mlp import GatedMLP
from moelens.models.components.moe import Experts, GatedSharedExpertMoe, SharedExpertMoe, SharedFirstMoe, SparseMoe
from moelens.models.components.norm import RMSNorm
from moelens.models.components.rotary import Rotary
from moelens.models.components.router import Float32SoftmaxTopK, SigmoidGroupedTopK, SoftmaxTopK, TopKRouter

__all__ = [
    "Attention", "Block", "Embed", "Experts", "Float32SoftmaxTopK", "GatedMLP", "GatedSharedExpertMoe",
    "QKNormAfterRotaryAttention", "RMSNorm", "Rotary", "SharedExpertMoe", "SharedFirstMoe", "SigmoidGroupedTopK",
    "SoftmaxTopK", "SparseMoe", "TopKRouter",
]
