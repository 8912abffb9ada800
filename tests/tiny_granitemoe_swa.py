"""Tiny GraniteMoeSWA checkpoints built with transformers' own GraniteMoeSWAForCausalLM (fixed seeds, no
downloads), with the multipliers of tiny_granitemoe, a window shorter than the test prompts and random sinks."""

from __future__ import annotations

from pathlib import Path

import tiny
from tiny_granitemoe import MULTIPLIERS, transformers_names


def granitemoe_swa_config(**overrides):
    from transformers import GraniteMoeSWAConfig

    kwargs = dict(
        vocab_size=96,
        hidden_size=64,
        intermediate_size=32,
        shared_intermediate_size=48,  # transformers' default is 0 (no shared MLP): the no_shared variant
        num_hidden_layers=4,  # transformers' default layer_types: full, sliding, sliding, sliding
        num_attention_heads=4,
        num_key_value_heads=2,
        num_local_experts=8,
        num_experts_per_tok=3,
        max_position_embeddings=256,
        sliding_window=5,
        eos_token_id=2,
        pad_token_id=0,
        rope_parameters={"rope_type": "default", "rope_theta": 10000.0},
        **MULTIPLIERS,
    )
    kwargs.update(overrides)
    return GraniteMoeSWAConfig(**kwargs)


def build_granitemoe_swa(folder: Path, seed: int = 0, max_shard_size: str | None = None, **overrides) -> Path:
    """transformers' names as it saves them: block_sparse_moe.experts.gate_up_proj / down_proj (stacked),
    router.weight, shared_mlp.input_linear / output_linear (transformers 5.24 maps no other spelling for this
    model type, so a checkpoint it loads stores these)."""
    from transformers import GraniteMoeSWAForCausalLM

    model = tiny.new_model(GraniteMoeSWAForCausalLM, granitemoe_swa_config(**overrides), seed)
    return tiny.save_hf(model, folder, max_shard_size)


VARIANTS = {
    ("granitemoe_swa", "base"): lambda d: build_granitemoe_swa(d, seed=0),
    # the experts already stored fused and stacked, as base (renaming finds no Granite-3 Hub keys to change)
    ("granitemoe_swa", "fused"): lambda d: transformers_names(build_granitemoe_swa(d, seed=1)),
    ("granitemoe_swa", "sharded"): lambda d: build_granitemoe_swa(d, seed=2, max_shard_size="100KB"),
    ("granitemoe_swa", "no_shared"): lambda d: build_granitemoe_swa(
        d, seed=3, shared_intermediate_size=0, attention_bias=True, tie_word_embeddings=True
    ),
    # a layer without rotary (layer_rope_theta 0), one at another base, sliding layers first
    ("granitemoe_swa", "layer_rope"): lambda d: build_granitemoe_swa(
        d, seed=4, layer_types=["sliding_attention", "full_attention", "sliding_attention", "full_attention"],
        layer_rope_theta=[0, 10000.0, 500.0, 0],
    ),
}
