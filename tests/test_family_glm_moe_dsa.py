"""GLM-5 (DeepSeek Sparse Attention with an interleaved indexer rotary, and layers that reuse the key selection of
the layer before) against transformers' own GlmMoeDsaForCausalLM on the same tiny checkpoints."""

import json

import pytest
import torch

import family_harness as harness
import tiny_glm_moe_dsa as tiny_glm
from dsa_checks import captured, index_scores_by_hand, selection_sites, window_selection
from flagships import flagship
from family_harness import References, build_checkpoints, check_bit_exact, check_greedy_generation, left_padded, tokens
from moelens import HookedTransformer
from moelens.models.components.sparse_latent_attention import IndexedLatentAttention, SharedSelectionLatentAttention
from moelens.models.glm_moe_dsa import HookedGlmMoeDsa
from moelens.verify import compare
from test_family_deepseek_v32 import full_size_plan

VARIANTS = [v for (_, v) in tiny_glm.VARIANTS]
PER_BLOCK = ("hook_resid_pre", "hook_attn_out", "hook_mlp_out", "hook_resid_post", "ln1.hook_normalized",
             "ln2.hook_normalized", "attn.hook_q", "attn.hook_q_latent", "attn.hook_kv_latent", "attn.hook_z",
             "attn.hook_index_topk")


@pytest.fixture(scope="module")
def checkpoints(tmp_path_factory):
    return build_checkpoints(tmp_path_factory, "glm_moe_dsa", tiny_glm.VARIANTS)


@pytest.fixture(scope="module")
def models(checkpoints):
    return {v: HookedTransformer.from_pretrained(p, progress=False) for v, p in checkpoints.items()}


@pytest.fixture(scope="module")
def references(checkpoints):
    return References(checkpoints)


def test_variants_are_what_they_claim(models, checkpoints):
    base, hub = models["base"], models["hub"]
    assert base.cfg.indexer_layers == (True, False, True, False) and hub.cfg.indexer_layers == (True, True, False, True)
    assert [type(b.attn) for b in base.blocks] == [IndexedLatentAttention, SharedSelectionLatentAttention] * 2
    assert not hasattr(base.blocks[1].attn, "indexer") and base.cfg.index_rope_interleaved
    raw = json.loads((checkpoints["hub"] / "config.json").read_text())
    assert "indexer_types" not in raw and raw["index_topk_freq"] == 2 and "rope_parameters" not in raw


@pytest.mark.parametrize("variant", VARIANTS)
def test_float32(models, references, variant):
    """Logits and every site against transformers', the selections of shared layers (its attention's third
    output) included."""
    model = models[variant]
    assert type(model) is HookedGlmMoeDsa
    harness.check_report(compare(model, references[variant], tokens()), model, lambda layer: PER_BLOCK)


def test_float32_left_padded(models, references):
    toks, mask = tokens(5, (3, 24)), torch.ones(3, 24, dtype=torch.long)
    mask[0, :4], mask[1, :9] = 0, 0
    report = compare(models["base"], references["base"], toks, mask)
    assert report.max_logit_diff <= 1e-5 and report.index_mismatches == 0, report


def test_index_scores_use_the_interleaved_rotary(models, references):
    from transformers.models.glm_moe_dsa.modeling_glm_moe_dsa import apply_rotary_pos_emb_interleave

    toks = tokens()
    expected = index_scores_by_hand(
        references["base"], toks, 2, lambda q, k, c, s: apply_rotary_pos_emb_interleave(q, k, c, s, unsqueeze_dim=2))
    _, cache = models["base"].run_with_cache(toks, names_filter="*hook_index_scores")
    assert (cache["blocks.2.attn.hook_index_scores"].double() - expected).abs().max() <= 1e-5
    assert "blocks.1.attn.hook_index_scores" not in cache.cache_dict  # a shared layer scores nothing


def test_shared_layers_reuse_the_selection_before_them(models):
    selections = selection_sites(models["base"], tokens())
    assert torch.equal(selections[1], selections[0]) and torch.equal(selections[3], selections[2])
    assert not torch.equal(selections[2], selections[0])


def test_an_edited_selection_reaches_the_layers_that_reuse_it(models, references):
    """A selection written at layer 0's hook_index_topk is what layers 0 and 1 attend with (transformers with the
    same forced on its layer-0 indexer); one written at shared layer 1 holds for layer 1 alone."""
    model, toks = models["base"], tokens()
    window = window_selection(2, 40, model.cfg.index_topk)
    expected, _ = captured(references["base"], toks, {},
                           indexer_output=lambda layer, out: window.to(out.dtype) if layer == 0 else None)
    got = model.run_with_hooks(toks, fwd_hooks=[("blocks.0.attn.hook_index_topk", lambda t, hook: window.clone())])
    assert (got - expected).abs().max() <= 1e-5
    store = {}
    model.run_with_hooks(toks, fwd_hooks=[
        ("blocks.1.attn.hook_index_topk", lambda t, hook: window.clone()),
        ("blocks.0.attn.hook_index_topk", lambda t, hook: store.__setitem__(0, t.clone())),
        ("blocks.2.attn.hook_index_topk", lambda t, hook: store.__setitem__(2, t.clone())),
        ("blocks.3.attn.hook_index_topk", lambda t, hook: store.__setitem__(3, t.clone())),
    ])
    assert not torch.equal(store[0], window) and torch.equal(store[3], store[2])


def test_starting_at_a_shared_layer_is_refused(models):
    model = models["base"]
    resid = model(tokens(), stop_at_layer=1)
    with pytest.raises(ValueError, match="layer 1 reuses the key selection"):
        model(resid, start_at_layer=1)
    assert torch.equal(model(model(tokens(), stop_at_layer=2), start_at_layer=2), model(tokens()))


def test_bfloat16_is_bit_exact(checkpoints, references):
    model = HookedTransformer.from_pretrained(checkpoints["base"], dtype=torch.bfloat16, progress=False)
    check_bit_exact(compare(model, references("base", torch.bfloat16), tokens()))


@pytest.mark.parametrize("padded", [False, True])
def test_greedy_generation_matches_transformers(models, references, padded):
    prompt = left_padded(5, (3, 9), (0, 3, 1)) if padded else (tokens(5, (3, 9)), None)
    check_greedy_generation(models["base"], references["base"], *prompt, new=64)


def test_indexer_schedules_as_transformers_derives_them():
    from transformers import GlmMoeDsaConfig

    raw = tiny_glm.glm_moe_dsa_config().to_dict()
    raw.pop("indexer_types")
    for extra in ({"index_topk_pattern": "FSSF"}, {"index_topk_freq": 3, "index_skip_topk_offset": 1}, {}):
        theirs = GlmMoeDsaConfig(**{k: v for k, v in raw.items() if k not in ("mlp_layer_types", "layer_types")}, **extra)
        ours = HookedGlmMoeDsa.config_from_hf({**raw, **extra})
        assert ours.indexer_layers == tuple(k == "full" for k in theirs.indexer_types), extra
    assert HookedGlmMoeDsa.config_from_hf({**raw, "index_topk_pattern": "FSSF"}).indexer_layers == (True, False, False, True)


def test_config_refusals():
    raw = tiny_glm.glm_moe_dsa_config().to_dict()
    for change, message in (
        ({"indexer_types": ["shared", "full", "full", "full"]}, "layer 0"),
        ({"indexer_types": ["full", "shared"]}, "indexer_types"),
        ({"indexer_types": ["full", "sparse", "full", "full"]}, "indexer_types"),
        ({"indexer_types": None, "index_topk_pattern": "FXFF"}, "index_topk_pattern"),
        ({"mlp_layer_types": ["dense"] * 4}, "mlp_layer_types"),
    ):
        with pytest.raises(ValueError, match=message):
            HookedGlmMoeDsa.config_from_hf({**raw, **change})


def test_fp8_checkpoint_equals_transformers_dequantized(tmp_path):
    from test_quantized_checkpoints import assert_params_equal, check_logits, quantize_folder, transformers_dequantized

    folder = tiny_glm.build(tmp_path / "fp8", seed=5)
    quantize_folder(folder, (128, 128))
    for dtype in (torch.float32, torch.bfloat16):
        hf = transformers_dequantized(folder, dtype)
        model = HookedTransformer.from_pretrained(folder, dtype=dtype, progress=False)
        assert_params_equal(model, hf.state_dict())
        check_logits(model, hf, dtype)  # float32 within 1e-5 (transformers' fp8 linear rounds its own way), bf16 bitwise


GLM_5 = flagship("glm_moe_dsa", "zai-org/GLM-5")


def test_plan_at_full_size():
    """746.1 GB as fp8."""
    assert full_size_plan(GLM_5) / 1e9 == pytest.approx(746.1, abs=0.1)


def test_support_names_the_layers_that_score(models):
    rows = {r.name: r for r in models["base"].support(print_table=False).rows}
    assert rows["blocks.L.attn.hook_index_scores"].layers == "0,2" and rows["blocks.L.attn.hook_index_topk"].layers == "all"
    assert rows["blocks.L.attn.hook_index_topk"].reference == "model.layers.L.self_attn (out.2)"


def test_embedded_default_loads_and_runs():
    model = HookedTransformer.from_pretrained("tiny-glm-moe-dsa", progress=False)
    assert type(model) is HookedGlmMoeDsa and model.cfg.indexer_layers == (True, True, False, True)
    logits = model("Hello, shared selections; hello again")
    assert torch.isfinite(logits).all()
    assert model.generate("Hi", max_new_tokens=3, stop_at_eos=False, do_sample=False)
