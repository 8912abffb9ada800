"""Tiny Granite MoE checkpoints built with transformers' own GraniteMoeForCausalLM (fixed seeds, no downloads),
with muP multipliers away from 1 so that each one moves the result."""

from __future__ import annotations

from pathlib import Path

import tiny
from safetensors.torch import load_file, save_file

# each away from 1 (and attention_multiplier from 1/sqrt(d_head) = 0.25), as Granite's released configs are
MULTIPLIERS = dict(embedding_multiplier=6.0, residual_multiplier=0.4, attention_multiplier=0.15, logits_scaling=2.5)


def granitemoe_config(**overrides):
    from transformers import GraniteMoeConfig

    kwargs = dict(
        vocab_size=96,
        hidden_size=64,
        intermediate_size=32,
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
    return GraniteMoeConfig(**kwargs)


def build_granitemoe(folder: Path, seed: int = 0, max_shard_size: str | None = None, **overrides) -> Path:
    """transformers 5's save_pretrained writes the Hub's spelling: block_sparse_moe.input_linear / output_linear
    and router.layer."""
    from transformers import GraniteMoeForCausalLM

    model = tiny.new_model(GraniteMoeForCausalLM, granitemoe_config(**overrides), seed)
    return tiny.save_hf(model, folder, max_shard_size)


def transformers_names(folder: Path) -> Path:
    """transformers 5's in-memory names: block_sparse_moe.experts.gate_up_proj / down_proj and router.weight."""
    path = folder / "model.safetensors"
    tensors = load_file(path)
    renames = {".block_sparse_moe.input_linear.weight": ".block_sparse_moe.experts.gate_up_proj",
               ".block_sparse_moe.output_linear.weight": ".block_sparse_moe.experts.down_proj",
               ".block_sparse_moe.router.layer.weight": ".block_sparse_moe.router.weight"}
    for key in list(tensors):
        for hub, ours in renames.items():
            if key.endswith(hub):
                tensors[key.replace(hub, ours)] = tensors.pop(key)
    save_file(tensors, path, metadata={"format": "pt"})
    return folder


VARIANTS = {
    ("granitemoe", "base"): lambda d: build_granitemoe(d, seed=0),
    ("granitemoe", "fused"): lambda d: transformers_names(build_granitemoe(d, seed=1)),
    ("granitemoe", "sharded"): lambda d: build_granitemoe(d, seed=2, max_shard_size="100KB"),
    ("granitemoe", "biased_tied"): lambda d: build_granitemoe(
        d, seed=3, attention_bias=True, tie_word_embeddings=True, num_key_value_heads=4
    ),
}
