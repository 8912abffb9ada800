"""HookedHYV3: Tencent's Hy3 (Hunyuan v3; tencent/Hy3, tencent/Hy3-preview; model_type hy_v3).

What is special about the family: GLM-4.5's blocks (moelens.models.glm4_moe) with Qwen3's attention (a per-head
RMSNorm of queries and keys before the rotary, always; head_dim 128 unless config.json says otherwise; q, k, v
and o biased where attention_bias) and a mixture without expert groups: the float32 sigmoid router adds its
correction bias only to choose, the weights are the chosen scores always renormalised (+1e-20) and times
router_scaling_factor (SigmoidGroupedTopK with one group); an ungated shared expert
moe_intermediate_size * num_shared_experts wide. Dense and mixture blocks are listed per layer by mlp_layer_types
("dense" / "sparse"; transformers' default: the first block dense). The correction bias is the mixture block's
buffer (mlp.e_score_correction_bias), not the router's. enable_moe_fp32_combine adds the routed and shared outputs
in float32 and rounds once, which is what an addition in the model's dtype does: nothing to model.

Config names are the Hub's (num_experts, num_shared_experts, router_scaling_factor); the DeepSeek spellings of
them, which transformers' HYV3Config does not read, are refused rather than read silently.

Like transformers, the model is the num_hidden_layers blocks: the Hub checkpoint's multi-token-prediction layer
(model.layers.80, num_nextn_predict_layers) is not part of it, and loading passes over its keys.
"""

from __future__ import annotations

from moelens.config import HFConfig, common_fields, refuse_unread_fields
from moelens.models.components import SharedExpertMoe, SigmoidGroupedTopK
from moelens.models.components.qk_norm_attention import QKNormBeforeRotaryAttention
from moelens.models.deepseek_v3 import deepseek_mixture_fields
from moelens.models.glm4_moe import Glm4MoeConfig, HookedGlm4Moe, attention_sites
from moelens.models.glm4_moe_lite import mlp_layer_types
from moelens.models.recipe import Recipe, decoder_recipe
from moelens.models.sites import Entry, decoder_site_map, dense_mlp, router_references, routed_experts
from moelens.sitemap import Reference, SiteMap, Weight

# config.json's names for the mixture fields deepseek_mixture_fields reads (transformers' attribute_map included)
SPELLINGS = {
    "num_experts": "n_routed_experts", "num_local_experts": "n_routed_experts",
    "num_shared_experts": "n_shared_experts", "router_scaling_factor": "routed_scaling_factor",
}
# Present in Hy3's config.json, unused by transformers' model: the q/k norm's switch (always on there), the
# experts' width under another name (moe_intermediate_size is read), first_k_dense_replace (mlp_layer_types
# decides; checked against it), and the float32 combine (rounds as the model's dtype does)
IGNORED_FIELDS = ("qk_norm", "expert_hidden_dim", "first_k_dense_replace", "enable_moe_fp32_combine")


class HookedHYV3(HookedGlm4Moe):
    model_type = "hy_v3"

    @classmethod
    def recipe(cls, cfg: Glm4MoeConfig) -> Recipe:
        return decoder_recipe(cfg, QKNormBeforeRotaryAttention, SharedExpertMoe, SigmoidGroupedTopK)

    @classmethod
    def site_map(cls, cfg: Glm4MoeConfig) -> SiteMap:
        mtp = tuple(f"model.layers.{i}." for i in range(cfg.n_layers, cfg.n_layers + cfg.mtp_layers))
        return decoder_site_map(cfg, _layer_sites, mtp)

    # transformers' HYV3Config defaults (Hy3's sizes), for the fields config.json leaves out
    defaults = dict(
        hidden_size=4096, rms_norm_eps=1e-5, max_position_embeddings=131072, num_key_value_heads=8, head_dim=128,
        rope_theta=11_158_840.0, n_routed_experts=192, num_experts_per_tok=8, n_shared_experts=1,
        moe_intermediate_size=1536, intermediate_size=13312, routed_scaling_factor=2.826,
    )

    @classmethod
    def config_from_hf(cls, raw: dict) -> Glm4MoeConfig:
        refuse_unread_fields(raw, SPELLINGS, "HYV3Config")
        hf = HFConfig.with_spellings(raw, SPELLINGS)
        d = cls.defaults
        fields = common_fields(
            hf, rms_norm_eps=d["rms_norm_eps"], max_position_embeddings=d["max_position_embeddings"],
            num_key_value_heads=d["num_key_value_heads"], rope_theta=d["rope_theta"], hidden_size=d["hidden_size"],
            d_head=hf.integer("head_dim", d["head_dim"], at_least=1),
        )
        if fields["rope"].partial_rotary_factor != 1.0:
            raise ValueError(
                f"partial_rotary_factor {fields['rope'].partial_rotary_factor}: Hy3's rotary turns the whole head "
                "(transformers does not read the field); expected 1 or none"
            )
        if hf.flag("mlp_bias", False):
            raise ValueError("mlp_bias = true (biased dense and shared-expert MLPs) is not supported: no Hy3 "
                             "checkpoint has them")
        moe_layers = mlp_layer_types(hf, raw, fields["n_layers"])
        mixture = {k: d[k] for k in (
            "n_routed_experts", "num_experts_per_tok", "n_shared_experts", "moe_intermediate_size",
            "intermediate_size", "routed_scaling_factor",
        )}
        attention_bias = hf.flag("attention_bias", False)
        return Glm4MoeConfig(
            **fields,
            **deepseek_mixture_fields(
                hf, fields["n_layers"], 0, n_group=1, topk_group=1, moe_layers=moe_layers,
                fixed=dict(n_group=1, topk_group=1, norm_topk_prob=True), **mixture,
            ),
            family=cls.model_type,
            qkv_bias=attention_bias,
            o_bias=attention_bias,
            qk_norm=True,
            mtp_layers=hf.integer("num_nextn_predict_layers", 0, at_least=0),
            fields_read=tuple(hf.label(f) for f in hf.read),
            fields_ignored=tuple(f for f in IGNORED_FIELDS if f in raw),
        )


def _layer_sites(cfg: Glm4MoeConfig, layer: int, src: str, dst: str) -> list[Entry]:
    """GLM-4.5's attention (q/k norms); the mixture under the Hub's names (mlp.router.gate, mlp.expert_bias,
    mlp.shared_mlp: what transformers' save_pretrained writes too) or transformers' module names."""
    entries = attention_sites(cfg, src, dst)
    if not cfg.moe_layers[layer]:
        return entries + dense_mlp(src, dst)
    mlp = f"{src}.mlp"
    return entries + [
        Weight(f"{dst}.mlp.router.weight", (f"{mlp}.router.gate.weight", f"{mlp}.gate.weight")),
        Weight(f"{dst}.mlp.router.e_score_correction_bias", (f"{mlp}.expert_bias", f"{mlp}.e_score_correction_bias")),
        routed_experts(cfg, (f"{mlp}.experts",), dst),
        *(Weight(f"{dst}.mlp.shared_expert.{proj}.weight",
                 (f"{mlp}.shared_mlp.{proj}.weight", f"{mlp}.shared_experts.{proj}.weight"))
          for proj in ("gate_proj", "up_proj", "down_proj")),
        *router_references(dst, f"{mlp}.gate"),
        Reference(f"{dst}.mlp.hook_routed_out", f"{mlp}.experts"),
        Reference(f"{dst}.mlp.shared_expert.hook_out", f"{mlp}.shared_experts"),
    ]
