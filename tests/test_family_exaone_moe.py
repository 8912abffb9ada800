"""K-EXAONE (HookedExaoneMoe): dots.llm1's blocks with global layers that have no rotary (NoPE), against
transformers' own ExaoneMoeForCausalLM on the same tiny checkpoints. The generic suites compare every site of the
base checkpoint; here: every variant site by site in float32 (the sliding layers' window shorter than the input),
the full layers' queries and keys unrotated, bit for bit in bfloat16, greedy generation, both spellings of the
correction bias, the multi-token-prediction module, K-EXAONE's defaults and refusals, verify and the embedded
default (the plan at full size: the flagship file, tests/test_flagships.py)."""

import pytest
import torch

import tiny_exaone_moe
from family_harness import (
    References, build_checkpoints, check_bit_exact, check_greedy_generation, copy_checkpoint, left_padded,
    rewrite_tensors, stored_keys, tokens,
)
from moelens import HookedTransformer
from moelens.cli import main
from moelens.loaders.errors import CheckpointError
from moelens.models.components import SharedExpertMoe, SigmoidGroupedTopK
from moelens.models.components.qk_norm_attention import QKNormNoRotaryAttention, QKNormSlidingWindowAttention
from moelens.models.exaone_moe import HookedExaoneMoe
from moelens.verify import compare
from test_family_glm4_moe import check_report

VARIANTS = [v for (_, v) in tiny_exaone_moe.VARIANTS]
SLIDING, NOPE = QKNormSlidingWindowAttention, QKNormNoRotaryAttention


@pytest.fixture(scope="module")
def ckpts(tmp_path_factory):
    return build_checkpoints(tmp_path_factory, "exaone_moe", tiny_exaone_moe.VARIANTS)


@pytest.fixture(scope="module")
def models(ckpts):
    return {v: HookedTransformer.from_pretrained(p, progress=False) for v, p in ckpts.items()}


@pytest.fixture(scope="module")
def refs(ckpts):
    return References(ckpts)


def test_variants_are_what_they_claim(models, refs, ckpts):
    base, grouped = models["base"], models["grouped"]
    assert type(base) is HookedExaoneMoe
    assert [type(b.attn) for b in base.blocks] == [SLIDING, NOPE, SLIDING, NOPE]
    assert [type(b.attn) for b in grouped.blocks] == [SLIDING, SLIDING, SLIDING, NOPE]
    assert [layer.self_attn.is_sliding for layer in refs("base").model.layers] == [True, False, True, False]
    assert base.cfg.attention_windows == (6, None, 6, None)
    assert base.cfg.moe_layers == (False, True, True, True) and grouped.cfg.moe_layers == (True, False, True, True)
    assert base.cfg.d_head == 24 and base.cfg.d_shared == 2 * base.cfg.d_expert and not base.cfg.qkv_bias
    assert (grouped.cfg.n_group, grouped.cfg.topk_group, grouped.cfg.norm_topk_prob) == (4, 2, False)
    recipe = HookedExaoneMoe.recipe(base.cfg)
    for layer in base.cfg.moe_layer_indices:
        assert recipe.layers[layer].ffn.moe is SharedExpertMoe and recipe.layers[layer].ffn.router is SigmoidGroupedTopK
    assert "model.layers.1.mlp.e_score_correction_bias" in stored_keys(ckpts["base"])  # the Hub's spelling
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


def test_full_layers_have_no_rotary_and_sliding_layers_their_window(models):
    """On a full layer what enters the scores is the normed projections themselves; a sliding layer's rotates
    them, and without its window the model leaves transformers' (so both are tested)."""
    model = models["base"]
    _, cache = model.run_with_cache(tokens(), names_filter=lambda n: ".attn.hook_" in n)
    for layer, rotated in ((1, False), (2, True)):
        attn = model.blocks[layer].attn
        normed = attn.q_norm(cache["q", layer])
        assert torch.equal(cache["rot_q", layer], normed) != rotated
        assert torch.equal(cache["rot_k", layer], attn.k_norm(cache["k", layer])) != rotated


def test_without_the_window_the_sliding_layer_differs(models, refs):
    model = models["base"]
    model.blocks[2].attn.sliding_window = None
    try:
        report = compare(model, refs("base"), tokens())
    finally:
        model.blocks[2].attn.sliding_window = 6
    assert report.max_logit_diff > 1e-3


def test_float32_left_padded(models, refs):
    toks, mask = tokens(5, (3, 24)), torch.ones(3, 24, dtype=torch.long)
    mask[0, :4], mask[1, :9] = 0, 0
    report = compare(models["base"], refs("base"), toks, mask)
    assert report.max_logit_diff <= 1e-5 and report.index_mismatches == 0, report


@pytest.mark.parametrize("variant", ["base", "grouped"])
def test_bfloat16_is_bit_exact(ckpts, refs, variant):
    model = HookedTransformer.from_pretrained(ckpts[variant], dtype=torch.bfloat16, progress=False)
    ref = refs(variant, torch.bfloat16)
    for layer, block in enumerate(model.blocks):
        if block.is_moe:
            gate = ref.model.layers[layer].mlp.gate
            assert block.mlp.router.weight.dtype == gate.weight.dtype == torch.float32
            assert block.mlp.router.e_score_correction_bias.dtype == gate.e_score_correction_bias.dtype == torch.float32
    check_bit_exact(compare(model, ref, tokens()))


@pytest.mark.parametrize("padded", [False, True])
def test_greedy_generation_matches_transformers(models, refs, padded):
    prompt = left_padded(5, (3, 9), (0, 3, 1)) if padded else (tokens(5, (3, 9)), None)
    check_greedy_generation(models["base"], refs("base"), *prompt)


def test_module_spelling_of_the_bias_and_the_mtp_module(ckpts, models, tmp_path):
    """transformers' module spelling of the correction bias loads the same model; the checkpoint's
    multi-token-prediction module (mtp.*) is passed over, as transformers does; another extra key is refused."""
    folder = copy_checkpoint(ckpts, tmp_path)

    def respell(tensors):
        for key in [k for k in tensors if k.endswith(".mlp.e_score_correction_bias")]:
            tensors[key.replace(".mlp.", ".mlp.gate.")] = tensors.pop(key)
        tensors["mtp.layers.0.eh_proj.weight"] = torch.ones(64, 128)

    rewrite_tensors(folder, respell)
    model = HookedTransformer.from_pretrained(folder, progress=False)
    assert torch.equal(model(tokens()), models["base"](tokens()))
    rewrite_tensors(folder, lambda t: t.update({"model.layers.4.enorm.weight": torch.ones(64)}))
    with pytest.raises(CheckpointError, match="unexpected .*model.layers.4."):
        HookedTransformer.from_pretrained(folder, progress=False)


def test_k_exaone_defaults_and_refusals():
    raw = tiny_exaone_moe.exaone_moe_config().to_dict()
    absent = {k: v for k, v in raw.items() if k not in ("layer_types", "mlp_layer_types", "sliding_window_pattern",
                                                         "sliding_window", "first_k_dense_replace")}
    cfg = HookedExaoneMoe.config_from_hf(absent)  # pattern 4: three sliding layers of 4096, then a full one
    assert cfg.attention_windows == (4096, 4096, 4096, None) and cfg.moe_layers == (False, True, True, True)
    # mlp_layer_types over first_k_dense_replace, as transformers
    cfg = HookedExaoneMoe.config_from_hf({**raw, "mlp_layer_types": ["sparse"] * 4, "first_k_dense_replace": 2})
    assert cfg.moe_layers == (True,) * 4 and "first_k_dense_replace" in cfg.fields_ignored
    for change, message in (
        ({"sliding_window": None}, "sliding_window = null"),
        ({"n_routed_experts": 8}, "n_routed_experts, which transformers' ExaoneMoeConfig does not read"),
        ({"n_shared_experts": 2}, "spell it num_shared_experts"),
        ({"layer_types": None, "sliding_window_pattern": "LLLG"}, "sliding_window_pattern"),
        ({"layer_types": ["full_attention"] * 3}, "layer_types must list 4 entries"),
        ({"mlp_layer_types": ["dense"] * 4}, "leaving no mixture block"),
        ({"n_group": 3}, "multiple of n_group"),
        ({"rope_parameters": {"rope_type": "default", "rope_theta": 1000.0, "partial_rotary_factor": 0.5}},
         "partial_rotary_factor 0.5"),
    ):
        with pytest.raises(ValueError, match=message):
            HookedExaoneMoe.config_from_hf({**raw, **change})


def test_verify_command_and_embedded_default(tmp_path, monkeypatch, capsys):
    monkeypatch.setattr("moelens.defaults.cache_root", lambda: tmp_path)
    model = HookedTransformer.from_pretrained("tiny-k-exaone", progress=False)
    assert type(model) is HookedExaoneMoe and model.cfg.attention_windows == (16, 16, 16, None)
    assert type(model.blocks[3].attn) is NOPE and model.cfg.n_experts == 16
    assert main(["verify", "tiny-k-exaone"]) == 0
    out = capsys.readouterr().out
    assert "float32: OK" in out and "bfloat16: OK" in out
