"""Tiny Aria text-model checkpoints (aria_text) built with transformers' own class (fixed seeds, no downloads)."""

from __future__ import annotations

from pathlib import Path

import tiny


def aria_text_config(**overrides):
    from transformers import AriaTextConfig

    kwargs = dict(
        vocab_size=96,
        hidden_size=64,
        intermediate_size=24,
        num_hidden_layers=3,
        num_attention_heads=4,
        num_key_value_heads=2,
        moe_num_experts=8,
        moe_topk=3,
        moe_num_shared_experts=2,
        bos_token_id=None,
        eos_token_id=2,
        pad_token_id=None,
        max_position_embeddings=256,
        rope_parameters={"rope_type": "default", "rope_theta": 1000.0},
    )
    kwargs.update(overrides)
    return AriaTextConfig(**kwargs)


def build_aria_text(folder: Path, seed: int = 0, max_shard_size: str | None = None, **overrides) -> Path:
    from transformers import AriaTextForCausalLM

    model = tiny.new_model(AriaTextForCausalLM, aria_text_config(**overrides), seed)
    return tiny.save_hf(model, folder, max_shard_size)


build = build_aria_text
VARIANTS = {
    ("aria_text", "base"): lambda d: build(d, seed=0),
    ("aria_text", "sharded"): lambda d: build(d, seed=2, max_shard_size="100KB"),
    # attention biases, a gelu shared expert (the routed experts stay SiLU-gated), one shared expert, top-1
    ("aria_text", "biased"): lambda d: build(
        d, seed=3, attention_bias=True, hidden_act="gelu_pytorch_tanh", moe_num_shared_experts=1, moe_topk=1,
    ),
}
