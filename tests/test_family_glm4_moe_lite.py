"""GLM-4.7-Flash (glm4_moe_lite: DeepSeek-V3's latent attention and sigmoid grouped router, blocks listed by
mlp_layer_types) against transformers' own Glm4MoeLiteForCausalLM on the same tiny checkpoints."""

import pytest
import torch

import tiny
import tiny_glm4_moe_lite as tiny_lite
from flagships import flagship
from family_harness import (
    References, build_checkpoints, check_bit_exact, check_greedy_generation, config_json, copy_checkpoint,
    left_padded, rewrite_tensors, stored_keys, tokens,
)
from moelens import HookedTransformer, KVCache
from moelens.cli import main
from moelens.loaders.errors import CheckpointError
from moelens.models.components import SharedExpertMoe, SigmoidGroupedTopK
from moelens.models.components.latent_attention import MultiHeadLatentAttention
from moelens.models.glm4_moe_lite import HookedGlm4MoeLite
from moelens.plan import plan
from moelens.verify import compare
from test_family_deepseek_v3 import check_report

VARIANTS = [v for (_, v) in tiny_lite.VARIANTS]


@pytest.fixture(scope="module")
def checkpoints(tmp_path_factory):
    return build_checkpoints(tmp_path_factory, "glm4_moe_lite", tiny_lite.VARIANTS)


@pytest.fixture(scope="module")
def models(checkpoints):
    return {v: HookedTransformer.from_pretrained(p, progress=False) for v, p in checkpoints.items()}


@pytest.fixture(scope="module")
def references(checkpoints):
    return References(checkpoints)


def test_variants_are_what_they_claim(models, checkpoints):
    base, types = models["base"].cfg, models["layer_types"].cfg
    assert base.moe_layers == (False, True, True) and types.moe_layers == (True, False, True, False)
    assert base.q_lora_rank and types.q_lora_rank is None
    assert base.rope.interleaved and not types.rope.interleaved and types.rope.kind == "yarn"
    assert base.n_group == 1 and types.n_group == 4 and types.topk_group == 2 and not types.norm_topk_prob
    assert types.qkv_bias and types.o_bias and base.routed_scaling_factor == 1.8
    assert "mlp_layer_types" in config_json(checkpoints["base"])  # transformers 5 writes it
    for model in models.values():
        recipe = HookedGlm4MoeLite.recipe(model.cfg)
        assert all(spec.mixer is MultiHeadLatentAttention for spec in recipe.layers)
        assert all(spec.ffn.moe is SharedExpertMoe and spec.ffn.router is SigmoidGroupedTopK for spec in recipe.layers if spec.is_moe)
    assert len(list(checkpoints["sharded"].glob("*.safetensors"))) > 1
    keys = stored_keys(checkpoints["fused"])
    assert "model.layers.1.mlp.experts.gate_up_proj" in keys and not any(".experts.0." in k for k in keys)
    assert "model.layers.1.mlp.experts.7.down_proj.weight" in stored_keys(checkpoints["base"])


@pytest.mark.parametrize("variant", VARIANTS)
def test_float32(models, references, variant):
    model = models[variant]
    assert type(model) is HookedGlm4MoeLite
    check_report(compare(model, references[variant], tokens()), model)


def test_float32_left_padded_and_fused_attention(models, references):
    model, ref = models["base"], references["base"]
    toks, mask = tokens(5, (3, 24)), torch.ones(3, 24, dtype=torch.long)
    mask[0, :4], mask[1, :9] = 0, 0
    report = compare(model, ref, toks, mask)
    assert report.max_logit_diff <= 1e-5 and report.index_mismatches == 0, report
    model.set_attention_backend("fused")
    try:
        report = compare(model, ref, toks)
    finally:
        model.set_attention_backend("eager")
    assert report.max_logit_diff <= 1e-5 and report.index_mismatches == 0, report


@pytest.mark.parametrize("variant", ["base", "layer_types"])
def test_bfloat16_is_bit_exact(checkpoints, references, variant):
    model = HookedTransformer.from_pretrained(checkpoints[variant], dtype=torch.bfloat16, progress=False)
    ref = references(variant, torch.bfloat16)
    for layer, block in enumerate(model.blocks):
        if block.is_moe:
            assert block.mlp.router.weight.dtype == ref.model.layers[layer].mlp.gate.weight.dtype == torch.float32
    check_bit_exact(compare(model, ref, tokens()))


@pytest.mark.parametrize("variant,padded", [("base", False), ("base", True), ("layer_types", True)])
def test_greedy_generation_matches_transformers(models, references, variant, padded):
    prompt = left_padded(5, (3, 9), (0, 3, 1)) if padded else (tokens(5, (3, 9)), None)
    check_greedy_generation(models[variant], references[variant], *prompt, new=64)


def test_cached_steps_match_the_uncached_forward(models):
    model = models["layer_types"]
    toks, mask = tokens(5, (3, 9)), torch.ones(3, 9, dtype=torch.long)
    mask[1, :3] = 0
    with torch.no_grad():
        full = model(toks, attention_mask=mask)
        cache = KVCache.for_model(model)
        parts = [model(toks[:, :5], attention_mask=mask[:, :5], past_kv_cache=cache)]
        parts += [model(toks[:, 5:8], past_kv_cache=cache), model(toks[:, 8:], past_kv_cache=cache)]
    assert (torch.cat(parts, dim=1) - full)[mask.bool()].abs().max() <= 1e-5


# ---- config spellings and refusals --------------------------------------------------------------------


def test_hub_config_spelling_loads_the_same_model(checkpoints, models, tmp_path):
    """GLM-4.7-Flash's config.json: no mlp_layer_types, first_k_dense_replace 1, rope_theta at the top level and
    a partial_rotary_factor of 1; transformers reads it as the same model."""
    folder = copy_checkpoint(checkpoints, tmp_path)
    tiny.edit_config(folder, mlp_layer_types=None, first_k_dense_replace=1, rope_parameters=None, rope_theta=1000.0,
                     partial_rotary_factor=1.0)
    model = HookedTransformer.from_pretrained(folder, progress=False)
    assert model.cfg == models["base"].cfg
    assert "first_k_dense_replace" in model.cfg.fields_ignored
    assert torch.equal(model(tokens()), models["base"](tokens()))
    check_report(compare(model, References({"hub": folder})["hub"], tokens()), model)


def test_inconsistent_layer_fields_are_refused():
    raw = tiny_lite.glm4_moe_lite_config().to_dict()
    for change, message in (
        ({"first_k_dense_replace": 2}, r"first_k_dense_replace = 2 disagrees with mlp_layer_types"),
        ({"mlp_layer_types": None, "first_k_dense_replace": 2}, r"mlp_layer_types \(absent"),
        ({"mlp_layer_types": ["dense", "sparse"]}, "mlp_layer_types must list 3 entries"),
        ({"mlp_layer_types": ["dense", "moe", "sparse"]}, "mlp_layer_types must list 3 entries"),
        ({"mlp_layer_types": ["dense"] * 3}, "mlp_layer_types makes every block a dense MLP"),
        ({"num_key_value_heads": 2}, "num_key_value_heads"),
        ({"n_group": 3}, "multiple of n_group"),
        ({"rope_parameters": {"rope_type": "default", "rope_theta": 1e4, "partial_rotary_factor": 0.5}},
         "partial_rotary_factor"),
    ):
        with pytest.raises(ValueError, match=message):
            HookedGlm4MoeLite.config_from_hf({**raw, **change})
    # agreeing fields are accepted
    assert HookedGlm4MoeLite.config_from_hf({**raw, "first_k_dense_replace": 1}).moe_layers == (False, True, True)


@pytest.mark.parametrize("key", [
    "model.layers.0.self_attn.kv_b_proj.weight",
    "model.layers.2.self_attn.q_a_layernorm.weight",
    "model.layers.1.mlp.gate.e_score_correction_bias",
    "model.layers.2.mlp.experts.5.gate_proj.weight",
    "model.layers.1.mlp.shared_experts.down_proj.weight",
    "model.layers.0.mlp.up_proj.weight",
])
def test_missing_tensor_is_named(checkpoints, tmp_path, key):
    folder = copy_checkpoint(checkpoints, tmp_path)
    rewrite_tensors(folder, lambda t: t.pop(key))
    with pytest.raises(CheckpointError, match="missing") as info:
        HookedTransformer.from_pretrained(folder, progress=False)
    assert key in str(info.value)


def test_multi_token_prediction_layer_is_skipped_only_when_the_config_has_one(checkpoints, models, tmp_path):
    folder = copy_checkpoint(checkpoints, tmp_path)
    rewrite_tensors(folder, lambda t: t.update({"model.layers.3.eh_proj.weight": torch.ones(4, 4)}))
    tiny.edit_config(folder, num_nextn_predict_layers=0)
    with pytest.raises(CheckpointError, match="unexpected .*model.layers.3.eh_proj.weight"):
        HookedTransformer.from_pretrained(folder, progress=False)
    tiny.edit_config(folder, num_nextn_predict_layers=1)
    model = HookedTransformer.from_pretrained(folder, progress=False)
    assert torch.equal(model(tokens()), models["base"](tokens()))


# ---- plan, support, embedded default -------------------------------------------------------------------

GLM_47_FLASH = flagship("glm4_moe_lite", "zai-org/GLM-4.7-Flash")


def test_plan_at_full_size_dense_first_block_and_cache():
    """(Its counts against transformers' and the published total: tests/test_flagships.py.)"""
    p = plan(dict(GLM_47_FLASH), dtype="bfloat16", cpu_memory="2TB")
    assert [layer.kind for layer in p.per_layer] == ["dense"] + ["moe"] * 46
    # every head's decompressed key (192 + 64) and value (256), bf16, seq 2048
    assert p.kv_cache["bytes"] == 47 * 2048 * 20 * (192 + 64 + 256) * 2


def test_support_lists_the_family_sites(models):
    table = models["layer_types"].support(print_table=False)
    rows = {r.name: r for r in table.rows}
    assert rows["blocks.L.mlp.hook_choice_scores"].layers == "0,2"
    assert rows["blocks.L.mlp.hook_post"].layers == "1,3"
    assert rows["blocks.L.attn.hook_kv_latent"].reference == "model.layers.L.self_attn.kv_a_layernorm"
    assert "mlp_layer_types" in table.config_fields


def test_verify_command_and_embedded_default(tmp_path, monkeypatch, capsys):
    monkeypatch.setattr("moelens.defaults.cache_root", lambda: tmp_path)
    model = HookedTransformer.from_pretrained("tiny-glm4-moe-lite", progress=False)
    assert type(model) is HookedGlm4MoeLite and model.cfg.moe_layers == (False, True, True, True)
    logits = model("Hello, latent attention")
    assert logits.shape[-1] == 260 and torch.isfinite(logits).all()
    assert main(["verify", "tiny-glm4-moe-lite"]) == 0  # the Hub's spelling (no mlp_layer_types), read by transformers too
    out = capsys.readouterr().out
    assert "float32: OK" in out and "bfloat16: OK" in out
