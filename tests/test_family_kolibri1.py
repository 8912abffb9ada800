"""Kolibri 1 (kolibri1: q/k-normed attention on sliding layers with the rotary and full layers without, sandwich
norms, a router choosing on logits + correction bias and weighing by the chosen logits' sigmoid, a shared expert)
against transformers' own Kolibri1ForCausalLM on the same tiny checkpoints. The generic suites compare every site
of the base checkpoint; here: what each variant is, every site of each variant, bfloat16 bit for bit (the bias kept
float32, the weight in the model's dtype), generation across the window, the sandwich norms' place, the original
checkpoints' and transformers' module spellings, the refusals, and the embedded default."""

import pytest
import torch

import tiny_kolibri1
from family_harness import (
    References, build_checkpoints, check_bit_exact, check_greedy_generation, check_report, copy_checkpoint,
    left_padded, rewrite_tensors, stored_keys, tokens, ATTENTION_SITES, BLOCK_SITES, ROUTER_SITES,
)
from moelens import HookedTransformer
from moelens.cli import main
from moelens.loaders.errors import CheckpointError
from moelens.models.components.qk_norm_attention import QKNormNoRotaryAttention, QKNormSlidingWindowAttention
from moelens.models.components.sandwich_block import SandwichBlock
from moelens.models.kolibri1 import BiasedLogitsSigmoidTopK, HookedKolibri1
from moelens.verify import compare

VARIANTS = [v for (_, v) in tiny_kolibri1.VARIANTS]
PER_BLOCK = (*ATTENTION_SITES, *BLOCK_SITES, *ROUTER_SITES, "ln1_post.hook_normalized", "ln2_post.hook_normalized",
             "mlp.shared_expert.hook_out")


@pytest.fixture(scope="module")
def checkpoints(tmp_path_factory):
    return build_checkpoints(tmp_path_factory, "kolibri1", tiny_kolibri1.VARIANTS)


@pytest.fixture(scope="module")
def models(checkpoints):
    return {v: HookedTransformer.from_pretrained(p, progress=False) for v, p in checkpoints.items()}


@pytest.fixture(scope="module")
def references(checkpoints):
    return References(checkpoints)


def test_variants_are_what_they_claim(models, checkpoints):
    base, types = models["base"].cfg, models["layer_types"].cfg
    assert base.attention_windows == (5, None, 5) and types.attention_windows == (5, 5, 5, 5, None)
    assert base.norm_topk_prob and not types.norm_topk_prob and base.d_shared == 40
    for model in models.values():
        for layer, block in enumerate(model.blocks):
            assert type(block) is SandwichBlock and type(block.mlp.router) is BiasedLogitsSigmoidTopK
            rotated = model.cfg.window(layer) is not None
            assert type(block.attn) is (QKNormSlidingWindowAttention if rotated else QKNormNoRotaryAttention)
    assert len(list(checkpoints["sharded"].glob("*.safetensors"))) > 1
    keys = stored_keys(checkpoints["fused"])
    assert "model.layers.1.mlp.experts.gate_up_proj" in keys and not any(".experts.0." in k for k in keys)


@pytest.mark.parametrize("variant", VARIANTS)
def test_float32_every_site(models, references, variant):
    model = models[variant]
    assert type(model) is HookedKolibri1
    check_report(compare(model, references[variant], tokens()), model, lambda layer: PER_BLOCK)


@pytest.mark.parametrize("variant", ["base", "layer_types"])
def test_bfloat16_is_bit_exact(checkpoints, references, variant):
    model = HookedTransformer.from_pretrained(checkpoints[variant], dtype=torch.bfloat16, progress=False)
    router = model.blocks[0].mlp.router
    assert router.e_score_correction_bias.dtype == torch.float32 and router.weight.dtype == torch.bfloat16
    check_bit_exact(compare(model, references(variant, torch.bfloat16), tokens()))
    # a dtype move keeps the bias float32, its values unrounded
    before = router.e_score_correction_bias.clone()
    model.to(torch.float16).to(torch.bfloat16)
    assert router.e_score_correction_bias.dtype == torch.float32 and torch.equal(router.e_score_correction_bias, before)


@pytest.mark.parametrize("variant,padded", [("base", True), ("layer_types", False)])
def test_greedy_generation_matches_transformers(models, references, variant, padded):
    """Past the window (5): the cached keys outside it are masked as transformers masks them."""
    prompt = left_padded(5, (3, 9), (0, 3, 1)) if padded else (tokens(5, (3, 9)), None)
    check_greedy_generation(models[variant], references[variant], *prompt, new=24)


def test_sandwich_norms(models):
    """attn_out = ln1_post(attention), mlp_out = ln2_post(routed + shared): what the stream adds."""
    model = models["base"]
    _, cache = model.run_with_cache(tokens())
    for layer in range(3):
        c = lambda site: cache[f"blocks.{layer}.{site}"]
        block = model.blocks[layer]
        assert torch.equal(c("ln1_post.hook_normalized"), c("hook_attn_out"))
        assert torch.equal(c("ln2_post.hook_normalized"), c("hook_mlp_out"))
        torch.testing.assert_close(block.ln2_post(c("mlp.hook_routed_out") + c("mlp.hook_shared_out")), c("hook_mlp_out"),
                                   rtol=0, atol=1e-6)
        torch.testing.assert_close(c("hook_resid_pre") + c("hook_attn_out"), c("hook_resid_mid"), rtol=0, atol=1e-6)
        assert block.post_norm("mixer") is block.ln1_post and block.post_norm("ffn") is block.ln2_post


def test_full_layer_has_no_rotary(models):
    """On the full layer the normed queries enter the scores unrotated: shifting every position changes nothing."""
    model = models["base"]
    toks = tokens(7, (1, 12))
    _, cache = model.run_with_cache(toks, names_filter=lambda n: n.endswith("hook_rot_q"))
    q = cache["blocks.1.attn.hook_rot_q"]
    attn = model.blocks[1].attn
    _, plain = model.run_with_cache(toks, names_filter=lambda n: n.endswith("attn.hook_q"))
    assert torch.equal(q, attn.q_norm(plain["blocks.1.attn.hook_q"]))
    assert not torch.equal(cache["blocks.0.attn.hook_rot_q"], model.blocks[0].attn.q_norm(plain["blocks.0.attn.hook_q"]))


def test_checkpoint_and_module_spellings(checkpoints, models, tmp_path):
    """transformers saves three tensors under the checkpoints' names (post_attn_norm, post_ffn_norm,
    moe.router.expert_bias); its modules' names for them (what its conversion mapping renames them to) read the same."""
    keys = stored_keys(checkpoints["base"])
    assert "model.layers.0.post_attn_norm.weight" in keys and "model.layers.0.moe.router.expert_bias" in keys
    folder = copy_checkpoint(checkpoints, tmp_path)

    def module_names(t):
        for layer in range(3):
            src = f"model.layers.{layer}"
            t[f"{src}.post_self_attn_layernorm.weight"] = t.pop(f"{src}.post_attn_norm.weight")
            t[f"{src}.post_mlp_layernorm.weight"] = t.pop(f"{src}.post_ffn_norm.weight")
            t[f"{src}.mlp.gate.e_score_correction_bias"] = t.pop(f"{src}.moe.router.expert_bias")

    rewrite_tensors(folder, module_names)
    model = HookedTransformer.from_pretrained(folder, progress=False)
    assert torch.equal(model(tokens()), models["base"](tokens()))


def test_refusals_name_the_field():
    raw = tiny_kolibri1.kolibri1_config().to_dict()
    for change, message in (
        ({"sliding_window": None}, "sliding_window = null"),
        ({"layer_types": ["sliding_attention"] * 2}, "layer_types must list 3 entries"),
        ({"layer_types": ["sliding_attention", "chunked_attention", "full_attention"]}, "layer_types must list 3"),
        ({"rope_parameters": {"rope_type": "default", "rope_theta": 1e4, "partial_rotary_factor": 0.5}},
         "partial_rotary_factor"),
        ({"num_experts": 9}, "both num_experts = 9 and num_local_experts = 8"),
    ):
        with pytest.raises(ValueError, match=message):
            HookedKolibri1.config_from_hf({**raw, **change})


@pytest.mark.parametrize("key", [
    "model.layers.1.post_attn_norm.weight",
    "model.layers.2.post_ffn_norm.weight",
    "model.layers.0.moe.router.expert_bias",
    "model.layers.1.self_attn.k_norm.weight",
    "model.layers.1.mlp.shared_experts.up_proj.weight",
])
def test_missing_tensor_is_named(checkpoints, tmp_path, key):
    folder = copy_checkpoint(checkpoints, tmp_path)
    rewrite_tensors(folder, lambda t: t.pop(key))
    with pytest.raises(CheckpointError, match="missing") as info:
        HookedTransformer.from_pretrained(folder, progress=False)
    assert key in str(info.value)


def test_verify_command_and_embedded_default(tmp_path, monkeypatch, capsys):
    monkeypatch.setattr("moelens.defaults.cache_root", lambda: tmp_path)
    model = HookedTransformer.from_pretrained("tiny-kolibri1", progress=False)
    assert type(model) is HookedKolibri1 and model.cfg.attention_windows == (8, 8, 8, 8, None)
    assert main(["verify", "tiny-kolibri1"]) == 0
    out = capsys.readouterr().out
    assert "float32: OK" in out and "bfloat16: OK" in out
