"""Tiny DeepSeek-V3 checkpoints built with transformers' own class (fixed seeds, no downloads)."""

from __future__ import annotations

from pathlib import Path

import torch

import tiny


def deepseek_v3_config(**overrides):
    from transformers import DeepseekV3Config

    kwargs = dict(
        vocab_size=96,
        hidden_size=64,
        intermediate_size=80,
        moe_intermediate_size=24,
        num_hidden_layers=3,
        num_attention_heads=4,
        num_key_value_heads=4,
        q_lora_rank=24,
        kv_lora_rank=16,
        qk_nope_head_dim=12,
        qk_rope_head_dim=8,
        v_head_dim=10,
        n_routed_experts=8,
        num_experts_per_tok=3,
        n_shared_experts=2,
        n_group=4,
        topk_group=2,
        first_k_dense_replace=1,
        routed_scaling_factor=2.5,
        norm_topk_prob=True,
        rope_interleave=True,
        max_position_embeddings=256,
        # YaRN with mscale (the real checkpoint's: both 1.0), the tests' sequences longer than the original 16
        rope_parameters={
            "rope_type": "yarn", "factor": 4.0, "original_max_position_embeddings": 16, "rope_theta": 10000.0,
            "mscale": 1.0, "mscale_all_dim": 1.0, "beta_fast": 32.0, "beta_slow": 1.0,
        },
    )
    kwargs.update(overrides)
    return DeepseekV3Config(**kwargs)


def build_deepseek_v3(
    folder: Path, seed: int = 0, max_shard_size: str | None = None, bias_scale: float = 0.3, **overrides
) -> Path:
    """A correction bias large enough to change the chosen experts for many tokens."""
    from transformers import DeepseekV3ForCausalLM

    model = tiny.new_model(DeepseekV3ForCausalLM, deepseek_v3_config(**overrides), seed)
    gen = torch.Generator().manual_seed(seed + 1000)
    with torch.no_grad():
        for layer in model.model.layers:
            if hasattr(layer.mlp, "gate"):
                bias = layer.mlp.gate.e_score_correction_bias
                bias.copy_(bias_scale * torch.randn(bias.shape, generator=gen))
    return tiny.save_hf(model, folder, max_shard_size)


build = build_deepseek_v3
VARIANTS = {
    ("deepseek_v3", "base"): lambda d: build(d, seed=0),
    ("deepseek_v3", "fused"): lambda d: tiny.fused(build(d, seed=1)),
    ("deepseek_v3", "sharded"): lambda d: build(d, seed=2, max_shard_size="100KB"),
    # no q bottleneck (q_proj), the rotary not interleaved, one group, unscaled default rotary, biased
    ("deepseek_v3", "plain_q"): lambda d: build(
        d, seed=3, q_lora_rank=None, rope_interleave=False, n_group=1, topk_group=1, norm_topk_prob=False,
        routed_scaling_factor=1.0, attention_bias=True, rope_parameters={"rope_type": "default", "rope_theta": 1000.0},
    ),
    # YaRN with mscale != mscale_all_dim (cos / sin scaled, the softmax too), two dense blocks
    ("deepseek_v3", "mscale"): lambda d: build(
        d, seed=4, first_k_dense_replace=2, num_hidden_layers=4, rope_interleave=False,
        rope_parameters={
            "rope_type": "yarn", "factor": 8.0, "original_max_position_embeddings": 16, "rope_theta": 10000.0,
            "mscale": 0.8, "mscale_all_dim": 0.6,
        },
    ),
}
