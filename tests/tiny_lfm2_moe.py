"""Tiny LFM2-MoE checkpoints built with transformers' own Lfm2MoeForCausalLM (fixed seeds, no downloads): gated
short-convolution layers around a full-attention one, a dense first layer, and an expert bias on the sigmoid
scores' scale, large enough to change the chosen experts for many tokens."""

from __future__ import annotations

import json
from pathlib import Path

import torch
from safetensors.torch import load_file, save_file

import tiny

LAYER_TYPES = ["conv", "full_attention", "conv", "conv"]


def lfm2_moe_config(**overrides):
    from transformers import Lfm2MoeConfig

    kwargs = dict(
        vocab_size=96,
        hidden_size=64,
        intermediate_size=80,
        moe_intermediate_size=32,
        num_hidden_layers=len(LAYER_TYPES),
        layer_types=LAYER_TYPES,
        num_attention_heads=4,
        num_key_value_heads=2,
        num_dense_layers=1,
        num_experts=8,
        num_experts_per_tok=3,
        conv_L_cache=3,
        max_position_embeddings=256,
        eos_token_id=2,
        pad_token_id=0,
        rope_parameters={"rope_type": "default", "rope_theta": 10000.0},
    )
    kwargs.update(overrides)
    return Lfm2MoeConfig(**kwargs)


def build_lfm2_moe(
    folder: Path, seed: int = 0, max_shard_size: str | None = None, bias_scale: float = 0.3, **overrides
) -> Path:
    from transformers import Lfm2MoeForCausalLM

    model = tiny.new_model(Lfm2MoeForCausalLM, lfm2_moe_config(**overrides), seed)
    gen = torch.Generator().manual_seed(seed + 3000)
    with torch.no_grad():
        for layer in model.model.layers:
            bias = getattr(layer.feed_forward, "expert_bias", None)
            if bias is not None:  # transformers starts it at zeros; sigmoid scores are within (0, 1)
                bias.copy_(bias_scale * torch.randn(bias.shape, generator=gen))
    return tiny.save_hf(model, folder, max_shard_size)


def fuse_w1_w3_w2(folder: Path) -> Path:
    """Rewrite a single-file checkpoint's per-expert w1 / w3 / w2 in transformers' fused layout (gate_up_proj
    [E, 2 * I, H], gate rows first; down_proj [E, H, I])."""
    path = folder / "model.safetensors"
    tensors = load_file(path)
    prefixes = sorted({k.split(".experts.")[0] for k in tensors if ".experts.0.w1." in k})
    for prefix in prefixes:
        n = len({k.split(".")[5] for k in tensors if k.startswith(f"{prefix}.experts.")})
        expert = f"{prefix}.experts"
        gate_up = [torch.cat([tensors.pop(f"{expert}.{e}.w1.weight"), tensors.pop(f"{expert}.{e}.w3.weight")]) for e in range(n)]
        down = [tensors.pop(f"{expert}.{e}.w2.weight") for e in range(n)]
        tensors[f"{expert}.gate_up_proj"] = torch.stack(gate_up)
        tensors[f"{expert}.down_proj"] = torch.stack(down)
    save_file(tensors, path, metadata={"format": "pt"})
    return folder


def hub_spelling(folder: Path) -> Path:
    """config.json as LFM2-8B-A1B's first upload spells it: tie_embedding for tie_word_embeddings, rope_theta at
    the top level."""
    path = folder / "config.json"
    config = json.loads(path.read_text())
    config["tie_embedding"] = config.pop("tie_word_embeddings")
    config["rope_theta"] = config.pop("rope_parameters")["rope_theta"]
    path.write_text(json.dumps(config, indent=2))
    return folder


VARIANTS = {
    ("lfm2_moe", "base"): lambda d: build_lfm2_moe(d, seed=0),
    ("lfm2_moe", "fused"): lambda d: fuse_w1_w3_w2(build_lfm2_moe(d, seed=1)),
    ("lfm2_moe", "sharded"): lambda d: build_lfm2_moe(d, seed=2, max_shard_size="100KB"),
    # biases on in_proj, the convolution and out_proj; an attention layer first; an untied head; the Hub's spelling
    ("lfm2_moe", "conv_bias"): lambda d: hub_spelling(build_lfm2_moe(
        d, seed=3, conv_bias=True, tie_word_embeddings=False, layer_types=["full_attention", "conv", "conv", "full_attention"],
    )),
    # no expert bias, weights neither renormalised nor scaled by 1, a longer kernel, every layer a mixture
    ("lfm2_moe", "unbiased"): lambda d: build_lfm2_moe(
        d, seed=4, use_expert_bias=False, norm_topk_prob=False, routed_scaling_factor=2.5, conv_L_cache=4,
        num_dense_layers=0,
    ),
}
