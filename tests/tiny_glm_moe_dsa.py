"""Tiny GLM-5 checkpoints built with transformers' own class (fixed seeds, no downloads): four layers, the
second and fourth reusing the key selection of the layer before (indexer_types), index_topk 3."""

from __future__ import annotations

from pathlib import Path

import tiny
from tiny_deepseek_v32 import dsa_fields, hub_spelling, perturb_dsa

SHARED = ["full", "shared", "full", "shared"]


def glm_moe_dsa_config(**overrides):
    from transformers import GlmMoeDsaConfig

    fields = dsa_fields(num_hidden_layers=4, n_group=1, topk_group=1, rms_norm_eps=1e-5)
    fields.update(overrides)
    if "indexer_types" not in fields and not any(k.startswith("index_topk_") or k == "index_skip_topk_offset" for k in fields):
        fields["indexer_types"] = SHARED
    return GlmMoeDsaConfig(**fields)


def build_glm_moe_dsa(folder: Path, seed: int = 0, max_shard_size: str | None = None, **overrides) -> Path:
    from transformers import GlmMoeDsaForCausalLM

    model = tiny.new_model(GlmMoeDsaForCausalLM, glm_moe_dsa_config(**overrides), seed)
    perturb_dsa(model, seed)
    return tiny.save_hf(model, folder, max_shard_size)


build = build_glm_moe_dsa
VARIANTS = {
    # seed 4: an edit of expert 0's router logit moves the logits (the generic per-site tests need every site live)
    # and no correction bias outweighs the generic tests' forced router logits
    ("glm_moe_dsa", "base"): lambda d: build(d, seed=4),
    ("glm_moe_dsa", "sharded"): lambda d: build(d, seed=6, max_shard_size="100KB"),
    ("glm_moe_dsa", "fused"): lambda d: tiny.fused(build(d, seed=3)),
    # the Hub's schedule: every second layer from index_skip_topk_offset on shares (full, full, shared, full)
    ("glm_moe_dsa", "hub"): lambda d: hub_spelling(
        build(d, seed=5, index_topk_freq=2, index_skip_topk_offset=2), index_topk_freq=2, index_skip_topk_offset=2
    ),
}
