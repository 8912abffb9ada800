"""Tiny K-EXAONE checkpoints built with transformers' own class (fixed seeds, no downloads)."""

from __future__ import annotations

from pathlib import Path

import torch

import tiny


def exaone_moe_config(**overrides):
    from transformers import ExaoneMoeConfig

    kwargs = dict(
        vocab_size=96,
        hidden_size=64,
        intermediate_size=80,
        moe_intermediate_size=24,
        num_hidden_layers=4,
        num_attention_heads=4,
        num_key_value_heads=2,
        head_dim=24,  # not hidden_size / heads, as K-EXAONE's 128 (6144 / 64 is 96)
        num_experts=8,
        num_experts_per_tok=3,
        num_shared_experts=2,
        first_k_dense_replace=1,
        routed_scaling_factor=2.5,
        # sliding (window 6, rotary) and full (no rotary) layers alternating; the tests' inputs are longer than 6
        sliding_window=6,
        sliding_window_pattern=2,
        max_position_embeddings=256,
        rope_parameters={"rope_type": "default", "rope_theta": 1000.0},
        pad_token_id=None,
        bos_token_id=None,
        eos_token_id=None,
    )
    kwargs.update(overrides)
    return ExaoneMoeConfig(**{k: v for k, v in kwargs.items() if v is not None})  # None: the field left out


def build_exaone_moe(
    folder: Path, seed: int = 0, max_shard_size: str | None = None, bias_scale: float = 0.15, bias_seed: int = 3003,
    **overrides,
) -> Path:
    """The correction bias drawn from seed + bias_seed, large enough to change the chosen experts for most tokens,
    and a draw under which the base variant's experts stay reachable where the generic tests need them."""
    from transformers import ExaoneMoeForCausalLM

    model = tiny.new_model(ExaoneMoeForCausalLM, exaone_moe_config(**overrides), seed)
    gen = torch.Generator().manual_seed(seed + bias_seed)
    with torch.no_grad():
        for layer in model.model.layers:
            if hasattr(layer.mlp, "gate"):
                bias = layer.mlp.gate.e_score_correction_bias
                bias.copy_(bias_scale * torch.randn(bias.shape, generator=gen))
    return tiny.save_hf(model, folder, max_shard_size)


build = build_exaone_moe
VARIANTS = {
    # sliding rotary layers and global NoPE layers alternating, one dense block first
    ("exaone_moe", "base"): lambda d: build(d, seed=0),
    ("exaone_moe", "fused"): lambda d: tiny.fused(build(d, seed=1)),
    ("exaone_moe", "sharded"): lambda d: build(d, seed=2, max_shard_size="100KB"),
    # K-EXAONE's own layout: layer_types given (three sliding layers, then a global one) with its pattern string,
    # which transformers then does not read; blocks by mlp_layer_types, expert groups, unnormalised weights
    ("exaone_moe", "grouped"): lambda d: build(
        d, seed=3, sliding_window_pattern="LLLG",
        layer_types=["sliding_attention"] * 3 + ["full_attention"],
        mlp_layer_types=["sparse", "dense", "sparse", "sparse"], n_group=4, topk_group=2, norm_topk_prob=False,
        routed_scaling_factor=1.0,
    ),
}
