"""HookedQwen2Moe: Qwen1.5-MoE-A2.7B, Qwen2-57B-A14B (model_type qwen2_moe).

What is special about the family: biased q/k/v, a softmax router whose top-k weights are renormalised only
when norm_topk_prob says so and are cast back to the model dtype, a shared expert run first and gated by a
sigmoid after the routed experts, and dense blocks where mlp_only_layers / decoder_sparse_step say so.
"""

from __future__ import annotations

from moelens.config import HFConfig, MoeConfig
from moelens.loaders.checkpoint import CheckpointNames
from moelens.models.base import HookedTransformer
from moelens.verify import moe_reference_sites


class HookedQwen2Moe(HookedTransformer):
    model_type = "qwen2_moe"
    checkpoint_names = CheckpointNames(
        router="mlp.gate.weight", shared_expert="mlp.shared_expert", shared_gate="mlp.shared_expert_gate.weight"
    )
    # moelens hook <- transformers module under the decoder layer (see moelens.verify)
    reference_sites = moe_reference_sites("mlp.gate", "mlp.experts", "mlp.shared_expert") + (
        ("blocks.L.mlp.hook_shared_gate", "mlp.shared_expert_gate", "out"),
        ("blocks.L.mlp.hook_post", "mlp.down_proj", "in"),
    )

    @classmethod
    def config_from_hf(cls, raw: dict) -> MoeConfig:
        hf = HFConfig(raw)
        n_layers = hf.req("num_hidden_layers")
        n_experts = hf.req("num_experts")
        if hf.opt("use_sliding_window", False):
            raise ValueError("use_sliding_window=true is not supported (no released Qwen2-MoE checkpoint sets it)")
        sparse_step = hf.opt("decoder_sparse_step", 1)
        mlp_only = set(hf.opt("mlp_only_layers", []))
        # transformers' rule, num_experts > 0 included
        moe_layers = tuple(
            i not in mlp_only and n_experts > 0 and (i + 1) % sparse_step == 0 for i in range(n_layers)
        )
        any_moe = any(moe_layers)
        top_k = hf.req("num_experts_per_tok") if any_moe else 0
        return MoeConfig(
            family=cls.model_type,
            d_model=hf.req("hidden_size"),
            n_layers=n_layers,
            n_heads=hf.req("num_attention_heads"),
            n_kv_heads=hf.opt("num_key_value_heads", hf.req("num_attention_heads")),
            d_head=hf.head_dim(),
            d_vocab=hf.req("vocab_size"),
            norm_eps=hf.opt("rms_norm_eps", 1e-6),
            rope=hf.rope(),
            max_position_embeddings=hf.opt("max_position_embeddings", 32768),
            qkv_bias=hf.opt("qkv_bias", True),
            act_fn=hf.opt("hidden_act", "silu"),
            d_mlp=hf.req("intermediate_size") if not all(moe_layers) else hf.opt("intermediate_size", 0),
            moe_layers=moe_layers,
            n_experts=n_experts,
            top_k=tuple(top_k if m else 0 for m in moe_layers),
            d_expert=hf.req("moe_intermediate_size") if any_moe else 0,
            d_shared=hf.req("shared_expert_intermediate_size") if any_moe else 0,
            shared_gate=True,
            shared_first=True,
            router_scoring="softmax",
            norm_topk_prob=hf.opt("norm_topk_prob", False),
            tie_word_embeddings=hf.opt("tie_word_embeddings", False),
            fields_read=tuple(hf.read),
        )
