"""Tiny Qwen3-MoE checkpoints built with transformers' own class."""

from __future__ import annotations

from pathlib import Path

import tiny


def qwen3_moe_config(**overrides):
    from transformers import Qwen3MoeConfig

    kwargs = dict(
        vocab_size=96,
        hidden_size=64,
        intermediate_size=80,
        num_hidden_layers=3,
        num_attention_heads=4,
        num_key_value_heads=2,
        head_dim=24,  # not hidden_size / heads, as in Qwen3-30B-A3B
        moe_intermediate_size=32,
        num_experts=8,
        num_experts_per_tok=3,
        norm_topk_prob=True,
        max_position_embeddings=256,
        rope_parameters={"rope_type": "default", "rope_theta": 1000.0},
    )
    kwargs.update(overrides)
    return Qwen3MoeConfig(**kwargs)


def build_qwen3_moe(folder: Path, seed: int = 0, max_shard_size: str | None = None, **overrides) -> Path:
    """save_pretrained writes per-expert mlp.experts.E.gate_proj/up_proj/down_proj (the Hub's spelling)."""
    from transformers import Qwen3MoeForCausalLM

    model = tiny.new_model(Qwen3MoeForCausalLM, qwen3_moe_config(**overrides), seed)
    return tiny.save_hf(model, folder, max_shard_size)


VARIANTS = {
    ("qwen3_moe", "base"): lambda d: build_qwen3_moe(d, seed=0),
    ("qwen3_moe", "fused"): lambda d: tiny.fused(build_qwen3_moe(d, seed=1)),
    ("qwen3_moe", "sharded"): lambda d: build_qwen3_moe(d, seed=2, max_shard_size="100KB"),
    ("qwen3_moe", "unnormalised"): lambda d: build_qwen3_moe(d, seed=3, norm_topk_prob=False),
    ("qwen3_moe", "dense_block"): lambda d: build_qwen3_moe(d, seed=4, mlp_only_layers=[1]),
    ("qwen3_moe", "sparse_step_biased"): lambda d: build_qwen3_moe(d, seed=5, decoder_sparse_step=2, attention_bias=True),
    ("qwen3_moe", "tied"): lambda d: build_qwen3_moe(d, seed=6, tie_word_embeddings=True),
}
