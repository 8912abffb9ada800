"""Tiny gpt-oss checkpoints built with transformers' own GptOssForCausalLM (fixed seeds, no downloads)."""

from __future__ import annotations

from pathlib import Path

import tiny

WINDOW = 5  # the sliding layers' window: shorter than the test inputs, so the mask matters


def gpt_oss_config(**overrides):
    from transformers import GptOssConfig

    kwargs = dict(
        vocab_size=96,
        hidden_size=64,
        intermediate_size=32,
        head_dim=16,
        num_hidden_layers=3,
        num_attention_heads=4,
        num_key_value_heads=2,
        num_local_experts=8,
        num_experts_per_tok=3,
        max_position_embeddings=256,
        sliding_window=WINDOW,
        swiglu_limit=1.5,  # below many gate/up values of the tiny model, so the clamps act
        rope_parameters={"rope_type": "yarn", "rope_theta": 150000.0, "factor": 4.0, "beta_fast": 32.0,
                         "beta_slow": 1.0, "truncate": False, "original_max_position_embeddings": 64},
        eos_token_id=2,
        pad_token_id=1,
    )
    kwargs.update(overrides)
    return GptOssConfig(**kwargs)


def build_gpt_oss(folder: Path, seed: int = 0, max_shard_size: str | None = None, **overrides) -> Path:
    from transformers import GptOssForCausalLM

    model = tiny.new_model(GptOssForCausalLM, gpt_oss_config(**overrides), seed)
    return tiny.save_hf(model, folder, max_shard_size)


VARIANTS = {
    ("gpt_oss", "base"): lambda d: build_gpt_oss(d, seed=0),
    ("gpt_oss", "full_only"): lambda d: build_gpt_oss(d, seed=1, layer_types=["full_attention"] * 3),
    ("gpt_oss", "sharded"): lambda d: build_gpt_oss(d, seed=2, max_shard_size="100KB"),
    ("gpt_oss", "fused"): lambda d: build_gpt_oss(d, seed=3),  # transformers saves gpt-oss's experts fused already
}
