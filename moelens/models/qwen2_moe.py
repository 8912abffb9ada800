"""HookedQwen2Moe: Qwen1.5-MoE-A2.7B, Qwen2-57B-A14B (model_type qwen2_moe).

What is special about the family: biased q/k/v, a softmax router whose top-k weights are renormalised only
when norm_topk_prob says so and are cast back to the model dtype, a shared expert run first and gated by a
sigmoid after the routed experts, and dense blocks where mlp_only_layers / decoder_sparse_step say so.
"""

from __future__ import annotations

from moelens.config import HFConfig, MoeConfig, common_fields, routed_fields
from moelens.models.base import HookedTransformer
from moelens.models.components import Attention, GatedSharedExpertMoe, SoftmaxTopK
from moelens.models.recipe import Recipe, decoder_recipe
from moelens.models.sites import Entry, attention_projections, decoder_site_map, dense_mlp, gated_mlp, router_references, routed_experts
from moelens.sitemap import Reference, SiteMap, Weight


class HookedQwen2Moe(HookedTransformer):
    model_type = "qwen2_moe"

    @classmethod
    def recipe(cls, cfg: MoeConfig) -> Recipe:
        return decoder_recipe(cfg, Attention, GatedSharedExpertMoe, SoftmaxTopK)

    @classmethod
    def site_map(cls, cfg: MoeConfig) -> SiteMap:
        return decoder_site_map(cfg, _layer_sites)

    @classmethod
    def config_from_hf(cls, raw: dict) -> MoeConfig:
        hf = HFConfig(raw)
        fields = common_fields(hf, rms_norm_eps=1e-6, max_position_embeddings=32768)
        n_experts = hf.integer("num_experts", at_least=0)
        if hf.flag("use_sliding_window", False):
            raise ValueError("use_sliding_window=true is not supported (no released Qwen2-MoE checkpoint sets it)")
        moe_layers = mixture_layers(hf, fields["n_layers"], n_experts)
        any_moe = any(moe_layers)
        d_expert = hf.integer("moe_intermediate_size", at_least=1) if any_moe else 0
        return MoeConfig(
            **fields,
            **routed_fields(hf, moe_layers, n_experts, d_expert),
            family=cls.model_type,
            qkv_bias=hf.flag("qkv_bias", True),
            d_mlp=dense_width(hf, moe_layers),
            d_shared=hf.integer("shared_expert_intermediate_size", at_least=1) if any_moe else 0,
            norm_topk_prob=hf.flag("norm_topk_prob", False),
            fields_read=tuple(hf.read),
        )


def mixture_layers(hf: HFConfig, n_layers: int, n_experts: int) -> tuple[bool, ...]:
    """Which blocks are mixtures, by transformers' Qwen rule (Qwen2-MoE and Qwen3-MoE): not listed in
    mlp_only_layers, every decoder_sparse_step-th block, and only if num_experts > 0."""
    sparse_step = hf.integer("decoder_sparse_step", 1, at_least=1)
    mlp_only = set(hf.integers("mlp_only_layers", [], at_least=0, at_most=n_layers - 1))
    return tuple(i not in mlp_only and n_experts > 0 and (i + 1) % sparse_step == 0 for i in range(n_layers))


def dense_width(hf: HFConfig, moe_layers: tuple[bool, ...]) -> int:
    """The dense blocks' intermediate_size (Qwen2-MoE and Qwen3-MoE); not needed, so 0 where absent, when every
    block is a mixture."""
    if all(moe_layers):
        return hf.integer("intermediate_size", 0, at_least=0)
    return hf.integer("intermediate_size", at_least=1)


def _layer_sites(cfg: MoeConfig, layer: int, src: str, dst: str) -> list[Entry]:
    return attention_projections(cfg, src, dst) + feed_forward_sites(cfg, layer, src, dst)


def feed_forward_sites(cfg: MoeConfig, layer: int, src: str, dst: str) -> list[Entry]:
    """A dense MLP, or Qwen2-MoE's mixture (router, experts, a shared expert gated by shared_expert_gate); Qwen3-Next
    stores its feed-forwards the same way."""
    if not cfg.moe_layers[layer]:
        return dense_mlp(src, dst)
    return [
        Weight(f"{dst}.mlp.router.weight", (f"{src}.mlp.gate.weight",)),
        routed_experts(cfg, (f"{src}.mlp.experts",), dst),
        *gated_mlp(f"{src}.mlp.shared_expert", f"{dst}.mlp.shared_expert"),
        Weight(f"{dst}.mlp.shared_gate.weight", (f"{src}.mlp.shared_expert_gate.weight",)),
        *router_references(dst, f"{src}.mlp.gate"),
        Reference(f"{dst}.mlp.hook_routed_out", f"{src}.mlp.experts"),
        Reference(f"{dst}.mlp.shared_expert.hook_out", f"{src}.mlp.shared_expert"),
        Reference(f"{dst}.mlp.hook_shared_gate", f"{src}.mlp.shared_expert_gate"),
    ]
