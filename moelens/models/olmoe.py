"""HookedOlmoe: OLMoE-1B-7B (model_type olmoe).

What is special about the family: an RMSNorm over each token's whole query projection and one over its whole
key projection (all heads together, weights [n_heads * d_head] and [n_kv_heads * d_head]) before the split
into heads and the rotary; where clip_qkv is set, q, k (after those norms) and v clamped to
[-clip_qkv, clip_qkv]; a softmax top-k router (64 experts, top 8 in the released model) whose weights are
renormalised only when norm_topk_prob says so (false by default) and are cast back to the model dtype;
routed experts only (no shared expert) in every block; biases on q, k, v and o only with attention_bias.
transformers sizes the q/k norms by hidden_size, so the head dimension is hidden_size / num_attention_heads.
"""

from __future__ import annotations

from moelens.config import HFConfig, MoeConfig, common_fields, routed_fields
from moelens.models.base import HookedTransformer
from moelens.models.components import SoftmaxTopK, SparseMoe
from moelens.models.components.projection_norm_attention import ClipQKVConfig, ProjectionQKNormAttention
from moelens.models.recipe import Recipe, decoder_recipe
from moelens.models.sites import Entry, attention_projections, decoder_site_map, router_references, routed_experts
from moelens.sitemap import Reference, SiteMap, Weight


class HookedOlmoe(HookedTransformer):
    model_type = "olmoe"

    @classmethod
    def recipe(cls, cfg: MoeConfig) -> Recipe:
        return decoder_recipe(cfg, ProjectionQKNormAttention, SparseMoe, SoftmaxTopK)

    @classmethod
    def site_map(cls, cfg: ClipQKVConfig) -> SiteMap:
        return decoder_site_map(cfg, _layer_sites)

    @classmethod
    def config_from_hf(cls, raw: dict) -> ClipQKVConfig:
        hf = HFConfig(raw)
        fields = common_fields(hf, rms_norm_eps=1e-5, max_position_embeddings=4096, d_head=_head_dim(hf))
        rope = fields["rope"]
        if rope.kind != "default" or rope.partial_rotary_factor != 1.0:
            # transformers' OLMoE rotary ignores partial_rotary_factor; no released OLMoE scales its rotary
            raise ValueError(
                f"OLMoE rope settings {hf.rope_section().raw} with partial_rotary_factor {rope.partial_rotary_factor} "
                "are not supported: only the plain rotary over the whole head"
            )
        n_layers = fields["n_layers"]
        n_experts = hf.integer("num_experts", at_least=1)
        bias = hf.flag("attention_bias", False)
        return ClipQKVConfig(
            **fields,
            **routed_fields(hf, (True,) * n_layers, n_experts, hf.integer("intermediate_size", at_least=1)),
            family=cls.model_type,
            qkv_bias=bias,
            o_bias=bias,
            norm_topk_prob=hf.flag("norm_topk_prob", False),
            clip_qkv=hf.number("clip_qkv", None, above=0),
            fields_read=tuple(hf.read),
        )


def _head_dim(hf: HFConfig) -> int:
    """hidden_size / num_attention_heads, which head_dim may only repeat: transformers' OLMoE sizes q_norm and
    k_norm by hidden_size."""
    d_model = hf.integer("hidden_size", at_least=1)
    n_heads = hf.integer("num_attention_heads", at_least=1, at_most=d_model)
    if d_model % n_heads:
        raise ValueError(
            f"hidden_size ({d_model}) must be a multiple of num_attention_heads ({n_heads}): transformers' "
            "OLMoE sizes q_norm by hidden_size and the query projection by heads x (hidden_size // heads)"
        )
    d_head = d_model // n_heads
    if hf.integer("head_dim", d_head, at_least=1) != d_head:
        raise ValueError(
            f"head_dim = {hf.raw['head_dim']}: OLMoE's q_norm and k_norm are sized by hidden_size / "
            f"num_attention_heads = {d_head}, so the head dimension must be that"
        )
    return d_head


def _layer_sites(cfg: ClipQKVConfig, layer: int, src: str, dst: str) -> list[Entry]:
    attn = f"{src}.self_attn"
    # transformers' q_norm / k_norm outputs, and v_proj's, are clamped in place by clip_qkv after the module
    # returns, so what a forward hook keeps of them is the clamped tensor: hook_q / hook_k / hook_v's value.
    # q_proj's and k_proj's raw outputs (before the norms) have no moelens hook.
    entries = [
        e for e in attention_projections(cfg, src, dst) if not isinstance(e, Reference) or e.hook.endswith("hook_v")
    ]
    return entries + [
        Weight(f"{dst}.attn.q_norm.weight", (f"{attn}.q_norm.weight",)),
        Weight(f"{dst}.attn.k_norm.weight", (f"{attn}.k_norm.weight",)),
        Reference(f"{dst}.attn.hook_q", f"{attn}.q_norm"),
        Reference(f"{dst}.attn.hook_k", f"{attn}.k_norm"),
        Weight(f"{dst}.mlp.router.weight", (f"{src}.mlp.gate.weight",)),
        routed_experts(cfg, (f"{src}.mlp.experts",), dst),
        *router_references(dst, f"{src}.mlp.gate"),
        Reference(f"{dst}.mlp.hook_routed_out", f"{src}.mlp.experts"),
    ]
