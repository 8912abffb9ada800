"""dots.llm1 (HookedDots1): GLM-4.5's blocks with Qwen3's q/k-normed attention and per-layer sliding windows,
against transformers' own Dots1ForCausalLM on the same tiny checkpoints. The generic suites compare every site of
the base checkpoint; here: every variant site by site in float32 (the sliding layer's window shorter than the
input), bit for bit in bfloat16, greedy generation past the window, dots1's defaults and refusals, verify and
the embedded default (the plan at full size: the flagship file, tests/test_flagships.py)."""

import pytest
import torch

import tiny_dots1
from family_harness import (
    References, build_checkpoints, check_bit_exact, check_greedy_generation, left_padded, tokens,
)
from moelens import HookedTransformer
from moelens.cli import main
from moelens.models.components import SharedExpertMoe, SigmoidGroupedTopK
from moelens.models.components.qk_norm_attention import QKNormSlidingWindowAttention
from moelens.models.dots1 import HookedDots1
from moelens.verify import compare
from test_family_glm4_moe import check_report

VARIANTS = [v for (_, v) in tiny_dots1.VARIANTS]


@pytest.fixture(scope="module")
def ckpts(tmp_path_factory):
    return build_checkpoints(tmp_path_factory, "dots1", tiny_dots1.VARIANTS)


@pytest.fixture(scope="module")
def models(ckpts):
    return {v: HookedTransformer.from_pretrained(p, progress=False) for v, p in ckpts.items()}


@pytest.fixture(scope="module")
def refs(ckpts):
    return References(ckpts)


def test_variants_are_what_they_claim(models, refs):
    base, grouped = models["base"], models["grouped"]
    assert type(base) is HookedDots1
    assert base.cfg.attention_windows == (None, None, 6) and grouped.cfg.attention_windows == (None, None, None)
    assert [block.attn.sliding_window for block in base.blocks] == [None, None, 6]
    assert [layer.self_attn.sliding_window for layer in refs("base").model.layers] == [None, None, 6]
    assert all(type(block.attn) is QKNormSlidingWindowAttention for m in models.values() for block in m.blocks)
    assert base.cfg.d_head == 24 and grouped.cfg.d_head == 16 and base.cfg.d_rot == base.cfg.d_head
    assert not base.cfg.qkv_bias and grouped.cfg.qkv_bias and grouped.cfg.o_bias
    assert base.cfg.moe_layers == (False, True, True) and base.cfg.d_shared == 2 * base.cfg.d_expert
    assert base.cfg.norm_topk_prob and not grouped.cfg.norm_topk_prob and (grouped.cfg.n_group, grouped.cfg.topk_group) == (4, 2)
    recipe = HookedDots1.recipe(base.cfg)
    for layer in base.cfg.moe_layer_indices:
        assert recipe.layers[layer].ffn.moe is SharedExpertMoe and recipe.layers[layer].ffn.router is SigmoidGroupedTopK


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


def test_the_window_is_what_makes_the_sliding_layer_match(models, refs):
    """Without its window the sliding layer's output differs from transformers' (so the window is tested)."""
    model, ref = models["base"], refs("base")
    model.blocks[2].attn.sliding_window = None
    try:
        report = compare(model, ref, tokens())
    finally:
        model.blocks[2].attn.sliding_window = 6
    assert report.max_logit_diff > 1e-3


def test_float32_left_padded(models, refs):
    model, ref = models["base"], refs("base")
    toks, mask = tokens(5, (3, 24)), torch.ones(3, 24, dtype=torch.long)
    mask[0, :4], mask[1, :9] = 0, 0
    report = compare(model, ref, toks, mask)
    assert report.max_logit_diff <= 1e-5 and report.index_mismatches == 0, report


@pytest.mark.parametrize("variant", ["base", "grouped"])
def test_bfloat16_is_bit_exact(ckpts, refs, variant):
    model = HookedTransformer.from_pretrained(ckpts[variant], dtype=torch.bfloat16, progress=False)
    ref = refs(variant, torch.bfloat16)
    for layer, block in enumerate(model.blocks):
        if block.is_moe:
            assert block.mlp.router.weight.dtype == ref.model.layers[layer].mlp.gate.weight.dtype == torch.float32
    check_bit_exact(compare(model, ref, tokens()))


@pytest.mark.parametrize("padded", [False, True])
def test_greedy_generation_matches_transformers(models, refs, padded):
    """Prompt and continuation together run past the sliding layer's 6 positions."""
    prompt = left_padded(5, (3, 9), (0, 3, 1)) if padded else (tokens(5, (3, 9)), None)
    check_greedy_generation(models["base"], refs("base"), *prompt)


def test_dots1_defaults_and_refusals():
    raw = {k: v for k, v in tiny_dots1.dots1_config().to_dict().items() if k not in ("layer_types",)}
    # layer_types absent: sliding from max_window_layers on where sliding_window is set, as transformers
    assert HookedDots1.config_from_hf(raw).attention_windows == (None, None, 6)
    assert HookedDots1.config_from_hf({**raw, "sliding_window": None}).attention_windows == (None,) * 3
    absent = {k: v for k, v in raw.items() if k not in ("max_window_layers", "norm_topk_prob", "sliding_window")}
    cfg = HookedDots1.config_from_hf(absent)  # max_window_layers 62: no sliding layer; norm_topk_prob false
    assert cfg.attention_windows == (None,) * 3 and not cfg.norm_topk_prob
    for missing in ("n_routed_experts", "n_shared_experts", "num_experts_per_tok"):  # transformers has no default
        with pytest.raises(KeyError, match=missing):
            HookedDots1.config_from_hf({k: v for k, v in raw.items() if k != missing})
    for change, message in (
        ({"layer_types": ["full_attention", "sliding_attention"]}, "layer_types must list 3 entries"),
        ({"layer_types": ["full_attention"] * 2 + ["chunked_attention"]}, "layer_types must list"),
        ({"layer_types": ["sliding_attention"] * 3, "sliding_window": None}, r"sliding_attention but sliding_window"),
        ({"rope_parameters": {"rope_type": "default", "rope_theta": 1000.0, "partial_rotary_factor": 0.5}},
         "partial_rotary_factor 0.5"),
        ({"sliding_window": 0}, "sliding_window"),
        ({"n_group": 3}, "multiple of n_group"),
    ):
        with pytest.raises(ValueError, match=message):
            HookedDots1.config_from_hf({**raw, **change})


def test_verify_command_and_embedded_default(tmp_path, monkeypatch, capsys):
    monkeypatch.setattr("moelens.defaults.cache_root", lambda: tmp_path)
    model = HookedTransformer.from_pretrained("tiny-dots1", progress=False)
    assert type(model) is HookedDots1 and model.cfg.moe_layers == (False, True, True, True)
    assert model.cfg.attention_windows == (None, None, None, 16) and model.cfg.n_experts == 16
    assert main(["verify", "tiny-dots1"]) == 0
    out = capsys.readouterr().out
    assert "float32: OK" in out and "bfloat16: OK" in out
