"""Tiny ERNIE-4.5 MoE checkpoints built with transformers' own Ernie4_5_MoeForCausalLM (fixed seeds, no downloads)."""

from __future__ import annotations

from pathlib import Path

import tiny
import torch


def ernie4_5_moe_config(**overrides):
    from transformers import Ernie4_5_MoeConfig

    kwargs = dict(
        vocab_size=96,
        hidden_size=64,
        intermediate_size=80,
        num_hidden_layers=3,
        num_attention_heads=4,
        num_key_value_heads=2,
        moe_num_experts=8,
        moe_k=3,
        moe_intermediate_size=24,
        moe_num_shared_experts=2,
        moe_layer_start_index=1,
        max_position_embeddings=256,
        tie_word_embeddings=False,
        rope_parameters={"rope_type": "default", "rope_theta": 1000.0},
    )
    kwargs.update(overrides)
    return Ernie4_5_MoeConfig(**kwargs)


def build_ernie4_5_moe(folder: Path, seed: int = 0, max_shard_size: str | None = None, **overrides) -> Path:
    from transformers import Ernie4_5_MoeForCausalLM

    model = tiny.new_model(Ernie4_5_MoeForCausalLM, ernie4_5_moe_config(**overrides), seed)
    # a correction bias of the softmax scores' size (~1 / n_experts), so that it changes some choices without
    # deciding them all; drawn from its own seed
    gen = torch.Generator().manual_seed(seed + 3000)
    with torch.no_grad():
        for layer in model.model.layers:
            statics = getattr(layer.mlp, "gate", None)
            if statics is not None:
                bias = statics.moe_statics.e_score_correction_bias
                bias.copy_(0.1 * torch.randn(bias.shape, generator=gen))
    return tiny.save_hf(model, folder, max_shard_size)


build = build_ernie4_5_moe
VARIANTS = {
    ("ernie4_5_moe", "base"): lambda d: build(d, seed=0),
    ("ernie4_5_moe", "fused"): lambda d: tiny.fused(build(d, seed=1)),
    ("ernie4_5_moe", "sharded"): lambda d: build(d, seed=2, max_shard_size="100KB"),
    # the embeddings tied (transformers' default), every second block a mixture up to block 2, no shared expert,
    # the router's renormalising floor above the tiny sums it divides (so the clamp acts)
    ("ernie4_5_moe", "interval"): lambda d: build(
        d, seed=3, num_hidden_layers=4, tie_word_embeddings=True, moe_layer_interval=2, moe_layer_start_index=0,
        moe_layer_end_index=2, moe_num_shared_experts=0, moe_norm_min=1.5,
    ),
}
