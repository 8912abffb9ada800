"""Tiny Granite MoE checkpoints with a shared MLP, built with transformers' own GraniteMoeSharedForCausalLM (fixed
seeds, no downloads), with the multipliers of tiny_granitemoe."""

from __future__ import annotations

from pathlib import Path

import tiny
from tiny_granitemoe import MULTIPLIERS, transformers_names


def granitemoeshared_config(**overrides):
    from transformers import GraniteMoeSharedConfig

    kwargs = dict(
        vocab_size=96,
        hidden_size=64,
        intermediate_size=32,
        shared_intermediate_size=48,
        num_hidden_layers=3,
        num_attention_heads=4,
        num_key_value_heads=2,
        num_local_experts=8,
        num_experts_per_tok=3,
        max_position_embeddings=256,
        eos_token_id=2,
        pad_token_id=0,
        rope_parameters={"rope_type": "default", "rope_theta": 10000.0},
        **MULTIPLIERS,
    )
    kwargs.update(overrides)
    return GraniteMoeSharedConfig(**kwargs)


def build_granitemoeshared(folder: Path, seed: int = 0, max_shard_size: str | None = None, **overrides) -> Path:
    """The Hub's spelling: block_sparse_moe.input_linear / output_linear, router.layer, shared_mlp.input_linear /
    output_linear."""
    from transformers import GraniteMoeSharedForCausalLM

    model = tiny.new_model(GraniteMoeSharedForCausalLM, granitemoeshared_config(**overrides), seed)
    return tiny.save_hf(model, folder, max_shard_size)


VARIANTS = {
    ("granitemoeshared", "base"): lambda d: build_granitemoeshared(d, seed=0),
    ("granitemoeshared", "fused"): lambda d: transformers_names(build_granitemoeshared(d, seed=1)),
    ("granitemoeshared", "sharded"): lambda d: build_granitemoeshared(d, seed=2, max_shard_size="100KB"),
    ("granitemoeshared", "no_shared"): lambda d: build_granitemoeshared(
        d, seed=3, shared_intermediate_size=0, attention_bias=True, tie_word_embeddings=True
    ),
}
