"""Tiny FlexOlmo checkpoints built with transformers' own FlexOlmoForCausalLM (fixed seeds, no downloads)."""

from __future__ import annotations

from pathlib import Path

import tiny


def flex_olmo_config(**overrides):
    from transformers import FlexOlmoConfig

    kwargs = dict(
        vocab_size=96,
        hidden_size=64,
        intermediate_size=32,
        num_hidden_layers=3,
        num_attention_heads=4,
        num_key_value_heads=2,
        num_experts=8,
        num_experts_per_tok=3,
        max_position_embeddings=256,
        eos_token_id=2,
        pad_token_id=1,
        rope_parameters={"rope_type": "default", "rope_theta": 10000.0},
    )
    kwargs.update(overrides)
    return FlexOlmoConfig(**kwargs)


def build_flex_olmo(folder: Path, seed: int = 0, max_shard_size: str | None = None, **overrides) -> Path:
    from transformers import FlexOlmoForCausalLM

    return tiny.save_hf(tiny.new_model(FlexOlmoForCausalLM, flex_olmo_config(**overrides), seed), folder, max_shard_size)


build = build_flex_olmo
VARIANTS = {
    ("flex_olmo", "base"): lambda d: build(d, seed=0),
    ("flex_olmo", "fused"): lambda d: tiny.fused(build(d, seed=1)),
    ("flex_olmo", "sharded"): lambda d: build(d, seed=2, max_shard_size="100KB"),
    # biased attention, tied embeddings, renormalised top-k weights, every head its own keys
    ("flex_olmo", "biased_tied"): lambda d: build(
        d, seed=3, attention_bias=True, tie_word_embeddings=True, norm_topk_prob=True, num_key_value_heads=4
    ),
}
