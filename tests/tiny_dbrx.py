"""Tiny DBRX checkpoints built with transformers' own DbrxForCausalLM (fixed seeds, no downloads): a fused Wqkv,
experts stored flat, bias-free LayerNorms, clip_qkv and the router's p-norm."""

from __future__ import annotations

from pathlib import Path

import torch

import tiny

CLIP = 0.6  # the base variant's clip_qkv: below many q / k / v entries, so the clamp acts
NO_CLIP = 1e9  # a bound no entry reaches: transformers' run of a checkpoint whose clip_qkv is null (which it refuses)


def dbrx_config(clip_qkv: float | None = CLIP, attn: dict | None = None, ffn: dict | None = None, **overrides):
    from transformers import DbrxConfig

    kwargs = dict(
        d_model=64,
        n_heads=4,
        n_layers=3,
        max_seq_len=256,
        vocab_size=96,
        eos_token_id=2,
        pad_token_id=1,
        # transformers reads attn_config.rope_theta's presence, not its value: the rotary's is the top level's
        attn_config={"kv_n_heads": 2, "clip_qkv": clip_qkv, "rope_theta": 10000.0, **(attn or {})},
        ffn_config={"ffn_hidden_size": 32, "moe_num_experts": 8, "moe_top_k": 3, **(ffn or {})},
        rope_parameters={"rope_type": "default", "rope_theta": 10000.0},
    )
    kwargs.update(overrides)
    return DbrxConfig(**kwargs)


def build_dbrx(folder: Path, seed: int = 0, max_shard_size: str | None = None, **overrides) -> Path:
    from transformers import DbrxForCausalLM

    model = tiny.new_model(DbrxForCausalLM, dbrx_config(**overrides), seed)
    gen = torch.Generator().manual_seed(seed + 100)
    with torch.no_grad():  # tiny.perturb knows norms by the other families' names; DBRX's are norm_1, norm_2, norm_f
        for name, p in model.named_parameters():
            if name.endswith((".norm_1.weight", ".norm_2.weight", ".norm_f.weight")):
                p.copy_(1.0 + 0.3 * torch.randn(p.shape, generator=gen))
    return tiny.save_hf(model, folder, max_shard_size)


def without_clip(folder: Path) -> Path:
    """clip_qkv null in config.json: moelens clamps nothing (transformers' clamp(min=None, max=None) raises; its
    run with clip_qkv NO_CLIP is the same model)."""
    config = tiny.json.loads((folder / "config.json").read_text())
    config["attn_config"]["clip_qkv"] = None
    (folder / "config.json").write_text(tiny.json.dumps(config, indent=2))
    return folder


VARIANTS = {
    ("dbrx", "base"): lambda d: build_dbrx(d, seed=0),
    ("dbrx", "sharded"): lambda d: build_dbrx(d, seed=1, max_shard_size="100KB"),
    # ffn_config.moe_normalize_expert_weights: 2 (the weights' Euclidean norm is 1), null (not normalised)
    ("dbrx", "p2"): lambda d: build_dbrx(d, seed=2, ffn={"moe_normalize_expert_weights": 2.0}),
    ("dbrx", "unnormalised"): lambda d: build_dbrx(d, seed=3, ffn={"moe_normalize_expert_weights": None}),
    # all heads their own keys (kv_n_heads = n_heads), gelu experts, another top-level theta
    ("dbrx", "mha_gelu"): lambda d: build_dbrx(
        d, seed=4, ffn={"ffn_act_fn": {"name": "gelu"}},
        attn={"kv_n_heads": 4, "rope_theta": 500.0}, rope_parameters={"rope_type": "default", "rope_theta": 500.0},
    ),
}
