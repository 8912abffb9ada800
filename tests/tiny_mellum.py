"""Tiny Mellum checkpoints (mellum) built with transformers' own class (fixed seeds, no downloads)."""

from __future__ import annotations

from pathlib import Path

import tiny

ROPES = {"full_attention": {"rope_type": "default", "rope_theta": 50000.0},
         "sliding_attention": {"rope_type": "default", "rope_theta": 100.0}}


def mellum_config(**overrides):
    from transformers import MellumConfig

    kwargs = dict(
        vocab_size=96,
        hidden_size=64,
        intermediate_size=80,
        num_hidden_layers=3,
        num_attention_heads=4,
        num_key_value_heads=2,
        head_dim=16,
        moe_intermediate_size=32,
        num_experts=8,
        num_experts_per_tok=3,
        sliding_window=5,
        layer_types=["sliding_attention", "full_attention", "sliding_attention"],
        mlp_layer_types=["dense", "sparse", "sparse"],
        bos_token_id=None,
        eos_token_id=2,
        max_position_embeddings=256,
        rope_parameters=ROPES,
    )
    kwargs.update(overrides)
    return MellumConfig(**kwargs)


def build_mellum(folder: Path, seed: int = 0, max_shard_size: str | None = None, **overrides) -> Path:
    """A window shorter than the test sequences, each layer type its own rotary base (100 and 50000)."""
    from transformers import MellumForCausalLM

    model = tiny.new_model(MellumForCausalLM, mellum_config(**overrides), seed)
    return tiny.save_hf(model, folder, max_shard_size)


build = build_mellum
VARIANTS = {
    ("mellum", "base"): lambda d: build(d, seed=0),
    ("mellum", "fused"): lambda d: tiny.fused(build(d, seed=1)),
    ("mellum", "sharded"): lambda d: build(d, seed=2, max_shard_size="100KB"),
    # transformers' defaults: every layer full and a mixture (its own rope_parameters), unnormalised weights, biases
    ("mellum", "defaults"): lambda d: build(
        d, seed=3, layer_types=None, mlp_layer_types=None, rope_parameters=None, norm_topk_prob=False,
        attention_bias=True,
    ),
}
