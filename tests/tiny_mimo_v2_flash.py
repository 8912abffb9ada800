"""Tiny MiMo-V2-Flash checkpoints built with transformers' own MiMoV2FlashForCausalLM (fixed seeds, no downloads):
values narrower than queries and keys, a window shorter than the test prompts, random sinks and a correction
bias large enough to change the chosen experts."""

from __future__ import annotations

from pathlib import Path

import torch

import tiny

WINDOW = 5  # the sliding layers' window: shorter than the test inputs, so the mask matters


def mimo_v2_flash_config(**overrides):
    from transformers import MiMoV2FlashConfig

    kwargs = dict(
        vocab_size=96,
        hidden_size=64,
        intermediate_size=80,
        moe_intermediate_size=24,
        num_hidden_layers=4,  # transformers' default layer_types: full, sliding, sliding, sliding; layer 0 dense
        num_attention_heads=4,
        num_key_value_heads=1,  # the sliding layers have twice as many
        head_dim=24,  # the rotary turns int(24 * 0.334) = 8 of them
        v_head_dim=16,
        n_routed_experts=8,
        num_experts_per_tok=3,
        n_group=4,
        topk_group=2,
        routed_scaling_factor=2.5,
        attention_value_scale=0.6,
        max_position_embeddings=256,
        sliding_window=WINDOW,
        rope_parameters={
            "full_attention": {"rope_type": "default", "rope_theta": 50000.0, "partial_rotary_factor": 0.334},
            "sliding_attention": {"rope_type": "default", "rope_theta": 100.0, "partial_rotary_factor": 0.5},
        },
        eos_token_id=2,
        pad_token_id=0,
    )
    kwargs.update(overrides)
    return MiMoV2FlashConfig(**kwargs)


def build_mimo_v2_flash(folder: Path, seed: int = 0, max_shard_size: str | None = None, **overrides) -> Path:
    """transformers saves the sinks as the Hub names them (self_attn.attention_sink_bias) and the experts per
    expert; the correction bias ~ N(0, 0.1)."""
    from transformers import MiMoV2FlashForCausalLM

    model = tiny.new_model(MiMoV2FlashForCausalLM, mimo_v2_flash_config(**overrides), seed)
    gen = torch.Generator().manual_seed(seed + 1000)
    with torch.no_grad():
        for layer in model.model.layers:
            if hasattr(layer.mlp, "gate"):
                bias = layer.mlp.gate.e_score_correction_bias
                bias.copy_(0.1 * torch.randn(bias.shape, generator=gen))
    return tiny.save_hf(model, folder, max_shard_size)


build = build_mimo_v2_flash
VARIANTS = {
    # one group, as MiMo-V2-Flash's router (the other variants exercise DeepSeek-V3's group limit)
    ("mimo_v2_flash", "base"): lambda d: build(d, seed=0, n_group=1, topk_group=1),
    ("mimo_v2_flash", "fused"): lambda d: tiny.fused(build(d, seed=1)),
    ("mimo_v2_flash", "sharded"): lambda d: build(d, seed=2, max_shard_size="100KB"),
    # sliding layers first, two dense blocks, q / k / v biases, no value scale (null), one group, unscaled
    ("mimo_v2_flash", "layers"): lambda d: build(
        d, seed=3, num_hidden_layers=5, num_key_value_heads=2,
        layer_types=["sliding_attention", "full_attention", "sliding_attention", "sliding_attention", "full_attention"],
        mlp_layer_types=["dense", "sparse", "dense", "sparse", "sparse"], attention_bias=True,
        attention_value_scale=None, n_group=1, topk_group=1, routed_scaling_factor=1.0, norm_topk_prob=False,
    ),
}
