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
        n_layers = hf.integer("num_hidden_layers", at_least=1)
        n_experts = hf.integer("num_experts", at_least=0)
        if hf.flag("use_sliding_window", False):
            raise ValueError("use_sliding_window=true is not supported (no released Qwen2-MoE checkpoint sets it)")
        sparse_step = hf.integer("decoder_sparse_step", 1, at_least=1)
        mlp_only = set(hf.integers("mlp_only_layers", [], at_least=0, at_most=n_layers - 1))
        # transformers' rule, num_experts > 0 included
        moe_layers = tuple(
            i not in mlp_only and n_experts > 0 and (i + 1) % sparse_step == 0 for i in range(n_layers)
        )
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
            shared_gate=True,
            shared_first=True,
            router_scoring="softmax",
            norm_topk_prob=hf.flag("norm_topk_prob", False),
            tie_word_embeddings=hf.flag("tie_word_embeddings", False),
            fields_read=tuple(hf.read),
        )
