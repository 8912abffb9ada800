"""Tiny Nemotron-H checkpoints built with transformers' own class: Mamba-2, attention (no positional encoding),
mixture (grouped sigmoid router, relu2 experts, shared expert) and dense MLP layers, one sublayer each."""

from __future__ import annotations

from pathlib import Path

import torch
from safetensors.torch import load_file, save_file

import tiny

# M Mamba-2, E mixture, * attention, - MLP
PATTERN = "ME*-ME*E"


def nemotron_h_config(**overrides):
    from transformers import NemotronHConfig

    kwargs = dict(
        vocab_size=96,
        hidden_size=64,
        hybrid_override_pattern=PATTERN,
        num_attention_heads=4,
        num_key_value_heads=2,
        head_dim=16,
        intermediate_size=80,
        mamba_num_heads=8,
        mamba_head_dim=8,
        n_groups=2,
        ssm_state_size=16,
        conv_kernel=4,
        chunk_size=32,
        n_routed_experts=8,
        num_experts_per_tok=3,
        moe_intermediate_size=32,
        moe_shared_expert_intermediate_size=48,
        n_group=2,
        topk_group=1,
        routed_scaling_factor=2.5,
        max_position_embeddings=512,
    )
    kwargs.update(overrides)
    return NemotronHConfig(**kwargs)


def build_nemotron_h(folder: Path, seed: int = 0, max_shard_size: str | None = None, **overrides) -> Path:
    from transformers import NemotronHForCausalLM

    model = tiny.new_model(NemotronHForCausalLM, nemotron_h_config(**overrides), seed)
    with torch.no_grad():  # a correction bias that changes the choice, as a trained one does
        for name, buf in model.named_buffers():
            if name.endswith("e_score_correction_bias"):
                buf.copy_(torch.randn(buf.shape, generator=torch.Generator().manual_seed(seed)) * 0.1)
    return tiny.save_hf(model, folder, max_shard_size)


def fused(folder: Path) -> Path:
    """The experts stacked as transformers holds them: experts.up_proj [E, I, H], experts.down_proj [E, H, I]."""
    path = folder / "model.safetensors"
    tensors = load_file(path)
    prefixes = sorted({k.split(".experts.")[0] for k in tensors if ".experts.0.up_proj" in k})
    for prefix in prefixes:
        n = len({k.split(".")[5] for k in tensors if k.startswith(prefix + ".experts.")})
        for proj in ("up_proj", "down_proj"):
            tensors[f"{prefix}.experts.{proj}"] = torch.stack(
                [tensors.pop(f"{prefix}.experts.{e}.{proj}.weight") for e in range(n)])
    save_file(tensors, path, metadata={"format": "pt"})
    return folder


# The family's own suite (test_family_nemotron_h.py) uses these; the generic suites (conftest's VARIANTS) all but
# the long latent stack (eight layers, for the family's own float32 check of a deep hybrid stream).
FAMILY_VARIANTS = {
    ("nemotron_h", "base"): lambda d: build_nemotron_h(d, seed=0),
    ("nemotron_h", "fused"): lambda d: fused(build_nemotron_h(d, seed=1)),
    ("nemotron_h", "latent"): lambda d: build_nemotron_h(d, seed=2, moe_latent_size=24, n_group=1, norm_topk_prob=False,
                                                         routed_scaling_factor=1.0, hybrid_override_pattern="ME*E"),
    ("nemotron_h", "latent_long"): lambda d: build_nemotron_h(d, seed=2, moe_latent_size=24, n_group=1,
                                                              norm_topk_prob=False, routed_scaling_factor=1.0),
}

VARIANTS = {key: build for key, build in FAMILY_VARIANTS.items() if key[1] != "latent_long"}
VARIANTS[("nemotron_h", "sharded")] = lambda d: build_nemotron_h(d, seed=3, max_shard_size="100KB")
