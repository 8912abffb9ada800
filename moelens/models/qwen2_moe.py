"""HookedQwen2Moe: Qwen1.5-MoE-A2.7B, Qwen2-57B-A14B (model_type qwen2_moe).

What is special about the family: biased q/k/v, a softmax router whose top-k weights are renormalised only
when norm_topk_prob says so and are cast back to the model dtype, a shared expert run first and gated by a
sigmoid after the routed experts, and dense blocks where mlp_only_layers / decoder_sparse_step say so.
"""

from __future__ import annotations

from moelens.config import HFConfig, MoeConfig
from moelens.models.base import HookedTransformer
from moelens.models.components import Attention, Components, GatedSharedExpertMoe, SoftmaxTopK
from moelens.models.sites import Entry, attention_projections, decoder_site_map, dense_mlp, gated_mlp, router_references, routed_experts
from moelens.sitemap import Reference, SiteMap, Weight


class HookedQwen2Moe(HookedTransformer):
    model_type = "qwen2_moe"
    components = Components(attention=Attention, moe=GatedSharedExpertMoe, router=SoftmaxTopK)

    @classmethod
    def site_map(cls, cfg: MoeConfig) -> SiteMap:
        return decoder_site_map(cfg, _layer_sites)

    @classmethod
    def config_from_hf(cls, raw: dict) -> MoeConfig:
        hf = HFConfig(raw)
        n_layers = hf.integer("num_hidden_layers", at_least=1)
        n_experts = hf.integer("num_experts", at_least=0)
        if hf.flag("use_sliding_window", False):
            raise ValueError("use_sliding_window=true is not supported (no released Qwen2-MoE checkpoint sets it)")
        moe_layers = mixture_layers(hf, n_layers, n_experts)
        any_moe = any(moe_layers)
        top_k = hf.integer("num_experts_per_tok", at_least=1, at_most=n_experts) if any_moe else 0
        n_heads = hf.integer("num_attention_heads", at_least=1)
        if all(moe_layers):  # no dense block: its width is not needed
            d_mlp = hf.integer("intermediate_size", 0, at_least=0)
        else:
            d_mlp = hf.integer("intermediate_size", at_least=1)
        return MoeConfig(
            family=cls.model_type,
            d_model=hf.integer("hidden_size", at_least=1),
            n_layers=n_layers,
            n_heads=n_heads,
            n_kv_heads=hf.integer("num_key_value_heads", n_heads, at_least=1),
            d_head=hf.head_dim(),
            d_vocab=hf.integer("vocab_size", at_least=1),
            norm_eps=hf.number("rms_norm_eps", 1e-6, at_least=0),
            rope=hf.rope(),
            max_position_embeddings=hf.integer("max_position_embeddings", 32768, at_least=1),
            qkv_bias=hf.flag("qkv_bias", True),
            act_fn=hf.text("hidden_act", "silu"),
            d_mlp=d_mlp,
            moe_layers=moe_layers,
            n_experts=n_experts,
            top_k=tuple(top_k if m else 0 for m in moe_layers),
            d_expert=hf.integer("moe_intermediate_size", at_least=1) if any_moe else 0,
            d_shared=hf.integer("shared_expert_intermediate_size", at_least=1) if any_moe else 0,
            norm_topk_prob=hf.flag("norm_topk_prob", False),
            tie_word_embeddings=hf.flag("tie_word_embeddings", False),
            fields_read=tuple(hf.read),
        )


def mixture_layers(hf: HFConfig, n_layers: int, n_experts: int) -> tuple[bool, ...]:
    """Which blocks are mixtures, by transformers' Qwen rule (Qwen2-MoE and Qwen3-MoE): not listed in
    mlp_only_layers, every decoder_sparse_step-th block, and only if num_experts > 0."""
    sparse_step = hf.integer("decoder_sparse_step", 1, at_least=1)
    mlp_only = set(hf.integers("mlp_only_layers", [], at_least=0, at_most=n_layers - 1))
    return tuple(i not in mlp_only and n_experts > 0 and (i + 1) % sparse_step == 0 for i in range(n_layers))


def _layer_sites(cfg: MoeConfig, layer: int, src: str, dst: str) -> list[Entry]:
    entries = attention_projections(cfg, src, dst)
    if not cfg.moe_layers[layer]:
        return entries + dense_mlp(src, dst)
    return entries + [
        Weight(f"{dst}.mlp.router.weight", (f"{src}.mlp.gate.weight",)),
        routed_experts(cfg, (f"{src}.mlp.experts",), dst),
        *gated_mlp(f"{src}.mlp.shared_expert", f"{dst}.mlp.shared_expert"),
        Weight(f"{dst}.mlp.shared_gate.weight", (f"{src}.mlp.shared_expert_gate.weight",)),
        *router_references(dst, f"{src}.mlp.gate"),
        Reference(f"{dst}.mlp.hook_routed_out", f"{src}.mlp.experts"),
        Reference(f"{dst}.mlp.shared_expert.hook_out", f"{src}.mlp.shared_expert"),
        Reference(f"{dst}.mlp.hook_shared_gate", f"{src}.mlp.shared_expert_gate"),
    ]
