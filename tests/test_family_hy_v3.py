"""Hy3 (HookedHYV3): GLM-4.5's blocks with Qwen3's q/k-normed attention and an ungrouped sigmoid router whose
correction bias is the mixture block's, against transformers' own HYV3ForCausalLM on the same tiny checkpoints.
The generic suites compare every site of the base checkpoint; here: every variant site by site in float32, bit
for bit in bfloat16, greedy generation, the Hub's key spelling and transformers' module spelling, the
multi-token-prediction layer, Hy3's defaults and refusals, verify and the embedded default (the plan at full
size: the flagship file, tests/test_flagships.py)."""

import pytest
import torch

import tiny
import tiny_hy_v3
from family_harness import (
    References, build_checkpoints, check_bit_exact, check_greedy_generation, copy_checkpoint, left_padded,
    rewrite_tensors, stored_keys, tokens,
)
from moelens import HookedTransformer
from moelens.cli import main
from moelens.loaders.errors import CheckpointError
from moelens.models.components import SharedExpertMoe, SigmoidGroupedTopK
from moelens.models.components.qk_norm_attention import QKNormBeforeRotaryAttention
from moelens.models.hy_v3 import HookedHYV3
from moelens.verify import compare
from test_family_glm4_moe import check_report

VARIANTS = [v for (_, v) in tiny_hy_v3.VARIANTS]


@pytest.fixture(scope="module")
def ckpts(tmp_path_factory):
    return build_checkpoints(tmp_path_factory, "hy_v3", tiny_hy_v3.VARIANTS)


@pytest.fixture(scope="module")
def models(ckpts):
    return {v: HookedTransformer.from_pretrained(p, progress=False) for v, p in ckpts.items()}


@pytest.fixture(scope="module")
def refs(ckpts):
    return References(ckpts)


def test_variants_are_what_they_claim(models, ckpts):
    base, types = models["base"].cfg, models["layer_types"].cfg
    assert type(models["base"]) is HookedHYV3
    assert base.moe_layers == (False, True, True) and types.moe_layers == (True, False, True, True)
    assert base.d_shared == 2 * base.d_expert and types.d_shared == types.d_expert and base.d_mlp == 80
    assert (base.n_group, base.topk_group) == (1, 1) and base.norm_topk_prob and base.routed_scaling_factor == 2.826
    assert base.d_head == 24 and not base.qkv_bias and types.qkv_bias and types.o_bias
    assert all(type(block.attn) is QKNormBeforeRotaryAttention for m in models.values() for block in m.blocks)
    recipe = HookedHYV3.recipe(base)
    for layer in base.moe_layer_indices:
        assert recipe.layers[layer].ffn.moe is SharedExpertMoe and recipe.layers[layer].ffn.router is SigmoidGroupedTopK
    keys = stored_keys(ckpts["base"])  # transformers writes the Hub's names
    assert {"model.layers.1.mlp.router.gate.weight", "model.layers.1.mlp.expert_bias",
            "model.layers.1.mlp.shared_mlp.up_proj.weight"} <= set(keys)
    assert len(list(ckpts["sharded"].glob("*.safetensors"))) > 1


def test_correction_bias_changes_the_choice(models):
    model = models["base"]
    _, cache = model.run_with_cache(tokens(), names_filter=lambda n: "mlp.hook_" in n)
    for layer in model.cfg.moe_layer_indices:
        unbiased = cache["router_scores", layer].topk(3).indices.sort(-1).values
        chosen = cache["expert_indices", layer].sort(-1).values
        assert (unbiased != chosen).any(-1).float().mean() > 0.5


@pytest.mark.parametrize("variant", VARIANTS)
def test_float32_every_site(models, refs, variant):
    model = models[variant]
    check_report(compare(model, refs(variant), tokens()), model)


@pytest.mark.parametrize("variant", ["base", "layer_types"])
def test_bfloat16_is_bit_exact(ckpts, refs, variant):
    """The router weight and correction bias float32 as transformers keeps them, the routed and shared outputs
    added in float32 and rounded once (enable_moe_fp32_combine): bit for bit."""
    model = HookedTransformer.from_pretrained(ckpts[variant], dtype=torch.bfloat16, progress=False)
    ref = refs(variant, torch.bfloat16)
    assert ref.config.enable_moe_fp32_combine
    for layer, block in enumerate(model.blocks):
        if block.is_moe:
            mlp = ref.model.layers[layer].mlp
            assert block.mlp.router.weight.dtype == mlp.gate.weight.dtype == torch.float32
            assert block.mlp.router.e_score_correction_bias.dtype == mlp.e_score_correction_bias.dtype == torch.float32
    check_bit_exact(compare(model, ref, tokens()))


@pytest.mark.parametrize("padded", [False, True])
def test_greedy_generation_matches_transformers(models, refs, padded):
    prompt = left_padded(5, (3, 9), (0, 3, 1)) if padded else (tokens(5, (3, 9)), None)
    check_greedy_generation(models["base"], refs("base"), *prompt)


def test_transformers_module_spelling_loads_the_same_model(ckpts, models, tmp_path):
    folder = copy_checkpoint(ckpts, tmp_path)
    renames = {".mlp.router.gate.": ".mlp.gate.", ".mlp.expert_bias": ".mlp.e_score_correction_bias",
               ".mlp.shared_mlp.": ".mlp.shared_experts."}

    def respell(tensors):
        for key in list(tensors):
            new = key
            for old, spelled in renames.items():
                new = new.replace(old, spelled)
            tensors[new] = tensors.pop(key)

    rewrite_tensors(folder, respell)
    assert "model.layers.1.mlp.e_score_correction_bias" in stored_keys(folder)
    model = HookedTransformer.from_pretrained(folder, progress=False)
    assert torch.equal(model(tokens()), models["base"](tokens()))


def test_multi_token_prediction_layer_is_skipped_only_when_the_config_has_it(ckpts, models, tmp_path):
    folder = copy_checkpoint(ckpts, tmp_path)
    extra = {"model.layers.3.eh_proj.weight": torch.ones(64, 128), "model.layers.3.enorm.weight": torch.ones(64)}
    rewrite_tensors(folder, lambda t: t.update(extra))
    with pytest.raises(CheckpointError, match="unexpected .*model.layers.3."):
        HookedTransformer.from_pretrained(folder, progress=False)
    tiny.edit_config(folder, num_nextn_predict_layers=1)
    model = HookedTransformer.from_pretrained(folder, progress=False)
    assert torch.equal(model(tokens()), models["base"](tokens()))


def test_hy3_defaults_and_refusals():
    raw = tiny_hy_v3.hy_v3_config().to_dict()
    minimal = {k: raw[k] for k in ("hidden_size", "num_hidden_layers", "vocab_size")} | {"num_attention_heads": 16}
    cfg = HookedHYV3.config_from_hf(minimal)  # transformers' defaults: Hy3's head, experts and router
    assert (cfg.d_head, cfg.n_kv_heads, cfg.n_experts, cfg.top_k, cfg.d_expert) == (128, 8, 192, 8, 1536)
    assert cfg.rope.theta == 11_158_840.0 and cfg.routed_scaling_factor == 2.826 and cfg.moe_layers == (False, True, True)
    # fields transformers' HYV3 does not read: the groups and renormalisation are fixed, a first_k_dense_replace
    # that agrees with mlp_layer_types is passed over
    cfg = HookedHYV3.config_from_hf({**raw, "n_group": 4, "topk_group": 2, "norm_topk_prob": False,
                                     "first_k_dense_replace": 1, "qk_norm": True})
    assert (cfg.n_group, cfg.topk_group, cfg.norm_topk_prob) == (1, 1, True)
    assert {"first_k_dense_replace", "qk_norm"} <= set(cfg.fields_ignored)
    for change, message in (
        ({"n_routed_experts": 8}, "n_routed_experts, which transformers' HYV3Config does not read .*num_experts"),
        ({"routed_scaling_factor": 2.5}, "spell it router_scaling_factor"),
        ({"first_k_dense_replace": 2}, "first_k_dense_replace = 2 disagrees with mlp_layer_types"),
        ({"mlp_layer_types": ["dense"] * 3}, "leaving no mixture block"),
        ({"mlp_layer_types": ["dense", "moe", "sparse"]}, "mlp_layer_types must list 3 entries"),
        ({"mlp_bias": True}, "mlp_bias"),
        ({"num_experts": 1, "num_experts_per_tok": 1}, "2 best experts"),
        ({"rope_parameters": {"rope_type": "default", "rope_theta": 1000.0, "partial_rotary_factor": 0.5}},
         "partial_rotary_factor 0.5"),
    ):
        with pytest.raises(ValueError, match=message):
            HookedHYV3.config_from_hf({**raw, **change})


def test_verify_command_and_embedded_default(tmp_path, monkeypatch, capsys):
    monkeypatch.setattr("moelens.defaults.cache_root", lambda: tmp_path)
    model = HookedTransformer.from_pretrained("tiny-hy3", progress=False)
    assert type(model) is HookedHYV3 and model.cfg.moe_layers == (False, True, True, True)
    assert model.cfg.n_experts == 16 and model.cfg.rope.theta == 11_158_840.0
    assert main(["verify", "tiny-hy3"]) == 0
    out = capsys.readouterr().out
    assert "float32: OK" in out and "bfloat16: OK" in out
