"""Tiny Command-A MoE checkpoints (cohere2_moe) built with transformers' own class (fixed seeds, no downloads)."""

from __future__ import annotations

from pathlib import Path

import tiny


def cohere2_moe_config(**overrides):
    from transformers import Cohere2MoeConfig

    kwargs = dict(
        vocab_size=96,
        hidden_size=64,
        intermediate_size=32,
        prefix_dense_intermediate_size=48,
        num_hidden_layers=4,
        num_attention_heads=4,
        num_key_value_heads=2,
        head_dim=16,
        num_experts=8,
        num_experts_per_tok=3,
        sliding_window=5,
        # a full dense layer (rotated: prefix_dense_sliding_window_pattern 1), sliding layers, a full NoPE layer
        layer_types=["full_attention", "sliding_attention", "full_attention", "sliding_attention"],
        mlp_layer_types=["dense", "sparse", "sparse", "sparse"],
        logit_scale=0.125,
        bos_token_id=1,
        eos_token_id=2,
        pad_token_id=0,
        max_position_embeddings=256,
        rope_parameters={"rope_type": "default", "rope_theta": 1000.0},
    )
    kwargs.update(overrides)
    return Cohere2MoeConfig(**kwargs)


def build_cohere2_moe(folder: Path, seed: int = 0, max_shard_size: str | None = None, **overrides) -> Path:
    """A window shorter than the test sequences; layer_norm_eps's LayerNorm (no rms_norm_eps), tied head."""
    from transformers import Cohere2MoeForCausalLM

    model = tiny.new_model(Cohere2MoeForCausalLM, cohere2_moe_config(**overrides), seed)
    return tiny.save_hf(model, folder, max_shard_size)


build = build_cohere2_moe
VARIANTS = {
    ("cohere2_moe", "base"): lambda d: build(d, seed=0),
    ("cohere2_moe", "fused"): lambda d: tiny.fused(build(d, seed=1)),
    ("cohere2_moe", "sharded"): lambda d: build(d, seed=2, max_shard_size="100KB"),
    # the sigmoid router (renormalised), a shared expert summed in, RMSNorm (rms_norm_eps), biases, an untied
    # head, a scale that is no power of two, and the dense full layer without rotary (prefix pattern 2)
    ("cohere2_moe", "sigmoid_shared"): lambda d: build(
        d, seed=3, expert_selection_fn="sigmoid", norm_topk_prob=True, num_shared_experts=1,
        shared_expert_combination_strategy="sum", rms_norm_eps=1e-6, attention_bias=True, tie_word_embeddings=False,
        logit_scale=0.3, prefix_dense_sliding_window_pattern=2,
    ),
    # transformers' defaults for the layer patterns: sliding, sliding, sliding, full; every layer a mixture
    ("cohere2_moe", "defaults"): lambda d: build(d, seed=4, layer_types=None, mlp_layer_types=None),
}
