"""ERNIE-4.5 MoE (float32 in-place pair rotary, the softmax router with its moe_statics correction bias and its floor
under the renormalising sum, shared experts, mixture blocks by interval / start / end) against transformers' own
Ernie4_5_MoeForCausalLM on the same tiny checkpoints."""

import pytest
import torch

import tiny
import tiny_ernie4_5_moe as tiny_ernie
from flagships import flagship
from family_harness import (
    MODEL_SITES, References, build_checkpoints, check_bit_exact, check_greedy_generation, check_report, copy_checkpoint,
    left_padded, rewrite_tensors, stored_keys, tokens,
)
from moelens import HookedTransformer
from moelens.cli import main
from moelens.loaders.errors import CheckpointError
from moelens.models.components import SharedFirstMoe, SparseMoe
from moelens.models.components.rotary import Float32Rotary
from moelens.models.ernie4_5_moe import AdjacentPairRotaryAttention, HookedErnie4_5Moe, StatisticsBiasedSoftmaxTopK
from moelens.plan import plan
from moelens.verify import compare

VARIANTS = [v for (_, v) in tiny_ernie.VARIANTS]
ATTENTION = ("hook_resid_pre", "ln1.hook_normalized", "attn.hook_q", "attn.hook_k", "attn.hook_v", "hook_attn_out",
             "ln2.hook_normalized", "hook_mlp_out", "hook_resid_post")
MIXTURE = ("mlp.hook_router_logits", "mlp.hook_choice_scores", "mlp.hook_expert_weights", "mlp.hook_expert_indices",
           "mlp.hook_routed_out")


@pytest.fixture(scope="module")
def checkpoints(tmp_path_factory):
    return build_checkpoints(tmp_path_factory, "ernie4_5_moe", tiny_ernie.VARIANTS)


@pytest.fixture(scope="module")
def models(checkpoints):
    return {v: HookedTransformer.from_pretrained(p, progress=False) for v, p in checkpoints.items()}


@pytest.fixture(scope="module")
def references(checkpoints):
    return References(checkpoints)


def test_variants_are_what_they_claim(models, checkpoints):
    base, interval = models["base"].cfg, models["interval"].cfg
    assert base.moe_layers == (False, True, True) and base.d_shared == 2 * base.d_expert == 48
    assert not base.tie_word_embeddings and base.moe_norm_min == 1e-12 and base.rope.interleaved
    assert interval.moe_layers == (False, True, False, False) and interval.d_shared == 0
    assert interval.tie_word_embeddings and interval.moe_norm_min == 1.5
    model = models["base"]
    assert type(model.rotary) is Float32Rotary and type(model.blocks[0].attn) is AdjacentPairRotaryAttention
    assert type(model.blocks[1].mlp) is SharedFirstMoe and type(models["interval"].blocks[1].mlp) is SparseMoe
    assert type(model.blocks[1].mlp.router) is StatisticsBiasedSoftmaxTopK
    assert len(list(checkpoints["sharded"].glob("*.safetensors"))) > 1
    keys = stored_keys(checkpoints["fused"])
    assert "model.layers.1.mlp.experts.gate_up_proj" in keys and not any(".experts.0." in k for k in keys)
    # the Hub's spelling of the correction bias, [1, n_experts], which transformers' save_pretrained writes too
    assert "model.layers.1.mlp.moe_statics.e_score_correction_bias" in stored_keys(checkpoints["base"])


@pytest.mark.parametrize("variant", VARIANTS)
def test_float32_every_site(models, references, variant):
    model = models[variant]
    assert type(model) is HookedErnie4_5Moe

    def sites(layer):
        shared = ("mlp.shared_expert.hook_out",) if model.cfg.d_shared else ()
        return ATTENTION + ((*MIXTURE, *shared) if model.cfg.moe_layers[layer] else ("mlp.hook_post",))

    check_report(compare(model, references[variant], tokens()), model, sites, model_sites=MODEL_SITES)


@pytest.mark.parametrize("variant", ["base", "interval"])
def test_bfloat16_is_bit_exact(checkpoints, references, variant):
    model = HookedTransformer.from_pretrained(checkpoints[variant], dtype=torch.bfloat16, progress=False)
    ref = references(variant, torch.bfloat16)
    router, theirs = model.blocks[1].mlp.router, ref.model.layers[1].mlp.gate
    assert router.weight.dtype == theirs.weight.dtype == torch.float32
    assert router.e_score_correction_bias.dtype == theirs.moe_statics.e_score_correction_bias.dtype == torch.float32
    _, cache = model.run_with_cache(tokens(), names_filter="blocks.1.mlp.hook_expert_weights")
    assert cache["blocks.1.mlp.hook_expert_weights"].dtype == torch.bfloat16  # cast back, as transformers does
    check_bit_exact(compare(model, ref, tokens()))


def test_the_correction_bias_and_the_floor_act(models):
    """The bias changes some tokens' choice from the top-k of the unbiased scores; the interval variant's floor
    (1.5, above any sum of k softmax scores) divides every weight by it, where the base's leaves them summing to 1."""
    _, cache = models["base"].run_with_cache(tokens(), names_filter=["*hook_router_scores", "*hook_expert_indices",
                                                                     "*hook_expert_weights"])
    scores, chosen = cache["blocks.1.mlp.hook_router_scores"], cache["blocks.1.mlp.hook_expert_indices"]
    assert (scores.topk(3, -1).indices.sort(-1).values != chosen.sort(-1).values).any()
    torch.testing.assert_close(cache["blocks.1.mlp.hook_expert_weights"].sum(-1), torch.ones(chosen.shape[:-1]))
    _, cache = models["interval"].run_with_cache(tokens(), names_filter=["*hook_router_scores", "*hook_expert_indices",
                                                                         "*hook_expert_weights"])
    chosen_scores = cache["blocks.1.mlp.hook_router_scores"].gather(-1, cache["blocks.1.mlp.hook_expert_indices"])
    torch.testing.assert_close(cache["blocks.1.mlp.hook_expert_weights"], chosen_scores / 1.5, rtol=0, atol=0)


def test_rotated_heads_keep_the_checkpoint_order(models, references):
    """hook_rot_q is transformers' query after its rotary (interleaved pairs turned in place), bit for bit."""
    from transformers.models.ernie4_5_moe import modeling_ernie4_5_moe as hf

    model, ref = models["base"], references["base"]
    seen = {}
    original = hf.apply_rotary_pos_emb

    def spy(q, k, cos, sin, *args, **kwargs):
        q_rot, k_rot = original(q, k, cos, sin, *args, **kwargs)
        seen.setdefault("q", q_rot)
        seen.setdefault("k", k_rot)
        return q_rot, k_rot

    hf.apply_rotary_pos_emb = spy
    try:
        with torch.no_grad():
            ref(tokens())
    finally:
        hf.apply_rotary_pos_emb = original
    _, cache = model.run_with_cache(tokens(), names_filter=["blocks.0.attn.hook_rot_q", "blocks.0.attn.hook_rot_k"])
    assert torch.equal(cache["blocks.0.attn.hook_rot_q"], seen["q"].transpose(1, 2))
    assert torch.equal(cache["blocks.0.attn.hook_rot_k"], seen["k"].transpose(1, 2))


@pytest.mark.parametrize("variant,padded", [("base", True), ("interval", True)])
def test_greedy_generation_matches_transformers(models, references, variant, padded):
    prompt = left_padded(5, (3, 9), (0, 3, 1)) if padded else (tokens(5, (3, 9)), None)
    check_greedy_generation(models[variant], references[variant], *prompt, new=16)


# ---- config spellings and refusals --------------------------------------------------------------------


def test_hub_config_spelling_loads_the_same_model(checkpoints, models, tmp_path):
    """The Hub's config.json: rope_theta at the top level, training settings transformers does not read, and the
    attribute_map's generic names for the expert count and k."""
    folder = copy_checkpoint(checkpoints, tmp_path)
    raw = tiny.json.loads((folder / "config.json").read_text())
    theta = raw["rope_parameters"]["rope_theta"]
    tiny.edit_config(folder, rope_parameters=None, rope_theta=theta, moe_capacity=[8, 8, 8], moe_gate="topk",
                     moe_use_aux_free=True, moe_num_experts=None, num_experts=8, moe_k=None, num_experts_per_tok=3)
    model = HookedTransformer.from_pretrained(folder, progress=False)
    assert model.cfg == models["base"].cfg
    assert {"moe_capacity", "moe_gate", "moe_use_aux_free"} <= set(model.cfg.fields_ignored)
    assert torch.equal(model(tokens()), models["base"](tokens()))


def test_config_refusals():
    raw = tiny_ernie.ernie4_5_moe_config().to_dict()
    for change, message in (
        ({"use_bias": True}, "use_bias"),
        ({"moe_k": 9}, "moe_k"),
        ({"moe_layer_interval": 0}, "moe_layer_interval"),
        ({"moe_norm_min": -1.0}, "moe_norm_min"),
        ({"moe_num_shared_experts": "2"}, "moe_num_shared_experts"),
        ({"num_experts": 16}, "moe_num_experts = 8 and num_experts = 16 disagree"),
        ({"rope_parameters": {"rope_type": "default", "rope_theta": 1000.0, "partial_rotary_factor": 0.5}},
         "partial_rotary_factor"),
    ):
        with pytest.raises((ValueError, KeyError), match=message):
            HookedErnie4_5Moe.config_from_hf({**raw, **change})


@pytest.mark.parametrize("key", [
    "model.layers.1.mlp.gate.weight",
    "model.layers.2.mlp.moe_statics.e_score_correction_bias",
    "model.layers.2.mlp.experts.5.gate_proj.weight",
    "model.layers.1.mlp.shared_experts.down_proj.weight",
    "model.layers.0.mlp.up_proj.weight",
])
def test_missing_tensor_is_named(checkpoints, tmp_path, key):
    folder = copy_checkpoint(checkpoints, tmp_path)
    rewrite_tensors(folder, lambda t: t.pop(key))
    with pytest.raises(CheckpointError, match="missing") as info:
        HookedTransformer.from_pretrained(folder, progress=False)
    assert "e_score_correction_bias" in str(info.value) if "moe_statics" in key else key in str(info.value)


def test_the_bias_in_transformers_module_path_and_the_mtp_layers(checkpoints, models, tmp_path):
    """The correction bias under transformers' in-memory path (gate.moe_statics) loads the same; the
    multi-token-prediction tensors a published checkpoint stores (model.mtp_*) are skipped, as transformers skips
    them; a bias of the wrong shape is named."""
    folder = copy_checkpoint(checkpoints, tmp_path)

    def move(t):
        for layer in (1, 2):
            t[f"model.layers.{layer}.mlp.gate.moe_statics.e_score_correction_bias"] = t.pop(
                f"model.layers.{layer}.mlp.moe_statics.e_score_correction_bias")
        t["model.mtp_linear_proj.0.weight"] = torch.zeros(64, 128)

    rewrite_tensors(folder, move)
    model = HookedTransformer.from_pretrained(folder, progress=False)
    assert torch.equal(model(tokens()), models["base"](tokens()))
    rewrite_tensors(folder, lambda t: t.update({"model.layers.1.mlp.gate.moe_statics.e_score_correction_bias": torch.zeros(8)}))
    with pytest.raises(CheckpointError, match="e_score_correction_bias"):
        HookedTransformer.from_pretrained(folder, progress=False)


# ---- plan, support, embedded default -------------------------------------------------------------------

ERNIE_21B_A3B = flagship("ernie4_5_moe", "baidu/ERNIE-4.5-21B-A3B-PT")


def test_plan_at_full_size_dense_first_block():
    """(Its counts against transformers' and the published total: tests/test_flagships.py.)"""
    p = plan(dict(ERNIE_21B_A3B), dtype="bfloat16", cpu_memory="2TB")
    assert [layer.kind for layer in p.per_layer] == ["dense"] + ["moe"] * 27


def test_support_lists_the_family_sites(models):
    table = models["base"].support(print_table=False)
    rows = {r.name: r for r in table.rows}
    assert rows["blocks.L.mlp.hook_router_logits"].reference == "model.layers.L.mlp.gate (out.0)"
    assert rows["blocks.L.mlp.hook_choice_scores"].reference == "model.layers.L.mlp.gate.moe_statics"
    assert rows["blocks.L.mlp.hook_router_logits"].layers == "1,2"
    assert "moe_layer_interval" in table.config_fields


def test_verify_command_and_embedded_default(tmp_path, monkeypatch, capsys):
    monkeypatch.setattr("moelens.defaults.cache_root", lambda: tmp_path)
    model = HookedTransformer.from_pretrained("tiny-ernie4.5-moe", progress=False)
    assert type(model) is HookedErnie4_5Moe and model.cfg.moe_layers == (False, True, True, True)
    logits = model("Hello, ERNIE")
    assert logits.shape[-1] == 260 and torch.isfinite(logits).all()
    assert main(["verify", "tiny-ernie4.5-moe"]) == 0
    out = capsys.readouterr().out
    assert "float32: OK" in out and "bfloat16: OK" in out
