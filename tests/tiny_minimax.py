"""Tiny MiniMax checkpoints built with transformers' own class: lightning-attention layers (block_size 8, so a
20-token prompt spans two whole blocks and a partial one) beside softmax-attention layers, the residual factors
away from 1, Mixtral's mixture in the Hub's spelling (block_sparse_moe, experts w1 / w3 / w2)."""

from __future__ import annotations

from pathlib import Path

import torch
from safetensors.torch import load_file, save_file

import tiny
from tiny_mixtral import fused

LAYER_TYPES = ["linear_attention", "full_attention", "linear_attention", "linear_attention"]
# The read-out sums q k^T v over every earlier token (the slow heads barely decay over 40 tokens): with tiny.perturb's
# unit-scale q, k and v it reaches ~80, where one float32 ulp is 8e-6 and the one-ulp differences of the sublayers
# before it (the same in every family) show as 1e-5. Scaling qkv_proj keeps it near the stream's own magnitude.
QKV_SCALE = 0.5


def minimax_config(**overrides):
    from transformers import MiniMaxConfig

    kwargs = dict(
        vocab_size=96,
        hidden_size=64,
        intermediate_size=32,
        num_hidden_layers=4,
        num_attention_heads=4,
        num_key_value_heads=2,
        head_dim=16,
        num_local_experts=8,
        num_experts_per_tok=2,
        max_position_embeddings=256,
        block_size=8,
        layer_types=LAYER_TYPES,
        full_attn_alpha_factor=1.5,
        full_attn_beta_factor=0.75,
        linear_attn_alpha_factor=1.25,
        linear_attn_beta_factor=0.8,
        mlp_alpha_factor=1.1,
        mlp_beta_factor=1.3,
        rope_parameters={"rope_type": "default", "rope_theta": 1000.0},
    )
    kwargs.update(overrides)
    return MiniMaxConfig(**kwargs)


def build_minimax(folder: Path, seed: int = 0, max_shard_size: str | None = None, **overrides) -> Path:
    from transformers import MiniMaxForCausalLM

    model = tiny.new_model(MiniMaxForCausalLM, minimax_config(**overrides), seed)
    with torch.no_grad():  # q, k, v of about a third of tiny.perturb's: see QKV_SCALE
        for layer in model.model.layers:
            if hasattr(layer.self_attn, "qkv_proj"):
                layer.self_attn.qkv_proj.weight.mul_(QKV_SCALE)
    return tiny.save_hf(model, folder, max_shard_size)


def without_decay_buffers(folder: Path) -> Path:
    """The checkpoint less the lightning layers' stored decay tables (transformers recomputes them)."""
    path = folder / "model.safetensors"
    tensors = load_file(path)
    for key in [k for k in tensors if k.rsplit(".", 1)[-1] in ("slope_rate", "query_decay", "key_decay", "diagonal_decay")]:
        del tensors[key]
    save_file(tensors, path, metadata={"format": "pt"})
    return folder


VARIANTS = {
    ("minimax", "base"): lambda d: build_minimax(d, seed=0),
    ("minimax", "fused"): lambda d: fused(build_minimax(d, seed=1)),
    ("minimax", "sharded"): lambda d: build_minimax(d, seed=2, max_shard_size="100KB"),
    # transformers' defaults: softmax and lightning layers alternating, every factor 1
    ("minimax", "defaults"): lambda d: build_minimax(
        d, seed=3, layer_types=None, full_attn_alpha_factor=1, full_attn_beta_factor=1, linear_attn_alpha_factor=1,
        linear_attn_beta_factor=1, mlp_alpha_factor=1, mlp_beta_factor=1),
    ("minimax", "sliding_window"): lambda d: build_minimax(
        d, seed=4, sliding_window=6, layer_types=["full_attention", "linear_attention", "full_attention", "linear_attention"]),
    ("minimax", "no_decay_buffers"): lambda d: without_decay_buffers(build_minimax(d, seed=5)),
    ("minimax", "one_block"): lambda d: build_minimax(d, seed=6, block_size=256),
}
