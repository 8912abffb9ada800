"""HookedSolarOpen: Solar-Open-100B (model_type solar_open).

What is special about the family: YaRN rotary (optionally over a part of each head); a float32 sigmoid router
whose e_score_correction_bias is added only to choose experts (`hook_choice_scores`), optionally limited to
the best `topk_group` of `n_group` expert groups; weights read from the unbiased sigmoid, renormalised when
norm_topk_prob, times routed_scaling_factor, kept float32; a shared expert (moe_intermediate_size *
n_shared_experts wide) added after the routed experts; every block a mixture (first_k_dense_replace is
ignored, as transformers builds it).
"""

from __future__ import annotations

from moelens.config import HFConfig, MoeConfig, common_fields
from moelens.models.base import HookedTransformer
from moelens.models.components import Attention, SharedExpertMoe, SigmoidGroupedTopK
from moelens.models.deepseek_v3 import deepseek_mixture_fields
from moelens.models.recipe import Recipe, decoder_recipe
from moelens.models.sites import Entry, attention_projections, decoder_site_map, gated_mlp, router_references, routed_experts
from moelens.sitemap import Reference, SiteMap, Weight


class HookedSolarOpen(HookedTransformer):
    model_type = "solar_open"

    @classmethod
    def recipe(cls, cfg: MoeConfig) -> Recipe:
        return decoder_recipe(cfg, Attention, SharedExpertMoe, SigmoidGroupedTopK)

    @classmethod
    def site_map(cls, cfg: MoeConfig) -> SiteMap:
        return decoder_site_map(cfg, _layer_sites)

    @classmethod
    def config_from_hf(cls, raw: dict) -> MoeConfig:
        hf = HFConfig(raw)
        fields = common_fields(
            hf, rms_norm_eps=1e-5, max_position_embeddings=131072, num_key_value_heads=8,
            d_head=hf.integer("head_dim", 128, at_least=1),  # transformers' SolarOpenConfig default
        )
        return MoeConfig(
            **fields,
            # every block a mixture (first_k_dense_replace is not read); no defaults for the experts' sizes
            **deepseek_mixture_fields(
                hf, fields["n_layers"], first_dense=0, n_group=1, topk_group=1, routed_scaling_factor=1.0
            ),
            family=cls.model_type,
            qkv_bias=hf.flag("attention_bias", False),
            fields_read=tuple(hf.read),
            fields_ignored=tuple(f for f in ("first_k_dense_replace", "intermediate_size") if f in raw),
        )


def _layer_sites(cfg: MoeConfig, layer: int, src: str, dst: str) -> list[Entry]:
    return attention_projections(cfg, src, dst) + [
        Weight(f"{dst}.mlp.router.weight", (f"{src}.mlp.gate.weight",)),
        Weight(f"{dst}.mlp.router.e_score_correction_bias", (f"{src}.mlp.gate.e_score_correction_bias",)),
        routed_experts(cfg, (f"{src}.mlp.experts",), dst),
        *gated_mlp(f"{src}.mlp.shared_experts", f"{dst}.mlp.shared_expert"),
        *router_references(dst, f"{src}.mlp.gate"),
        Reference(f"{dst}.mlp.hook_routed_out", f"{src}.mlp.experts"),
        Reference(f"{dst}.mlp.shared_expert.hook_out", f"{src}.mlp.shared_experts"),
    ]
