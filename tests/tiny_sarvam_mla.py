"""Tiny Sarvam-MLA checkpoints: SarvamMLAConfig run by transformers' DeepseekV3ForCausalLM, as
AutoModelForCausalLM maps it (fixed seeds, no downloads)."""

from __future__ import annotations

import json
from pathlib import Path

import torch

import tiny

YARN = {
    "factor": 4.0, "original_max_position_embeddings": 16, "rope_theta": 10000.0, "mscale": 1.0,
    "mscale_all_dim": 1.0, "beta_fast": 32.0, "beta_slow": 1.0,
}


def sarvam_mla_config(**overrides):
    from transformers import SarvamMLAConfig

    kwargs = dict(
        vocab_size=96, hidden_size=64, intermediate_size=80, moe_intermediate_size=24, num_hidden_layers=3,
        num_attention_heads=4, kv_lora_rank=16, qk_nope_head_dim=12, qk_rope_head_dim=8, v_head_dim=10,
        n_routed_experts=8, num_experts_per_tok=3, n_shared_experts=1, routed_scaling_factor=2.5,
        max_position_embeddings=256, rope_parameters={"rope_type": "yarn", **YARN},
    )
    kwargs.update(overrides)
    return SarvamMLAConfig(**kwargs)


def build_sarvam_mla(folder: Path, seed: int = 0, max_shard_size: str | None = None, **overrides) -> Path:
    """Sarvam's defaults otherwise (no query bottleneck, one expert group, one dense block first); a correction
    bias large enough to change the chosen experts for many tokens."""
    from transformers import AutoModelForCausalLM

    config = sarvam_mla_config(**overrides)
    torch.manual_seed(seed)
    model = AutoModelForCausalLM.from_config(config)
    assert type(model).__name__ == "DeepseekV3ForCausalLM"
    tiny.perturb(model, seed)
    # seed + 3000: a draw under which every expert stays reachable (the generic tests raise expert 0's logit)
    gen = torch.Generator().manual_seed(seed + 3000)
    with torch.no_grad():
        for layer in model.model.layers:
            if hasattr(layer.mlp, "gate"):
                bias = layer.mlp.gate.e_score_correction_bias
                bias.copy_(0.3 * torch.randn(bias.shape, generator=gen))
    return tiny.save_hf(model, folder, max_shard_size)


def original_spelling(folder: Path) -> Path:
    """config.json as Sarvam's original one spells it: num_experts / num_shared_experts, head_dim the latent
    cache's width (kv_lora_rank + qk_rope_head_dim), q_head_dim, and the rotary as rope_scaling "deepseek_yarn"."""
    path = folder / "config.json"
    config = json.loads(path.read_text())
    config["num_experts"] = config.pop("n_routed_experts")
    config["num_shared_experts"] = config.pop("n_shared_experts")
    config["head_dim"] = config["kv_lora_rank"] + config["qk_rope_head_dim"]
    config["q_head_dim"] = config["qk_nope_head_dim"] + config["qk_rope_head_dim"]
    params = config.pop("rope_parameters")
    config["rope_scaling"] = {"type": "deepseek_yarn", **{k: v for k, v in params.items() if k != "rope_type"}}
    path.write_text(json.dumps(config, indent=2))
    return folder


build = build_sarvam_mla
VARIANTS = {
    ("sarvam_mla", "base"): lambda d: build(d, seed=0),
    ("sarvam_mla", "fused"): lambda d: tiny.fused(build(d, seed=1)),
    ("sarvam_mla", "original_spelling"): lambda d: original_spelling(build(d, seed=2)),
    ("sarvam_mla", "sharded"): lambda d: build(d, seed=3, max_shard_size="100KB"),
}
