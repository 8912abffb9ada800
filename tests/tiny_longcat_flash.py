"""Tiny LongCat-Flash checkpoints built with transformers' own class: blocks of two MLA + dense-MLP pairs and a
shortcut mixture of real and identity (zero-computation) experts."""

from __future__ import annotations

from pathlib import Path

import torch
from safetensors.torch import load_file, save_file

import tiny


def longcat_flash_config(**overrides):
    from transformers import LongcatFlashConfig

    kwargs = dict(
        vocab_size=96,
        hidden_size=64,
        num_layers=2,
        num_attention_heads=4,
        ffn_hidden_size=80,
        q_lora_rank=24,
        kv_lora_rank=16,
        qk_nope_head_dim=8,
        qk_rope_head_dim=8,
        head_dim=8,  # transformers' rotary is head_dim wide: the qk_rope_head_dim
        v_head_dim=12,
        moe_topk=3,
        n_routed_experts=6,
        zero_expert_num=2,
        expert_ffn_hidden_size=32,
        routed_scaling_factor=3.0,
        max_position_embeddings=512,
        rope_parameters={"rope_type": "default", "rope_theta": 10000.0},
    )
    kwargs.update(overrides)
    return LongcatFlashConfig(**kwargs)


def build_longcat_flash(folder: Path, seed: int = 0, max_shard_size: str | None = None, bias_scale: float = 0.3,
                        **overrides) -> Path:
    """bias_scale: the correction bias ~ N(0, bias_scale) times the score scale, so that it changes choices
    (perturb leaves buffers at zero)."""
    from transformers import LongcatFlashForCausalLM

    model = tiny.new_model(LongcatFlashForCausalLM, longcat_flash_config(**overrides), seed)
    gen = torch.Generator().manual_seed(seed + 100)
    with torch.no_grad():
        for layer in model.model.layers:
            bias = layer.mlp.router.e_score_correction_bias
            bias.copy_(bias_scale * torch.randn(bias.shape, generator=gen) / bias.numel())
    return tiny.save_hf(model, folder, max_shard_size)


def hub_keys(folder: Path) -> Path:
    """Drop the identity experts' gate / up rows transformers saves (the Hub checkpoint has none)."""
    path = folder / "model.safetensors"
    tensors = load_file(path)
    n = tiny.json.loads((folder / "config.json").read_text())["n_routed_experts"]
    kept = {k: v for k, v in tensors.items() if not (".mlp.experts." in k and k.split(".")[5].isdigit() and int(k.split(".")[5]) >= n)}
    save_file(kept, path, metadata={"format": "pt"})
    return folder


def with_identity_rows(folder: Path, to: Path) -> Path:
    """A copy of a checkpoint without the identity experts' rows (the Hub's layout), with zero gate / up rows added
    for them: transformers 5.24's fused gate_up_proj has a row per routable expert and refuses the Hub layout's
    fewer rows, so this is the copy transformers loads (the identity experts never read those rows)."""
    import shutil

    shutil.copytree(folder, to)
    path = to / "model.safetensors"
    tensors = load_file(path)
    config = tiny.json.loads((to / "config.json").read_text())
    n, zero = config["n_routed_experts"], config.get("zero_expert_num") or 0
    for layer in range(config["num_layers"]):
        prefix = f"model.layers.{layer}.mlp.experts"
        for proj in ("gate_proj", "up_proj"):
            like = tensors[f"{prefix}.0.{proj}.weight"]
            for e in range(n, n + zero):
                tensors[f"{prefix}.{e}.{proj}.weight"] = torch.zeros_like(like)
    save_file(tensors, path, metadata={"format": "pt"})
    return to


# The family's own suite (test_family_longcat_flash.py) uses these; the generic suites (conftest's VARIANTS) a
# three-block base, as the other families' (they read blocks 0-2 and the final stream apart), and a sharded copy.
# No fused one there: transformers loads a fused checkpoint only with the identity experts' rows, which the fused
# (Hub) layout lacks; the family's suite checks its fused variant against the base weights' reference.
FAMILY_VARIANTS = {
    ("longcat_flash", "base"): lambda d: build_longcat_flash(d, seed=0),
    ("longcat_flash", "hub_keys"): lambda d: hub_keys(build_longcat_flash(d, seed=0)),
    ("longcat_flash", "fused"): lambda d: tiny.fused(hub_keys(build_longcat_flash(d, seed=0))),
}

VARIANTS = {
    ("longcat_flash", "base"): lambda d: build_longcat_flash(d, seed=0, num_layers=3),
    ("longcat_flash", "sharded"): lambda d: build_longcat_flash(d, seed=3, num_layers=3, max_shard_size="100KB"),
}
