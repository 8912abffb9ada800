"""HookedSolarOpen: Solar-Open-100B (model_type solar_open).

What is special about the family: YaRN rotary (optionally over a part of each head); a float32 sigmoid router
whose e_score_correction_bias is added only to choose experts (`hook_choice_scores`), optionally limited to
the best `topk_group` of `n_group` expert groups; weights read from the unbiased sigmoid, renormalised when
norm_topk_prob, times routed_scaling_factor, kept float32; a shared expert (moe_intermediate_size *
n_shared_experts wide) added after the routed experts; every block a mixture (first_k_dense_replace is
ignored, as transformers builds it).
"""

from __future__ import annotations

from moelens.config import HFConfig, MoeConfig
from moelens.models.base import HookedTransformer
from moelens.models.components import Attention, Components, SharedExpertMoe, SigmoidGroupedTopK
from moelens.models.sites import Entry, attention_projections, decoder_site_map, gated_mlp, router_references, routed_experts
from moelens.sitemap import Reference, SiteMap, Weight


class HookedSolarOpen(HookedTransformer):
    model_type = "solar_open"
    components = Components(attention=Attention, moe=SharedExpertMoe, router=SigmoidGroupedTopK)

    @classmethod
    def site_map(cls, cfg: MoeConfig) -> SiteMap:
        return decoder_site_map(cfg, _layer_sites)

    @classmethod
    def config_from_hf(cls, raw: dict) -> MoeConfig:
        hf = HFConfig(raw)
        n_layers = hf.integer("num_hidden_layers", at_least=1)
        d_expert = hf.integer("moe_intermediate_size", at_least=1)
        n_experts = hf.integer("n_routed_experts", at_least=1)
        top_k = hf.integer("num_experts_per_tok", at_least=1, at_most=n_experts)
        n_group, topk_group = hf.integer("n_group", 1, at_least=1), hf.integer("topk_group", 1, at_least=1)
        SigmoidGroupedTopK.check_groups(n_experts, top_k, n_group, topk_group)
        return MoeConfig(
            family=cls.model_type,
            d_model=hf.integer("hidden_size", at_least=1),
            n_layers=n_layers,
            n_heads=hf.integer("num_attention_heads", at_least=1),
            n_kv_heads=hf.integer("num_key_value_heads", 8, at_least=1),
            d_head=hf.integer("head_dim", 128, at_least=1),  # transformers' SolarOpenConfig default
            d_vocab=hf.integer("vocab_size", at_least=1),
            norm_eps=hf.number("rms_norm_eps", 1e-5, at_least=0),
            rope=hf.rope(),
            max_position_embeddings=hf.integer("max_position_embeddings", 131072, at_least=1),
            qkv_bias=hf.flag("attention_bias", False),
            act_fn=hf.text("hidden_act", "silu"),
            moe_layers=(True,) * n_layers,
            n_experts=n_experts,
            top_k=(top_k,) * n_layers,
            d_expert=d_expert,
            d_shared=d_expert * hf.integer("n_shared_experts", 1, at_least=1),
            norm_topk_prob=hf.flag("norm_topk_prob", True),
            routed_scaling_factor=hf.number("routed_scaling_factor", 1.0),
            n_group=n_group,
            topk_group=topk_group,
            tie_word_embeddings=hf.flag("tie_word_embeddings", False),
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
