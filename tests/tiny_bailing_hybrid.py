"""Tiny Ling (bailing_hybrid) checkpoints built with transformers' own class: Kimi Delta Attention layers with
Ling's full-rank, bounded forget gate beside head-gated latent attention, two dense blocks first, DeepSeek-V3's
grouped sigmoid router with a correction bias and a shared expert."""

from __future__ import annotations

from pathlib import Path

import torch

import tiny


def bailing_hybrid_config(**overrides):
    from transformers import BailingHybridConfig

    kwargs = dict(
        vocab_size=96,
        hidden_size=64,
        intermediate_size=80,
        moe_intermediate_size=24,
        num_hidden_layers=4,  # linear, linear, linear, full (a group of layer_group_size 4)
        layer_group_size=4,
        num_attention_heads=4,
        num_key_value_heads=4,
        head_dim=8,  # the KDA heads' width (transformers: linear_head_dim)
        short_conv_kernel_size=4,
        q_lora_rank=None,
        kv_lora_rank=16,
        qk_nope_head_dim=12,
        qk_rope_head_dim=8,
        v_head_dim=10,
        num_local_experts=8,
        num_experts_per_tok=3,
        n_shared_experts=1,
        n_group=2,
        topk_group=2,
        first_k_dense_replace=1,
        routed_scaling_factor=2.5,
        norm_topk_prob=True,
        max_position_embeddings=256,
        rope_theta=10000.0,
        pad_token_id=0,
        eos_token_id=2,
    )
    kwargs.update(overrides)
    return BailingHybridConfig(**kwargs)


def build_bailing_hybrid(folder: Path, seed: int = 0, max_shard_size: str | None = None, bias_scale: float = 0.3,
                         **overrides) -> Path:
    """A correction bias large enough to change the chosen experts for many tokens."""
    from transformers import BailingHybridForCausalLM

    model = tiny.new_model(BailingHybridForCausalLM, bailing_hybrid_config(**overrides), seed)
    gen = torch.Generator().manual_seed(seed + 1000)
    with torch.no_grad():
        for layer in model.model.layers:
            if hasattr(layer.mlp, "gate"):
                bias = layer.mlp.gate.e_score_correction_bias
                bias.copy_(bias_scale * torch.randn(bias.shape, generator=gen))
    return tiny.save_hf(model, folder, max_shard_size)


FAMILY_VARIANTS = {
    ("bailing_hybrid", "base"): lambda d: build_bailing_hybrid(d, seed=2),
    # the unbounded forget gate (-exp(A_log) * softplus), a low-rank query, YaRN (its mscale in the softmax scale),
    # six layers in groups of three, two dense blocks first
    ("bailing_hybrid", "softplus_yarn"): lambda d: build_bailing_hybrid(
        d, seed=3, kda_safe_gate=False, q_lora_rank=24, num_hidden_layers=6, layer_group_size=3, first_k_dense_replace=2,
        rope_parameters={"rope_type": "yarn", "factor": 4.0, "original_max_position_embeddings": 16,
                         "rope_theta": 10000.0, "mscale": 1.0, "mscale_all_dim": 1.0, "beta_fast": 32.0,
                         "beta_slow": 1.0},
    ),
}

VARIANTS = {**FAMILY_VARIANTS,
            ("bailing_hybrid", "sharded"): lambda d: build_bailing_hybrid(d, seed=5, max_shard_size="100KB")}
