"""Tiny OLMoE checkpoints built with transformers' own OlmoeForCausalLM (fixed seeds, no downloads)."""

from __future__ import annotations

from pathlib import Path

import tiny

CLIP = 0.6  # the "clip" variant's clip_qkv: below many normed q/k entries and values, so the clamp acts


def olmoe_config(**overrides):
    from transformers import OlmoeConfig

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
    return OlmoeConfig(**kwargs)


def build_olmoe(folder: Path, seed: int = 0, max_shard_size: str | None = None, **overrides) -> Path:
    from transformers import OlmoeForCausalLM

    model = tiny.new_model(OlmoeForCausalLM, olmoe_config(**overrides), seed)
    return tiny.save_hf(model, folder, max_shard_size)


VARIANTS = {
    ("olmoe", "base"): lambda d: build_olmoe(d, seed=0),
    ("olmoe", "clip"): lambda d: build_olmoe(d, seed=1, clip_qkv=CLIP),
    ("olmoe", "norm_topk"): lambda d: build_olmoe(d, seed=2, norm_topk_prob=True),
    ("olmoe", "biased_tied"): lambda d: build_olmoe(
        d, seed=3, attention_bias=True, tie_word_embeddings=True, num_key_value_heads=4
    ),
    ("olmoe", "sharded"): lambda d: build_olmoe(d, seed=4, max_shard_size="100KB"),
    ("olmoe", "fused"): lambda d: tiny.fused(build_olmoe(d, seed=5)),
}
