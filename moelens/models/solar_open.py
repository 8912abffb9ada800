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
from moelens.loaders.checkpoint import CheckpointNames
from moelens.models.base import HookedTransformer
from moelens.verify import moe_reference_sites


class HookedSolarOpen(HookedTransformer):
    model_type = "solar_open"
    checkpoint_names = CheckpointNames(
        router="mlp.gate.weight", correction_bias="mlp.gate.e_score_correction_bias", shared_expert="mlp.shared_experts"
    )
    reference_sites = moe_reference_sites("mlp.gate", "mlp.experts", "mlp.shared_experts")

    @classmethod
    def config_from_hf(cls, raw: dict) -> MoeConfig:
        hf = HFConfig(raw)
        n_layers = hf.req("num_hidden_layers")
        d_expert = hf.req("moe_intermediate_size")
        n_group, topk_group = hf.opt("n_group", 1), hf.opt("topk_group", 1)
        n_experts = hf.req("n_routed_experts")
        if n_experts % n_group:
            raise ValueError(f"n_routed_experts ({n_experts}) must be a multiple of n_group ({n_group})")
        return MoeConfig(
            family=cls.model_type,
            d_model=hf.req("hidden_size"),
            n_layers=n_layers,
            n_heads=hf.req("num_attention_heads"),
            n_kv_heads=hf.opt("num_key_value_heads", 8),
            d_head=hf.opt("head_dim", 128),  # transformers' SolarOpenConfig default
            d_vocab=hf.req("vocab_size"),
            norm_eps=hf.opt("rms_norm_eps", 1e-5),
            rope=hf.rope(),
            max_position_embeddings=hf.opt("max_position_embeddings", 131072),
            qkv_bias=hf.opt("attention_bias", False),
            act_fn=hf.opt("hidden_act", "silu"),
            moe_layers=(True,) * n_layers,
            n_experts=n_experts,
            top_k=(hf.req("num_experts_per_tok"),) * n_layers,
            d_expert=d_expert,
            d_shared=d_expert * hf.opt("n_shared_experts", 1),
            shared_first=False,
            router_scoring="sigmoid",
            router_in_float32=True,
            router_compute_float32=True,
            norm_topk_prob=hf.opt("norm_topk_prob", True),
            routed_scaling_factor=float(hf.opt("routed_scaling_factor", 1.0)),
            correction_bias=True,
            n_group=n_group,
            topk_group=topk_group,
            tie_word_embeddings=hf.opt("tie_word_embeddings", False),
            fields_read=tuple(hf.read),
            fields_ignored=tuple(f for f in ("first_k_dense_replace", "intermediate_size") if f in raw),
        )
