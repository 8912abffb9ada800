"""Tiny Flint checkpoints (flint) built with transformers' own class (fixed seeds, no downloads)."""

from __future__ import annotations

from pathlib import Path

import torch

import tiny


def flint_config(**overrides):
    from transformers import FlintConfig

    kwargs = dict(
        vocab_size=96,
        hidden_size=64,
        intermediate_size=80,
        num_hidden_layers=3,
        num_attention_heads=4,
        num_key_value_heads=2,
        head_dim=16,
        moe_intermediate_size=32,
        shared_expert_intermediate_size=40,
        num_experts=8,
        num_experts_per_tok=3,
        norm_topk_prob=True,
        sliding_window=5,
        layer_types=["sliding_attention", "full_attention", "sliding_attention"],
        mlp_only_layers=[0],
        bos_token_id=None,
        eos_token_id=2,
        max_position_embeddings=256,
        rope_parameters={"rope_type": "default", "rope_theta": 1000.0},
    )
    kwargs.update(overrides)
    return FlintConfig(**kwargs)


def build_flint(folder: Path, seed: int = 0, max_shard_size: str | None = None, **overrides) -> Path:
    """A window shorter than the test sequences, a full (no-rotary) layer between sliding ones, a dense first block,
    and sinks on the scores' scale (N(0, 1) * 2), so that they take a visible share of each row's mass."""
    from transformers import FlintForCausalLM

    model = tiny.new_model(FlintForCausalLM, flint_config(**overrides), seed)
    gen = torch.Generator().manual_seed(seed + 4000)
    with torch.no_grad():
        for layer in model.model.layers:
            sinks = layer.self_attn.sinks
            sinks.copy_(2.0 * torch.randn(sinks.shape, generator=gen))
    return tiny.save_hf(model, folder, max_shard_size)


build = build_flint
VARIANTS = {
    ("flint", "base"): lambda d: build(d, seed=0),
    ("flint", "fused"): lambda d: tiny.fused(build(d, seed=1)),
    ("flint", "sharded"): lambda d: build(d, seed=2, max_shard_size="100KB"),
    # transformers' default layer_types and mlp_only_layers (the first two blocks dense), unnormalised weights
    ("flint", "layer_types"): lambda d: build(d, seed=3, num_hidden_layers=6, layer_types=None, mlp_only_layers=None,
                                              norm_topk_prob=False),
    # every second block a mixture, q/k/v/o biases
    ("flint", "sparse_step"): lambda d: build(d, seed=4, num_hidden_layers=4, decoder_sparse_step=2, mlp_only_layers=[],
                                              layer_types=["full_attention", "sliding_attention"] * 2,
                                              attention_bias=True),
}
