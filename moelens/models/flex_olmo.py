"""HookedFlexOlmo: FlexOlmo-7x7B-1T (model_type flex_olmo).

What is special about the family: OLMo-2's post-norm blocks (moelens.models.components.post_norm_block: attention
and the mixture read the residual stream unnormed, and each output is RMS-normed before the add, by
post_attention_layernorm and post_feedforward_layernorm: blocks.L.ln1_post, blocks.L.ln2_post); OLMo-2's RMSNorm,
the weight applied to the float32 normed input before the cast back (every norm: the post-norms, q/k norms and the
final one); an RMSNorm over each token's whole query and whole key projection before the split into heads; the
rotary from float32 cos / sin, q and k turned in float32 and cast back; OLMoE's softmax top-k router (renormalised
only with norm_topk_prob) in the model dtype, routed experts of intermediate_size in every block, no shared expert.
"""

from __future__ import annotations

from moelens.config import HFConfig, MoeConfig, common_fields, routed_fields
from moelens.models.base import HookedTransformer
from moelens.models.components import SoftmaxTopK, SparseMoe
from moelens.models.components.norm import CastAfterWeightRMSNorm
from moelens.models.components.post_norm_block import PostNormBlock
from moelens.models.components.projection_norm_attention import ClipQKVConfig, ProjectionQKNormAttention
from moelens.models.components.rotary import Float32Rotary, apply_rotary
from moelens.models.recipe import LayerSpec, Mixture, Recipe
from moelens.models.sites import Entry, attention_projections, own_blocks_site_map, router_references, routed_experts
from moelens.sitemap import Reference, SiteMap, Weight

# transformers' FlexOlmoConfig defaults (FlexOlmo-7x7B-1T's sizes)
DEFAULTS = dict(hidden_size=4096, intermediate_size=11008, max_position_embeddings=4096, rms_norm_eps=1e-6,
                rope_theta=500000.0, num_experts=7, num_experts_per_tok=5)


class Olmo2ProjectionNormAttention(ProjectionQKNormAttention):
    """OLMoE's attention (q and k normed over the whole projection) with OLMo-2's norms (the weight before the cast)
    and its rotary: q and k turned against float32 cos / sin, in float32, then cast back."""

    def __init__(self, cfg: ClipQKVConfig, layer: int) -> None:
        super().__init__(cfg, layer)
        self.q_norm = CastAfterWeightRMSNorm(cfg.n_heads * cfg.d_head, cfg.norm_eps, hooked=False)
        self.k_norm = CastAfterWeightRMSNorm(cfg.n_kv_heads * cfg.d_head, cfg.norm_eps, hooked=False)

    def position(self, q, k, cos, sin):
        return apply_rotary(q, cos, sin).to(q.dtype), apply_rotary(k, cos, sin).to(k.dtype)


class HookedFlexOlmo(HookedTransformer):
    model_type = "flex_olmo"
    rotary_class = Float32Rotary

    @classmethod
    def recipe(cls, cfg: MoeConfig) -> Recipe:
        spec = LayerSpec(Olmo2ProjectionNormAttention, Mixture(SparseMoe, SoftmaxTopK), CastAfterWeightRMSNorm,
                         block=PostNormBlock)
        return Recipe((spec,) * cfg.n_layers, CastAfterWeightRMSNorm)

    @classmethod
    def site_map(cls, cfg: ClipQKVConfig) -> SiteMap:
        return own_blocks_site_map(cfg, _layer_sites)

    @classmethod
    def config_from_hf(cls, raw: dict) -> ClipQKVConfig:
        raw = _canonical_names(raw)
        hf = HFConfig(raw)
        d = DEFAULTS
        fields = common_fields(hf, rms_norm_eps=d["rms_norm_eps"], max_position_embeddings=d["max_position_embeddings"],
                               hidden_size=d["hidden_size"], rope_theta=d["rope_theta"])
        rope = fields["rope"]
        if rope.partial_rotary_factor != 1.0:
            raise ValueError(
                f"partial_rotary_factor = {rope.partial_rotary_factor}: transformers' FlexOlmo turns every dim of a "
                "head, so only 1.0 is supported"
            )
        n_layers = fields["n_layers"]
        n_experts = hf.integer("num_experts", d["num_experts"], at_least=1)
        bias = hf.flag("attention_bias", False)
        return ClipQKVConfig(
            **fields,
            **routed_fields(hf, (True,) * n_layers, n_experts, hf.integer("intermediate_size", d["intermediate_size"], at_least=1),
                            num_experts_per_tok=d["num_experts_per_tok"]),
            family=cls.model_type,
            qkv_bias=bias,
            o_bias=bias,
            norm_topk_prob=hf.flag("norm_topk_prob", False),
            fields_read=tuple(hf.read),
        )


def _canonical_names(raw: dict) -> dict:
    """config.json with transformers' attribute_map applied (num_local_experts -> num_experts); both spellings with
    different values are refused."""
    if raw.get("num_local_experts") is None:
        return {k: v for k, v in raw.items() if k != "num_local_experts"}
    raw = dict(raw)
    value = raw.pop("num_local_experts")
    if raw.get("num_experts") is not None and raw["num_experts"] != value:
        raise ValueError(f"num_experts = {raw['num_experts']!r} and num_local_experts = {value!r} disagree "
                         "(transformers reads num_local_experts as num_experts)")
    raw["num_experts"] = value
    return raw


def _layer_sites(cfg: ClipQKVConfig, layer: int, src: str, dst: str) -> list[Entry]:
    attn = f"{src}.self_attn"
    # q_norm / k_norm's outputs are hook_q / hook_k; q_proj's and k_proj's raw outputs have no moelens hook
    projections = [e for e in attention_projections(cfg, src, dst)
                   if not isinstance(e, Reference) or e.hook.endswith("hook_v")]
    return projections + [
        Weight(f"{dst}.attn.q_norm.weight", (f"{attn}.q_norm.weight",)),
        Weight(f"{dst}.attn.k_norm.weight", (f"{attn}.k_norm.weight",)),
        Weight(f"{dst}.ln1_post.weight", (f"{src}.post_attention_layernorm.weight",)),
        Weight(f"{dst}.ln2_post.weight", (f"{src}.post_feedforward_layernorm.weight",)),
        Weight(f"{dst}.mlp.router.weight", (f"{src}.mlp.gate.weight",)),
        routed_experts(cfg, (f"{src}.mlp.experts",), dst),
        Reference(f"{dst}.hook_resid_pre", src, "in"),
        Reference(f"{dst}.attn.hook_q", f"{attn}.q_norm"),
        Reference(f"{dst}.attn.hook_k", f"{attn}.k_norm"),
        Reference(f"{dst}.ln1_post.hook_normalized", f"{src}.post_attention_layernorm"),
        Reference(f"{dst}.hook_attn_out", f"{src}.post_attention_layernorm"),
        *router_references(dst, f"{src}.mlp.gate"),
        Reference(f"{dst}.mlp.hook_routed_out", f"{src}.mlp.experts"),
        Reference(f"{dst}.ln2_post.hook_normalized", f"{src}.post_feedforward_layernorm"),
        Reference(f"{dst}.hook_mlp_out", f"{src}.post_feedforward_layernorm"),
        Reference(f"{dst}.hook_resid_post", src),
    ]
