"""GLM-4.5 family (partial rotary, optional q/k norm, sigmoid grouped router with correction bias, shared expert,
dense first blocks) against transformers' own Glm4MoeForCausalLM on the same tiny checkpoints: site by site in
float32, bit for bit in bfloat16, greedy generation, both config and checkpoint spellings, the multi-token-
prediction layers, bad checkpoints, the plan's counts at full size, support(), verify and the embedded default."""

import json
import shutil

import pytest
import torch

import moelens.models.glm4_moe  # noqa: F401  (registers model_type "glm4_moe")
import tiny
import family_harness as harness
import tiny_glm4_moe as tiny_glm
from flagships import flagship
from family_harness import (
    ATTENTION_SITES, BLOCK_SITES, MODEL_SITES, ROUTER_SITES, References, build_checkpoints, check_bit_exact,
    check_greedy_generation, copy_checkpoint, left_padded, rewrite_tensors, stored_keys, tokens,
)
from moelens import HookedTransformer
from moelens.cli import main
from moelens.loaders.errors import CheckpointError
from moelens.models.components import Attention, SharedExpertMoe, SigmoidGroupedTopK
from moelens.models.components.qk_norm_attention import QKNormBeforeRotaryAttention
from moelens.models.glm4_moe import HookedGlm4Moe
from moelens.plan import plan
from moelens.verify import compare
from test_plan import hf_weights

VARIANTS = [v for (_, v) in tiny_glm.VARIANTS]


@pytest.fixture(scope="module")
def ckpts(tmp_path_factory):
    return build_checkpoints(tmp_path_factory, "glm4_moe", tiny_glm.VARIANTS)


@pytest.fixture(scope="module")
def models(ckpts):
    return {v: HookedTransformer.from_pretrained(p, progress=False) for v, p in ckpts.items()}


@pytest.fixture(scope="module")
def refs(ckpts):
    return References(ckpts)


GLM_BLOCK_SITES = BLOCK_SITES + ATTENTION_SITES
MIXTURE_SITES = ROUTER_SITES + ("mlp.shared_expert.hook_out",)


def check_report(report, model, tol=1e-5):
    def sites(layer):
        return GLM_BLOCK_SITES + (MIXTURE_SITES if model.cfg.moe_layers[layer] else ("mlp.hook_post",))

    harness.check_report(report, model, sites, tol, MODEL_SITES)


def test_variants_are_what_they_claim(models, ckpts):
    base, air, yarn = models["base"].cfg, models["air"].cfg, models["yarn"].cfg
    assert base.qk_norm and not air.qk_norm and yarn.qk_norm
    assert base.qkv_bias and not base.o_bias and not yarn.qkv_bias
    assert base.d_head == 24 != base.d_model // base.n_heads and base.d_rot == 12 and base.n_kv_heads < base.n_heads
    assert air.d_head == 16 and air.d_rot == 4 and air.rope.partial_rotary_factor == 0.25
    assert yarn.rope.kind == "yarn" and yarn.d_rot == 12 and yarn.rope.original_max_position_embeddings < 40
    assert base.n_group == 1 and air.n_group == 4 and air.topk_group == 2
    assert base.norm_topk_prob and base.routed_scaling_factor == 2.5 and not air.norm_topk_prob
    assert base.moe_layers == (False, True, True) and air.moe_layers == (False, False, True, True)
    assert base.d_shared == 2 * base.d_expert and base.d_mlp == 80 and base.mtp_layers == 1
    assert type(models["base"].blocks[0].attn) is QKNormBeforeRotaryAttention
    assert type(models["air"].blocks[0].attn) is Attention
    assert len(list(ckpts["sharded"].glob("*.safetensors"))) > 1
    fused = stored_keys(ckpts["fused"])
    assert "model.layers.1.mlp.experts.gate_up_proj" in fused and not any(".experts.0." in k for k in fused)
    assert "model.layers.1.mlp.experts.7.down_proj.weight" in stored_keys(ckpts["base"])  # the Hub's spelling
    # transformers writes the rotary share inside rope_parameters
    assert json.loads((ckpts["base"] / "config.json").read_text())["rope_parameters"]["partial_rotary_factor"] == 0.5


def test_correction_bias_changes_the_choice(models):
    """The biased choice is not the top-k of the scores for many tokens (else the bias would go untested)."""
    model = models["base"]
    _, cache = model.run_with_cache(tokens(), names_filter=lambda n: "mlp.hook_" in n)
    for layer in model.cfg.moe_layer_indices:
        unbiased = cache["router_scores", layer].topk(3).indices.sort(-1).values
        chosen = cache["expert_indices", layer].sort(-1).values
        assert (unbiased != chosen).any(-1).float().mean() > 0.5


def test_components():
    raw = tiny_glm.glm4_moe_config().to_dict()
    normed_cfg = HookedGlm4Moe.config_from_hf(raw)
    normed = HookedGlm4Moe.recipe(normed_cfg)
    plain = HookedGlm4Moe.recipe(HookedGlm4Moe.config_from_hf({**raw, "use_qk_norm": False}))
    assert {spec.mixer for spec in normed.layers} == {QKNormBeforeRotaryAttention}
    assert {spec.mixer for spec in plain.layers} == {Attention}
    for layer in normed_cfg.moe_layer_indices:
        for recipe in (normed, plain):
            assert recipe.layers[layer].ffn.moe is SharedExpertMoe and recipe.layers[layer].ffn.router is SigmoidGroupedTopK


# ---- float32: every site, every variant -------------------------------------------------------------


@pytest.mark.parametrize("variant", VARIANTS)
def test_float32_every_site(models, refs, variant):
    model = models[variant]
    assert type(model) is HookedGlm4Moe
    check_report(compare(model, refs(variant), tokens()), model)


def test_float32_left_padded_and_fused_attention(models, refs):
    model, ref = models["base"], refs("base")
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


@pytest.mark.parametrize("variant", ["base", "air"])
def test_partial_rotary_is_transformers(models, refs, variant):
    """hook_rot_q / hook_rot_k against transformers' own rotary embedding and apply_rotary_pos_emb on the same
    (normed) heads: the first d_rot dims rotated in rotate-half layout, the rest passed through untouched."""
    from transformers.models.glm4_moe.modeling_glm4_moe import apply_rotary_pos_emb

    model, ref = models[variant], refs(variant)
    toks = tokens(shape=(2, 12))
    _, cache = model.run_with_cache(toks, names_filter=lambda n: n.startswith("blocks.1.attn.hook_"))
    attn = model.blocks[1].attn
    q, k = cache["blocks.1.attn.hook_q"], cache["blocks.1.attn.hook_k"]
    if model.cfg.qk_norm:
        q, k = attn.q_norm(q), attn.k_norm(k)
    positions = torch.arange(12).expand(2, 12)
    cos, sin = ref.model.rotary_emb(q, positions)
    assert cos.shape[-1] == model.cfg.d_rot < model.cfg.d_head
    with torch.no_grad():
        q_ref, k_ref = apply_rotary_pos_emb(q.transpose(1, 2), k.transpose(1, 2), cos, sin)
    rot_q, rot_k = cache["blocks.1.attn.hook_rot_q"], cache["blocks.1.attn.hook_rot_k"]
    assert torch.equal(rot_q, q_ref.transpose(1, 2)) and torch.equal(rot_k, k_ref.transpose(1, 2))
    d_rot = model.cfg.d_rot
    assert torch.equal(rot_q[..., d_rot:], q[..., d_rot:]) and not torch.equal(rot_q[..., 1:, :, :d_rot], q[..., 1:, :, :d_rot])


# ---- bfloat16: bit for bit --------------------------------------------------------------------------


@pytest.mark.parametrize("variant", ["base", "air"])
def test_bfloat16_is_bit_exact(ckpts, refs, variant):
    """The router weight, correction bias and routing weights float32 as transformers keeps them; every other
    op in the reference's order: bf16 logits and every reference site identical, the same experts chosen."""
    model = HookedTransformer.from_pretrained(ckpts[variant], dtype=torch.bfloat16, progress=False)
    ref = refs(variant, torch.bfloat16)
    for layer, block in enumerate(model.blocks):
        if block.is_moe:
            gate = ref.model.layers[layer].mlp.gate
            assert block.mlp.router.weight.dtype == gate.weight.dtype == torch.float32
            assert block.mlp.router.e_score_correction_bias.dtype == gate.e_score_correction_bias.dtype == torch.float32
    check_bit_exact(compare(model, ref, tokens()))


# ---- generation -------------------------------------------------------------------------------------


@pytest.mark.parametrize("variant,padded", [("base", False), ("base", True), ("air", True)])
def test_greedy_generation_matches_transformers(models, refs, variant, padded):
    prompt = left_padded(5, (3, 9), (0, 3, 1)) if padded else (tokens(5, (3, 9)), None)
    check_greedy_generation(models[variant], refs(variant), *prompt)


# ---- config spellings -------------------------------------------------------------------------------


def test_hub_config_spelling_loads_the_same_model(ckpts, models, tmp_path):
    """The Hub's config.json: rope_theta and partial_rotary_factor at the top level, rope_scaling null."""
    folder = shutil.copytree(ckpts["air"], tmp_path / "hub")
    config = json.loads((folder / "config.json").read_text())
    rope = config.pop("rope_parameters")
    config.update(rope_theta=rope["rope_theta"], partial_rotary_factor=rope["partial_rotary_factor"], rope_scaling=None)
    (folder / "config.json").write_text(json.dumps(config))
    model = HookedTransformer.from_pretrained(folder, progress=False)
    assert model.cfg == models["air"].cfg
    assert torch.equal(model(tokens()), models["air"](tokens()))  # transformers' reading: the verify test below


def test_partial_rotary_factor_defaults_as_transformers_does():
    """Absent in both places: half the head (transformers' Glm4MoeConfig default); rope_parameters' value wins
    over the top-level one."""
    from transformers import Glm4MoeConfig

    raw = {k: v for k, v in tiny_glm.glm4_moe_config().to_dict().items() if k != "rope_parameters"}
    cases = [
        {"rope_theta": 1000.0},
        {"rope_theta": 1000.0, "partial_rotary_factor": 0.25},
        {"rope_parameters": {"rope_type": "default", "rope_theta": 1000.0}, "partial_rotary_factor": 0.25},
        {"rope_parameters": {"rope_type": "default", "rope_theta": 1000.0, "partial_rotary_factor": 0.75}, "partial_rotary_factor": 0.25},
        {"rope_parameters": {"rope_type": "default", "rope_theta": 1000.0, "partial_rotary_factor": 1.0}},
    ]
    seen = set()
    for case in cases:
        expected = Glm4MoeConfig(**{**raw, **case}).rope_parameters["partial_rotary_factor"]
        cfg = HookedGlm4Moe.config_from_hf({**raw, **case})
        assert cfg.rope.partial_rotary_factor == expected and cfg.d_rot == int(24 * expected), case
        seen.add(expected)
    assert seen == {0.5, 0.25, 0.75, 1.0}


def test_config_refusals():
    raw = tiny_glm.glm4_moe_config().to_dict()
    for change, message in (
        ({"n_group": 3}, "multiple of n_group"),
        ({"topk_group": 2}, "topk_group"),
        ({"n_group": 4, "topk_group": 1}, "num_experts_per_tok"),
        ({"num_experts_per_tok": 9}, "num_experts_per_tok"),
        ({"use_qk_norm": "yes"}, "use_qk_norm"),
        ({"num_nextn_predict_layers": -1}, "num_nextn_predict_layers"),
        ({"first_k_dense_replace": 3}, "first_k_dense_replace = 3 makes all 3 blocks"),
        ({"rope_parameters": {"rope_type": "default", "rope_theta": 1000.0, "partial_rotary_factor": 0.3}}, "even"),
    ):
        with pytest.raises(ValueError, match=message):
            HookedGlm4Moe.config_from_hf({**raw, **change})
    with pytest.raises(KeyError, match="hidden_size"):
        HookedGlm4Moe.config_from_hf({k: v for k, v in raw.items() if k != "hidden_size"})


# ---- checkpoints the loader refuses, and the MTP layers it passes over ------------------------------------


@pytest.mark.parametrize("key", [
    "model.layers.1.self_attn.q_norm.weight",
    "model.layers.2.self_attn.k_proj.bias",
    "model.layers.1.mlp.gate.e_score_correction_bias",
    "model.layers.2.mlp.experts.5.gate_proj.weight",
    "model.layers.1.mlp.shared_experts.down_proj.weight",
    "model.layers.0.mlp.up_proj.weight",
])
def test_missing_tensor_is_named(ckpts, tmp_path, key):
    folder = copy_checkpoint(ckpts, tmp_path)
    rewrite_tensors(folder, lambda t: t.pop(key))
    with pytest.raises(CheckpointError, match="missing") as info:
        HookedTransformer.from_pretrained(folder, progress=False)
    assert key in str(info.value)


def test_misshapen_tensor_is_named(ckpts, tmp_path):
    folder, key = copy_checkpoint(ckpts, tmp_path), "model.layers.2.mlp.shared_experts.gate_proj.weight"
    rewrite_tensors(folder, lambda t: t.update({key: torch.zeros(24, 64)}))  # moe_intermediate_size * n_shared_experts is 48
    with pytest.raises(CheckpointError) as info:
        HookedTransformer.from_pretrained(folder, progress=False)
    assert all(part in str(info.value) for part in (key, "(24, 64)", "(48, 64)"))


def test_q_norm_without_use_qk_norm_is_refused(ckpts, tmp_path):
    """A checkpoint with q/k norms whose config says use_qk_norm false would silently drop them: refused."""
    folder = copy_checkpoint(ckpts, tmp_path)
    tiny.edit_config(folder, use_qk_norm=False)
    with pytest.raises(CheckpointError, match="unexpected") as info:
        HookedTransformer.from_pretrained(folder, progress=False)
    assert "self_attn.q_norm.weight" in str(info.value)


def test_multi_token_prediction_layers_are_skipped_only_when_the_config_has_them(ckpts, models, tmp_path):
    """GLM's Hub checkpoints store num_nextn_predict_layers extra layers after the last block, which neither
    transformers nor moelens runs: they load past them; any other extra layer is refused."""
    folder = copy_checkpoint(ckpts, tmp_path)
    n_layers = models["base"].cfg.n_layers
    extra = {
        f"model.layers.{n_layers}.eh_proj.weight": torch.ones(64, 128),
        f"model.layers.{n_layers}.enorm.weight": torch.ones(64),
        f"model.layers.{n_layers}.mlp.experts.0.up_proj.weight": torch.ones(24, 64),
    }
    rewrite_tensors(folder, lambda t: t.update(extra))
    tiny.edit_config(folder, num_nextn_predict_layers=0)
    with pytest.raises(CheckpointError, match=f"unexpected .*model.layers.{n_layers}."):
        HookedTransformer.from_pretrained(folder, progress=False)
    tiny.edit_config(folder, num_nextn_predict_layers=1)
    model = HookedTransformer.from_pretrained(folder, progress=False)
    assert torch.equal(model(tokens()), models["base"](tokens()))
    assert f"model.layers.{n_layers}." in HookedGlm4Moe.site_map(model.cfg).ignored_prefixes


# ---- plan, support, verify, embedded default -----------------------------------------------------------

GLM_45 = flagship("glm4_moe", "zai-org/GLM-4.5")
GLM_45_AIR = flagship("glm4_moe", "zai-org/GLM-4.5-Air")


@pytest.mark.parametrize("config,dense", [(GLM_45, 3), (GLM_45_AIR, 1)], ids=["GLM-4.5", "GLM-4.5-Air"])
def test_plan_at_full_size_dense_first_blocks_qk_norms_and_cache(config, dense):
    """(The counts against transformers' and the published totals: tests/test_flagships.py.)"""
    hf = hf_weights(dict(config), torch.bfloat16)
    p = plan(dict(config), dtype="bfloat16", cpu_memory="2TB")
    assert [layer.kind for layer in p.per_layer] == ["dense"] * dense + ["moe"] * (config["num_hidden_layers"] - dense)
    norms = sum(t.numel() for n, t in hf.items() if "q_norm" in n or "k_norm" in n)
    assert norms == (config["num_hidden_layers"] * 2 * 128 if config["use_qk_norm"] else 0)
    # the cache holds 8 kv heads' keys and values of 128 each, bf16, seq 2048
    assert p.kv_cache["bytes"] == config["num_hidden_layers"] * 2048 * 2 * 8 * 128 * 2


def test_support_lists_the_family_sites(models):
    table = models["base"].support(print_table=False)
    rows = {r.name: r for r in table.rows}
    assert rows["blocks.L.attn.hook_q"].reference == "model.layers.L.self_attn.q_proj"
    assert rows["blocks.L.attn.hook_rot_q"].shape == "[batch, pos, 4, 24]"
    assert rows["blocks.L.attn.hook_k"].shape == "[batch, pos, 2, 24]"
    assert rows["blocks.L.mlp.hook_choice_scores"].layers == "1,2"
    assert rows["blocks.L.mlp.hook_router_logits"].reference == "model.layers.L.mlp.gate (out.0)"
    assert rows["blocks.L.mlp.shared_expert.hook_out"].reference == "model.layers.L.mlp.shared_experts"
    assert rows["blocks.L.mlp.hook_post"].layers == "0"
    assert "use_qk_norm" in table.config_fields and "num_nextn_predict_layers" in table.config_fields


def test_verify_command_and_embedded_default(tmp_path, monkeypatch, capsys):
    monkeypatch.setattr("moelens.defaults.cache_root", lambda: tmp_path)
    model = HookedTransformer.from_pretrained("tiny-glm4-moe", progress=False)
    assert type(model) is HookedGlm4Moe and model.cfg.moe_layers == (False, True, True, True)
    assert model.cfg.qk_norm and model.cfg.d_rot == 16 and model.cfg.n_experts == 16
    logits, cache = model.run_with_cache("Hello, partial rotary", names_filter="*hook_choice_scores")
    assert logits.shape[-1] == 260 and torch.isfinite(logits).all()
    assert cache["blocks.3.mlp.hook_choice_scores"].shape[-1] == 16
    assert model.generate("Hi", max_new_tokens=3, stop_at_eos=False, do_sample=False)
    assert main(["verify", "tiny-glm4-moe"]) == 0  # the Hub's config spelling, read by transformers too
    out = capsys.readouterr().out
    assert "float32: OK" in out and "bfloat16: OK" in out and "blocks.3.mlp.hook_expert_indices" in out
