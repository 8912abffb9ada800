"""Tiny Mistral Small 4 checkpoints built with transformers' own classes (fixed seeds, no downloads): the text model
(Mistral4ForCausalLM, from transformers.models.mistral4: AutoModelForCausalLM does not map mistral4) and the Hub's
multimodal layout (Mistral3ForConditionalGeneration with a tiny Pixtral vision tower: config.json model_type
mistral3 with the text model's config as text_config, its tensors saved under language_model., the vision tower's
and the projector's beside them). transformers writes Mistral 4's experts stacked (gate_up_proj, down_proj), its
only layout; the per-expert spelling is written from it by hand (per_expert_keys)."""

from __future__ import annotations

from pathlib import Path

from safetensors.torch import load_file, save_file

import tiny

# YaRN as Mistral Small 4's (mscale = mscale_all_dim = 1), its original length 16 so that the tests' sequences
# (40 to 80 tokens) cross several periods of the queries' scaling by position; beta larger than the published 0.1
# so that the scaling moves the scores well past rounding
YARN = {
    "rope_type": "yarn", "rope_theta": 10000.0, "factor": 4.0, "original_max_position_embeddings": 16,
    "beta_fast": 32.0, "beta_slow": 1.0, "mscale": 1.0, "mscale_all_dim": 1.0, "llama_4_scaling_beta": 0.4,
}


def mistral4_config(**overrides):
    from transformers.models.mistral4 import Mistral4Config

    kwargs = dict(
        vocab_size=96,
        hidden_size=64,
        intermediate_size=80,
        moe_intermediate_size=24,
        num_hidden_layers=3,
        num_attention_heads=4,
        num_key_value_heads=4,
        q_lora_rank=24,
        kv_lora_rank=16,
        qk_nope_head_dim=12,
        qk_rope_head_dim=8,
        v_head_dim=10,
        n_routed_experts=8,
        num_experts_per_tok=3,
        n_shared_experts=1,
        first_k_dense_replace=1,
        max_position_embeddings=256,
        pad_token_id=0,
        rope_parameters=dict(YARN),
    )
    kwargs.update(overrides)
    return Mistral4Config(**kwargs)


def build_mistral4(folder: Path, seed: int = 0, max_shard_size: str | None = None, **overrides) -> Path:
    from transformers.models.mistral4 import Mistral4ForCausalLM

    model = tiny.new_model(Mistral4ForCausalLM, mistral4_config(**overrides), seed)
    return tiny.save_hf(model, folder, max_shard_size)


def build_multimodal(folder: Path, seed: int = 0, tie_word_embeddings: bool | None = False, **overrides) -> Path:
    """The Hub's layout, saved by transformers' Mistral3ForConditionalGeneration around a Mistral 4 text model; its
    head untied as the Hub's (tie_word_embeddings None: left to Mistral3Config's default, tied)."""
    from transformers import Mistral3Config, Mistral3ForConditionalGeneration

    vision = dict(model_type="pixtral", hidden_size=16, intermediate_size=24, num_hidden_layers=1, num_attention_heads=2,
                  head_dim=8, image_size=32, patch_size=4)
    config = Mistral3Config(text_config=mistral4_config(**overrides).to_dict(), vision_config=vision,
                            spatial_merge_size=2, image_token_index=90,
                            **({} if tie_word_embeddings is None else {"tie_word_embeddings": tie_word_embeddings}))
    return tiny.save_hf(tiny.new_model(Mistral3ForConditionalGeneration, config, seed), folder)


def per_expert_keys(folder: Path) -> Path:
    """The stacked experts rewritten one tensor per expert (model.layers.L.mlp.experts.E.gate_proj.weight, ...),
    the other spelling moelens reads (transformers reads only the stacked one for Mistral 4)."""
    path = folder / "model.safetensors"
    tensors = load_file(path)
    for key in [k for k in tensors if k.endswith("mlp.experts.gate_up_proj")]:
        prefix = key.removesuffix(".gate_up_proj")
        gate_up, down = tensors.pop(key), tensors.pop(f"{prefix}.down_proj")
        gate, up = gate_up.chunk(2, dim=1)
        for e in range(gate_up.shape[0]):
            tensors[f"{prefix}.{e}.gate_proj.weight"] = gate[e].contiguous()
            tensors[f"{prefix}.{e}.up_proj.weight"] = up[e].contiguous()
            tensors[f"{prefix}.{e}.down_proj.weight"] = down[e].contiguous()
    save_file(tensors, path, metadata={"format": "pt"})
    return folder


build = build_mistral4
VARIANTS = {
    # a dense first block, the query bottleneck, the rotary interleaved, YaRN, the queries scaled by position
    ("mistral4", "base"): lambda d: build(d, seed=0),
    # transformers' own (stacked) layout, as base; every block a mixture, as Mistral Small 4's
    ("mistral4", "fused"): lambda d: build(d, seed=1, first_k_dense_replace=0),
    ("mistral4", "sharded"): lambda d: build(d, seed=2, max_shard_size="100KB"),
    # expert groups, no renormalisation, a routed scale, no query bottleneck, the rotary half-split, YaRN with
    # mscale != mscale_all_dim (cos / sin scaled, the softmax too), biased projections, two dense blocks
    ("mistral4", "grouped"): lambda d: build(
        d, seed=3, num_hidden_layers=4, first_k_dense_replace=2, n_group=4, topk_group=2, norm_topk_prob=False,
        routed_scaling_factor=2.0, q_lora_rank=None, rope_interleave=False, attention_bias=True,
        rope_parameters={**YARN, "factor": 8.0, "original_max_position_embeddings": 12, "mscale": 0.8,
                         "mscale_all_dim": 0.6, "llama_4_scaling_beta": 0.3},
    ),
    # the Hub's multimodal layout (text_config, keys under language_model., a vision tower beside it)
    ("mistral4", "multimodal"): lambda d: build_multimodal(d, seed=4),
}
