"""Tiny Qwen3-Next checkpoints built with transformers' own class: Gated DeltaNet layers (three in four) and gated
full attention, the zero-centred norms, a sigmoid-gated shared expert beside the routed ones."""

from __future__ import annotations

from pathlib import Path

import tiny


def qwen3_next_config(**overrides):
    from transformers import Qwen3NextConfig

    kwargs = dict(
        vocab_size=96,
        hidden_size=64,
        intermediate_size=80,
        num_hidden_layers=4,  # linear, linear, linear, full
        num_attention_heads=4,
        num_key_value_heads=2,
        head_dim=16,
        partial_rotary_factor=0.25,
        linear_conv_kernel_dim=4,
        linear_key_head_dim=8,
        linear_value_head_dim=12,
        linear_num_key_heads=2,
        linear_num_value_heads=4,
        moe_intermediate_size=32,
        shared_expert_intermediate_size=40,
        num_experts=8,
        num_experts_per_tok=3,
        norm_topk_prob=True,
        max_position_embeddings=512,
        rope_parameters={"rope_type": "default", "rope_theta": 10000.0, "partial_rotary_factor": 0.25},
    )
    kwargs.update(overrides)
    return Qwen3NextConfig(**kwargs)


def build_qwen3_next(folder: Path, seed: int = 0, max_shard_size: str | None = None, **overrides) -> Path:
    from transformers import Qwen3NextForCausalLM

    model = tiny.new_model(Qwen3NextForCausalLM, qwen3_next_config(**overrides), seed)
    return tiny.save_hf(model, folder, max_shard_size)


# The family's own suite (test_family_qwen3_next.py) and the generic suites (conftest's VARIANTS) use these.
FAMILY_VARIANTS = {
    ("qwen3_next", "base"): lambda d: build_qwen3_next(d, seed=0),
    ("qwen3_next", "fused"): lambda d: tiny.fused(build_qwen3_next(d, seed=1)),
    ("qwen3_next", "dense_block"): lambda d: build_qwen3_next(d, seed=2, mlp_only_layers=[1], norm_topk_prob=False),
    ("qwen3_next", "interval"): lambda d: build_qwen3_next(d, seed=3, num_hidden_layers=5, layer_types=None,
                                                           full_attention_interval=2),
}

# and a checkpoint in several shards, as every family of the generic suites has
VARIANTS = {**FAMILY_VARIANTS, ("qwen3_next", "sharded"): lambda d: build_qwen3_next(d, seed=5, max_shard_size="100KB")}
