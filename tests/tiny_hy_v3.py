"""Tiny Hy3 (Hunyuan v3) checkpoints built with transformers' own class (fixed seeds, no downloads)."""

from __future__ import annotations

from pathlib import Path

import torch

import tiny


def hy_v3_config(**overrides):
    from transformers import HYV3Config

    kwargs = dict(
        vocab_size=96,
        hidden_size=64,
        intermediate_size=80,
        moe_intermediate_size=24,
        num_hidden_layers=3,
        num_attention_heads=4,
        num_key_value_heads=2,
        head_dim=24,  # not hidden_size / heads (transformers' default is 128 whatever the width)
        num_experts=8,
        num_experts_per_tok=3,
        num_shared_experts=2,
        router_scaling_factor=2.826,
        max_position_embeddings=256,
        rope_parameters={"rope_type": "default", "rope_theta": 1000.0},
    )
    kwargs.update(overrides)
    return HYV3Config(**{k: v for k, v in kwargs.items() if v is not None})  # None: the field left out


def build_hy_v3(
    folder: Path, seed: int = 0, max_shard_size: str | None = None, bias_scale: float = 0.2, bias_seed: int = 3000,
    **overrides,
) -> Path:
    """The correction bias (the mixture block's buffer) drawn from seed + bias_seed, large enough to change the
    chosen experts for most tokens, and a draw under which the base variant's experts stay reachable where the
    generic tests need them (expert 0 not chosen by every token already, expert 3 by some tokens only)."""
    from transformers import HYV3ForCausalLM

    model = tiny.new_model(HYV3ForCausalLM, hy_v3_config(**overrides), seed)
    gen = torch.Generator().manual_seed(seed + bias_seed)
    with torch.no_grad():
        for layer in model.model.layers:
            if hasattr(layer.mlp, "e_score_correction_bias"):
                bias = layer.mlp.e_score_correction_bias
                bias.copy_(bias_scale * torch.randn(bias.shape, generator=gen))
    return tiny.save_hf(model, folder, max_shard_size)


build = build_hy_v3
VARIANTS = {
    # q/k norm, the first block dense (transformers' default), renormalised weights times router_scaling_factor
    ("hy_v3", "base"): lambda d: build(d, seed=0),
    ("hy_v3", "fused"): lambda d: tiny.fused(build(d, seed=1)),
    ("hy_v3", "sharded"): lambda d: build(d, seed=2, max_shard_size="100KB"),
    # blocks listed by mlp_layer_types (a dense block between mixtures), biased attention, one shared expert
    ("hy_v3", "layer_types"): lambda d: build(
        d, seed=3, num_hidden_layers=4, mlp_layer_types=["sparse", "dense", "sparse", "sparse"], attention_bias=True,
        num_shared_experts=1,
    ),
}
