"""Family-neutral building blocks shared by every hooked MoE model."""

from moelens.models.components.attention import Attention
from moelens.models.components.block import Block
from moelens.models.components.embed import Embed
from moelens.models.components.mlp import GatedMLP
from moelens.models.components.moe import Experts, SparseMoe
from moelens.models.components.norm import RMSNorm
from moelens.models.components.rotary import Rotary
from moelens.models.components.router import Router

__all__ = ["Attention", "Block", "Embed", "Experts", "GatedMLP", "RMSNorm", "Rotary", "Router", "SparseMoe"]
