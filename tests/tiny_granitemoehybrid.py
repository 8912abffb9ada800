"""Tiny Granite-4.0-H checkpoints built with transformers' own GraniteMoeHybridForCausalLM (fixed seeds, no
downloads): Mamba-2 and attention layers as config.json names them ("mamba", "attention"), the multipliers of
tiny_granitemoe, a chunk shorter than the tests' prompts (the chunked scan crosses chunks)."""

from __future__ import annotations

import json
from pathlib import Path

import tiny
from tiny_granitemoe import MULTIPLIERS, transformers_names

LAYER_TYPES = ["mamba", "attention", "mamba"]


def granitemoehybrid_config(**overrides):
    from transformers import GraniteMoeHybridConfig

    kwargs = dict(
        vocab_size=96,
        hidden_size=64,
        intermediate_size=32,
        shared_intermediate_size=48,
        num_hidden_layers=len(LAYER_TYPES),
        layer_types=LAYER_TYPES,
        num_attention_heads=4,
        num_key_value_heads=2,
        num_local_experts=8,
        num_experts_per_tok=3,
        max_position_embeddings=256,
        position_embedding_type="nope",
        mamba_n_heads=8,
        mamba_n_groups=2,
        mamba_d_state=16,
        mamba_d_conv=4,
        mamba_expand=2,
        mamba_chunk_size=8,
        eos_token_id=2,
        pad_token_id=0,
        rope_parameters={"rope_type": "default", "rope_theta": 10000.0},
        **MULTIPLIERS,
    )
    kwargs.update(overrides)
    return GraniteMoeHybridConfig(**kwargs)


def build_granitemoehybrid(folder: Path, seed: int = 0, max_shard_size: str | None = None, **overrides) -> Path:
    """The Hub's spelling: block_sparse_moe.input_linear / output_linear, router.layer, shared_mlp.input_linear /
    output_linear, mamba.*; config.json's time_step_limit as transformers writes it, [0.0, {"__float__":
    "Infinity"}]."""
    from transformers import GraniteMoeHybridForCausalLM

    model = tiny.new_model(GraniteMoeHybridForCausalLM, granitemoehybrid_config(**overrides), seed)
    return tiny.save_hf(model, folder, max_shard_size)


def hub_layer_names(folder: Path) -> Path:
    """config.json's layer_types as the Hub's configs spell them ("mamba", "attention"); transformers 5 writes
    its own names ("linear_attention", "full_attention")."""
    path = folder / "config.json"
    config = json.loads(path.read_text())
    names = {"linear_attention": "mamba", "full_attention": "attention"}
    config["layer_types"] = [names[kind] for kind in config["layer_types"]]
    path.write_text(json.dumps(config, indent=2))
    return folder


VARIANTS = {
    ("granitemoehybrid", "base"): lambda d: hub_layer_names(build_granitemoehybrid(d, seed=0)),
    ("granitemoehybrid", "fused"): lambda d: transformers_names(build_granitemoehybrid(d, seed=1)),
    ("granitemoehybrid", "sharded"): lambda d: build_granitemoehybrid(d, seed=2, max_shard_size="100KB"),
    # rotary attention (position_embedding_type "rope"), biases, an attention layer first
    ("granitemoehybrid", "rope"): lambda d: build_granitemoehybrid(
        d, seed=3, position_embedding_type="rope", attention_bias=True, tie_word_embeddings=True,
        layer_types=["attention", "mamba", "attention"],
    ),
    # no experts: the shared MLP is each layer's dense MLP (granite-4.0-h-micro)
    ("granitemoehybrid", "dense"): lambda d: build_granitemoehybrid(d, seed=4, num_local_experts=0),
}
