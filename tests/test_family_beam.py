"""Beam (depth-scaled sandwich blocks, gated q/k-norm attention with a per-head gate bias, NoPE full layers with the
scalable-softmax query scale, a grouped sigmoid router, float32 SwiGLUs, softcapped logits) against transformers'
own BeamForCausalLM on the same tiny checkpoints."""

import math

import pytest
import torch

import tiny_beam
from family_harness import (
    MODEL_SITES, References, build_checkpoints, check_bit_exact, check_greedy_generation, check_report, copy_checkpoint, left_padded,
    rewrite_tensors, stored_keys, tokens,
)
from flagships import flagship
from moelens import HookedTransformer
from moelens.cli import main
from moelens.loaders.errors import CheckpointError
from moelens.models.beam import BeamAttention, BeamRouter, DepthScaledSandwichBlock, HookedBeam
from moelens.plan import plan
from moelens.verify import compare

VARIANTS = [v for (_, v) in tiny_beam.VARIANTS]
ATTENTION = ("hook_resid_pre", "ln1.hook_normalized", "attn.hook_q", "attn.hook_k", "attn.hook_v", "attn.hook_z",
             "ln1_post.hook_normalized", "hook_attn_out", "ln2.hook_normalized", "ln2_post.hook_normalized",
             "hook_mlp_out", "hook_resid_post")
MIXTURE = ("mlp.hook_router_logits", "mlp.hook_expert_weights", "mlp.hook_expert_indices", "mlp.hook_routed_out")


def per_block(model):
    return lambda layer: ATTENTION + (MIXTURE if model.cfg.moe_layers[layer] else ("mlp.hook_post",))


@pytest.fixture(scope="module")
def checkpoints(tmp_path_factory):
    return build_checkpoints(tmp_path_factory, "beam", tiny_beam.VARIANTS)


@pytest.fixture(scope="module")
def models(checkpoints):
    return {v: HookedTransformer.from_pretrained(p, progress=False) for v, p in checkpoints.items()}


@pytest.fixture(scope="module")
def references(checkpoints):
    return References(checkpoints)


def test_variants_are_what_they_claim(models, checkpoints):
    base, other = models["base"].cfg, models["rotary_uncapped"].cfg
    assert base.moe_layers == (False, True, True, True) and base.attention_windows == (5, None, 5, None)
    assert [r is None for r in base.layer_ropes] == [False, True, False, True] and base.final_logit_softcapping == 3.0
    assert all(r is not None for r in other.layer_ropes) and other.layer_ropes[1].theta == 500000.0
    assert other.final_logit_softcapping is None and other.tie_word_embeddings
    block = models["base"].blocks[1]
    assert type(block) is DepthScaledSandwichBlock and type(block.attn) is BeamAttention
    assert type(block.mlp.router) is BeamRouter and (block.mlp.router.n_group, block.mlp.router.topk_group) == (4, 2)
    assert len(list(checkpoints["sharded"].glob("*.safetensors"))) > 1
    keys = stored_keys(checkpoints["fused"])
    assert "model.layers.1.mlp.experts.gate_up_proj" in keys and not any(".experts.0." in k for k in keys)


@pytest.mark.parametrize("variant", VARIANTS)
def test_float32_every_site(models, references, variant):
    model = models[variant]
    assert type(model) is HookedBeam
    check_report(compare(model, references[variant], tokens()), model, per_block(model), model_sites=MODEL_SITES)


@pytest.mark.parametrize("variant", ["base", "rotary_uncapped"])
def test_bfloat16_is_bit_exact(checkpoints, references, variant):
    """The router float32 (weight and choice bias, as transformers keeps them), the experts' sum scaled in bfloat16
    after the sum, the float32 SwiGLUs, rotary and query scale cast back, the softcap in float32: op for op."""
    model = HookedTransformer.from_pretrained(checkpoints[variant], dtype=torch.bfloat16, progress=False)
    router = model.blocks[1].mlp.router
    assert router.weight.dtype == torch.float32 and router.e_score_correction_bias.dtype == torch.float32
    check_bit_exact(compare(model, references(variant, torch.bfloat16), tokens()))


def test_slots_in_transformers_order(models, references):
    """The router's top-k is sorted (the best choice score first), as transformers' slots; the weights are
    transformers' (routed_scaling_factor scales the experts' sum, hook_routed_out)."""
    model, ref = models["base"], references["base"]
    seen = {}
    handle = ref.model.layers[2].mlp.gate.register_forward_hook(lambda m, a, out: seen.update(out=out))
    try:
        with torch.no_grad():
            ref(tokens())
    finally:
        handle.remove()
    _, cache = model.run_with_cache(tokens())
    _, weights, indices = seen["out"]
    assert torch.equal(cache["blocks.2.mlp.hook_expert_indices"].reshape(indices.shape), indices)
    torch.testing.assert_close(cache["blocks.2.mlp.hook_expert_weights"].reshape(weights.shape), weights,
                               rtol=0, atol=1e-6)
    choice = cache["blocks.2.mlp.hook_choice_scores"]
    assert (choice.gather(-1, cache["blocks.2.mlp.hook_expert_indices"]).diff(dim=-1) <= 0).all()


def test_gate_bias_and_nope_query_scale(models, references):
    """hook_attn_gate is transformers' gate_proj output plus each head's gate_bias; on a NoPE layer hook_rot_q is
    the q-normed query times (1 + (i + 1) / 2048) ** 0.1, i the token's position (written with pow here), and
    hook_rot_k the normed key; a left-padded row gets the positions it has alone."""
    model, ref = models["base"], references["base"]
    toks = tokens()
    seen = {}
    handle = ref.model.layers[1].self_attn.gate_proj.register_forward_hook(lambda m, a, out: seen.update(gate=out))
    try:
        with torch.no_grad():
            ref(toks)
    finally:
        handle.remove()
    _, cache = model.run_with_cache(toks)
    bias = ref.model.layers[1].self_attn.gate_bias
    by_hand = seen["gate"].view(*toks.shape, 4, 16) + bias[:, None]
    torch.testing.assert_close(cache["blocks.1.attn.hook_attn_gate"], by_hand, rtol=0, atol=1e-6)

    def normed(x, weight):
        x = x.float()
        return weight * (x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + model.cfg.norm_eps))

    attn = model.blocks[1].attn
    scale = (1 + (torch.arange(toks.shape[1]) + 1) / 2048) ** 0.1
    torch.testing.assert_close(cache["blocks.1.attn.hook_rot_q"],
                               normed(cache["blocks.1.attn.hook_q"], attn.q_norm.weight) * scale[None, :, None, None],
                               rtol=1e-6, atol=1e-6)
    torch.testing.assert_close(cache["blocks.1.attn.hook_rot_k"], normed(cache["blocks.1.attn.hook_k"], attn.k_norm.weight),
                               rtol=0, atol=1e-6)
    padded, mask = left_padded(5, (2, 9), (0, 3))
    _, pcache = model.run_with_cache(padded, attention_mask=mask)
    _, alone = model.run_with_cache(padded[1:, 3:])
    torch.testing.assert_close(pcache["blocks.1.attn.hook_rot_q"][1, 3:], alone["blocks.1.attn.hook_rot_q"][0],
                               rtol=0, atol=1e-5)


def test_depth_scaled_adds_and_softcapped_logits(models):
    """resid_mid = resid_pre * sqrt((i - 1) / i) + attn_out, attn_out = ln1_post's output / sqrt(i), i = 2 (layer +
    1); the logits 3 tanh(unembedding / 3), every one within (-3, 3); the stream is no sum of sublayer outputs, so
    the decompositions refuse it, naming the block."""
    model = models["base"]
    with torch.no_grad():
        logits, cache = model.run_with_cache(tokens())
    for layer in range(4):
        i = 2 * (layer + 1)
        torch.testing.assert_close(cache[f"blocks.{layer}.hook_attn_out"],
                                   cache[f"blocks.{layer}.ln1_post.hook_normalized"] / math.sqrt(i), rtol=1e-6, atol=1e-7)
        torch.testing.assert_close(cache[f"blocks.{layer}.hook_resid_mid"],
                                   cache[f"blocks.{layer}.hook_resid_pre"] * math.sqrt((i - 1) / i)
                                   + cache[f"blocks.{layer}.hook_attn_out"], rtol=1e-6, atol=1e-6)
        torch.testing.assert_close(cache[f"blocks.{layer}.hook_resid_post"],
                                   cache[f"blocks.{layer}.hook_resid_mid"] * math.sqrt(i / (i + 1))
                                   + cache[f"blocks.{layer}.hook_mlp_out"], rtol=1e-6, atol=1e-6)
    raw = cache["ln_final.hook_normalized"] @ model.unembed.weight.T
    torch.testing.assert_close(logits, 3.0 * torch.tanh(raw / 3.0), rtol=0, atol=1e-6)
    assert logits.abs().max() < 3.0 and raw.abs().max() > 3.0
    with pytest.raises(ValueError, match="block 0 .*does not add its sublayers. outputs"):
        cache.decompose_resid()
    with pytest.raises(ValueError, match="does not add its sublayers. outputs"):
        cache.get_full_resid_decomposition()


def test_neurons_and_slots_sum_to_what_the_sublayer_adds(models):
    """The routed part's scale is routed_scaling_factor: the slots' outputs times 2.5 sum to hook_routed_out; each
    neuron's write, through the frozen post-norm and the depth scale 1 / sqrt(i), sums to hook_mlp_out, on a mixture
    block and on a dense one."""
    model = models["base"]
    with torch.no_grad():
        _, cache = model.run_with_cache(tokens())
        part = model.blocks[2].mlp.parts()[0]
        assert part.kind == "routed" and part.scale == 2.5
        torch.testing.assert_close(cache["blocks.2.mlp.hook_expert_outputs"].sum(-2) * 2.5,
                                   cache["blocks.2.mlp.hook_routed_out"], rtol=0, atol=1e-6)
        torch.testing.assert_close(cache.get_neuron_results(2).sum((-3, -2)), cache["blocks.2.hook_mlp_out"],
                                   rtol=0, atol=1e-5)
        torch.testing.assert_close(cache.get_neuron_results(0).sum(-2), cache["blocks.0.hook_mlp_out"], rtol=0, atol=1e-5)


@pytest.mark.parametrize("variant,padded", [("base", True), ("rotary_uncapped", False)])
def test_greedy_generation_matches_transformers(models, references, variant, padded):
    """Beyond the sliding window (5): the cache's sliding layers see only the last positions; the NoPE layers'
    query scale continues from the cache's positions."""
    prompt = left_padded(5, (3, 9), (0, 3, 1)) if padded else (tokens(5, (3, 9)), None)
    check_greedy_generation(models[variant], references[variant], *prompt, new=16)


# ---- config spellings and refusals --------------------------------------------------------------------


def test_defaults_where_config_json_is_silent(checkpoints, models, tmp_path):
    """Without rope_parameters, transformers' default: the sliding layers at rope_theta 10000, the full ones NoPE;
    without final_logit_softcapping, a cap of 30; a null one, none."""
    folder = copy_checkpoint(checkpoints, tmp_path)
    tiny_beam.tiny.edit_config(folder, rope_parameters=None)
    model = HookedTransformer.from_pretrained(folder, progress=False)
    assert model.cfg == models["base"].cfg
    raw = tiny_beam.beam_config().to_dict()
    del raw["final_logit_softcapping"]
    assert HookedBeam.config_from_hf(raw).final_logit_softcapping == 30.0
    assert HookedBeam.config_from_hf({**raw, "final_logit_softcapping": None}).final_logit_softcapping is None


def test_config_refusals():
    raw = tiny_beam.beam_config().to_dict()
    for change, message in (
        ({"layer_types": ["sliding_attention"] * 2}, "layer_types must list 4 entries"),
        ({"mlp_layer_types": ["dense"] * 4}, "every block a dense MLP"),
        ({"rope_parameters": {"sliding_attention": {"rope_theta": 1e4}}}, "rope_parameters must hold"),
        ({"rope_parameters": {"sliding_attention": {"rope_theta": 1e4, "partial_rotary_factor": 0.5},
                              "full_attention": None}}, "partial_rotary_factor"),
        ({"final_logit_softcapping": 0}, "final_logit_softcapping"),
        ({"final_logit_softcapping": -2.0}, "final_logit_softcapping"),
        ({"n_group": 3}, "n_group"),
        ({"topk_group": 5}, "topk_group"),
        ({"sliding_window": None}, "sliding_window = null"),
        ({"num_experts_per_tok": 9}, "num_experts_per_tok"),
    ):
        with pytest.raises((ValueError, KeyError), match=message):
            HookedBeam.config_from_hf({**raw, **change})


@pytest.mark.parametrize("key", [
    "model.layers.0.post_feedforward_layernorm.weight",
    "model.layers.1.pre_feedforward_layernorm.weight",
    "model.layers.2.self_attn.gate_bias",
    "model.layers.1.mlp.gate.e_score_correction_bias",
    "model.layers.3.mlp.gate.weight",
])
def test_missing_tensor_is_named(checkpoints, tmp_path, key):
    folder = copy_checkpoint(checkpoints, tmp_path)
    rewrite_tensors(folder, lambda t: t.pop(key))
    with pytest.raises(CheckpointError, match="missing") as info:
        HookedTransformer.from_pretrained(folder, progress=False)
    assert key in str(info.value)


# ---- plan, support, embedded default -------------------------------------------------------------------


BEAM = flagship("beam", "reflection/Beam-1.0-501B-A23B")


def test_plan_at_full_size_by_hand():
    """52 layers x (q, o and the gate 3 x 5120 x 6144, k and v 2 x 5120 x 1024, 48 gate biases, 2 x 128 q/k norms,
    4 x 5120 norms), three dense MLPs (3 x 5120 x 20480), 49 mixtures (256 x 3 x 5120 x 2560 experts, a 256 x 5120
    router and its 256 biases), 2 x 151936 x 5120 embeddings and the final norm. (Its count against transformers':
    tests/test_flagships.py.)"""
    p = plan(dict(BEAM), dtype="bfloat16", cpu_memory="2TB")
    per_layer = 3 * 5120 * 6144 + 2 * 5120 * 1024 + 48 + 2 * 128 + 4 * 5120
    mixture = 256 * 3 * 5120 * 2560 + 256 * 5120 + 256
    assert p.parameters == 52 * per_layer + 3 * 3 * 5120 * 20480 + 49 * mixture + 2 * 151936 * 5120 + 5120


def test_support_names_the_references(models):
    rows = {r.name: r for r in models["base"].support(print_table=False).rows}
    assert rows["blocks.L.hook_attn_out"].reference == "model.layers.L.post_attention_layernorm"
    assert rows["blocks.L.ln2.hook_normalized"].reference == "model.layers.L.pre_feedforward_layernorm"
    assert rows["blocks.L.hook_mlp_out"].reference == "model.layers.L.post_feedforward_layernorm"
    assert rows["hook_logits"].reference == "lm_head"


def test_embedded_default_and_verify():
    model = HookedTransformer.from_pretrained("tiny-beam", progress=False)
    assert type(model) is HookedBeam and model.cfg.final_logit_softcapping == 30.0
    assert main(["verify", "tiny-beam"]) == 0
