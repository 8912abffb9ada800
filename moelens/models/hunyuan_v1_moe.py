"""HookedHunyuanMoe: Hunyuan-A13B (model_type hunyuan_v1_moe).

What is special about the family: per-head RMSNorm of queries and keys after the rotary (so
attention_queries / attention_keys are read after the norms); a rotary base stretched by NTK alpha,
theta * alpha ** (d_head / (d_head - 2)); a float32 router (`mlp.gate.wg`) whose softmax top-k weights are
always renormalised and stay float32; top-k per layer (`moe_topk` list); a shared expert (`shared_mlp`) run
first and added ungated; experts and shared expert `intermediate_size` wide. Like transformers, it ignores
moe_intermediate_size, num_shared_expert, routed_scaling_factor and norm_topk_prob.
"""

from __future__ import annotations

from moelens.config import HFConfig, MoeConfig, RopeConfig, common_fields
from moelens.models.base import HookedTransformer
from moelens.models.components import Float32SoftmaxTopK, QKNormAfterRotaryAttention, SharedFirstMoe
from moelens.models.recipe import Recipe, decoder_recipe
from moelens.models.sites import Entry, attention_projections, decoder_site_map, gated_mlp, router_references, routed_experts
from moelens.sitemap import Reference, SiteMap, Weight

IGNORED_FIELDS = ("moe_intermediate_size", "num_shared_expert", "routed_scaling_factor", "norm_topk_prob", "use_qk_norm")


class HookedHunyuanMoe(HookedTransformer):
    model_type = "hunyuan_v1_moe"
    # transformers builds the q/k norms whatever use_qk_norm says
    @classmethod
    def recipe(cls, cfg: MoeConfig) -> Recipe:
        return decoder_recipe(cfg, QKNormAfterRotaryAttention, SharedFirstMoe, Float32SoftmaxTopK)

    @classmethod
    def site_map(cls, cfg: MoeConfig) -> SiteMap:
        return decoder_site_map(cfg, _layer_sites)

    @classmethod
    def config_from_hf(cls, raw: dict) -> MoeConfig:
        hf = HFConfig(raw)
        # Tencent's own config names it attention_head_dim; transformers' needs head_dim
        d_head = hf.head_dim(("head_dim", "attention_head_dim"))
        fields = common_fields(
            hf, rms_norm_eps=1e-5, max_position_embeddings=2048, d_head=d_head, rope=_ntk_alpha_rope(hf, d_head)
        )
        n_layers = fields["n_layers"]
        experts = set(hf.per_layer("num_experts", n_layers, at_least=1))
        if len(experts) != 1:
            raise ValueError(f"num_experts must be the same on every layer, got {sorted(experts)}")
        n_experts = experts.pop()
        width = hf.integer("intermediate_size", at_least=1)
        bias = hf.flag("attention_bias", False)
        return MoeConfig(
            **fields,
            family=cls.model_type,
            qkv_bias=bias,
            o_bias=bias,
            moe_layers=(True,) * n_layers,
            n_experts=n_experts,
            top_k_per_layer=hf.per_layer("moe_topk", n_layers, at_least=1, at_most=n_experts),
            d_expert=width,
            d_shared=width,
            norm_topk_prob=True,
            fields_read=tuple(hf.read),
            fields_ignored=tuple(f for f in IGNORED_FIELDS if f in raw),
        )


def _layer_sites(cfg: MoeConfig, layer: int, src: str, dst: str) -> list[Entry]:
    attn = f"{src}.self_attn"
    return attention_projections(cfg, src, dst) + [
        Weight(f"{dst}.attn.q_norm.weight", (f"{attn}.query_layernorm.weight",)),
        Weight(f"{dst}.attn.k_norm.weight", (f"{attn}.key_layernorm.weight",)),
        Weight(f"{dst}.mlp.router.weight", (f"{src}.mlp.gate.wg.weight",)),
        routed_experts(cfg, (f"{src}.mlp.experts",), dst),
        *gated_mlp(f"{src}.mlp.shared_mlp", f"{dst}.mlp.shared_expert"),
        Reference(f"{dst}.attn.hook_rot_q", f"{attn}.query_layernorm", "out.heads_first"),
        Reference(f"{dst}.attn.hook_rot_k", f"{attn}.key_layernorm", "out.heads_first"),
        *router_references(dst, f"{src}.mlp.gate"),
        Reference(f"{dst}.mlp.hook_routed_out", f"{src}.mlp.experts"),
        Reference(f"{dst}.mlp.shared_expert.hook_out", f"{src}.mlp.shared_mlp"),
    ]


def _ntk_alpha_rope(hf: HFConfig, d_head: int) -> RopeConfig:
    rope = hf.rope_section()
    kind = rope.text("rope_type", rope.text("type", "default"))
    theta = rope.number("rope_theta", hf.number("rope_theta", 10000.0, above=0), above=0)
    alpha = rope.number("alpha", None, above=0)
    if kind == "dynamic" and alpha:
        if d_head <= 2:
            raise ValueError(f"head dimension {d_head}: the NTK alpha stretch alpha ** (d / (d - 2)) needs d > 2")
        # a fixed alpha only stretches the base (transformers calls this ntk_alpha)
        return RopeConfig(theta=theta * alpha ** (d_head / (d_head - 2)))
    if kind == "default":
        return RopeConfig(theta=theta)
    raise ValueError(f"Hunyuan rope settings {rope.raw} are not supported (expected 'dynamic' with an 'alpha', or none)")
