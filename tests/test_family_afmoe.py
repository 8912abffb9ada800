"""AFMoE (Arcee Trinity: sandwich-norm blocks, gated attention with q/k norm, NoPE full layers beside rotary
sliding ones, muP's embedding scale, a sigmoid router with a float32 choice bias and sorted slots) against
transformers' own AfmoeForCausalLM on the same tiny checkpoints."""

import pytest
import torch

import tiny_afmoe
from flagships import flagship
from family_harness import (
    MODEL_SITES, References, build_checkpoints, check_bit_exact, check_greedy_generation, check_report, copy_checkpoint,
    left_padded, rewrite_tensors, stored_keys, tokens,
)
from moelens import HookedTransformer
from moelens.cli import main
from moelens.loaders.errors import CheckpointError
from moelens.models.afmoe import AfmoeAttention, AfmoeRouter, HookedAfmoe
from moelens.models.components.norm import CastAfterWeightRMSNorm
from moelens.models.components.sandwich_block import SandwichBlock
from moelens.plan import plan
from moelens.verify import compare

VARIANTS = [v for (_, v) in tiny_afmoe.VARIANTS]
ATTENTION = ("hook_resid_pre", "ln1.hook_normalized", "attn.hook_q", "attn.hook_k", "attn.hook_v", "attn.hook_attn_gate",
             "attn.hook_z", "ln1_post.hook_normalized", "hook_attn_out", "ln2.hook_normalized", "ln2_post.hook_normalized",
             "hook_mlp_out", "hook_resid_post")
MIXTURE = ("mlp.hook_router_logits", "mlp.hook_expert_weights", "mlp.hook_expert_indices", "mlp.hook_routed_out",
           "mlp.shared_expert.hook_out")


def per_block(model):
    return lambda layer: ATTENTION + (MIXTURE if model.cfg.moe_layers[layer] else ("mlp.hook_post",))


@pytest.fixture(scope="module")
def checkpoints(tmp_path_factory):
    return build_checkpoints(tmp_path_factory, "afmoe", tiny_afmoe.VARIANTS)


@pytest.fixture(scope="module")
def models(checkpoints):
    return {v: HookedTransformer.from_pretrained(p, progress=False) for v, p in checkpoints.items()}


@pytest.fixture(scope="module")
def references(checkpoints):
    return References(checkpoints)


def test_variants_are_what_they_claim(models, checkpoints):
    base, plain = models["base"].cfg, models["plain_tied"].cfg
    assert base.embedding_multiplier == 8.0 and plain.embedding_multiplier == 1.0 and plain.tie_word_embeddings
    assert base.moe_layers == (False, True, True) and base.d_shared == 2 * base.d_expert
    assert base.attention_windows == (5, None, 5) and base.rotary_layers == (True, False, True)
    assert plain.attention_windows == (5, 5, None) and plain.rotary_layers == (True, True, False)
    block = models["base"].blocks[1]
    assert type(block) is SandwichBlock and type(block.attn) is AfmoeAttention and type(block.mlp.router) is AfmoeRouter
    assert type(block.ln1) is type(block.ln1_post) is type(block.attn.q_norm) is CastAfterWeightRMSNorm
    assert len(list(checkpoints["sharded"].glob("*.safetensors"))) > 1
    keys = stored_keys(checkpoints["fused"])
    assert "model.layers.1.mlp.experts.gate_up_proj" in keys and not any(".experts.0." in k for k in keys)


@pytest.mark.parametrize("variant", VARIANTS)
def test_float32_every_site(models, references, variant):
    model = models[variant]
    assert type(model) is HookedAfmoe
    check_report(compare(model, references[variant], tokens()), model, per_block(model), model_sites=MODEL_SITES)


@pytest.mark.parametrize("variant", ["base", "plain_tied"])
def test_bfloat16_is_bit_exact(checkpoints, references, variant):
    """The router's logits in bfloat16 then cast, its choice bias float32 (transformers keeps expert_bias float32 in
    any dtype), the norms' weight applied before the cast: op for op."""
    model = HookedTransformer.from_pretrained(checkpoints[variant], dtype=torch.bfloat16, progress=False)
    router = model.blocks[1].mlp.router
    assert router.weight.dtype == torch.bfloat16 and router.e_score_correction_bias.dtype == torch.float32
    check_bit_exact(compare(model, references(variant, torch.bfloat16), tokens()))


def test_slots_in_transformers_order(models, references):
    """The router's top-k is sorted (the best choice score first), as transformers' slots: indices and weights
    slot for slot, not only as sets."""
    model, ref = models["base"], references["base"]
    seen = {}
    handle = ref.model.layers[1].mlp.router.register_forward_hook(lambda m, a, out: seen.update(out=out))
    try:
        with torch.no_grad():
            ref(tokens())
    finally:
        handle.remove()
    _, cache = model.run_with_cache(tokens())
    _, weights, indices = seen["out"]
    assert torch.equal(cache["blocks.1.mlp.hook_expert_indices"].reshape(indices.shape), indices)
    torch.testing.assert_close(cache["blocks.1.mlp.hook_expert_weights"].reshape(weights.shape), weights, rtol=0, atol=1e-6)
    choice = cache["blocks.1.mlp.hook_choice_scores"]
    assert (choice.gather(-1, cache["blocks.1.mlp.hook_expert_indices"]).diff(dim=-1) <= 0).all()


def test_full_layers_have_no_rotary_and_the_gate_scales_each_head(models):
    """On a full layer what enters the scores is the q/k-normed projection itself (written out here: the float32
    RMS norm of each head, times the weight); on a sliding layer the rotary turns it. hook_z is the heads' outputs
    times sigmoid(hook_attn_gate), and hook_embed the embedding rows times sqrt(d_model)."""
    model = models["base"]
    toks = tokens()
    _, cache = model.run_with_cache(toks)

    def normed(x, weight):
        x = x.float()
        return weight * (x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + model.cfg.norm_eps))

    for layer in range(3):
        attn = model.blocks[layer].attn
        q, rot_q = cache[f"blocks.{layer}.attn.hook_q"], cache[f"blocks.{layer}.attn.hook_rot_q"]
        by_hand = normed(q, attn.q_norm.weight)
        if model.cfg.rotary_layers[layer]:
            assert (by_hand - rot_q).abs().max() > 1e-2
        else:
            torch.testing.assert_close(rot_q, by_hand, rtol=0, atol=1e-6)
            torch.testing.assert_close(cache[f"blocks.{layer}.attn.hook_rot_k"],
                                       normed(cache[f"blocks.{layer}.attn.hook_k"], attn.k_norm.weight), rtol=0, atol=1e-6)
    # the gate: zero it (sigmoid 0.5) and the heads' outputs halve
    ungated = {}
    with model.hooks([("blocks.2.attn.hook_attn_gate", lambda g, hook: torch.zeros_like(g)),
                      ("blocks.2.attn.hook_z", lambda z, hook: ungated.update(z=z.clone()))]):
        model(toks)
    gate = torch.sigmoid(cache["blocks.2.attn.hook_attn_gate"])
    torch.testing.assert_close(cache["blocks.2.attn.hook_z"] / gate, 2 * ungated["z"], rtol=1e-5, atol=1e-6)
    torch.testing.assert_close(cache["hook_embed"], model.embed.weight[toks] * 8.0, rtol=0, atol=0)


def test_decompositions_take_each_part_through_the_frozen_post_norm(models):
    """Sandwich blocks: the parts of each sublayer through its post-norm's weight over the cached scale sum to the
    stream and, through the final norm, to the logits; the heads of a layer are what its attention adds."""
    model = models["base"]
    toks = tokens()
    with torch.no_grad():
        logits, cache = model.run_with_cache(toks)
    final = cache["resid_post", -1]
    answer = logits.gather(-1, toks[..., None])[..., 0]
    for expand in (False, True):
        stack = cache.get_full_resid_decomposition(expand_neurons=expand)
        torch.testing.assert_close(stack.sum(0), final, rtol=0, atol=1e-5)
        torch.testing.assert_close(cache.logit_attrs(stack, toks).sum(0), answer, rtol=0, atol=1e-4)
    heads = cache.stack_head_results(layer=1)
    torch.testing.assert_close(heads.sum(0), cache["attn_out", 0], rtol=0, atol=1e-5)


@pytest.mark.parametrize("variant,padded", [("base", True), ("plain_tied", False)])
def test_greedy_generation_matches_transformers(models, references, variant, padded):
    """Beyond the sliding window (5): the cache's sliding layers see only the last positions."""
    prompt = left_padded(5, (3, 9), (0, 3, 1)) if padded else (tokens(5, (3, 9)), None)
    check_greedy_generation(models[variant], references[variant], *prompt, new=16)


def test_fold_ln_folds_the_pre_norms_and_leaves_the_post_norms(checkpoints, models):
    """ln1 / ln2 fold into what reads them (q, k, v, the gate; the router, experts and shared expert); the
    post-norms keep their weights; the logits are unchanged up to rounding."""
    folded = HookedTransformer.from_pretrained(checkpoints["base"], fold_ln=True, progress=False)
    base = models["base"]
    for block in folded.blocks:
        assert torch.equal(block.ln1.weight, torch.ones_like(block.ln1.weight))
        assert torch.equal(block.ln2.weight, torch.ones_like(block.ln2.weight))
    assert torch.equal(folded.blocks[1].ln2_post.weight, base.blocks[1].ln2_post.weight)
    with torch.no_grad():
        assert (folded(tokens()) - base(tokens())).abs().max() <= 1e-4


# ---- config spellings and refusals --------------------------------------------------------------------


def test_layer_types_default_from_global_attn_every_n_layers(checkpoints, models, tmp_path):
    """Without layer_types, transformers' rule: every global_attn_every_n_layers-th layer full (here 2: layer 1)."""
    folder = copy_checkpoint(checkpoints, tmp_path)
    tiny_afmoe.tiny.edit_config(folder, layer_types=None)
    model = HookedTransformer.from_pretrained(folder, progress=False)
    assert model.cfg == models["base"].cfg
    assert torch.equal(model(tokens()), models["base"](tokens()))


def test_config_refusals():
    raw = tiny_afmoe.afmoe_config().to_dict()
    for change, message in (
        ({"layer_types": ["sliding_attention"] * 2}, "layer_types must list 3 entries"),
        ({"layer_types": ["sliding_attention", "chunked", "full_attention"]}, "layer_types"),
        ({"num_experts_per_tok": 9}, "num_experts_per_tok"),
        ({"sliding_window": 0}, "sliding_window"),
        ({"mup_enabled": "yes"}, "mup_enabled"),
    ):
        with pytest.raises((ValueError, KeyError), match=message):
            HookedAfmoe.config_from_hf({**raw, **change})


@pytest.mark.parametrize("key", [
    "model.layers.0.post_mlp_layernorm.weight",
    "model.layers.1.pre_mlp_layernorm.weight",
    "model.layers.2.self_attn.gate_proj.weight",
    "model.layers.1.mlp.expert_bias",
    "model.layers.2.mlp.router.gate.weight",
])
def test_missing_tensor_is_named(checkpoints, tmp_path, key):
    folder = copy_checkpoint(checkpoints, tmp_path)
    rewrite_tensors(folder, lambda t: t.pop(key))
    with pytest.raises(CheckpointError, match="missing") as info:
        HookedTransformer.from_pretrained(folder, progress=False)
    assert key in str(info.value)


# ---- plan, support, embedded default -------------------------------------------------------------------


TRINITY_MINI = flagship("afmoe", "arcee-ai/Trinity-Mini")


def test_plan_at_full_size_by_hand():
    """32 layers x (5 x 2048^2: q, k, v, o and the gate; 2 x 128 q/k norms; 4 x 2048 norms), the first a dense MLP
    (3 x 2048 x 6144), 31 mixtures (64 x 3 x 2048 x 1408 experts, a 64 x 2048 router and its 64 biases, two shared
    experts 3 x 2048 x 2816), 2 x 200192 x 2048 embeddings and the final norm. (Its count against transformers':
    tests/test_flagships.py.)"""
    p = plan(dict(TRINITY_MINI), dtype="bfloat16", cpu_memory="2TB")
    per_layer = 5 * 2048**2 + 2 * 128 + 4 * 2048
    mixture = 64 * 3 * 2048 * 1408 + 64 * 2048 + 64 + 3 * 2048 * 2816
    assert p.parameters == 32 * per_layer + 3 * 2048 * 6144 + 31 * mixture + 2 * 200192 * 2048 + 2048


def test_support_lists_the_sandwich_norms_and_the_gate(models):
    rows = {r.name: r for r in models["base"].support(print_table=False).rows}
    assert rows["blocks.L.hook_attn_out"].reference == "model.layers.L.post_attention_layernorm"
    assert rows["blocks.L.ln2.hook_normalized"].reference == "model.layers.L.pre_mlp_layernorm"
    assert rows["blocks.L.hook_mlp_out"].reference == "model.layers.L.post_mlp_layernorm"
    assert rows["blocks.L.attn.hook_attn_gate"].reference == "model.layers.L.self_attn.gate_proj"


def test_embedded_default_and_verify():
    model = HookedTransformer.from_pretrained("tiny-afmoe", progress=False)
    assert type(model) is HookedAfmoe and model.cfg.embedding_multiplier == 8.0
    assert main(["verify", "tiny-afmoe"]) == 0
