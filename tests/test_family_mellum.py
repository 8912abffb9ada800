"""Mellum (mellum: Qwen3-MoE's blocks on sliding-window and full layers, each layer type with its own rotary,
dense blocks by mlp_layer_types) against transformers' own MellumForCausalLM on the same tiny checkpoints. The
generic suites compare every site of the base checkpoint; here: what each variant is, every site of each variant,
bfloat16 bit for bit, generation across the window, the per-type rotary, the refusals, the multi-token-prediction
layer skipped, and the embedded default."""

import pytest
import torch

import tiny
import tiny_mellum
from family_harness import (
    ATTENTION_SITES, BLOCK_SITES, ROUTER_SITES, References, build_checkpoints, check_bit_exact,
    check_greedy_generation, check_report, copy_checkpoint, left_padded, rewrite_tensors, stored_keys, tokens,
)
from moelens import HookedTransformer
from moelens.cli import main
from moelens.loaders.errors import CheckpointError
from moelens.models.mellum import HookedMellum, LayerTypeRotaryAttention
from moelens.verify import compare

VARIANTS = [v for (_, v) in tiny_mellum.VARIANTS]
PER_BLOCK = (*ATTENTION_SITES, *BLOCK_SITES)


@pytest.fixture(scope="module")
def checkpoints(tmp_path_factory):
    return build_checkpoints(tmp_path_factory, "mellum", tiny_mellum.VARIANTS)


@pytest.fixture(scope="module")
def models(checkpoints):
    return {v: HookedTransformer.from_pretrained(p, progress=False) for v, p in checkpoints.items()}


@pytest.fixture(scope="module")
def references(checkpoints):
    return References(checkpoints)


def test_variants_are_what_they_claim(models, checkpoints):
    base, defaults = models["base"].cfg, models["defaults"].cfg
    assert base.attention_windows == (5, None, 5) and base.moe_layers == (False, True, True)
    assert [r.theta for r in base.layer_ropes] == [100.0, 50000.0, 100.0]
    assert defaults.attention_windows == (None,) * 3 and defaults.moe_layers == (True,) * 3
    assert [r.theta for r in defaults.layer_ropes] == [500000.0] * 3  # transformers' default: full layers' base
    assert base.norm_topk_prob and not defaults.norm_topk_prob and defaults.qkv_bias and defaults.o_bias
    for model in models.values():
        assert all(type(b.attn) is LayerTypeRotaryAttention for b in model.blocks)
    assert len(list(checkpoints["sharded"].glob("*.safetensors"))) > 1
    keys = stored_keys(checkpoints["fused"])
    assert "model.layers.1.mlp.experts.gate_up_proj" in keys and not any(".experts.0." in k for k in keys)


@pytest.mark.parametrize("variant", VARIANTS)
def test_float32_every_site(models, references, variant):
    model = models[variant]
    assert type(model) is HookedMellum
    report = compare(model, references[variant], tokens())
    check_report(report, model, lambda layer: PER_BLOCK + (ROUTER_SITES if model.cfg.moe_layers[layer] else ()))


@pytest.mark.parametrize("variant", ["base", "defaults"])
def test_bfloat16_is_bit_exact(checkpoints, references, variant):
    model = HookedTransformer.from_pretrained(checkpoints[variant], dtype=torch.bfloat16, progress=False)
    check_bit_exact(compare(model, references(variant, torch.bfloat16), tokens()))


@pytest.mark.parametrize("variant,padded", [("base", True), ("defaults", False)])
def test_greedy_generation_matches_transformers(models, references, variant, padded):
    """Past the window (5): the cached keys outside it are masked as transformers masks them."""
    prompt = left_padded(5, (3, 9), (0, 3, 1)) if padded else (tokens(5, (3, 9)), None)
    check_greedy_generation(models[variant], references[variant], *prompt, new=24)


def test_each_layer_type_turns_with_its_own_base(models):
    """hook_rot_q is q_norm(q) rotated by the layer type's tables: 100 on the sliding layers, 50000 on the full one."""
    model = models["base"]
    toks = tokens(7, (1, 12))
    _, cache = model.run_with_cache(toks)
    positions = torch.arange(12)[None]
    for layer, theta in ((0, 100.0), (1, 50000.0)):
        attn = model.blocks[layer].attn
        q = attn.q_norm(cache[f"blocks.{layer}.attn.hook_q"])
        inv = 1.0 / theta ** (torch.arange(0, 16, 2).float() / 16)
        angles = torch.cat([positions[..., None] * inv] * 2, -1)[:, :, None, :]
        half = torch.cat([-q[..., 8:], q[..., :8]], -1)
        torch.testing.assert_close(cache[f"blocks.{layer}.attn.hook_rot_q"], q * angles.cos() + half * angles.sin(),
                                   rtol=0, atol=1e-5)


def test_refusals_name_the_field():
    raw = tiny_mellum.mellum_config().to_dict()
    ropes = tiny_mellum.ROPES
    for change, message in (
        ({"rope_parameters": {"full_attention": ropes["full_attention"]}}, "an object per layer type"),
        ({"rope_parameters": {**ropes, "sliding_attention": {"rope_theta": 1e4, "partial_rotary_factor": 0.5}}},
         r"rope_parameters.sliding_attention.partial_rotary_factor = 0.5"),
        ({"layer_types": ["sliding_attention"] * 2}, "layer_types must list 3 entries"),
        ({"mlp_layer_types": ["dense", "moe", "sparse"]}, "mlp_layer_types must list 3 entries"),
        ({"mlp_layer_types": ["dense"] * 3}, "every block a dense MLP"),
        ({"num_experts": 9}, "both num_experts = 9 and num_local_experts = 8"),
    ):
        with pytest.raises(ValueError, match=message):
            HookedMellum.config_from_hf({**raw, **change})


def test_multi_token_prediction_layer_is_skipped(checkpoints, models, tmp_path):
    folder = copy_checkpoint(checkpoints, tmp_path)
    rewrite_tensors(folder, lambda t: t.update({"mtp.layers.0.eh_proj.weight": torch.ones(4, 4)}))
    tiny.edit_config(folder, num_mtp_layers=1)
    model = HookedTransformer.from_pretrained(folder, progress=False)
    assert torch.equal(model(tokens()), models["base"](tokens()))
    assert "num_nextn_predict_layers" in model.cfg.fields_ignored or "num_mtp_layers" in model.cfg.fields_ignored


@pytest.mark.parametrize("key", ["model.layers.1.self_attn.q_norm.weight", "model.layers.0.mlp.up_proj.weight",
                                 "model.layers.2.mlp.experts.4.down_proj.weight"])
def test_missing_tensor_is_named(checkpoints, tmp_path, key):
    folder = copy_checkpoint(checkpoints, tmp_path)
    rewrite_tensors(folder, lambda t: t.pop(key))
    with pytest.raises(CheckpointError, match="missing") as info:
        HookedTransformer.from_pretrained(folder, progress=False)
    assert key in str(info.value)


def test_verify_command_and_embedded_default(tmp_path, monkeypatch, capsys):
    monkeypatch.setattr("moelens.defaults.cache_root", lambda: tmp_path)
    model = HookedTransformer.from_pretrained("tiny-mellum", progress=False)
    assert type(model) is HookedMellum and model.cfg.attention_windows == (8, 8, 8, None)
    assert main(["verify", "tiny-mellum"]) == 0
    out = capsys.readouterr().out
    assert "float32: OK" in out and "bfloat16: OK" in out
