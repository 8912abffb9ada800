"""Tiny Beam checkpoints built with transformers' own BeamForCausalLM (fixed seeds, no downloads)."""

from __future__ import annotations

from pathlib import Path

import torch

import tiny

WINDOW = 5  # the sliding layers' window: shorter than the test inputs, so the mask matters


def beam_config(**overrides):
    from transformers import BeamConfig

    kwargs = dict(
        vocab_size=96, hidden_size=64, intermediate_size=80, moe_intermediate_size=24, num_hidden_layers=4,
        num_attention_heads=4, num_key_value_heads=2, head_dim=16, num_experts=8, num_experts_per_tok=3,
        n_group=4, topk_group=2, routed_scaling_factor=2.5, sliding_window=WINDOW, max_position_embeddings=256,
        layer_types=["sliding_attention", "full_attention", "sliding_attention", "full_attention"],
        mlp_layer_types=["dense", "sparse", "sparse", "sparse"], final_logit_softcapping=3.0,
    )
    kwargs.update(overrides)
    return BeamConfig(**kwargs)


def build_beam(folder: Path, seed: int = 0, max_shard_size: str | None = None, **overrides) -> Path:
    """Every weight drawn by tiny.perturb; the choice bias and the attention gate's bias drawn again, N(0, 0.2)
    and N(0, 1): large enough to change the chosen experts of many tokens and the gates, small enough that no
    expert is chosen by every token. final_logit_softcapping 3 is near the tiny logits' size, so the cap bends them."""
    from transformers import BeamForCausalLM

    model = tiny.new_model(BeamForCausalLM, beam_config(**overrides), seed)
    gen = torch.Generator().manual_seed(seed + 3000)
    with torch.no_grad():
        for layer in model.model.layers:
            layer.self_attn.gate_bias.copy_(torch.randn(layer.self_attn.gate_bias.shape, generator=gen))
            gate = getattr(layer.mlp, "gate", None)
            if hasattr(gate, "e_score_correction_bias"):
                gate.e_score_correction_bias.copy_(0.2 * torch.randn(gate.e_score_correction_bias.shape, generator=gen))
    return tiny.save_hf(model, folder, max_shard_size)


VARIANTS = {
    ("beam", "base"): lambda d: build_beam(d, seed=0),
    ("beam", "fused"): lambda d: tiny.fused(build_beam(d, seed=1)),
    ("beam", "sharded"): lambda d: build_beam(d, seed=2, max_shard_size="100KB"),
    # rotary on every layer type (the full layers at their own base: no NoPE, no query scale), no logit cap,
    # the head tied to the embedding
    ("beam", "rotary_uncapped"): lambda d: build_beam(
        d, seed=3, final_logit_softcapping=None, tie_word_embeddings=True,
        rope_parameters={"sliding_attention": {"rope_type": "default", "rope_theta": 10000.0},
                         "full_attention": {"rope_type": "default", "rope_theta": 500000.0}}),
}
