"""Tiny Kimi-Linear checkpoints built with transformers' own class: Kimi Delta Attention layers beside latent
attention without a rotary, a dense first block, DeepSeek-V3's grouped sigmoid router with a correction bias and
a shared expert."""

from __future__ import annotations

from pathlib import Path

import torch

import tiny


def kimi_linear_config(**overrides):
    from transformers import KimiLinearConfig

    kwargs = dict(
        vocab_size=96,
        hidden_size=64,
        intermediate_size=80,
        moe_intermediate_size=24,
        num_hidden_layers=4,  # linear, linear, linear, full (0-based layer 3)
        num_attention_heads=4,
        num_key_value_heads=4,
        q_lora_rank=None,
        kv_lora_rank=16,
        qk_nope_head_dim=12,
        qk_rope_head_dim=8,
        v_head_dim=10,
        num_local_experts=8,
        num_experts_per_tok=3,
        n_shared_experts=2,
        n_group=1,  # Kimi-Linear's own: no group limit (the grouped rule: the "grouped" variant)
        topk_group=1,
        routed_scaling_factor=2.5,
        norm_topk_prob=True,
        max_position_embeddings=256,
        linear_attn_config={"head_dim": 8, "num_heads": 3, "short_conv_kernel_size": 4,
                            "full_attn_layers": [4], "kda_layers": [1, 2, 3]},
        first_k_dense_replace=1,
        pad_token_id=0,
        bos_token_id=1,
        eos_token_id=2,
    )
    kwargs.update(overrides)
    return KimiLinearConfig(**kwargs)


def build_kimi_linear(folder: Path, seed: int = 0, max_shard_size: str | None = None, bias_scale: float = 0.3,
                      **overrides) -> Path:
    """A correction bias large enough to change the chosen experts for many tokens."""
    from transformers import KimiLinearForCausalLM

    model = tiny.new_model(KimiLinearForCausalLM, kimi_linear_config(**overrides), seed)
    gen = torch.Generator().manual_seed(seed + 1000)
    with torch.no_grad():
        for layer in model.model.layers:
            if hasattr(layer.mlp, "gate"):
                bias = layer.mlp.gate.e_score_correction_bias
                bias.copy_(bias_scale * torch.randn(bias.shape, generator=gen))
    return tiny.save_hf(model, folder, max_shard_size)


FAMILY_VARIANTS = {
    ("kimi_linear", "base"): lambda d: build_kimi_linear(d, seed=2),
    # DeepSeek-V3's group limit, a low-rank query, and the layer kinds from transformers' default (full attention on
    # layer 4 of 6) rather than linear_attn_config's lists
    ("kimi_linear", "grouped"): lambda d: build_kimi_linear(
        d, seed=3, n_group=4, topk_group=2, q_lora_rank=24, num_hidden_layers=6,
        linear_attn_config={"head_dim": 8, "num_heads": 3, "short_conv_kernel_size": 3},
    ),
}

VARIANTS = {**FAMILY_VARIANTS, ("kimi_linear", "sharded"): lambda d: build_kimi_linear(d, seed=5, max_shard_size="100KB")}
