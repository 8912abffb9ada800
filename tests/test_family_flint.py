"""Flint (flint: sink attention on sliding layers with the rotary and full layers without, after a q/k norm, scores
and softmax float32, a float32 sigmoid router, an ungated shared expert, dense blocks) against transformers' own
FlintForCausalLM on the same tiny checkpoints. The generic suites compare every site of the base checkpoint; here:
what each variant is, every site of each variant, bfloat16 bit for bit (the sinks and the router weight kept
float32), generation across the window, the sinks' share of the pattern, the full layers' missing rotary, both
spellings of the sinks, the refusals, and the embedded default."""

import pytest
import torch

import tiny_flint
from family_harness import (
    References, build_checkpoints, check_bit_exact, check_greedy_generation, check_report, copy_checkpoint,
    left_padded, rewrite_tensors, stored_keys, tokens, ATTENTION_SITES, BLOCK_SITES, ROUTER_SITES,
)
from moelens import HookedTransformer
from moelens.cli import main
from moelens.loaders.errors import CheckpointError
from moelens.models.components import SharedExpertMoe
from moelens.models.components.norm import CastAfterWeightRMSNorm
from moelens.models.flint import FlintAttention, Float32SigmoidTopK, HookedFlint
from moelens.verify import compare

VARIANTS = [v for (_, v) in tiny_flint.VARIANTS]
MOE_SITES = (*ROUTER_SITES, "mlp.shared_expert.hook_out")


@pytest.fixture(scope="module")
def checkpoints(tmp_path_factory):
    return build_checkpoints(tmp_path_factory, "flint", tiny_flint.VARIANTS)


@pytest.fixture(scope="module")
def models(checkpoints):
    return {v: HookedTransformer.from_pretrained(p, progress=False) for v, p in checkpoints.items()}


@pytest.fixture(scope="module")
def references(checkpoints):
    return References(checkpoints)


def test_variants_are_what_they_claim(models, checkpoints):
    base, types, step = models["base"].cfg, models["layer_types"].cfg, models["sparse_step"].cfg
    assert base.attention_windows == (5, None, 5) and base.moe_layers == (False, True, True)
    # transformers' defaults: full on the first two layers, every fourth from layer 1 and the last; two dense blocks
    assert types.attention_windows == (None, None, 5, 5, 5, None)
    assert types.moe_layers == (False, False, True, True, True, True) and not types.norm_topk_prob
    assert step.moe_layers == (False, True, False, True) and step.qkv_bias and step.o_bias
    assert base.norm_topk_prob and base.d_shared == 40 and base.d_mlp == 80
    for model in models.values():
        for layer, block in enumerate(model.blocks):
            assert type(block.attn) is FlintAttention and type(block.ln1) is CastAfterWeightRMSNorm
            assert block.attn.rotary == (model.cfg.window(layer) is not None)
            if model.cfg.moe_layers[layer]:
                assert type(block.mlp) is SharedExpertMoe and type(block.mlp.router) is Float32SigmoidTopK
    assert len(list(checkpoints["sharded"].glob("*.safetensors"))) > 1
    keys = stored_keys(checkpoints["fused"])
    assert "model.layers.1.mlp.experts.gate_up_proj" in keys and not any(".experts.0." in k for k in keys)


@pytest.mark.parametrize("variant", VARIANTS)
def test_float32_every_site(models, references, variant):
    model = models[variant]
    assert type(model) is HookedFlint
    sites = lambda layer: (*ATTENTION_SITES, *BLOCK_SITES, *(MOE_SITES if model.cfg.moe_layers[layer] else ()))
    check_report(compare(model, references[variant], tokens()), model, sites)


@pytest.mark.parametrize("variant", ["base", "layer_types", "sparse_step"])
def test_bfloat16_is_bit_exact(checkpoints, references, variant):
    """Scores and softmax float32, as transformers computes them, so every site matches bit for bit."""
    model = HookedTransformer.from_pretrained(checkpoints[variant], dtype=torch.bfloat16, progress=False)
    attn, router = model.blocks[1].attn, model.blocks[model.cfg.moe_layer_indices[0]].mlp.router
    assert attn.sinks.dtype == torch.float32 and router.weight.dtype == torch.float32
    assert attn.q_proj.weight.dtype == torch.bfloat16
    check_bit_exact(compare(model, references(variant, torch.bfloat16), tokens()))


@pytest.mark.parametrize("variant,padded", [("base", True), ("layer_types", False)])
def test_greedy_generation_matches_transformers(models, references, variant, padded):
    """Past the window (5): the cached keys outside it are masked as transformers masks them."""
    prompt = left_padded(5, (3, 9), (0, 3, 1)) if padded else (tokens(5, (3, 9)), None)
    check_greedy_generation(models[variant], references[variant], *prompt, new=24)


def test_sinks_take_their_share_and_are_hookable(models):
    """On a sliding and a full layer, a pattern row is the softmax of the scores and the head's sink written out by
    hand, without the sink's share; raising the sinks through hook_sink_scores changes the logits."""
    model = models["base"]
    logits, cache = model.run_with_cache(tokens())
    for layer in (0, 1):
        scores, pattern = cache[f"blocks.{layer}.attn.hook_attn_scores"], cache[f"blocks.{layer}.attn.hook_pattern"]
        sinks = model.blocks[layer].attn.sinks.detach()
        by_hand = torch.softmax(torch.cat([scores, sinks.view(1, -1, 1, 1).expand(*scores.shape[:3], 1)], -1), -1)
        torch.testing.assert_close(pattern, by_hand[..., :-1], rtol=0, atol=1e-6)
        assert (pattern.sum(-1) < 1 - 1e-3).any() and cache[f"blocks.{layer}.attn.hook_sink_scores"].shape == (2, 4, 40, 1)
    raised = model.run_with_hooks(tokens(), fwd_hooks=[("blocks.1.attn.hook_sink_scores", lambda t, hook: t + 5.0)])
    in_place = model.run_with_hooks(tokens(), fwd_hooks=[("blocks.1.attn.hook_sink_scores", lambda t, hook: t.add_(5.0))])
    assert torch.equal(raised, in_place) and (raised - logits).abs().max() > 1e-3


def test_full_layer_has_no_rotary(models):
    """On the full layer the normed queries enter the scores unrotated; on a sliding layer they are turned."""
    model = models["base"]
    _, cache = model.run_with_cache(tokens(7, (1, 12)), names_filter=lambda n: "hook_rot_q" in n or "hook_q" in n)
    norm = lambda layer: model.blocks[layer].attn.q_norm(cache[f"blocks.{layer}.attn.hook_q"])
    assert torch.equal(cache["blocks.1.attn.hook_rot_q"], norm(1))
    assert not torch.equal(cache["blocks.0.attn.hook_rot_q"], norm(0))


def test_sinks_module_spelling(checkpoints, models, tmp_path):
    """transformers saves the sinks as self_attn.softmax_offset (the checkpoints' name); its module's name for
    them, self_attn.sinks (what its conversion mapping renames them to), reads the same."""
    keys = stored_keys(checkpoints["base"])
    assert "model.layers.0.self_attn.softmax_offset" in keys and "model.layers.0.self_attn.sinks" not in keys
    folder = copy_checkpoint(checkpoints, tmp_path)

    def module_names(t):
        for layer in range(3):
            t[f"model.layers.{layer}.self_attn.sinks"] = t.pop(f"model.layers.{layer}.self_attn.softmax_offset")

    rewrite_tensors(folder, module_names)
    model = HookedTransformer.from_pretrained(folder, progress=False)
    assert torch.equal(model(tokens()), models["base"](tokens()))


def test_refusals_name_the_field():
    raw = tiny_flint.flint_config().to_dict()
    for change, message in (
        ({"sliding_window": None}, "sliding_window = null"),
        ({"layer_types": ["sliding_attention"] * 2}, "layer_types must list 3 entries"),
        ({"layer_types": ["sliding_attention", "chunked_attention", "full_attention"]}, "layer_types must list 3"),
        ({"rope_parameters": {"rope_type": "default", "rope_theta": 1e4, "partial_rotary_factor": 0.5}},
         "partial_rotary_factor"),
        ({"mlp_only_layers": [3]}, "mlp_only_layers"),
        ({"intermediate_size": 0}, "intermediate_size"),
    ):
        with pytest.raises(ValueError, match=message):
            HookedFlint.config_from_hf({**raw, **change})


@pytest.mark.parametrize("key", [
    "model.layers.1.self_attn.softmax_offset",
    "model.layers.2.self_attn.k_norm.weight",
    "model.layers.1.mlp.shared_expert.up_proj.weight",
    "model.layers.2.mlp.gate.weight",
    "model.layers.0.mlp.down_proj.weight",
])
def test_missing_tensor_is_named(checkpoints, tmp_path, key):
    folder = copy_checkpoint(checkpoints, tmp_path)
    rewrite_tensors(folder, lambda t: t.pop(key))
    with pytest.raises(CheckpointError, match="missing") as info:
        HookedTransformer.from_pretrained(folder, progress=False)
    assert key in str(info.value)


def test_verify_command_and_embedded_default(tmp_path, monkeypatch, capsys):
    monkeypatch.setattr("moelens.defaults.cache_root", lambda: tmp_path)
    model = HookedTransformer.from_pretrained("tiny-flint", progress=False)
    assert type(model) is HookedFlint and model.cfg.attention_windows == (None, None, 8, 8, 8, None)
    assert model.cfg.moe_layers == (False, False, True, True, True, True)
    assert main(["verify", "tiny-flint"]) == 0
    out = capsys.readouterr().out
    assert "float32: OK" in out and "bfloat16: OK" in out
