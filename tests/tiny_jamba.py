"""Tiny Jamba checkpoints built with transformers' own JambaForCausalLM (fixed seeds, no downloads): Mamba and
attention layers by attn_layer_period / offset, mixture and dense layers by expert_layer_period / offset, so
that each mixer meets each feed-forward."""

from __future__ import annotations

from pathlib import Path

import torch
from safetensors.torch import load_file, save_file

import tiny

# with these: layer 0 Mamba + dense, 1 attention + mixture, 2 Mamba + dense, 3 Mamba + mixture
PERIODS = dict(attn_layer_period=3, attn_layer_offset=1, expert_layer_period=2, expert_layer_offset=1)


def jamba_config(**overrides):
    from transformers import JambaConfig

    kwargs = dict(
        vocab_size=96,
        hidden_size=64,
        intermediate_size=32,
        num_hidden_layers=4,
        num_attention_heads=4,
        num_key_value_heads=2,
        num_experts=8,
        num_experts_per_tok=3,
        max_position_embeddings=256,
        mamba_d_state=8,
        mamba_d_conv=4,
        mamba_expand=2,
        eos_token_id=2,
        pad_token_id=0,
        **PERIODS,
    )
    kwargs.update(overrides)
    return JambaConfig(**kwargs)


def build_jamba(folder: Path, seed: int = 0, max_shard_size: str | None = None, **overrides) -> Path:
    from transformers import JambaForCausalLM

    model = tiny.new_model(JambaForCausalLM, jamba_config(**overrides), seed)
    return tiny.save_hf(model, folder, max_shard_size)


def fused(folder: Path) -> Path:
    """transformers 5's in-memory names: each mixture's experts stacked as feed_forward.experts.gate_up_proj
    [E, 2 * d_expert, d_model] (gate rows first) and down_proj [E, d_model, d_expert]."""
    path = folder / "model.safetensors"
    tensors = load_file(path)
    layers = sorted({k.split(".")[2] for k in tensors if ".feed_forward.experts.0.gate_proj" in k})
    for layer in layers:
        prefix = f"model.layers.{layer}.feed_forward.experts"
        n = len({k.split(".")[5] for k in tensors if k.startswith(prefix + ".")})
        gate_up = [torch.cat([tensors.pop(f"{prefix}.{e}.gate_proj.weight"), tensors.pop(f"{prefix}.{e}.up_proj.weight")])
                   for e in range(n)]
        tensors[f"{prefix}.gate_up_proj"] = torch.stack(gate_up)
        tensors[f"{prefix}.down_proj"] = torch.stack([tensors.pop(f"{prefix}.{e}.down_proj.weight") for e in range(n)])
    save_file(tensors, path, metadata={"format": "pt"})
    return folder


VARIANTS = {
    ("jamba", "base"): lambda d: build_jamba(d, seed=0),
    ("jamba", "fused"): lambda d: fused(build_jamba(d, seed=1)),
    ("jamba", "sharded"): lambda d: build_jamba(d, seed=2, max_shard_size="100KB"),
    # the Mamba projections' biases and no convolution bias, a tied head, attention on the first layer
    ("jamba", "biases"): lambda d: build_jamba(
        d, seed=3, mamba_proj_bias=True, mamba_conv_bias=False, tie_word_embeddings=True, attn_layer_offset=0,
    ),
    # one expert: transformers builds no mixture at all, every feed-forward the dense MLP
    ("jamba", "dense"): lambda d: build_jamba(d, seed=4, num_experts=1),
}
