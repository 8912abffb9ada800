"""Tiny Mixtral checkpoints built with transformers' own class, in the spellings moelens must read."""

from __future__ import annotations

from pathlib import Path

import torch
from safetensors.torch import load_file, save_file

import tiny


def mixtral_config(**overrides):
    from transformers import MixtralConfig

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
        rope_parameters={"rope_type": "default", "rope_theta": 1000.0},
    )
    kwargs.update(overrides)
    return MixtralConfig(**kwargs)


def build_mixtral(folder: Path, seed: int = 0, max_shard_size: str | None = None, **overrides) -> Path:
    """transformers 5's save_pretrained writes the Hub's spelling: block_sparse_moe.gate, experts.E.w1/w2/w3."""
    from transformers import MixtralForCausalLM

    model = tiny.new_model(MixtralForCausalLM, mixtral_config(**overrides), seed)
    return tiny.save_hf(model, folder, max_shard_size)


def _rewrite(folder: Path, edit) -> Path:
    path = folder / "model.safetensors"
    tensors = load_file(path)
    edit(tensors)
    save_file(tensors, path, metadata={"format": "pt"})
    return folder


def _layers(tensors: dict) -> list[str]:
    return sorted({k.split(".")[2] for k in tensors if ".block_sparse_moe.gate." in k})


def fused(folder: Path) -> Path:
    """transformers 5's in-memory names: mlp.gate.weight and the fused mlp.experts.gate_up_proj / down_proj."""

    def edit(tensors):
        for layer in _layers(tensors):
            hub, ours = f"model.layers.{layer}.block_sparse_moe", f"model.layers.{layer}.mlp"
            n = len({k.split(".")[5] for k in tensors if k.startswith(f"{hub}.experts.")})
            tensors[f"{ours}.gate.weight"] = tensors.pop(f"{hub}.gate.weight")
            tensors[f"{ours}.experts.gate_up_proj"] = torch.stack(
                [torch.cat([tensors.pop(f"{hub}.experts.{e}.w1.weight"), tensors.pop(f"{hub}.experts.{e}.w3.weight")]) for e in range(n)]
            )
            tensors[f"{ours}.experts.down_proj"] = torch.stack([tensors.pop(f"{hub}.experts.{e}.w2.weight") for e in range(n)])

    return _rewrite(folder, edit)


def mlp_prefix(folder: Path) -> Path:
    """Per-expert w1/w2/w3 and the gate under transformers 5's module name `mlp` instead of `block_sparse_moe`."""

    def edit(tensors):
        for key in [k for k in tensors if ".block_sparse_moe." in k]:
            tensors[key.replace(".block_sparse_moe.", ".mlp.")] = tensors.pop(key)

    return _rewrite(folder, edit)


VARIANTS = {
    ("mixtral", "base"): lambda d: build_mixtral(d, seed=0),
    ("mixtral", "fused"): lambda d: fused(build_mixtral(d, seed=1)),
    ("mixtral", "sharded"): lambda d: build_mixtral(d, seed=2, max_shard_size="100KB"),
    ("mixtral", "mlp_prefix"): lambda d: mlp_prefix(build_mixtral(d, seed=3)),
    ("mixtral", "sliding_window"): lambda d: build_mixtral(d, seed=4, sliding_window=7),
    ("mixtral", "mha_tied"): lambda d: build_mixtral(d, seed=5, num_key_value_heads=4, tie_word_embeddings=True, num_experts_per_tok=3),
}
