"""Tiny, non-degenerate checkpoints built with transformers' own classes (fixed seeds, no downloads)."""

from __future__ import annotations

import json
from pathlib import Path

import torch
from safetensors.torch import load_file, save_file


def perturb(model: torch.nn.Module, seed: int) -> None:
    """Weights ~ N(0, 1/fan_in), norms ~ 1 + N(0, 0.3), biases ~ N(0, 0.3): every sublayer moves the stream."""
    gen = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for name, p in model.named_parameters():
            noise = torch.randn(p.shape, generator=gen, dtype=torch.float32)
            if name.endswith("norm.weight") or "layernorm" in name:
                p.copy_(1.0 + 0.3 * noise)
            elif name.endswith(".bias"):
                p.copy_(0.3 * noise)
            else:
                p.copy_(noise * p.shape[-1] ** -0.5)


def new_model(model_class, config, seed: int) -> torch.nn.Module:
    torch.manual_seed(seed)
    model = model_class(config)
    perturb(model, seed)
    return model


def qwen2_moe_config(**overrides):
    from transformers import Qwen2MoeConfig

    kwargs = dict(
        vocab_size=96,
        hidden_size=64,
        intermediate_size=80,
        num_hidden_layers=3,
        num_attention_heads=4,
        num_key_value_heads=2,
        moe_intermediate_size=32,
        shared_expert_intermediate_size=48,
        num_experts=8,
        num_experts_per_tok=3,
        max_position_embeddings=256,
        rope_parameters={"rope_type": "default", "rope_theta": 1000.0},
    )
    kwargs.update(overrides)
    return Qwen2MoeConfig(**kwargs)


def save_hf(model, folder: Path, max_shard_size: str | None = None) -> Path:
    kwargs = {"max_shard_size": max_shard_size} if max_shard_size else {}
    model.save_pretrained(folder, **kwargs)
    return folder


def build_qwen2_moe(folder: Path, seed: int = 0, max_shard_size: str | None = None, **overrides) -> Path:
    from transformers import Qwen2MoeForCausalLM

    model = new_model(Qwen2MoeForCausalLM, qwen2_moe_config(**overrides), seed)
    return save_hf(model, folder, max_shard_size)


def fused(folder: Path) -> Path:
    fuse_experts(folder)
    return folder


def fuse_experts(folder: Path) -> None:
    """Rewrite a single-file per-expert checkpoint in transformers' fused layout (gate_up_proj, down_proj)."""
    path = folder / "model.safetensors"
    tensors = load_file(path)
    layers = sorted({k.split(".")[2] for k in tensors if ".mlp.experts.0.gate_proj" in k})
    for layer in layers:
        prefix = f"model.layers.{layer}.mlp.experts"
        n = len({k.split(".")[5] for k in tensors if k.startswith(prefix + ".")})
        gate_up = [torch.cat([tensors.pop(f"{prefix}.{e}.gate_proj.weight"), tensors.pop(f"{prefix}.{e}.up_proj.weight")]) for e in range(n)]
        down = [tensors.pop(f"{prefix}.{e}.down_proj.weight") for e in range(n)]
        tensors[f"{prefix}.gate_up_proj"] = torch.stack(gate_up)
        tensors[f"{prefix}.down_proj"] = torch.stack(down)
    save_file(tensors, path, metadata={"format": "pt"})


def edit_config(folder: Path, **changes) -> None:
    path = folder / "config.json"
    config = json.loads(path.read_text())
    for key, value in changes.items():
        if value is None:
            config.pop(key, None)
        else:
            config[key] = value
    path.write_text(json.dumps(config))


def hunyuan_config(**overrides):
    from transformers import HunYuanMoEV1Config

    kwargs = dict(
        vocab_size=96,
        hidden_size=64,
        intermediate_size=32,
        num_hidden_layers=3,
        num_attention_heads=4,
        num_key_value_heads=2,
        head_dim=16,
        num_experts=8,
        moe_topk=[2, 3, 1],
        max_position_embeddings=256,
        tie_word_embeddings=True,
        rope_parameters={"rope_type": "dynamic", "alpha": 1000.0, "factor": 1.0, "rope_theta": 10000.0},
    )
    kwargs.update(overrides)
    return HunYuanMoEV1Config(**kwargs)


def build_hunyuan(folder: Path, seed: int = 0, max_shard_size: str | None = None, **overrides) -> Path:
    from transformers import HunYuanMoEV1ForCausalLM

    model = new_model(HunYuanMoEV1ForCausalLM, hunyuan_config(**overrides), seed)
    return save_hf(model, folder, max_shard_size)


def solar_config(**overrides):
    from transformers import SolarOpenConfig

    kwargs = dict(
        vocab_size=96,
        hidden_size=64,
        num_hidden_layers=3,
        num_attention_heads=4,
        num_key_value_heads=2,
        head_dim=16,
        moe_intermediate_size=24,
        n_routed_experts=8,
        num_experts_per_tok=3,
        n_shared_experts=2,
        n_group=4,
        topk_group=2,
        routed_scaling_factor=2.5,
        norm_topk_prob=False,
        attention_bias=True,
        max_position_embeddings=256,
        rope_parameters={"rope_type": "yarn", "factor": 4.0, "original_max_position_embeddings": 16, "rope_theta": 10000.0},
    )
    kwargs.update(overrides)
    return SolarOpenConfig(**kwargs)


def build_solar(folder: Path, seed: int = 0, max_shard_size: str | None = None, bias_scale: float = 0.3, **overrides) -> Path:
    """Solar with a correction bias large enough to change the chosen experts for many tokens."""
    from transformers import SolarOpenForCausalLM

    model = new_model(SolarOpenForCausalLM, solar_config(**overrides), seed)
    gen = torch.Generator().manual_seed(seed + 1000)
    with torch.no_grad():
        for layer in model.model.layers:
            bias = layer.mlp.gate.e_score_correction_bias
            bias.copy_(bias_scale * torch.randn(bias.shape, generator=gen))
    return save_hf(model, folder, max_shard_size)
