"""HookedGraniteMoe: Granite 3.0 / 3.1 MoE, PowerMoE (model_type granitemoe).

What is special about the family: Mixtral's layout with Granite's muP multipliers, each read from config.json
(1 where absent, as transformers):
- embedding_multiplier: the embedding rows are multiplied by it before they enter the stream (hook_embed and
  blocks.0.hook_resid_pre hold the product);
- residual_multiplier: each sublayer's output is multiplied by it before it is added (hook_attn_out and
  hook_mlp_out hold the product, so resid_pre + attn_out = resid_mid and resid_mid + mlp_out = resid_post;
  hook_z, hook_routed_out and the expert sites hold the modules' own outputs, before it);
- attention_multiplier: the softmax scale of the scores, in place of 1/sqrt(d_head);
- logits_scaling: the logits are the unembedding divided by it (hook_logits holds the quotient).
The router takes the top-k of its float32 logits and weights the k by a float32 softmax over them, cast to
the model's dtype. The Hub's checkpoints store each layer's experts stacked, block_sparse_moe.input_linear
[E, 2*d_expert, d_model] (gate rows first) and output_linear [E, d_model, d_expert], and the router as
block_sparse_moe.router.layer; transformers 5 names them experts.gate_up_proj / down_proj and router.weight.
q, k, v and o have biases only with attention_bias.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass

from moelens.config import HFConfig, MoeConfig, common_fields, routed_fields
from moelens.models.base import HookedTransformer
from moelens.models.components import SparseMoe
from moelens.models.components.multiplier_attention import MultiplierScaledAttention
from moelens.models.components.router import TopKLogitsSoftmax
from moelens.models.recipe import Recipe, decoder_recipe
from moelens.models.sites import Entry, attention_projections, decoder_site_map, router_references, routed_experts
from moelens.sitemap import ExpertStack, FusedExperts, Reference, SiteMap, Weight

MULTIPLIERS = ("embedding_multiplier", "residual_multiplier", "attention_multiplier", "logits_scaling")


@dataclass(frozen=True)
class GraniteMoeConfig(MoeConfig):
    """MoeConfig and Granite's muP multipliers (config.json's names)."""

    embedding_multiplier: float = 1.0
    residual_multiplier: float = 1.0
    attention_multiplier: float = 1.0
    logits_scaling: float = 1.0


def granite_recipe(cfg: GraniteMoeConfig, base: Recipe) -> Recipe:
    """`base` with Granite's stream multipliers: on every layer its residual multiplier, on the embedding and
    the logits theirs."""
    layers = tuple(dataclasses.replace(spec, residual_multiplier=cfg.residual_multiplier) for spec in base.layers)
    return dataclasses.replace(
        base, layers=layers, embedding_multiplier=cfg.embedding_multiplier, logits_divisor=cfg.logits_scaling
    )


def multiplier_fields(hf: HFConfig) -> dict:
    """The four multipliers, finite and positive, 1 where config.json has none (null is refused: transformers
    would multiply by it and fail)."""
    for name in MULTIPLIERS:
        if name in hf.raw and hf.raw[name] is None:
            raise ValueError(f"config.json: {name} is null; a finite positive number is needed (1 where absent)")
    return {name: hf.number(name, 1.0, above=0) for name in MULTIPLIERS}


def granite_site_map(cfg: GraniteMoeConfig, site_map: SiteMap) -> SiteMap:
    """The references of hook_logits divided by logits_scaling, as transformers divides lm_head's output."""
    references = tuple(
        dataclasses.replace(r, divisor=cfg.logits_scaling) if r.hook == "hook_logits" else r for r in site_map.references
    )
    return dataclasses.replace(site_map, references=references)


class HookedGraniteMoe(HookedTransformer):
    model_type = "granitemoe"

    @classmethod
    def recipe(cls, cfg: GraniteMoeConfig) -> Recipe:
        return granite_recipe(cfg, decoder_recipe(cfg, MultiplierScaledAttention, SparseMoe, TopKLogitsSoftmax))

    @classmethod
    def site_map(cls, cfg: GraniteMoeConfig) -> SiteMap:
        return granite_site_map(cfg, decoder_site_map(cfg, _layer_sites, mlp_module="block_sparse_moe"))

    @classmethod
    def config_from_hf(cls, raw: dict) -> GraniteMoeConfig:
        hf = HFConfig(raw)
        return GraniteMoeConfig(**granite_fields(hf), family=cls.model_type, fields_read=tuple(hf.read))


def granite_fields(hf: HFConfig) -> dict:
    """The fields granitemoe and granitemoeshared read alike (transformers' GraniteMoeConfig defaults)."""
    fields = granite_stream_fields(hf)
    n_experts = hf.integer("num_local_experts", 8, at_least=1)
    routed = routed_fields(
        hf, (True,) * fields["n_layers"], n_experts, hf.integer("intermediate_size", 11008, at_least=1),
        num_experts_per_tok=2,
    )
    return dict(**fields, **routed)


def granite_stream_fields(hf: HFConfig) -> dict:
    """What every Granite MoE family reads alike besides its feed-forward: the common fields (rotary over the
    whole head only), the four multipliers and attention_bias."""
    fields = common_fields(hf, rms_norm_eps=1e-6, max_position_embeddings=2048)
    if fields["rope"].partial_rotary_factor != 1.0:  # transformers' Granite rotary turns the whole head
        raise ValueError(
            f"partial_rotary_factor = {fields['rope'].partial_rotary_factor}: Granite's rotary (transformers') turns "
            "every dimension of the head, so only 1 is supported"
        )
    bias = hf.flag("attention_bias", False)
    return dict(**fields, **multiplier_fields(hf), qkv_bias=bias, o_bias=bias)


def granite_layer_sites(cfg: GraniteMoeConfig, layer: int, src: str, dst: str) -> list[Entry]:
    """Attention, router and routed experts of one layer, in the Hub's spelling or transformers 5's; the
    sublayer outputs' references times residual_multiplier, as transformers adds them."""
    return granite_attention_sites(cfg, src, dst) + [
        Reference(f"{dst}.hook_resid_mid", f"{src}.post_attention_layernorm", "in"),
        *granite_mixture_sites(cfg, src, dst),
    ]


def granite_attention_sites(cfg: GraniteMoeConfig, src: str, dst: str) -> list[Entry]:
    """q, k, v, o of one layer's self_attn; hook_attn_out is its output times residual_multiplier."""
    return attention_projections(cfg, src, dst) + [
        Reference(f"{dst}.attn.hook_z", f"{src}.self_attn.o_proj", "in"),
        Reference(f"{dst}.hook_attn_out", f"{src}.self_attn", "out.0", multiplier=cfg.residual_multiplier),
    ]


def granite_mixture_sites(cfg: GraniteMoeConfig, src: str, dst: str) -> list[Entry]:
    """The router and routed experts of one layer's block_sparse_moe (hook_mlp_out is the family's)."""
    moe = f"{src}.block_sparse_moe"
    return [
        Weight(f"{dst}.mlp.router.weight", (f"{moe}.router.layer.weight", f"{moe}.router.weight")),
        _experts(cfg, moe, dst),
        *router_references(dst, f"{moe}.router"),
        Reference(f"{dst}.mlp.hook_routed_out", f"{moe}.experts"),
    ]


def _layer_sites(cfg: GraniteMoeConfig, layer: int, src: str, dst: str) -> list[Entry]:
    return granite_layer_sites(cfg, layer, src, dst) + [
        Reference(f"{dst}.hook_mlp_out", f"{src}.block_sparse_moe", multiplier=cfg.residual_multiplier),
    ]


def _experts(cfg: GraniteMoeConfig, moe: str, dst: str) -> ExpertStack:
    """Stacked only: the Hub's input_linear / output_linear first, transformers 5's gate_up_proj / down_proj."""
    stack = routed_experts(cfg, (f"{moe}.experts",), dst, ())
    hub = FusedExperts(f"{moe}.input_linear.weight", f"{moe}.output_linear.weight")
    return dataclasses.replace(stack, fused=hub, other_fused=(stack.fused,), fused_first=True)
