"""Tiny DeepSeek-V3.2 checkpoints built with transformers' own class (fixed seeds, no downloads). index_topk 3 is
below the tests' lengths, so the indexer's choice shapes most queries' attention."""

from __future__ import annotations

from pathlib import Path

import torch

import tiny
from tiny_deepseek_v3 import deepseek_v3_config

# the fields transformers 5 saves for these families that the Hub's config.json does not have
DERIVED_FIELDS = ("mlp_layer_types", "layer_types", "indexer_types", "head_dim", "qk_head_dim")


def dsa_fields(**overrides) -> dict:
    """The tiny DeepSeek-V3 sizes, transformers' DeepseekV32Config keywords (no rope_interleave), plus the indexer."""
    kwargs = deepseek_v3_config().to_dict()
    kwargs = {k: kwargs[k] for k in (
        "vocab_size", "hidden_size", "intermediate_size", "moe_intermediate_size", "num_hidden_layers",
        "num_attention_heads", "num_key_value_heads", "q_lora_rank", "kv_lora_rank", "qk_nope_head_dim",
        "qk_rope_head_dim", "v_head_dim", "n_routed_experts", "num_experts_per_tok", "n_shared_experts", "n_group",
        "topk_group", "first_k_dense_replace", "routed_scaling_factor", "norm_topk_prob", "max_position_embeddings",
        "rope_parameters",
    )}
    kwargs.update(index_topk=3, index_head_dim=16, index_n_heads=4)
    kwargs.update(overrides)
    return kwargs


def deepseek_v32_config(**overrides):
    from transformers import DeepseekV32Config

    return DeepseekV32Config(**dsa_fields(**overrides))


def perturb_dsa(model, seed: int, bias_scale: float = 0.3) -> None:
    """A correction bias large enough to change the chosen experts; the indexer's LayerNorm bias as any bias."""
    gen = torch.Generator().manual_seed(seed + 1000)
    with torch.no_grad():
        for layer in model.model.layers:
            if hasattr(layer.mlp, "gate"):
                bias = layer.mlp.gate.e_score_correction_bias
                bias.copy_(bias_scale * torch.randn(bias.shape, generator=gen))
            indexer = layer.self_attn.indexer
            if indexer is not None:
                indexer.k_norm.weight.copy_(1.0 + 0.3 * torch.randn(indexer.k_norm.weight.shape, generator=gen))


def build_deepseek_v32(folder: Path, seed: int = 0, max_shard_size: str | None = None, **overrides) -> Path:
    from transformers import DeepseekV32ForCausalLM

    model = tiny.new_model(DeepseekV32ForCausalLM, deepseek_v32_config(**overrides), seed)
    perturb_dsa(model, seed)
    return tiny.save_hf(model, folder, max_shard_size)


def hub_spelling(folder: Path, **hub_fields) -> Path:
    """config.json as the Hub writes it: the rotary at the top level (rope_theta, rope_scaling), none of the
    per-layer lists transformers derives and saves."""
    import json

    config = json.loads((folder / "config.json").read_text())
    rope = dict(config["rope_parameters"])
    theta = rope.pop("rope_theta")
    changes = {k: None for k in DERIVED_FIELDS} | {"rope_parameters": None, "rope_theta": theta}
    if rope.get("rope_type", "default") != "default":
        changes["rope_scaling"] = rope | {"type": rope["rope_type"]}
    tiny.edit_config(folder, **changes, **hub_fields)
    return folder


build = build_deepseek_v32
VARIANTS = {
    # seed 4: every site live under the generic per-site edits, and expert 2 chosen in the last mixture layer
    ("deepseek_v32", "base"): lambda d: build(d, seed=4),
    ("deepseek_v32", "sharded"): lambda d: build(d, seed=6, max_shard_size="100KB"),
    ("deepseek_v32", "fused"): lambda d: tiny.fused(build(d, seed=1)),
    ("deepseek_v32", "hub"): lambda d: hub_spelling(build(d, seed=2)),
}
