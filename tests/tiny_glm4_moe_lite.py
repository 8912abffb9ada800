"""Tiny GLM-4.7-Flash checkpoints (glm4_moe_lite) built with transformers' own class (fixed seeds, no downloads)."""

from __future__ import annotations

from pathlib import Path

import torch

import tiny


def glm4_moe_lite_config(**overrides):
    from transformers import Glm4MoeLiteConfig

    kwargs = dict(
        vocab_size=96,
        hidden_size=64,
        intermediate_size=80,
        moe_intermediate_size=24,
        num_hidden_layers=3,
        num_attention_heads=4,
        num_key_value_heads=4,
        q_lora_rank=24,
        kv_lora_rank=16,
        qk_nope_head_dim=12,
        qk_rope_head_dim=8,
        v_head_dim=10,
        n_routed_experts=8,
        num_experts_per_tok=3,
        n_shared_experts=1,
        n_group=1,
        topk_group=1,
        routed_scaling_factor=1.8,
        norm_topk_prob=True,
        rope_interleave=True,
        max_position_embeddings=256,
        rope_parameters={"rope_type": "default", "rope_theta": 1000.0},
    )
    kwargs.update(overrides)
    return Glm4MoeLiteConfig(**kwargs)


def build_glm4_moe_lite(
    folder: Path, seed: int = 0, max_shard_size: str | None = None, bias_scale: float = 0.3, **overrides
) -> Path:
    """A correction bias large enough to change the chosen experts for many tokens, drawn from seed + 3000 (as
    GLM-4.5's): under it the base variant's experts 0 and 5 stay reachable, which the generic intervention tests
    need (under seed + 1000 expert 0's bias is the lowest of its layer and an edit of its logit changes nothing)."""
    from transformers import Glm4MoeLiteForCausalLM

    model = tiny.new_model(Glm4MoeLiteForCausalLM, glm4_moe_lite_config(**overrides), seed)
    gen = torch.Generator().manual_seed(seed + 3000)
    with torch.no_grad():
        for layer in model.model.layers:
            if hasattr(layer.mlp, "gate"):
                bias = layer.mlp.gate.e_score_correction_bias
                bias.copy_(bias_scale * torch.randn(bias.shape, generator=gen))
    return tiny.save_hf(model, folder, max_shard_size)


build = build_glm4_moe_lite
VARIANTS = {
    ("glm4_moe_lite", "base"): lambda d: build(d, seed=0),
    ("glm4_moe_lite", "fused"): lambda d: tiny.fused(build(d, seed=1)),
    ("glm4_moe_lite", "sharded"): lambda d: build(d, seed=2, max_shard_size="100KB"),
    # a dense block between mixtures (mlp_layer_types), no q bottleneck, half-split rotary, groups, biased, YaRN
    ("glm4_moe_lite", "layer_types"): lambda d: build(
        d, seed=3, num_hidden_layers=4, mlp_layer_types=["sparse", "dense", "sparse", "dense"], q_lora_rank=None,
        rope_interleave=False, n_group=4, topk_group=2, norm_topk_prob=False, attention_bias=True,
        rope_parameters={
            "rope_type": "yarn", "factor": 4.0, "original_max_position_embeddings": 16, "rope_theta": 10000.0,
            "mscale": 1.0, "mscale_all_dim": 0.8,
        },
    ),
}
