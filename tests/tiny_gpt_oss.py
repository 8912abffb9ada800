"""Tiny gpt-oss checkpoints built with transformers' own GptOssForCausalLM (fixed seeds, no downloads)."""

from __future__ import annotations

from pathlib import Path

import tiny

WINDOW = 5  # the sliding layers' window: shorter than the test inputs, so the mask matters


def gpt_oss_config(**overrides):
    from transformers import GptOssConfig

    kwargs = dict(
        vocab_size=96,
        hidden_size=64,
        intermediate_size=32,
        head_dim=16,
        num_hidden_layers=3,
        num_attention_heads=4,
        num_key_value_heads=2,
        num_local_experts=8,
        num_experts_per_tok=3,
        max_position_embeddings=256,
        sliding_window=WINDOW,
        swiglu_limit=1.5,  # below many gate/up values of the tiny model, so the clamps act
        rope_parameters={"rope_type": "yarn", "rope_theta": 150000.0, "factor": 4.0, "beta_fast": 32.0,
                         "beta_slow": 1.0, "truncate": False, "original_max_position_embeddings": 64},
        eos_token_id=2,
        pad_token_id=1,
    )
    kwargs.update(overrides)
    return GptOssConfig(**kwargs)


def build_gpt_oss(folder: Path, seed: int = 0, max_shard_size: str | None = None, **overrides) -> Path:
    from transformers import GptOssForCausalLM

    model = tiny.new_model(GptOssForCausalLM, gpt_oss_config(**overrides), seed)
    return tiny.save_hf(model, folder, max_shard_size)


VARIANTS = {
    ("gpt_oss", "base"): lambda d: build_gpt_oss(d, seed=0),
    ("gpt_oss", "full_only"): lambda d: build_gpt_oss(d, seed=1, layer_types=["full_attention"] * 3),
    ("gpt_oss", "sharded"): lambda d: build_gpt_oss(d, seed=2, max_shard_size="100KB"),
    ("gpt_oss", "fused"): lambda d: build_gpt_oss(d, seed=3),  # transformers saves gpt-oss's experts fused already
}


# e2m1 value of each 4-bit code (the sign is the high bit), the order MXFP4 stores them in
FP4_E2M1 = (0.0, 0.5, 1.0, 1.5, 2.0, 3.0, 4.0, 6.0, -0.0, -0.5, -1.0, -1.5, -2.0, -3.0, -4.0, -6.0)


def quantize_mxfp4(dense):
    """[..., rows, cols] -> (blocks uint8 [..., rows, cols / 32, 16], scales uint8 [..., rows, cols / 32]): each
    group of 32 values scaled by 2 ** (scale - 127), the smallest power of two that brings its largest magnitude
    to at most 6, each value the nearest e2m1 code; code 2k in byte k's low nibble, 2k + 1 in its high nibble."""
    import torch

    groups = dense.float().unflatten(-1, (dense.shape[-1] // 32, 32))
    exponent = torch.ceil(torch.log2(groups.abs().amax(-1, keepdim=True).clamp(min=2.0**-100) / 6.0))
    codes = (groups / 2.0**exponent)[..., None].sub(torch.tensor(FP4_E2M1)).abs().argmin(-1)
    blocks = (codes[..., 0::2] | (codes[..., 1::2] << 4)).to(torch.uint8)
    return blocks, (exponent.squeeze(-1) + 127).to(torch.uint8)


def dequantize_mxfp4_by_hand(blocks, scales):
    """The inverse, written out: [..., rows, groups, 16] and [..., rows, groups] -> [..., rows, groups * 32]."""
    import torch

    values = torch.tensor(FP4_E2M1)
    pairs = torch.stack([values[(blocks & 0x0F).long()], values[(blocks >> 4).long()]], dim=-1).flatten(-2)
    return (pairs * 2.0 ** (scales.float() - 127)[..., None]).flatten(-2)


def to_mxfp4(folder: Path) -> Path:
    """Rewrite a gpt-oss checkpoint's experts as the published one stores them: gate_up_proj_blocks / _scales
    ([E, 2 * d_expert, d_model / 32, ...], rows in transformers' interleaved gate/up order) and down_proj_blocks
    / _scales ([E, d_model, d_expert / 32, ...]); biases as they are; quantization_config mxfp4."""
    import json

    from safetensors.torch import load_file, save_file

    path = folder / "model.safetensors"
    tensors = load_file(path)
    for key in [k for k in tensors if k.endswith(("experts.gate_up_proj", "experts.down_proj"))]:
        blocks, scales = quantize_mxfp4(tensors.pop(key).transpose(1, 2))  # transformers keeps [E, in, out]
        tensors[f"{key}_blocks"], tensors[f"{key}_scales"] = blocks, scales
    save_file(tensors, path, metadata={"format": "pt"})
    config = json.loads((folder / "config.json").read_text())
    config["quantization_config"] = {"quant_method": "mxfp4", "modules_to_not_convert": ["model.layers.*.self_attn",
                                     "model.layers.*.mlp.router", "model.embed_tokens", "lm_head"]}
    (folder / "config.json").write_text(json.dumps(config, indent=2))
    return folder
