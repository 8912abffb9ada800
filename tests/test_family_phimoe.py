"""Phi-3.5-MoE (sparsemixer router, LayerNorms with bias, head bias, LongRoPE with its mscale switch): what the
generic suites do not cover, against transformers' own PhimoeForCausalLM and sparsemixer."""

import math

import pytest
import torch
from transformers.models.phimoe.modeling_phimoe import sparsemixer

import tiny_phimoe
from family_harness import References, build_checkpoints, check_bit_exact, stored_keys, tokens
from moelens import HookedTransformer
from moelens.cli import main
from moelens.config import MoeConfig, RopeConfig
from moelens.models.components.layer_norm import HookedLayerNorm
from moelens.models.components.router import SparseMixer
from moelens.models.phimoe import HookedPhimoe, LongRopeMscaleRotary
from moelens.verify import compare


@pytest.fixture(scope="module")
def checkpoints(tmp_path_factory):
    return build_checkpoints(tmp_path_factory, "phimoe", tiny_phimoe.VARIANTS)


@pytest.fixture(scope="module")
def models(checkpoints):
    return {v: HookedTransformer.from_pretrained(p, progress=False) for v, p in checkpoints.items()}


@pytest.fixture(scope="module")
def references(checkpoints):
    return References(checkpoints)


def test_variants_are_what_they_claim(models, checkpoints):
    base, hub = models["base"], models["hub_defaults"]
    assert type(base) is HookedPhimoe and type(base.rotary) is LongRopeMscaleRotary
    assert type(base.blocks[0].ln1) is HookedLayerNorm and type(base.ln_final) is HookedLayerNorm
    assert type(base.blocks[0].mlp.router) is SparseMixer
    assert base.cfg.qkv_bias and base.cfg.o_bias and base.cfg.unembed_bias and base.cfg.router_jitter_noise == 0.3
    assert base.cfg.rope.kind == "longrope" and base.cfg.rope.original_max_position_embeddings == 200
    assert not (hub.cfg.qkv_bias or hub.cfg.unembed_bias) and hub.unembed.bias is None
    assert hub.cfg.rope.kind == "default" and hub.cfg.attention_windows == (7, 7, 7) and hub.cfg.router_jitter_noise == 0.01
    assert models["long_context"].cfg.rope.original_max_position_embeddings == 16
    assert "model.layers.0.block_sparse_moe.experts.0.w1.weight" in stored_keys(checkpoints["base"])
    assert "model.layers.0.mlp.experts.gate_up_proj" in stored_keys(checkpoints["fused"])


def _router_config(n_experts: int, eps: float) -> MoeConfig:
    return MoeConfig(family="phimoe", d_model=4, n_layers=1, n_heads=1, n_kv_heads=1, d_head=4, d_vocab=8,
                     norm_eps=1e-5, rope=RopeConfig(theta=1e4), max_position_embeddings=8, moe_layers=(True,),
                     n_experts=n_experts, top_k_per_layer=(2,), d_expert=4, router_jitter_noise=eps)


def _logits(seed: int, shape: tuple[int, ...], dtype: torch.dtype, ties: bool) -> torch.Tensor:
    gen = torch.Generator().manual_seed(seed)
    logits = torch.randn(shape, generator=gen)
    if ties:  # near and exact ties, where the masking and torch.max's choice matter
        logits = (logits * 8).round() / 8
        logits[..., 3] = logits[..., 5]
    return logits.to(dtype)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("eps", [0.01, 0.3])
@pytest.mark.parametrize("ties", [False, True])
def test_router_is_transformers_sparsemixer_bit_for_bit(dtype, eps, ties):
    router = SparseMixer(_router_config(8, eps), top_k=2)
    logits = _logits(int(eps * 100) + ties, (512, 8), dtype, ties)
    weights_ref, indices_ref = sparsemixer(logits, jitter_eps=eps, training=False)
    indices = router.choose(router.scores(logits))
    weights = router.weights(router.scores(logits), indices, logits.dtype)
    assert torch.equal(indices, indices_ref)
    assert weights.dtype == weights_ref.dtype == dtype and torch.equal(weights, weights_ref)
    assert (weights < 1).any() and (weights == 1).any()  # some slots share their softmax, some do not


def test_replaced_indices_are_weighted_by_the_rule():
    """Hand-computed: with eps 0.01 only logits within 2% (relative) of a slot's chosen one share its softmax."""
    router = SparseMixer(_router_config(4, 0.01), top_k=2)
    logits = torch.tensor([[2.0, 1.99, 1.0, -3.0]], dtype=torch.float64)
    chosen = router.choose(logits)
    assert chosen.tolist() == [[0, 1]]
    shared = math.exp(2.0) / (math.exp(2.0) + math.exp(1.99))
    assert router.weights(logits, chosen, logits.dtype)[0].tolist() == pytest.approx([shared, 1.0], abs=1e-15)
    # slot 1 forced to expert 2 (1.0): 1.99 is within 2% above it, so it shares; slot 2 forced to expert 3 (-3.0):
    # every other logit (experts 1, 2 left; 0 taken) is above it and shares: (c - l) / max(|l|, c) < 0
    forced = torch.tensor([[2, 3]])
    w = router.weights(logits, forced, logits.dtype)
    first = math.exp(1.0) / (math.exp(2.0) + math.exp(1.99) + math.exp(1.0))
    second = math.exp(-3.0) / (math.exp(2.0) + math.exp(1.99) + math.exp(-3.0))
    assert w[0].tolist() == pytest.approx([first, second], abs=1e-15)


@pytest.mark.parametrize("n_tokens,mscale", [(12, 1.25), (40, 1.5)])
def test_longrope_mscale_switches_as_transformers(models, references, n_tokens, mscale):
    """original_max_position_embeddings 16: a 12-token forward scales cos and sin by short_mscale, a 40-token one
    by long_mscale (the frequencies stay the short ones, as transformers' forward computes them)."""
    model = models["long_context"]
    toks = tokens(seed=11, shape=(2, n_tokens))
    assert model.rotary.mscale(torch.arange(n_tokens)[None]) == mscale
    report = compare(model, references["long_context"], toks)
    assert report.max_logit_diff <= 1e-5 and report.index_mismatches == 0, report
    assert all(s.max_abs_diff <= 1e-5 for s in report.sites), report


def test_bfloat16_hub_defaults_bit_exact(checkpoints, references):
    model = HookedTransformer.from_pretrained(checkpoints["hub_defaults"], progress=False, dtype=torch.bfloat16)
    check_bit_exact(compare(model, references("hub_defaults", torch.bfloat16), tokens()))


def test_head_bias_is_b_U(models, references):
    assert torch.equal(models["base"].b_U, references["base"].lm_head.bias)
    assert torch.equal(models["base"].blocks[1].ln2.bias, references["base"].model.layers[1].post_attention_layernorm.bias)


def test_fold_ln_refused_naming_the_norm(checkpoints):
    with pytest.raises(ValueError, match=r"fold_ln cannot fold blocks\.0\.ln1: it is a LayerNorm with a bias"):
        HookedTransformer.from_pretrained(checkpoints["base"], progress=False, fold_ln=True)


@pytest.mark.parametrize("edit,match", [
    ({"num_experts_per_tok": 3}, r"num_experts_per_tok = 3: .*exactly 2 experts"),
    ({"rope_parameters": {"rope_type": "yarn", "rope_theta": 1e4, "factor": 2.0}}, r"rope type 'yarn'.*Phi-3.5-MoE"),
    ({"rope_parameters": {**tiny_phimoe.longrope(200), "rope_type": "longrope", "short_factor": [1.0] * 3}},
     r"rope_parameters\.short_factor = .*expected a list of 8 positive numbers"),
    ({"rope_parameters": {**tiny_phimoe.longrope(200), "rope_type": "longrope", "long_mscale": None}},
     r"rope_parameters\.long_mscale"),
    ({"router_jitter_noise": -0.1}, r"router_jitter_noise = -0\.1"),
    ({"lm_head_bias": "yes"}, r"lm_head_bias = 'yes'.*true or false"),
])
def test_bad_config_values_are_named(edit, match):
    raw = tiny_phimoe.phimoe_config().to_dict() | edit
    with pytest.raises((ValueError, KeyError), match=match):
        HookedPhimoe.config_from_hf(raw)


def test_support_names_the_families_modules(models):
    rows = {r.name: r for r in models["base"].support(print_table=False).rows}
    assert rows["blocks.L.mlp.hook_router_logits"].reference == "model.layers.L.mlp.router (out.0)"
    assert rows["blocks.L.mlp.hook_expert_weights"].reference == "model.layers.L.mlp.router (out.1)"
    assert "sparsemixer" in repr(models["base"].blocks[0].mlp.router) or "router_jitter_noise" in repr(
        models["base"].blocks[0].mlp.router)


def test_verify_command_and_embedded_default(tmp_path, monkeypatch, capsys):
    monkeypatch.setattr("moelens.defaults.cache_root", lambda: tmp_path)
    model = HookedTransformer.from_pretrained("tiny-phimoe", progress=False)
    assert type(model) is HookedPhimoe and model.cfg.rope.kind == "longrope" and model.cfg.unembed_bias
    assert main(["verify", "tiny-phimoe"]) == 0  # the Hub's spelling, read by transformers too
    out = capsys.readouterr().out
    assert "float32: OK" in out and "bfloat16: OK" in out
