"""Tiny Sarvam-MoE checkpoints: SarvamMoEConfig run by transformers' Glm4MoeForCausalLM, as AutoModelForCausalLM
maps it (fixed seeds, no downloads). save_pretrained writes Sarvam's own tensor names (transformers' conversion
mapping, reversed): model.word_embeddings, attention.query_key_value, attention.dense, query_layernorm /
key_layernorm, mlp.gate.expert_bias."""

from __future__ import annotations

import json
from pathlib import Path

import torch

import tiny


def sarvam_moe_config(**overrides):
    from transformers import SarvamMoEConfig

    kwargs = dict(
        vocab_size=96, hidden_size=64, intermediate_size=80, moe_intermediate_size=24, num_hidden_layers=3,
        num_attention_heads=4, num_key_value_heads=2, head_dim=24, n_routed_experts=8, num_experts_per_tok=3,
        n_shared_experts=1, attention_bias=True, max_position_embeddings=256,
        rope_parameters={"rope_type": "default", "rope_theta": 1000.0},
    )
    kwargs.update(overrides)
    return SarvamMoEConfig(**kwargs)


def build_sarvam_moe(folder: Path, seed: int = 0, max_shard_size: str | None = None, **overrides) -> Path:
    """Sarvam's defaults otherwise (the whole head rotated, the q/k norm, one group, one dense block first,
    weights times 2.5); q, k and v biased, so that the fused bias is split too; a correction bias that changes the
    chosen experts for some tokens, drawn from seed + 3000 at 0.1: a draw under which the base variant's second
    mixture keeps every expert reachable where the generic tests need it (at GLM-4.5's 0.3 it shuts expert 3
    out of every choice on their tokens)."""
    from transformers import AutoModelForCausalLM

    config = sarvam_moe_config(**overrides)
    torch.manual_seed(seed)
    model = AutoModelForCausalLM.from_config(config)
    assert type(model).__name__ == "Glm4MoeForCausalLM"
    tiny.perturb(model, seed)
    gen = torch.Generator().manual_seed(seed + 3000)
    with torch.no_grad():
        for layer in model.model.layers:
            if hasattr(layer.mlp, "gate"):
                bias = layer.mlp.gate.e_score_correction_bias
                bias.copy_(0.1 * torch.randn(bias.shape, generator=gen))
    return tiny.save_hf(model, folder, max_shard_size)


def original_spelling(folder: Path) -> Path:
    """config.json rewritten by hand in the names Sarvam's original config uses (transformers' attribute_map):
    num_experts, num_shared_experts, use_qkv_bias, and rope_theta at the top level."""
    path = folder / "config.json"
    config = json.loads(path.read_text())
    config["num_experts"] = config.pop("n_routed_experts")
    config["num_shared_experts"] = config.pop("n_shared_experts")
    config["use_qkv_bias"] = config.pop("attention_bias")
    params = config.pop("rope_parameters")
    config["rope_theta"] = params["rope_theta"]
    path.write_text(json.dumps(config, indent=2))
    return folder


build = build_sarvam_moe
VARIANTS = {
    ("sarvam_moe", "base"): lambda d: build(d, seed=0),
    ("sarvam_moe", "fused"): lambda d: tiny.fused(build(d, seed=1)),
    # no q/k/v biases (Sarvam-30B's use_qkv_bias is false), the rotary at Sarvam's theta
    ("sarvam_moe", "original_spelling"): lambda d: original_spelling(
        build(d, seed=2, attention_bias=False, rope_parameters={"rope_type": "default", "rope_theta": 8e6})
    ),
    ("sarvam_moe", "sharded"): lambda d: build(d, seed=3, max_shard_size="100KB"),
}
