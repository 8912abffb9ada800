"""Tiny dots.llm1 checkpoints built with transformers' own class (fixed seeds, no downloads)."""

from __future__ import annotations

from pathlib import Path

import torch

import tiny


def dots1_config(**overrides):
    from transformers import Dots1Config

    kwargs = dict(
        vocab_size=96,
        hidden_size=64,
        intermediate_size=80,
        moe_intermediate_size=24,
        num_hidden_layers=3,
        num_attention_heads=4,
        num_key_value_heads=2,
        head_dim=24,  # not hidden_size / heads
        n_routed_experts=8,
        num_experts_per_tok=3,
        n_shared_experts=2,
        n_group=1,
        topk_group=1,
        first_k_dense_replace=1,
        routed_scaling_factor=2.5,
        norm_topk_prob=True,
        # the last layer attends within 6 positions (the tests' inputs are longer); none do in dots.llm1 itself
        sliding_window=6,
        max_window_layers=2,
        max_position_embeddings=256,
        rope_parameters={"rope_type": "default", "rope_theta": 1000.0},
    )
    kwargs.update(overrides)
    return Dots1Config(**{k: v for k, v in kwargs.items() if v is not None})  # None: the field left out


def build_dots1(
    folder: Path, seed: int = 0, max_shard_size: str | None = None, bias_scale: float = 0.2, **overrides
) -> Path:
    """save_pretrained writes the Hub's per-expert spelling (mlp.experts.E.gate_proj ...). The correction bias is
    drawn large enough to change the chosen experts for most tokens, from seed + 3003: a draw under which the base
    variant's experts stay reachable where the generic tests need them (expert 0 not already chosen by every token,
    expert 3 by some tokens only); under many draws one bias far above the rest picks its expert for every token."""
    from transformers import Dots1ForCausalLM

    model = tiny.new_model(Dots1ForCausalLM, dots1_config(**overrides), seed)
    gen = torch.Generator().manual_seed(seed + 3003)
    with torch.no_grad():
        for layer in model.model.layers:
            if hasattr(layer.mlp, "gate"):
                bias = layer.mlp.gate.e_score_correction_bias
                bias.copy_(bias_scale * torch.randn(bias.shape, generator=gen))
    return tiny.save_hf(model, folder, max_shard_size)


build = build_dots1
VARIANTS = {
    # q/k norm, one sliding layer, one dense block first, renormalised and scaled weights
    ("dots1", "base"): lambda d: build(d, seed=0),
    ("dots1", "fused"): lambda d: tiny.fused(build(d, seed=1)),
    ("dots1", "sharded"): lambda d: build(d, seed=2, max_shard_size="100KB"),
    # dots.llm1's own arrangement: no sliding layer (max_window_layers = num_hidden_layers, no window), head_dim
    # from hidden_size / heads; here also biased attention, expert groups and unnormalised weights
    ("dots1", "grouped"): lambda d: build(
        d, seed=3, sliding_window=None, max_window_layers=3, head_dim=None, attention_bias=True, n_group=4,
        topk_group=2, norm_topk_prob=False, routed_scaling_factor=1.0,
    ),
}
