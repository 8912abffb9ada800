"""HookedGlm4Moe: GLM-4.5, GLM-4.5-Air, GLM-4.6 (model_type glm4_moe).

What is special about the family: the rotary turns only the first partial_rotary_factor of each head's dims
(0.5 when config.json says nothing, as transformers; rotate-half layout within them, the rest pass through);
q, k and v biased where attention_bias (o_proj never); where use_qk_norm (GLM-4.5, not GLM-4.5-Air), a
per-head RMSNorm of queries and keys before the rotary, so hook_q / hook_k hold the projections and
hook_rot_q / hook_rot_k the normed, rotated heads; the first first_k_dense_replace blocks are dense MLPs
(intermediate_size wide), the rest mixtures: DeepSeek-V3's float32 sigmoid router (SigmoidGroupedTopK:
e_score_correction_bias added only to choose, among the topk_group best of n_group groups, weights
renormalised when norm_topk_prob, times routed_scaling_factor, float32) and a shared expert
(moe_intermediate_size * n_shared_experts wide) added after the routed experts, ungated.

Like transformers, the model is the num_hidden_layers blocks: the Hub checkpoint's multi-token-prediction
layers (model.layers.92 of GLM-4.5, model.layers.46 of GLM-4.5-Air; num_nextn_predict_layers of them) are
not part of it, and loading passes over their keys.
"""

from __future__ import annotations

from dataclasses import dataclass

from moelens.config import HFConfig, MoeConfig, common_fields
from moelens.models.base import HookedTransformer
from moelens.models.components import Attention, SharedExpertMoe, SigmoidGroupedTopK
from moelens.models.components.qk_norm_attention import QKNormBeforeRotaryAttention
from moelens.models.recipe import Recipe, decoder_recipe
from moelens.models.deepseek_v3 import deepseek_mixture_fields
from moelens.models.sites import (
    Entry, attention_projections, decoder_site_map, dense_mlp, gated_mlp, router_references, routed_experts,
)
from moelens.sitemap import Reference, SiteMap, Weight


@dataclass(frozen=True)
class Glm4MoeConfig(MoeConfig):
    """MoeConfig plus whether queries and keys are normed (use_qk_norm) and how many multi-token-prediction
    layers the checkpoint stores after the last block (not run; see site_map)."""

    qk_norm: bool = False
    mtp_layers: int = 0


class HookedGlm4Moe(HookedTransformer):
    model_type = "glm4_moe"

    @classmethod
    def recipe(cls, cfg: Glm4MoeConfig) -> Recipe:
        # the q/k norm where config.json's use_qk_norm turns it on (GLM-4.5, 4.6; not Air, transformers' default)
        attention = QKNormBeforeRotaryAttention if cfg.qk_norm else Attention
        return decoder_recipe(cfg, attention, SharedExpertMoe, SigmoidGroupedTopK)

    @classmethod
    def site_map(cls, cfg: Glm4MoeConfig) -> SiteMap:
        # the Hub checkpoint's multi-token-prediction layers follow the last block; transformers skips them too
        mtp = tuple(f"model.layers.{i}." for i in range(cfg.n_layers, cfg.n_layers + cfg.mtp_layers))
        return decoder_site_map(cfg, _layer_sites, mtp)

    # transformers' Glm4MoeConfig defaults (GLM-4.5-Air's sizes), for the fields config.json leaves out
    defaults = dict(
        rms_norm_eps=1e-5, max_position_embeddings=131072, num_key_value_heads=8, partial_rotary_factor=0.5,
        rope_theta=10000.0, head_dim=None, n_routed_experts=128, num_experts_per_tok=8, moe_intermediate_size=1408,
        intermediate_size=10944, n_group=1, topk_group=1, routed_scaling_factor=1.0, first_k_dense_replace=1,
        use_qk_norm=False,
    )
    # other names config.json may use for a field ({other: field}, transformers' attribute_map)
    spellings: dict[str, str] = {"num_local_experts": "n_routed_experts"}

    @classmethod
    def config_from_hf(cls, raw: dict) -> Glm4MoeConfig:
        hf = HFConfig.with_spellings(raw, cls.spellings)
        d = cls.defaults
        head_dim = hf.integer("head_dim", d["head_dim"], at_least=1)  # None: hidden_size / num_attention_heads
        fields = common_fields(
            hf, rms_norm_eps=d["rms_norm_eps"], max_position_embeddings=d["max_position_embeddings"],
            num_key_value_heads=d["num_key_value_heads"], partial_rotary_factor=d["partial_rotary_factor"],
            rope_theta=d["rope_theta"], d_head=head_dim,
        )
        first_dense = hf.integer("first_k_dense_replace", d["first_k_dense_replace"], at_least=0)
        # transformers 5 saves num_nextn_predict_layers (num_mtp_layers is its attribute name); absent: none stored
        mtp_layers = hf.integer("num_nextn_predict_layers", None, at_least=0)
        if mtp_layers is None:
            mtp_layers = hf.integer("num_mtp_layers", 0, at_least=0)
        mixture = {k: d[k] for k in (
            "n_routed_experts", "num_experts_per_tok", "moe_intermediate_size", "intermediate_size", "n_group",
            "topk_group", "routed_scaling_factor",
        )}
        return Glm4MoeConfig(
            **fields,
            **deepseek_mixture_fields(hf, fields["n_layers"], first_dense, **mixture),
            family=cls.model_type,
            qkv_bias=hf.flag("attention_bias", False),  # q, k, v only: transformers' o_proj has no bias
            qk_norm=hf.flag("use_qk_norm", d["use_qk_norm"]),
            mtp_layers=mtp_layers,
            fields_read=tuple(hf.label(f) for f in hf.read),
        )


def attention_sites(cfg: Glm4MoeConfig, src: str, dst: str) -> list[Entry]:
    """q, k, v, o (biases where the config has them), the q/k norms where cfg.qk_norm, hook_z."""
    attn = f"{src}.self_attn"
    entries = attention_projections(cfg, src, dst) + [Reference(f"{dst}.attn.hook_z", f"{attn}.o_proj", "in")]
    if cfg.qk_norm:
        entries += [
            Weight(f"{dst}.attn.q_norm.weight", (f"{attn}.q_norm.weight",)),
            Weight(f"{dst}.attn.k_norm.weight", (f"{attn}.k_norm.weight",)),
        ]
    return entries


def _layer_sites(cfg: Glm4MoeConfig, layer: int, src: str, dst: str) -> list[Entry]:
    entries = attention_sites(cfg, src, dst)
    if not cfg.moe_layers[layer]:
        return entries + dense_mlp(src, dst)
    return entries + [
        Weight(f"{dst}.mlp.router.weight", (f"{src}.mlp.gate.weight",)),
        Weight(f"{dst}.mlp.router.e_score_correction_bias", (f"{src}.mlp.gate.e_score_correction_bias",)),
        routed_experts(cfg, (f"{src}.mlp.experts",), dst),
        *gated_mlp(f"{src}.mlp.shared_experts", f"{dst}.mlp.shared_expert"),
        *router_references(dst, f"{src}.mlp.gate"),
        Reference(f"{dst}.mlp.hook_routed_out", f"{src}.mlp.experts"),
        Reference(f"{dst}.mlp.shared_expert.hook_out", f"{src}.mlp.shared_experts"),
    ]
