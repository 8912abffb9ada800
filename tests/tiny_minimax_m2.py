"""Tiny MiniMax-M2 checkpoints built with transformers' own MiniMaxM2ForCausalLM (fixed seeds, no downloads),
in the spellings moelens must read."""

from __future__ import annotations

import json
from pathlib import Path

import torch
from safetensors.torch import load_file, save_file

import tiny


def minimax_m2_config(**overrides):
    from transformers import MiniMaxM2Config

    kwargs = dict(
        vocab_size=96,
        hidden_size=64,
        intermediate_size=32,
        num_hidden_layers=3,
        num_attention_heads=4,
        num_key_value_heads=2,
        head_dim=32,  # its own size: heads x head_dim is twice hidden_size, as in MiniMax-M2 (48 x 128 vs 3072)
        num_local_experts=8,
        num_experts_per_tok=3,
        max_position_embeddings=256,
        bos_token_id=None,
        eos_token_id=2,
        rotary_dim=16,  # half of each head, as MiniMax-M2's 64 of 128
        rope_theta=1000.0,
    )
    kwargs.update(overrides)
    return MiniMaxM2Config(**kwargs)


def build_minimax_m2(
    folder: Path, seed: int = 0, max_shard_size: str | None = None, bias_scale: float = 0.15, **overrides
) -> Path:
    """A correction bias large enough to change the chosen experts for many tokens, small enough that every
    expert stays reachable (a sigmoid is at most 1: a bias far below the others' shuts an expert out). transformers 5's
    save_pretrained writes the Hub's spelling: block_sparse_moe.{gate, e_score_correction_bias, experts.E.w1/w2/w3}."""
    from transformers import MiniMaxM2ForCausalLM

    model = tiny.new_model(MiniMaxM2ForCausalLM, minimax_m2_config(**overrides), seed)
    gen = torch.Generator().manual_seed(seed + 1000)
    with torch.no_grad():
        for layer in model.model.layers:
            bias = layer.mlp.e_score_correction_bias
            bias.copy_(bias_scale * torch.randn(bias.shape, generator=gen))
    return tiny.save_hf(model, folder, max_shard_size)


def _rewrite(folder: Path, edit) -> Path:
    path = folder / "model.safetensors"
    tensors = load_file(path)
    edit(tensors)
    save_file(tensors, path, metadata={"format": "pt"})
    return folder


def fused(folder: Path) -> Path:
    """transformers 5's in-memory names: mlp.gate.weight, mlp.e_score_correction_bias and the fused
    mlp.experts.gate_up_proj / down_proj."""

    def edit(tensors):
        for key in [k for k in tensors if ".block_sparse_moe." in k and ".experts." not in k]:
            tensors[key.replace(".block_sparse_moe.", ".mlp.")] = tensors.pop(key)
        layers = sorted({k.split(".")[2] for k in tensors if ".block_sparse_moe.experts." in k})
        for layer in layers:
            hub, ours = f"model.layers.{layer}.block_sparse_moe.experts", f"model.layers.{layer}.mlp.experts"
            n = len({k.split(".")[5] for k in tensors if k.startswith(f"{hub}.")})
            tensors[f"{ours}.gate_up_proj"] = torch.stack(
                [torch.cat([tensors.pop(f"{hub}.{e}.w1.weight"), tensors.pop(f"{hub}.{e}.w3.weight")]) for e in range(n)]
            )
            tensors[f"{ours}.down_proj"] = torch.stack([tensors.pop(f"{hub}.{e}.w2.weight") for e in range(n)])

    return _rewrite(folder, edit)


def mlp_prefix(folder: Path) -> Path:
    """Per-expert w1/w2/w3, the gate and the bias under transformers 5's module name `mlp`."""

    def edit(tensors):
        for key in [k for k in tensors if ".block_sparse_moe." in k]:
            tensors[key.replace(".block_sparse_moe.", ".mlp.")] = tensors.pop(key)

    return _rewrite(folder, edit)


def hub_config(folder: Path) -> Path:
    """config.json as MiniMax publishes it: rope_theta and rotary_dim at the top level (no rope_parameters),
    MiniMax's own switches at the values transformers builds, the MTP and training fields it does not read."""
    path = folder / "config.json"
    config = json.loads(path.read_text())
    rope = config.pop("rope_parameters")
    config.pop("partial_rotary_factor", None)
    config.update(
        rope_theta=rope["rope_theta"], rotary_dim=config["rotary_dim"], use_qk_norm=True, qk_norm_type="per_layer",
        scoring_func="sigmoid", use_routing_bias=True, shared_intermediate_size=0, mlp_intermediate_size=80,
        use_mtp=True, num_mtp_modules=0, mtp_transformer_layers=1, sliding_window=None,
        attn_type_list=[1] * config["num_hidden_layers"],
    )
    path.write_text(json.dumps(config))
    return folder


VARIANTS = {
    ("minimax_m2", "base"): lambda d: build_minimax_m2(d, seed=0),
    ("minimax_m2", "fused"): lambda d: fused(build_minimax_m2(d, seed=1)),
    ("minimax_m2", "sharded"): lambda d: build_minimax_m2(d, seed=2, max_shard_size="100KB"),
    ("minimax_m2", "mlp_prefix"): lambda d: mlp_prefix(build_minimax_m2(d, seed=3)),
    ("minimax_m2", "hub_config"): lambda d: hub_config(build_minimax_m2(d, seed=4)),
    # the rotary over whole heads, one kv head per query head, a tied head, top-1
    ("minimax_m2", "full_rotary_tied"): lambda d: build_minimax_m2(
        d, seed=5, rotary_dim=32, num_key_value_heads=4, tie_word_embeddings=True, num_experts_per_tok=1
    ),
}
