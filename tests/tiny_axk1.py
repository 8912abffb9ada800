"""Tiny A.X K1 checkpoints (axk1) built with transformers' own class (fixed seeds, no downloads)."""

from __future__ import annotations

from pathlib import Path

import torch

import tiny


def axk1_config(**overrides):
    from transformers import AXK1Config

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
        n_group=2,
        topk_group=1,
        routed_scaling_factor=2.5,
        norm_topk_prob=True,
        bos_token_id=None,
        eos_token_id=2,
        max_position_embeddings=256,
        rope_parameters={"rope_type": "default", "rope_theta": 1000.0},
    )
    kwargs.update(overrides)
    return AXK1Config(**kwargs)


def build_axk1(folder: Path, seed: int = 0, max_shard_size: str | None = None, bias_scale: float = 0.3, **overrides) -> Path:
    """transformers' default blocks (one dense block first, then mixtures, each mixture's output RMS-normed by
    post_mlp_layernorm); a correction bias large enough to change the chosen experts for many tokens."""
    from transformers import AXK1ForCausalLM

    model = tiny.new_model(AXK1ForCausalLM, axk1_config(**overrides), seed)
    gen = torch.Generator().manual_seed(seed + 3000)
    with torch.no_grad():
        for layer in model.model.layers:
            if hasattr(layer.mlp, "gate"):
                bias = layer.mlp.gate.e_score_correction_bias
                bias.copy_(bias_scale * torch.randn(bias.shape, generator=gen))
    return tiny.save_hf(model, folder, max_shard_size)


build = build_axk1
VARIANTS = {
    ("axk1", "base"): lambda d: build(d, seed=0),
    ("axk1", "fused"): lambda d: tiny.fused(build(d, seed=1)),
    ("axk1", "sharded"): lambda d: build(d, seed=2, max_shard_size="100KB"),
    # a dense block between mixtures (mlp_layer_types), half-split rotary, one group, unnormalised weights,
    # attention biases, YaRN (mscale_all_dim scales the softmax too)
    ("axk1", "layer_types"): lambda d: build(
        d, seed=3, num_hidden_layers=4, mlp_layer_types=["sparse", "dense", "sparse", "dense"], rope_interleave=False,
        n_group=1, topk_group=1, norm_topk_prob=False, attention_bias=True,
        rope_parameters={
            "rope_type": "yarn", "factor": 4.0, "original_max_position_embeddings": 16, "rope_theta": 10000.0,
            "mscale": 1.0, "mscale_all_dim": 0.8,
        },
    ),
}
