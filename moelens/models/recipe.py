"""A model as a recipe: one LayerSpec per layer (its token mixer, its feed-forward, its norm), chosen by the
family for each layer from its config, and the final norm.

    Recipe(layers=(LayerSpec(mixer=Attention, ffn=Dense()), LayerSpec(mixer=Attention, ffn=Mixture(SparseMoe,
           SoftmaxTopK)), ...), final_norm=RMSNorm)

A family's `recipe(cfg)` returns it (most families: `decoder_recipe`, softmax attention on every layer and a
mixture where cfg.moe_layers says). A layer may lack a mixer or a feed-forward (a layer of Nemotron-H is one of
Mamba-2, attention or MoE); a block then has only the sublayer it has.

Each part says, from the config, what it holds (`param_terms`: a mixer class's (cfg, layer), a feed-forward's
(cfg, layer), a norm class's (d), a router class's (cfg)) and a mixer what its state holds (`state_tensors`);
Recipe.param_terms and Recipe.state_tensors gather them for moelens plan, which builds nothing.
"""

from __future__ import annotations

import dataclasses
import math
from dataclasses import dataclass
from typing import TYPE_CHECKING

from torch import nn

from moelens.models.components.mlp import GatedMLP
from moelens.models.components.moe import SparseMoe
from moelens.models.components.norm import RMSNorm
from moelens.models.components.router import TopKRouter
from moelens.models.components.softcap import check_cap
from moelens.models.mixers.base import StateTensor
from moelens.models.terms import ParamTerm, under

if TYPE_CHECKING:
    from moelens.config import MoeConfig


@dataclass(frozen=True)
class Dense:
    """A dense gated MLP of cfg.d_mlp every token goes through."""

    mlp: type[GatedMLP] = GatedMLP
    is_moe = False

    def param_terms(self, cfg: MoeConfig, layer: int) -> tuple[ParamTerm, ...]:
        return self.mlp.param_terms(cfg.d_model, cfg.d_mlp, "dense_mlp")

    def build(self, cfg: MoeConfig, layer: int) -> nn.Module:
        return self.mlp(cfg.d_model, cfg.d_mlp, cfg.act_fn)


@dataclass(frozen=True)
class Mixture:
    """A mixture of experts: the arrangement (routed experts alone, or with a shared expert) and its router."""

    moe: type[SparseMoe]
    router: type[TopKRouter]
    is_moe = True

    def param_terms(self, cfg: MoeConfig, layer: int) -> tuple[ParamTerm, ...]:
        return self.moe.param_terms(cfg, layer, self.router)

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
    # each sublayer's output is multiplied by this before it is added to the stream (Granite's muP
    # residual_multiplier); hook_attn_out / hook_mlp_out hold the product, what the stream receives
    residual_multiplier: float = 1.0

    def __post_init__(self) -> None:
        if self.mixer is None and self.ffn is None:
            raise ValueError("a layer needs a token mixer or a feed-forward (LayerSpec with neither)")
        _check_multiplier("residual_multiplier", self.residual_multiplier)

    @property
    def is_moe(self) -> bool:
        return self.ffn is not None and self.ffn.is_moe


@dataclass(frozen=True)
class Recipe:
    """The layers and the final norm; and the stream's two constant factors outside the blocks (Granite's muP
    multipliers): the embedding is multiplied by embedding_multiplier before it enters the stream (hook_embed
    holds the product), and the logits are the unembedding divided by logits_divisor (hook_logits holds the
    quotient)."""

    layers: tuple[LayerSpec, ...]
    final_norm: type[nn.Module] = RMSNorm
    embedding_multiplier: float = 1.0
    logits_divisor: float = 1.0
    # the logits then softcapped in float32, cap * tanh(logits / cap) (Beam's final_logit_softcapping; hook_logits
    # holds the capped logits); None: none
    logits_softcap: float | None = None

    def __post_init__(self) -> None:
        _check_multiplier("embedding_multiplier", self.embedding_multiplier)
        _check_multiplier("logits_divisor", self.logits_divisor)
        if self.logits_softcap is not None:
            check_cap("logits_softcap", self.logits_softcap)

    def check(self, cfg: MoeConfig) -> None:
        if len(self.layers) != cfg.n_layers:
            raise ValueError(f"the recipe has {len(self.layers)} layers, the config {cfg.n_layers}")
        for layer, spec in enumerate(self.layers):
            if spec.is_moe != bool(cfg.moe_layers[layer]):
                raise ValueError(f"layer {layer}: the recipe's feed-forward and cfg.moe_layers disagree on the mixture")

    def routers(self) -> list[type[TopKRouter]]:
        return [spec.ffn.router for spec in self.layers if spec.is_moe]

    def param_terms(self, cfg: MoeConfig) -> tuple[ParamTerm, ...]:
        """Every parameter and buffer of the model, named as HookedTransformer names them, from the classes of
        its parts (no module built): the embedding, per layer its norms, token mixer (under the mixer class's
        block_attribute) and feed-forward (under mlp), the final norm and, untied, the unembedding."""
        head = 2 * cfg.d_vocab * cfg.d_model  # the unembedding's matmul, whichever term holds its matrix
        terms = [ParamTerm("embed.weight", (cfg.d_vocab, cfg.d_model), "embeddings",
                           flops=head if cfg.tie_word_embeddings else 0)]
        for layer, spec in enumerate(self.layers):
            block, own = f"blocks.{layer}", []
            if spec.block is not None:  # a block of its own arrangement says what it holds
                own += under(block, _asked(spec.block, "block")(cfg, layer, spec))
            elif spec.mixer is not None:
                own += under(f"{block}.ln1", _asked(spec.norm, "norm")(cfg.d_model))
                own += under(f"{block}.{spec.mixer.block_attribute}", _asked(spec.mixer, "token mixer")(cfg, layer))
            if spec.ffn is not None and spec.block is None:
                own += under(f"{block}.ln2", _asked(spec.norm, "norm")(cfg.d_model))
                own += under(f"{block}.mlp", _asked(spec.ffn, "feed-forward")(cfg, layer))
            terms += [dataclasses.replace(t, layer=layer) for t in own]
        terms += under("ln_final", _asked(self.final_norm, "norm")(cfg.d_model))
        if not cfg.tie_word_embeddings:  # tied: the embedding's matrix, counted once
            terms.append(ParamTerm("unembed.weight", (cfg.d_vocab, cfg.d_model), "unembedding", flops=head))
        if cfg.unembed_bias:
            terms.append(ParamTerm("unembed.bias", (cfg.d_vocab,), "unembedding"))
        return tuple(terms)

    def state_tensors(self, cfg: MoeConfig) -> list[tuple[StateTensor, ...]]:
        """Per layer, the tensors its mixer's state holds, each with its dtype; none for a layer without a mixer."""
        return [() if spec.mixer is None else spec.block.state_tensors(cfg, spec) if spec.block is not None
                else spec.mixer.state_tensors(cfg) for spec in self.layers]


def _check_multiplier(name: str, value: float) -> None:
    """A stream factor must be a finite, nonzero number (zero would erase the stream, or divide by zero)."""
    if isinstance(value, bool) or not isinstance(value, (int, float)) or not math.isfinite(value) or value == 0:
        raise ValueError(f"{name} must be a finite nonzero number, got {value!r}")


def _asked(part, kind: str):
    """part.param_terms, or an error naming the part that does not say what it holds."""
    terms = getattr(part, "param_terms", None)
    if terms is None:
        name = getattr(part, "__name__", type(part).__name__)
        raise TypeError(f"the {kind} {name} has no param_terms: each part of a recipe says what it holds for a config "
                        "(moelens.models.terms), which moelens plan counts")
    return terms


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
