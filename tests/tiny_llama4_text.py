"""Tiny Llama 4 text checkpoints built with transformers' own Llama4ForCausalLM (fixed seeds, no downloads), in
the spellings moelens must read: transformers' flat llama4_text (fused experts), the Hub's multimodal nesting
(model_type llama4, text_config, keys under language_model.), and per-expert keys."""

from __future__ import annotations

import json
from pathlib import Path

import torch
from safetensors.torch import load_file, save_file

import tiny

CHUNK = 8  # attention_chunk_size: a 40-token input spans five chunks
FLOOR_SCALE = 4  # the NoPE layers' temperature changes every 4 positions


def llama4_config(**overrides):
    from transformers import Llama4TextConfig

    kwargs = dict(
        vocab_size=96,
        hidden_size=64,
        intermediate_size=32,
        intermediate_size_mlp=80,
        num_hidden_layers=4,
        num_attention_heads=4,
        num_key_value_heads=2,
        head_dim=16,
        num_local_experts=8,
        num_experts_per_tok=1,
        interleave_moe_layer_step=1,  # every layer a mixture, as Scout
        no_rope_layer_interval=2,  # layers 1 and 3 NoPE
        attention_chunk_size=CHUNK,
        floor_scale=FLOOR_SCALE,
        attn_scale=0.1,
        use_qk_norm=True,
        max_position_embeddings=256,
        bos_token_id=None,
        eos_token_id=2,
        pad_token_id=0,
        rope_parameters={
            "rope_type": "llama3", "rope_theta": 500000.0, "factor": 16.0, "low_freq_factor": 1.0,
            "high_freq_factor": 4.0, "original_max_position_embeddings": 16,
        },
    )
    kwargs.update(overrides)
    return Llama4TextConfig(**kwargs)


def build_llama4(folder: Path, seed: int = 0, max_shard_size: str | None = None, **overrides) -> Path:
    from transformers import Llama4ForCausalLM

    model = tiny.new_model(Llama4ForCausalLM, llama4_config(**overrides), seed)
    return tiny.save_hf(model, folder, max_shard_size)


def _rewrite(folder: Path, edit) -> Path:
    path = folder / "model.safetensors"
    tensors = load_file(path)
    edit(tensors)
    save_file(tensors, path, metadata={"format": "pt"})
    return folder


def per_expert(folder: Path) -> Path:
    """feed_forward.experts.E.{gate,up,down}_proj.weight [out, in] in place of the fused, transposed stacks."""

    def edit(tensors):
        for key in [k for k in tensors if k.endswith(".experts.gate_up_proj")]:
            prefix = key.removesuffix(".gate_up_proj")
            gate_up, down = tensors.pop(key), tensors.pop(f"{prefix}.down_proj")  # [E, H, 2I], [E, I, H]
            gate, up = gate_up.chunk(2, dim=-1)
            for e in range(gate_up.shape[0]):
                tensors[f"{prefix}.{e}.gate_proj.weight"] = gate[e].T.contiguous()
                tensors[f"{prefix}.{e}.up_proj.weight"] = up[e].T.contiguous()
                tensors[f"{prefix}.{e}.down_proj.weight"] = down[e].T.contiguous()

    return _rewrite(folder, edit)


def hub_nested(folder: Path) -> Path:
    """As meta-llama publishes Llama 4: config.json of model_type llama4 with the text model as text_config (its
    rotary as rope_theta + rope_scaling, attn_temperature_tuning an integer), the keys under language_model., and
    a vision tower and projector beside it (stand-ins: moelens does not load them)."""
    path = folder / "config.json"
    text = json.loads(path.read_text())
    rope = text.pop("rope_parameters")
    text.update(rope_theta=rope.pop("rope_theta"), rope_scaling=rope, attn_temperature_tuning=4)
    text.pop("architectures", None)
    config = {
        "architectures": ["Llama4ForConditionalGeneration"], "model_type": "llama4", "text_config": text,
        "vision_config": {"model_type": "llama4_vision_model", "hidden_size": 8}, "boi_token_index": 90,
        "eoi_token_index": 91, "image_token_index": 92, "tie_word_embeddings": False,
    }
    path.write_text(json.dumps(config))

    def edit(tensors):
        for key in list(tensors):
            tensors[f"language_model.{key}"] = tensors.pop(key)
        tensors["vision_model.patch_embedding.linear.weight"] = torch.zeros(8, 12)
        tensors["multi_modal_projector.linear_1.weight"] = torch.zeros(64, 8)

    return _rewrite(folder, edit)


VARIANTS = {
    ("llama4_text", "base"): lambda d: build_llama4(d, seed=0),
    # Maverick's arrangement: dense and mixture layers alternating, no q/k norm, plain rotary, top-2 routing
    ("llama4_text", "interleaved"): lambda d: build_llama4(
        d, seed=1, interleave_moe_layer_step=2, use_qk_norm=False, num_experts_per_tok=2,
        rope_parameters={"rope_type": "default", "rope_theta": 10000.0},
    ),
    ("llama4_text", "sharded"): lambda d: build_llama4(d, seed=3, max_shard_size="100KB"),
    ("llama4_text", "fused"): lambda d: build_llama4(d, seed=6),  # transformers' own layout, as base
    # no temperature tuning, no chunks, one kv head per query head, tied head
    ("llama4_text", "plain"): lambda d: build_llama4(
        d, seed=5, attn_temperature_tuning=False, attention_chunk_size=None, num_key_value_heads=4,
        tie_word_embeddings=True,
    ),
}
# spellings transformers does not load (per-expert keys; the Hub's config, whose integer attn_temperature_tuning
# transformers 5's strict config refuses): the family's own tests compare them with the flat checkpoint
OWN_VARIANTS = {
    **VARIANTS,
    ("llama4_text", "per_expert"): lambda d: per_expert(build_llama4(d, seed=2)),
    ("llama4_text", "hub_nested"): lambda d: hub_nested(build_llama4(d, seed=4)),
}
