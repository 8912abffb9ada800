"""Sarvam MoE (HookedSarvamMoe): GLM-4.5's blocks under Sarvam's config and tensor names, against transformers'
Glm4MoeForCausalLM run from SarvamMoEConfig. The generic suites compare every site of the base checkpoint; here:
the checkpoints' own names (the fused query_key_value's rows into q, k, v; weights and biases), Sarvam's
defaults and original config spelling (every site against transformers, which translates it too), the fused
experts, the refusals, greedy generation, verify and the embedded default."""

import json

import pytest
import torch
from safetensors.torch import load_file

import tiny_sarvam_moe
from family_harness import (
    References, build_checkpoints, check_bit_exact, check_greedy_generation, copy_checkpoint, rewrite_tensors,
    stored_keys, tokens,
)
from moelens import HookedTransformer
from moelens.cli import main
from moelens.loaders.errors import CheckpointError
from moelens.models.sarvam_moe import HookedSarvamMoe
from moelens.verify import compare
from test_family_glm4_moe import check_report


@pytest.fixture(scope="module")
def ckpts(tmp_path_factory):
    return build_checkpoints(tmp_path_factory, "sarvam_moe", tiny_sarvam_moe.VARIANTS)


@pytest.fixture(scope="module")
def models(ckpts):
    return {v: HookedTransformer.from_pretrained(p, progress=False) for v, p in ckpts.items()}


@pytest.fixture(scope="module")
def refs(ckpts):
    return References(ckpts)


def test_checkpoints_carry_sarvams_tensor_names(ckpts):
    keys = set(stored_keys(ckpts["base"]))
    assert {"model.word_embeddings.weight", "model.layers.1.attention.query_key_value.weight",
            "model.layers.1.attention.query_key_value.bias", "model.layers.1.attention.dense.weight",
            "model.layers.1.attention.query_layernorm.weight", "model.layers.1.attention.key_layernorm.weight",
            "model.layers.1.mlp.gate.expert_bias"} <= keys
    assert not any("self_attn" in k or "embed_tokens" in k or "e_score_correction_bias" in k for k in keys)


def test_fused_qkv_rows_are_q_then_k_then_v(ckpts, models):
    stored = load_file(ckpts["base"] / "model.safetensors")
    attn = models["base"].blocks[1].attn
    q_rows, kv_rows = 4 * 24, 2 * 24  # 4 query heads, 2 key-value heads, head_dim 24
    for kind in ("weight", "bias"):
        fused = stored[f"model.layers.1.attention.query_key_value.{kind}"]
        assert fused.shape[0] == q_rows + 2 * kv_rows
        q, k, v = fused.split((q_rows, kv_rows, kv_rows))
        assert torch.equal(getattr(attn.q_proj, kind), q)
        assert torch.equal(getattr(attn.k_proj, kind), k)
        assert torch.equal(getattr(attn.v_proj, kind), v)
    router = models["base"].blocks[1].mlp.router
    assert torch.equal(router.e_score_correction_bias, stored["model.layers.1.mlp.gate.expert_bias"])


def test_sarvams_defaults_and_original_spelling(ckpts, models):
    config = json.loads((ckpts["original_spelling"] / "config.json").read_text())
    assert {"num_experts", "num_shared_experts", "use_qkv_bias", "rope_theta"} <= set(config)
    assert not {"n_routed_experts", "n_shared_experts", "attention_bias", "rope_parameters"} & set(config)
    for variant in ("base", "original_spelling"):
        model = models[variant]
        cfg = model.cfg
        assert type(model) is HookedSarvamMoe
        # Sarvam's defaults, which the tiny configs leave out: the whole head rotated, the q/k norm, one dense block
        assert cfg.rope.partial_rotary_factor == 1.0 and cfg.d_rot == cfg.d_head == 24 and cfg.qk_norm
        assert cfg.moe_layers == (False, True, True) and cfg.n_experts == 8 and cfg.d_shared == 24
    assert models["base"].cfg.qkv_bias and not models["original_spelling"].cfg.qkv_bias
    assert models["original_spelling"].cfg.rope.theta == 8e6
    assert {"num_experts", "num_shared_experts", "use_qkv_bias"} <= set(models["original_spelling"].cfg.fields_read)


@pytest.mark.parametrize("variant", ["original_spelling", "fused"])
def test_float32_every_site(models, refs, variant):
    model = models[variant]
    check_report(compare(model, refs(variant), tokens()), model)


def test_bfloat16_is_bit_exact(ckpts, refs):
    model = HookedTransformer.from_pretrained(ckpts["original_spelling"], dtype=torch.bfloat16, progress=False)
    check_bit_exact(compare(model, refs("original_spelling", torch.bfloat16), tokens()))


def test_greedy_generation_matches_transformers(models, refs):
    check_greedy_generation(models["base"], refs("base"), tokens(5, (3, 9)))


@pytest.mark.parametrize("edit, message", [
    (lambda c: c.update(n_routed_experts=c["num_experts"] + 1), r"both num_experts = 8 and n_routed_experts = 9"),
    (lambda c: c.update(use_qkv_bias="no"), r"use_qkv_bias"),
], ids=["both_names", "bad_value"])
def test_config_refusals_name_the_files_fields(ckpts, tmp_path, edit, message):
    folder = copy_checkpoint(ckpts, tmp_path, "original_spelling")
    config = json.loads((folder / "config.json").read_text())
    edit(config)
    (folder / "config.json").write_text(json.dumps(config))
    with pytest.raises(ValueError, match=message):
        HookedTransformer.from_pretrained(folder, progress=False)


def _one_row_short(tensors):
    key = "model.layers.1.attention.query_key_value.weight"
    tensors[key] = tensors[key][:-1].clone()


def _module_names(tensors):
    """transformers' module names for layer 1's attention (not what Sarvam or save_pretrained writes)."""
    fused = tensors.pop("model.layers.1.attention.query_key_value.weight")
    for name, rows in zip("qkv", fused.split((96, 48, 48))):
        tensors[f"model.layers.1.self_attn.{name}_proj.weight"] = rows.clone()


@pytest.mark.parametrize("edit, message", [
    (_one_row_short, r"query_key_value\.weight"),
    (_module_names, r"missing 1 tensor\(s\): 'model\.layers\.1\.attention\.query_key_value\.weight'"),
], ids=["fused_rows", "module_names"])
def test_checkpoint_refusals_name_the_key(ckpts, tmp_path, edit, message):
    folder = copy_checkpoint(ckpts, tmp_path, "base")
    rewrite_tensors(folder, edit)
    with pytest.raises(CheckpointError, match=message):
        HookedTransformer.from_pretrained(folder, progress=False)


def test_verify_command_and_embedded_default(tmp_path, monkeypatch, capsys):
    monkeypatch.setattr("moelens.defaults.cache_root", lambda: tmp_path)
    model = HookedTransformer.from_pretrained("tiny-sarvam-moe", progress=False)
    assert type(model) is HookedSarvamMoe and model.cfg.n_experts == 16 and model.cfg.d_rot == 16
    assert main(["verify", "tiny-sarvam-moe"]) == 0  # the original spelling, read by transformers too
    out = capsys.readouterr().out
    assert "float32: OK" in out and "bfloat16: OK" in out
