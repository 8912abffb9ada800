"""Tiny GLM-4.5-family checkpoints built with transformers' own class (fixed seeds, no downloads)."""

from __future__ import annotations

from pathlib import Path

import torch

import tiny


def glm4_moe_config(**overrides):
    from transformers import Glm4MoeConfig

    kwargs = dict(
        vocab_size=96,
        hidden_size=64,
        intermediate_size=80,
        moe_intermediate_size=24,
        num_hidden_layers=3,
        num_attention_heads=4,
        num_key_value_heads=2,
        head_dim=24,  # not hidden_size / heads, as in GLM-4.5 (128 where 5120 / 96 is not whole)
        n_routed_experts=8,
        num_experts_per_tok=3,
        n_shared_experts=2,
        n_group=1,
        topk_group=1,
        first_k_dense_replace=1,
        routed_scaling_factor=2.5,
        norm_topk_prob=True,
        use_qk_norm=True,
        attention_bias=True,
        max_position_embeddings=256,
        rope_parameters={"rope_type": "default", "rope_theta": 1000.0, "partial_rotary_factor": 0.5},
    )
    kwargs.update(overrides)
    return Glm4MoeConfig(**{k: v for k, v in kwargs.items() if v is not None})  # None: the field left out


def build_glm4_moe(
    folder: Path, seed: int = 0, max_shard_size: str | None = None, bias_scale: float = 0.3, **overrides
) -> Path:
    """save_pretrained writes the Hub's per-expert spelling (mlp.experts.E.gate_proj ...). The correction bias
    is large enough to change the chosen experts for most tokens. It is drawn from seed + 3000: a draw under
    which the base variant's experts stay reachable where the generic tests need them (they raise expert 0's
    router logit, push expert 5's until it is chosen, mean-ablate the least used expert of one batch on
    another); under some draws a bias far below the others' keeps an expert out of every choice."""
    from transformers import Glm4MoeForCausalLM

    model = tiny.new_model(Glm4MoeForCausalLM, glm4_moe_config(**overrides), seed)
    gen = torch.Generator().manual_seed(seed + 3000)
    with torch.no_grad():
        for layer in model.model.layers:
            if hasattr(layer.mlp, "gate"):
                bias = layer.mlp.gate.e_score_correction_bias
                bias.copy_(bias_scale * torch.randn(bias.shape, generator=gen))
    return tiny.save_hf(model, folder, max_shard_size)


build = build_glm4_moe
VARIANTS = {
    # GLM-4.5's arrangement: q/k norm, q/k/v biases, half the head rotated, one expert group, scaled weights
    ("glm4_moe", "base"): lambda d: build(d, seed=0),
    ("glm4_moe", "fused"): lambda d: tiny.fused(build(d, seed=1)),
    ("glm4_moe", "sharded"): lambda d: build(d, seed=2, max_shard_size="100KB"),
    # GLM-4.5-Air's: no q/k norm; here also head_dim from hidden_size / heads, a quarter of it rotated, expert
    # groups, unnormalised weights, two dense blocks
    ("glm4_moe", "air"): lambda d: build(
        d, seed=3, use_qk_norm=False, head_dim=None, n_group=4, topk_group=2, norm_topk_prob=False,
        routed_scaling_factor=1.0, first_k_dense_replace=2, num_hidden_layers=4,
        rope_parameters={"rope_type": "default", "rope_theta": 10000.0, "partial_rotary_factor": 0.25},
    ),
    # YaRN over the rotated half, no biases, the tests' sequences longer than the original 16 positions
    ("glm4_moe", "yarn"): lambda d: build(
        d, seed=4, attention_bias=False,
        rope_parameters={
            "rope_type": "yarn", "factor": 4.0, "original_max_position_embeddings": 16, "rope_theta": 10000.0,
            "partial_rotary_factor": 0.5,
        },
    ),
}
