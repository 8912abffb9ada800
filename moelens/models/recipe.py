"""A model as a recipe: one LayerSpec per layer (its token mixer, its feed-forward, its norm), chosen by the
family for each layer from its config, and the final norm.

    Recipe(layers=(LayerSpec(mixer=Attention, ffn=Dense()), LayerSpec(mixer=Attention, ffn=Mixture(SparseMoe,
           SoftmaxTopK)), ...), final_norm=RMSNorm)

A family's `recipe(cfg)` returns it (most families: `decoder_recipe`, softmax attention on every layer and a
mixture where cfg.moe_layers says). A layer may lack a mixer or a feed-forward (a layer of Nemotron-H is one of
Mamba-2, attention or MoE); a block then has only the sublayer it has.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING

from torch import nn

from moelens.models.components.mlp import GatedMLP
from moelens.models.components.moe import SparseMoe
from moelens.models.components.norm import RMSNorm
from moelens.models.components.router import TopKRouter
from moelens.models.mixers.base import StateBytes

if TYPE_CHECKING:
    from moelens.config import MoeConfig


@dataclass(frozen=True)
class Dense:
    """A dense gated MLP of cfg.d_mlp every token goes through."""

    mlp: type[GatedMLP] = GatedMLP
    is_moe = False

    def build(self, cfg: MoeConfig, layer: int) -> nn.Module:
        return self.mlp(cfg.d_model, cfg.d_mlp, cfg.act_fn)


@dataclass(frozen=True)
class Mixture:
    """A mixture of experts: the arrangement (routed experts alone, or with a shared expert) and its router."""

    moe: type[SparseMoe]
    router: type[TopKRouter]
    is_moe = True

    def build(self, cfg: MoeConfig, layer: int) -> nn.Module:
        return self.moe(cfg, layer, self.router)


FeedForward = Dense | Mixture


@dataclass(frozen=True)
class LayerSpec:
    """One layer: its token mixer's class (built as mixer(cfg, layer); None: no mixer), its feed-forward (None:
    none), the class of its pre-norms (each sublayer has one) and, where not the usual Block, its block's class."""

    mixer: type[nn.Module] | None
    ffn: FeedForward | None
    norm: type[nn.Module] = RMSNorm
    # the block class built from this spec (None: components.block.Block); a family whose block has several
    # sublayers (LongCat-Flash) gives its own, listing them in sublayers()
    block: type[nn.Module] | None = None

    def __post_init__(self) -> None:
        if self.mixer is None and self.ffn is None:
            raise ValueError("a layer needs a token mixer or a feed-forward (LayerSpec with neither)")

    @property
    def is_moe(self) -> bool:
        return self.ffn is not None and self.ffn.is_moe


@dataclass(frozen=True)
class Recipe:
    layers: tuple[LayerSpec, ...]
    final_norm: type[nn.Module] = RMSNorm

    def check(self, cfg: MoeConfig) -> None:
        if len(self.layers) != cfg.n_layers:
            raise ValueError(f"the recipe has {len(self.layers)} layers, the config {cfg.n_layers}")
        for layer, spec in enumerate(self.layers):
            if spec.is_moe != bool(cfg.moe_layers[layer]):
                raise ValueError(f"layer {layer}: the recipe's feed-forward and cfg.moe_layers disagree on the mixture")

    def routers(self) -> list[type[TopKRouter]]:
        return [spec.ffn.router for spec in self.layers if spec.is_moe]

    def state_bytes(self, cfg: MoeConfig) -> list[StateBytes]:
        """Per layer, what its mixer's state holds (values per token and per sequence); nothing for a layer
        without a mixer."""
        return [StateBytes() if spec.mixer is None else spec.mixer.state_bytes(cfg) for spec in self.layers]


def decoder_recipe(
    cfg: MoeConfig,
    attention: type[nn.Module],
    moe: type[SparseMoe],
    router: type[TopKRouter],
    norm: type[nn.Module] = RMSNorm,
    dense_mlp: type[GatedMLP] = GatedMLP,
) -> Recipe:
    """The usual decoder: `attention` on every layer, then a mixture where cfg.moe_layers says, else a dense MLP."""
    mixture, dense = Mixture(moe, router), Dense(dense_mlp)
    layers = tuple(LayerSpec(attention, mixture if is_moe else dense, norm) for is_moe in cfg.moe_layers)
    return Recipe(layers, norm)
