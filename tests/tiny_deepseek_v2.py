"""Tiny DeepSeek-V2 checkpoints built with transformers' own class (fixed seeds, no downloads)."""

from __future__ import annotations

from pathlib import Path

import tiny


def deepseek_v2_config(**overrides):
    from transformers import DeepseekV2Config

    kwargs = dict(
        vocab_size=96,
        hidden_size=64,
        intermediate_size=80,
        moe_intermediate_size=24,
        num_hidden_layers=3,
        num_attention_heads=4,
        num_key_value_heads=4,
        q_lora_rank=None,  # DeepSeek-V2-Lite's plain q_proj
        kv_lora_rank=16,
        qk_nope_head_dim=12,
        qk_rope_head_dim=8,
        v_head_dim=10,
        n_routed_experts=8,
        num_experts_per_tok=3,
        n_shared_experts=2,
        first_k_dense_replace=1,
        topk_method="greedy",
        routed_scaling_factor=1.0,
        max_position_embeddings=256,
        # YaRN with mscale = mscale_all_dim (DeepSeek-V2-Lite's: 0.707), the tests' sequences longer than 16
        rope_parameters={
            "rope_type": "yarn", "factor": 4.0, "original_max_position_embeddings": 16, "rope_theta": 10000.0,
            "mscale": 0.707, "mscale_all_dim": 0.707, "beta_fast": 32.0, "beta_slow": 1.0,
        },
    )
    kwargs.update(overrides)
    return DeepseekV2Config(**kwargs)


def build_deepseek_v2(folder: Path, seed: int = 0, max_shard_size: str | None = None, **overrides) -> Path:
    from transformers import DeepseekV2ForCausalLM

    return tiny.save_hf(tiny.new_model(DeepseekV2ForCausalLM, deepseek_v2_config(**overrides), seed), folder, max_shard_size)


build = build_deepseek_v2
VARIANTS = {
    ("deepseek_v2", "base"): lambda d: build(d, seed=0),
    ("deepseek_v2", "fused"): lambda d: tiny.fused(build(d, seed=1)),
    ("deepseek_v2", "sharded"): lambda d: build(d, seed=2, max_shard_size="100KB"),
    # DeepSeek-V2's own shape: a q bottleneck, group-limited routing scaled by routed_scaling_factor, biased
    # projections, the default rotary
    ("deepseek_v2", "grouped"): lambda d: build(
        d, seed=3, q_lora_rank=24, topk_method="group_limited_greedy", n_group=4, topk_group=2,
        routed_scaling_factor=16.0, attention_bias=True, rope_parameters={"rope_type": "default", "rope_theta": 1000.0},
    ),
}
