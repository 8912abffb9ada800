"""Tiny Kolibri 1 checkpoints (kolibri1) built with transformers' own class (fixed seeds, no downloads)."""

from __future__ import annotations

from pathlib import Path

import torch

import tiny


def kolibri1_config(**overrides):
    from transformers import Kolibri1Config

    kwargs = dict(
        vocab_size=96,
        hidden_size=64,
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
        bos_token_id=None,
        eos_token_id=2,
        max_position_embeddings=256,
        rope_parameters={"rope_type": "default", "rope_theta": 1000.0},
    )
    kwargs.update(overrides)
    return Kolibri1Config(**kwargs)


def build_kolibri1(
    folder: Path, seed: int = 0, max_shard_size: str | None = None, bias_scale: float = 1.0, **overrides
) -> Path:
    """A window shorter than the test sequences, a full (no-rotary) layer between sliding ones, and a correction bias
    on the logits' scale (N(0, 1)), large enough to change the chosen experts for many tokens."""
    from transformers import Kolibri1ForCausalLM

    model = tiny.new_model(Kolibri1ForCausalLM, kolibri1_config(**overrides), seed)
    gen = torch.Generator().manual_seed(seed + 3000)
    with torch.no_grad():
        for layer in model.model.layers:
            bias = layer.mlp.gate.e_score_correction_bias
            bias.copy_(bias_scale * torch.randn(bias.shape, generator=gen))
    return tiny.save_hf(model, folder, max_shard_size)


build = build_kolibri1
VARIANTS = {
    ("kolibri1", "base"): lambda d: build(d, seed=0),
    ("kolibri1", "fused"): lambda d: tiny.fused(build(d, seed=1)),
    ("kolibri1", "sharded"): lambda d: build(d, seed=2, max_shard_size="100KB"),
    # transformers' default layer_types (every fifth layer full), unnormalised weights
    ("kolibri1", "layer_types"): lambda d: build(d, seed=3, num_hidden_layers=5, layer_types=None, norm_topk_prob=False),
}
