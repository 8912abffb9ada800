"""Tiny Qwen3.5-MoE checkpoints built with transformers' own classes: the text model alone (model_type
qwen3_5_moe_text, Qwen3_5MoeForCausalLM) and the Hub's multimodal spelling (model_type qwen3_5_moe, the text
model's config as text_config, its keys under model.language_model., a vision tower beside it:
Qwen3_5MoeForConditionalGeneration); Gated DeltaNet layers with separate projections (three in four), gated full
attention with the interleaved multimodal rotary, a mixture with a sigmoid-gated shared expert on every layer."""

from __future__ import annotations

from pathlib import Path

import tiny


def text_config(**overrides):
    from transformers import Qwen3_5MoeTextConfig

    kwargs = dict(
        vocab_size=96,
        hidden_size=64,
        num_hidden_layers=4,  # linear, linear, linear, full
        num_attention_heads=4,
        num_key_value_heads=2,
        head_dim=16,
        linear_conv_kernel_dim=4,
        linear_key_head_dim=8,
        linear_value_head_dim=12,
        linear_num_key_heads=2,
        linear_num_value_heads=4,
        moe_intermediate_size=32,
        shared_expert_intermediate_size=40,
        num_experts=8,
        num_experts_per_tok=3,
        max_position_embeddings=512,
        # half of head_dim 16 rotated: 4 frequencies, interleaved T H W T as the Hub's mrope_section [11, 11, 10]
        # interleaves 32
        rope_parameters={"rope_type": "default", "rope_theta": 10000.0, "partial_rotary_factor": 0.5,
                         "mrope_section": [2, 1, 1], "mrope_interleaved": True},
    )
    kwargs.update(overrides)
    return Qwen3_5MoeTextConfig(**kwargs)


def build_text(folder: Path, seed: int = 0, max_shard_size: str | None = None, **overrides) -> Path:
    from transformers import Qwen3_5MoeForCausalLM

    model = tiny.new_model(Qwen3_5MoeForCausalLM, text_config(**overrides), seed)
    return tiny.save_hf(model, folder, max_shard_size)


def build_multimodal(folder: Path, seed: int = 0, **overrides) -> Path:
    """The Hub's spelling, saved by transformers' Qwen3_5MoeForConditionalGeneration (a tiny vision tower)."""
    from transformers import Qwen3_5MoeConfig, Qwen3_5MoeForConditionalGeneration

    vision = dict(depth=1, hidden_size=16, intermediate_size=24, num_heads=2, out_hidden_size=64, patch_size=4,
                  num_position_embeddings=16)
    config = Qwen3_5MoeConfig(text_config=text_config(**overrides).to_dict(), vision_config=vision,
                              image_token_id=90, video_token_id=91, vision_start_token_id=92, vision_end_token_id=93)
    return tiny.save_hf(tiny.new_model(Qwen3_5MoeForConditionalGeneration, config, seed), folder)


# The family's own suite (test_family_qwen3_5_moe.py) and the generic suites (conftest's VARIANTS) use these.
FAMILY_VARIANTS = {
    ("qwen3_5_moe", "base"): lambda d: build_text(d, seed=0),
    ("qwen3_5_moe", "fused"): lambda d: tiny.fused(build_text(d, seed=1)),
    ("qwen3_5_moe", "interval"): lambda d: build_text(d, seed=3, num_hidden_layers=5, layer_types=None,
                                                      full_attention_interval=2),
    ("qwen3_5_moe", "multimodal"): lambda d: build_multimodal(d, seed=4),
}

# and a checkpoint in several shards, as every family of the generic suites has
VARIANTS = {**FAMILY_VARIANTS, ("qwen3_5_moe", "sharded"): lambda d: build_text(d, seed=5, max_shard_size="100KB")}
