"""Tiny Phi-3.5-MoE checkpoints built with transformers' own class, in the spellings moelens must read."""

from __future__ import annotations

from pathlib import Path

import torch
from safetensors.torch import load_file, save_file

import tiny

HALF_HEAD = 8  # rotated frequencies per head (head_dim 16): one LongRoPE factor each


def longrope(original_max: int, short_mscale: float = 1.25, long_mscale: float = 1.5) -> dict:
    """LongRoPE settings as Phi-3.5-MoE's config.json spells them (rope_scaling, type), with distinct factors and
    mscales so that a mix-up shows."""
    return {
        "type": "longrope", "rope_theta": 1000.0, "original_max_position_embeddings": original_max,
        "short_factor": [1.0 + 0.25 * i for i in range(HALF_HEAD)], "long_factor": [2.0 + i for i in range(HALF_HEAD)],
        "short_mscale": short_mscale, "long_mscale": long_mscale,
    }


def phimoe_config(**overrides):
    from transformers import PhimoeConfig

    kwargs = dict(
        vocab_size=96,
        hidden_size=64,
        intermediate_size=32,
        num_hidden_layers=3,
        num_attention_heads=4,
        num_key_value_heads=2,
        num_local_experts=8,
        num_experts_per_tok=2,
        max_position_embeddings=256,
        attention_bias=True,
        lm_head_bias=True,
        # wider than Phi-3.5-MoE's 0.01, so that random logits leave several experts in a slot's softmax
        router_jitter_noise=0.3,
        rope_scaling=longrope(original_max=200),
    )
    kwargs.update(overrides)
    return PhimoeConfig(**kwargs)


def build_phimoe(folder: Path, seed: int = 0, max_shard_size: str | None = None, **overrides) -> Path:
    """transformers 5's save_pretrained writes the Hub's spelling: block_sparse_moe.gate, experts.E.w1/w2/w3."""
    from transformers import PhimoeForCausalLM

    model = tiny.new_model(PhimoeForCausalLM, phimoe_config(**overrides), seed)
    return tiny.save_hf(model, folder, max_shard_size)


def fused(folder: Path) -> Path:
    """transformers 5's in-memory names: mlp.router.weight and the fused mlp.experts.gate_up_proj / down_proj."""
    path = folder / "model.safetensors"
    tensors = load_file(path)
    for layer in sorted({k.split(".")[2] for k in tensors if ".block_sparse_moe.gate." in k}):
        hub, ours = f"model.layers.{layer}.block_sparse_moe", f"model.layers.{layer}.mlp"
        n = len({k.split(".")[5] for k in tensors if k.startswith(f"{hub}.experts.")})
        tensors[f"{ours}.router.weight"] = tensors.pop(f"{hub}.gate.weight")
        tensors[f"{ours}.experts.gate_up_proj"] = torch.stack(
            [torch.cat([tensors.pop(f"{hub}.experts.{e}.w1.weight"), tensors.pop(f"{hub}.experts.{e}.w3.weight")])
             for e in range(n)]
        )
        tensors[f"{ours}.experts.down_proj"] = torch.stack([tensors.pop(f"{hub}.experts.{e}.w2.weight") for e in range(n)])
    save_file(tensors, path, metadata={"format": "pt"})
    return folder


VARIANTS = {
    ("phimoe", "base"): lambda d: build_phimoe(d, seed=0),
    ("phimoe", "fused"): lambda d: fused(build_phimoe(d, seed=1)),
    ("phimoe", "sharded"): lambda d: build_phimoe(d, seed=2, max_shard_size="100KB"),
    # Phi-3.5-MoE's own settings: the narrow jitter, a sliding window, no LongRoPE, no biases
    ("phimoe", "hub_defaults"): lambda d: build_phimoe(
        d, seed=3, router_jitter_noise=0.01, sliding_window=7, attention_bias=False, lm_head_bias=False,
        rope_scaling=None, rope_parameters={"rope_type": "default", "rope_theta": 1000.0},
    ),
    # the tests' 40-token inputs are past original_max_position_embeddings: cos and sin scaled by long_mscale
    ("phimoe", "long_context"): lambda d: build_phimoe(d, seed=4, rope_scaling=longrope(original_max=16)),
}
