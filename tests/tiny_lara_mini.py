"""Tiny Lara Mini checkpoints built with transformers' own class: Gated DeltaNet layers (saved with their fused
in_proj and out_norm), sliding-window attention with the rotary and full attention without it, plain float32-weight
norms, a float32-logit softmax router and an ungated shared expert on every layer."""

from __future__ import annotations

from pathlib import Path

import tiny


def lara_mini_config(**overrides):
    from transformers import LaraMiniConfig

    kwargs = dict(
        vocab_size=96,
        hidden_size=64,
        num_hidden_layers=5,  # the released pattern: linear, sliding, linear, full, sliding
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
        sliding_window=5,  # shorter than the test sequences
        max_position_embeddings=512,
        tie_word_embeddings=True,
        bos_token_id=None,
        eos_token_id=2,
        rope_parameters={"rope_type": "default", "rope_theta": 10000.0},
    )
    kwargs.update(overrides)
    return LaraMiniConfig(**kwargs)


def build_lara_mini(folder: Path, seed: int = 0, max_shard_size: str | None = None, **overrides) -> Path:
    from transformers import LaraMiniForCausalLM

    model = tiny.new_model(LaraMiniForCausalLM, lara_mini_config(**overrides), seed)
    return tiny.save_hf(model, folder, max_shard_size)


build = build_lara_mini
VARIANTS = {
    ("lara_mini", "base"): lambda d: build(d, seed=0),
    ("lara_mini", "fused"): lambda d: build(d, seed=1),  # transformers saves the experts fused already
    ("lara_mini", "sharded"): lambda d: build(d, seed=2, max_shard_size="100KB"),
    # an untied head, attention biases, unnormalised top-k weights, layer kinds in another order
    ("lara_mini", "untied_biased"): lambda d: build(
        d, seed=3, tie_word_embeddings=False, attention_bias=True, norm_topk_prob=False, num_hidden_layers=4,
        layer_types=["full_attention", "linear_attention", "sliding_attention", "linear_attention"]),
}
