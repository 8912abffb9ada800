"""HookedQwen3Moe: Qwen3-30B-A3B, Qwen3-235B-A22B (model_type qwen3_moe).

What is special about the family: a per-head RMSNorm of queries and keys (q_norm / k_norm over d_head)
before the rotary, so hook_q / hook_k hold the projections before the norm and hook_rot_q / hook_rot_k the
normed, rotated heads; a head_dim of its own (128 in Qwen3-30B-A3B, where hidden_size / heads is 64);
q/k/v/o biases only where attention_bias; a softmax router whose top-k weights are renormalised only when
norm_topk_prob and are cast back to the model dtype; no shared expert; dense blocks where mlp_only_layers /
decoder_sparse_step say so (as Qwen2-MoE).
"""

from __future__ import annotations

from moelens.config import HFConfig, MoeConfig, common_fields, routed_fields
from moelens.models.base import HookedTransformer
from moelens.models.qwen2_moe import dense_width, mixture_layers
from moelens.models.components import SoftmaxTopK, SparseMoe
from moelens.models.components.qk_norm_attention import QKNormBeforeRotaryAttention
from moelens.models.recipe import Recipe, decoder_recipe
from moelens.models.sites import Entry, attention_projections, decoder_site_map, dense_mlp, router_references, routed_experts
from moelens.sitemap import Reference, SiteMap, Weight


class HookedQwen3Moe(HookedTransformer):
    model_type = "qwen3_moe"

    @classmethod
    def recipe(cls, cfg: MoeConfig) -> Recipe:
        return decoder_recipe(cfg, QKNormBeforeRotaryAttention, SparseMoe, SoftmaxTopK)

    @classmethod
    def site_map(cls, cfg: MoeConfig) -> SiteMap:
        return decoder_site_map(cfg, qk_norm_layer_sites)

    @classmethod
    def config_from_hf(cls, raw: dict) -> MoeConfig:
        hf = HFConfig(raw)
        fields = common_fields(hf, rms_norm_eps=1e-6, max_position_embeddings=32768)
        n_experts = _n_experts(hf)
        if hf.flag("use_sliding_window", False):
            raise ValueError("use_sliding_window=true is not supported (no released Qwen3-MoE checkpoint sets it)")
        moe_layers = mixture_layers(hf, fields["n_layers"], n_experts)
        d_expert = hf.integer("moe_intermediate_size", at_least=1) if any(moe_layers) else 0
        bias = hf.flag("attention_bias", False)
        return MoeConfig(
            **fields,
            **routed_fields(hf, moe_layers, n_experts, d_expert),
            family=cls.model_type,
            qkv_bias=bias,
            o_bias=bias,
            d_mlp=dense_width(hf, moe_layers),
            norm_topk_prob=hf.flag("norm_topk_prob", False),
            fields_read=tuple(hf.read),
            # transformers sets sliding_window to None unless use_sliding_window, and has no max_window_layers
            fields_ignored=tuple(f for f in ("sliding_window", "max_window_layers") if f in raw),
        )


def qk_norm_layer_sites(cfg: MoeConfig, layer: int, src: str, dst: str) -> list[Entry]:
    """A layer of q/k-normed attention (q_norm, k_norm) and a dense MLP or a softmax-routed mixture (mlp.gate,
    mlp.experts), in transformers' module names (Qwen3-MoE, Mellum)."""
    attn = f"{src}.self_attn"
    entries = attention_projections(cfg, src, dst) + [
        Weight(f"{dst}.attn.q_norm.weight", (f"{attn}.q_norm.weight",)),
        Weight(f"{dst}.attn.k_norm.weight", (f"{attn}.k_norm.weight",)),
        Reference(f"{dst}.attn.hook_z", f"{attn}.o_proj", "in"),
    ]
    if not cfg.moe_layers[layer]:
        return entries + dense_mlp(src, dst)
    return entries + [
        Weight(f"{dst}.mlp.router.weight", (f"{src}.mlp.gate.weight",)),
        routed_experts(cfg, (f"{src}.mlp.experts",), dst),
        *router_references(dst, f"{src}.mlp.gate"),
        Reference(f"{dst}.mlp.hook_routed_out", f"{src}.mlp.experts"),
    ]


def _n_experts(hf: HFConfig) -> int:
    """The Hub's config.json says num_experts; transformers 5 saves it as num_local_experts (its attribute_map)."""
    hub, saved = hf.integer("num_experts", None, at_least=0), hf.integer("num_local_experts", None, at_least=0)
    if hub is not None and saved is not None and hub != saved:
        raise ValueError(f"num_experts ({hub}) and num_local_experts ({saved}) disagree; they name the same size")
    if hub is None and saved is None:
        raise KeyError("num_experts")
    return hub if hub is not None else saved
