"""Tiny AFMoE (Arcee Trinity) checkpoints built with transformers' own AfmoeForCausalLM (fixed seeds, no
downloads)."""

from __future__ import annotations

from pathlib import Path

import torch

import tiny

WINDOW = 5  # the sliding layers' window: shorter than the test inputs, so the mask matters


def afmoe_config(**overrides):
    from transformers import AfmoeConfig

    kwargs = dict(
        vocab_size=96, hidden_size=64, intermediate_size=80, moe_intermediate_size=24, num_hidden_layers=3,
        num_dense_layers=1, num_attention_heads=4, num_key_value_heads=2, head_dim=16, num_experts=8,
        num_experts_per_tok=3, num_shared_experts=2, route_scale=2.5, global_attn_every_n_layers=2,
        sliding_window=WINDOW, mup_enabled=True, max_position_embeddings=256,
        rope_parameters={"rope_type": "default", "rope_theta": 10000.0},
    )
    kwargs.update(overrides)
    return AfmoeConfig(**kwargs)


def build_afmoe(folder: Path, seed: int = 0, max_shard_size: str | None = None, **overrides) -> Path:
    """Every weight drawn by tiny.perturb; the choice bias (expert_bias) drawn again, N(0, 0.2): large enough to
    change the chosen experts of many tokens, small enough that no expert is chosen by every token (the generic
    tests raise expert 0's choice score and expect the output to change)."""
    from transformers import AfmoeForCausalLM

    model = tiny.new_model(AfmoeForCausalLM, afmoe_config(**overrides), seed)
    gen = torch.Generator().manual_seed(seed + 3000)
    with torch.no_grad():
        for layer in model.model.layers:
            if hasattr(layer.mlp, "expert_bias"):
                layer.mlp.expert_bias.copy_(0.2 * torch.randn(layer.mlp.expert_bias.shape, generator=gen))
    return tiny.save_hf(model, folder, max_shard_size)


VARIANTS = {
    ("afmoe", "base"): lambda d: build_afmoe(d, seed=0),
    ("afmoe", "fused"): lambda d: tiny.fused(build_afmoe(d, seed=1)),
    ("afmoe", "sharded"): lambda d: build_afmoe(d, seed=2, max_shard_size="100KB"),
    # without muP's embedding scale, every layer sliding but the last, the head tied to the embedding
    ("afmoe", "plain_tied"): lambda d: build_afmoe(d, seed=3, mup_enabled=False, tie_word_embeddings=True,
                                                   layer_types=["sliding_attention", "sliding_attention", "full_attention"]),
}
