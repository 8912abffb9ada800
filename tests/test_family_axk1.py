"""A.X K1 (axk1: DeepSeek-V3's blocks, each mixture's output RMS-normed by post_mlp_layernorm) against
transformers' own AXK1ForCausalLM on the same tiny checkpoints. The generic suites compare every site of the base
checkpoint; here: what each variant is, every site of each variant, bfloat16 bit for bit, generation, the
post-norm's place in the block, the released checkpoints' spelling (the norm on dense blocks, the legacy
first_k_dense_replace), the refusals, and the embedded default."""

import pytest
import torch

import tiny
import tiny_axk1
from family_harness import (
    References, build_checkpoints, check_bit_exact, check_greedy_generation, config_json, copy_checkpoint,
    left_padded, rewrite_tensors, stored_keys, tokens,
)
from moelens import HookedTransformer
from moelens.cli import main
from moelens.loaders.errors import CheckpointError
from moelens.models.axk1 import HookedAXK1
from moelens.models.components.sandwich_block import FeedForwardPostNormBlock
from moelens.models.components.block import Block
from moelens.verify import compare
from test_family_deepseek_v3 import check_report

VARIANTS = [v for (_, v) in tiny_axk1.VARIANTS]


@pytest.fixture(scope="module")
def checkpoints(tmp_path_factory):
    return build_checkpoints(tmp_path_factory, "axk1", tiny_axk1.VARIANTS)


@pytest.fixture(scope="module")
def models(checkpoints):
    return {v: HookedTransformer.from_pretrained(p, progress=False) for v, p in checkpoints.items()}


@pytest.fixture(scope="module")
def references(checkpoints):
    return References(checkpoints)


def test_variants_are_what_they_claim(models, checkpoints):
    base, types = models["base"].cfg, models["layer_types"].cfg
    assert base.moe_layers == (False, True, True) and types.moe_layers == (True, False, True, False)
    assert base.rope.interleaved and not types.rope.interleaved and types.rope.kind == "yarn"
    assert (base.n_group, base.topk_group) == (2, 1) and types.n_group == 1 and not types.norm_topk_prob
    assert types.qkv_bias and types.o_bias and base.routed_scaling_factor == 2.5
    for model in models.values():
        for block, is_moe in zip(model.blocks, model.cfg.moe_layers):
            assert (type(block) is FeedForwardPostNormBlock) == is_moe and (type(block) is Block) == (not is_moe)
    assert len(list(checkpoints["sharded"].glob("*.safetensors"))) > 1
    keys = stored_keys(checkpoints["fused"])
    assert "model.layers.1.mlp.experts.gate_up_proj" in keys and not any(".experts.0." in k for k in keys)
    # transformers saves the norm where the released checkpoints keep it, on the decoder layer
    assert "model.layers.1.post_mlp_layernorm.weight" in stored_keys(checkpoints["base"])


@pytest.mark.parametrize("variant", VARIANTS)
def test_float32_every_site(models, references, variant):
    model = models[variant]
    assert type(model) is HookedAXK1
    report = compare(model, references[variant], tokens())
    check_report(report, model)
    compared = {s.site for s in report.sites}
    for layer, is_moe in enumerate(model.cfg.moe_layers):
        assert (f"blocks.{layer}.ln2_post.hook_normalized" in compared) == is_moe


@pytest.mark.parametrize("variant", ["base", "layer_types"])
def test_bfloat16_is_bit_exact(checkpoints, references, variant):
    model = HookedTransformer.from_pretrained(checkpoints[variant], dtype=torch.bfloat16, progress=False)
    check_bit_exact(compare(model, references(variant, torch.bfloat16), tokens()))


@pytest.mark.parametrize("variant,padded", [("base", True), ("layer_types", False)])
def test_greedy_generation_matches_transformers(models, references, variant, padded):
    prompt = left_padded(5, (3, 9), (0, 3, 1)) if padded else (tokens(5, (3, 9)), None)
    check_greedy_generation(models[variant], references[variant], *prompt, new=32)


def test_post_norm_ends_the_mixture(models):
    """mlp_out = ln2_post(routed + shared): the stream adds the normed sum, and the parts sum to the norm's input."""
    model = models["base"]
    _, cache = model.run_with_cache(tokens())
    for layer in (1, 2):
        c = lambda site: cache[f"blocks.{layer}.{site}"]
        assert torch.equal(c("ln2_post.hook_normalized"), c("hook_mlp_out"))
        norm = model.blocks[layer].ln2_post
        assert torch.allclose(norm(c("mlp.hook_routed_out") + c("mlp.hook_shared_out")), c("hook_mlp_out"), atol=1e-6)
        assert torch.allclose(c("hook_resid_mid") + c("hook_mlp_out"), c("hook_resid_post"), atol=1e-6)
        assert model.blocks[layer].post_norm("ffn") is norm and model.blocks[layer].post_norm("mixer") is None
    assert model.blocks[0].post_norm("ffn") is None
    # a hook that doubles ln2_post's scale (the divisor) halves what the mixture adds
    with model.hooks([("blocks.1.ln2_post.hook_scale", lambda s, hook: 2 * s)]):
        _, doubled = model.run_with_cache(tokens(), names_filter="blocks.1.hook_mlp_out")
    assert torch.allclose(2 * doubled["blocks.1.hook_mlp_out"], cache["blocks.1.hook_mlp_out"], atol=1e-5)


def test_released_checkpoint_spelling(checkpoints, tmp_path):
    """A.X K1's files: the legacy first_k_dense_replace instead of mlp_layer_types, post_mlp_layernorm stored on
    the dense block too (unused), and the norm also read under transformers' own module name."""
    folder = copy_checkpoint(checkpoints, tmp_path)
    tiny.edit_config(folder, mlp_layer_types=None, first_k_dense_replace=1, moe_layer_freq=1)

    def released(t):
        t["model.layers.0.post_mlp_layernorm.weight"] = torch.full((64,), 7.0)
        t["model.layers.2.mlp.post_mlp_layernorm.weight"] = t.pop("model.layers.2.post_mlp_layernorm.weight")

    rewrite_tensors(folder, released)
    assert config_json(folder).get("mlp_layer_types") is None
    model = HookedTransformer.from_pretrained(folder, progress=False)
    assert model.cfg.moe_layers == (False, True, True) and "first_k_dense_replace" in model.cfg.fields_read
    check_report(compare(model, References({"r": folder})["r"], tokens()), model)


def test_refusals_name_the_field():
    raw = tiny_axk1.axk1_config().to_dict()
    for change, message in (
        ({"q_lora_rank": None}, "q_lora_rank is null"),
        ({"first_k_dense_replace": 2}, r"first_k_dense_replace = 2 disagree with mlp_layer_types"),
        ({"moe_layer_freq": 2}, r"moe_layer_freq = 2 disagree with mlp_layer_types"),
        ({"mlp_layer_types": ["dense", "sparse"]}, "mlp_layer_types must list 3 entries"),
        ({"mlp_layer_types": ["dense"] * 3}, "mlp_layer_types makes every block a dense MLP"),
        ({"mlp_layer_types": None, "first_k_dense_replace": 3}, "mlp_layer_types makes every block a dense MLP"),
        ({"num_key_value_heads": 2}, "num_key_value_heads"),
        ({"n_group": 3}, "multiple of n_group"),
    ):
        with pytest.raises(ValueError, match=message):
            HookedAXK1.config_from_hf({**raw, **change})
    # the legacy fields are read where mlp_layer_types is absent, as transformers does
    legacy = HookedAXK1.config_from_hf({**raw, "mlp_layer_types": None, "first_k_dense_replace": 0, "moe_layer_freq": 2})
    assert legacy.moe_layers == (True, False, True)


@pytest.mark.parametrize("key", [
    "model.layers.1.post_mlp_layernorm.weight",
    "model.layers.2.mlp.gate.e_score_correction_bias",
    "model.layers.2.mlp.experts.5.gate_proj.weight",
    "model.layers.1.mlp.shared_experts.down_proj.weight",
])
def test_missing_tensor_is_named(checkpoints, tmp_path, key):
    folder = copy_checkpoint(checkpoints, tmp_path)
    rewrite_tensors(folder, lambda t: t.pop(key))
    with pytest.raises(CheckpointError, match="missing") as info:
        HookedTransformer.from_pretrained(folder, progress=False)
    assert key in str(info.value)


def test_verify_command_and_embedded_default(tmp_path, monkeypatch, capsys):
    monkeypatch.setattr("moelens.defaults.cache_root", lambda: tmp_path)
    model = HookedTransformer.from_pretrained("tiny-axk1", progress=False)
    assert type(model) is HookedAXK1 and model.cfg.moe_layers == (False, True, True, True)
    assert main(["verify", "tiny-axk1"]) == 0  # the released spelling (first_k_dense_replace), read by transformers too
    out = capsys.readouterr().out
    assert "float32: OK" in out and "bfloat16: OK" in out
