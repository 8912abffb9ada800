"""Command-A MoE (cohere2_moe: parallel attention + mixture blocks under one bias-free Cohere LayerNorm, rotary
sliding layers beside NoPE full ones, logits times logit_scale) against transformers' own Cohere2MoeForCausalLM on
the same tiny checkpoints. The generic suites compare every site of the base checkpoint; here: what each variant
is, every site of each variant, bfloat16 bit for bit, generation across the window, the parallel block, the norm,
the rotary and the logits' scale by hand, the routers' weights by hand, the decompositions of a parallel block,
the refusals, and the embedded default."""

import math

import pytest
import torch
from transformers import Cohere2MoeConfig

import tiny_cohere2_moe
from family_harness import (
    ATTENTION_SITES, MODEL_SITES, ROUTER_SITES, References, build_checkpoints, check_bit_exact,
    check_greedy_generation, check_report, copy_checkpoint, left_padded, rewrite_tensors, stored_keys, tokens,
)
from moelens import HookedTransformer
from moelens.cli import main
from moelens.loaders.errors import CheckpointError
from moelens.models.cohere2_moe import (
    CohereLayerNorm, HookedCohere2Moe, PairRotaryAttention, ParallelBlock, SigmoidOfChosenLogitsRenormalised,
    TopKLogitsFloat32Softmax,
)
from moelens.models.components.attention import NoPositionAttention
from moelens.models.components.norm import RMSNorm
from moelens.verify import compare

VARIANTS = [v for (_, v) in tiny_cohere2_moe.VARIANTS]
# a parallel block: one norm, no resid_mid
PER_BLOCK = (*ATTENTION_SITES, "hook_resid_pre", "hook_attn_out", "hook_mlp_out", "hook_resid_post",
             "ln1.hook_normalized")
THETA = 1000.0  # the tiny configs' rope_theta
D_HEAD = 16


@pytest.fixture(scope="module")
def checkpoints(tmp_path_factory):
    return build_checkpoints(tmp_path_factory, "cohere2_moe", tiny_cohere2_moe.VARIANTS)


@pytest.fixture(scope="module")
def models(checkpoints):
    return {v: HookedTransformer.from_pretrained(p, progress=False) for v, p in checkpoints.items()}


@pytest.fixture(scope="module")
def references(checkpoints):
    return References(checkpoints)


@pytest.fixture(scope="module")
def base_run(models):
    model = models["base"]
    with torch.no_grad():
        logits, cache = model.run_with_cache(tokens(7, (2, 12)))
    return model, logits, cache


def test_variants_are_what_they_claim(models, checkpoints):
    base, sig, defaults = models["base"], models["sigmoid_shared"], models["defaults"]
    assert base.cfg.attention_windows == (None, 5, None, 5) and base.cfg.moe_layers == (False, True, True, True)
    assert base.cfg.rotary_layers == (True, True, False, True)  # the dense full layer rotated (force_rope)
    assert [type(b.attn) for b in base.blocks] == [PairRotaryAttention, PairRotaryAttention, NoPositionAttention,
                                                   PairRotaryAttention]
    assert all(type(b) is ParallelBlock and type(b.ln1) is CohereLayerNorm for b in base.blocks)
    assert all(not hasattr(b, "ln2") and not b.has_resid_mid for b in base.blocks)
    assert type(base.blocks[1].mlp.router) is TopKLogitsFloat32Softmax and base.cfg.tie_word_embeddings
    assert base.cfg.logit_scale == 0.125 and base.cfg.d_mlp == 48 and base.cfg.parallel_attn_mlp
    assert sig.cfg.rotary_layers == (False, True, False, True)  # prefix_dense_sliding_window_pattern 2
    assert type(sig.blocks[1].mlp.router) is SigmoidOfChosenLogitsRenormalised and sig.cfg.norm_topk_prob
    assert type(sig.ln_final) is RMSNorm and sig.cfg.norm_eps == 1e-6 and sig.cfg.d_shared == 32
    assert sig.cfg.qkv_bias and sig.cfg.o_bias and not sig.cfg.tie_word_embeddings
    assert defaults.cfg.attention_windows == (5, 5, 5, None) and defaults.cfg.moe_layers == (True,) * 4
    assert defaults.cfg.rotary_layers == (True, True, True, False)
    assert len(list(checkpoints["sharded"].glob("*.safetensors"))) > 1
    keys = stored_keys(checkpoints["fused"])
    assert "model.layers.1.mlp.experts.gate_up_proj" in keys and not any(".experts.0." in k for k in keys)
    assert "model.layers.1.mlp.shared_experts.gate_proj.weight" in stored_keys(checkpoints["sigmoid_shared"])


@pytest.mark.parametrize("variant", VARIANTS)
def test_float32_every_site(models, references, variant):
    model = models[variant]
    assert type(model) is HookedCohere2Moe
    report = compare(model, references[variant], tokens())
    check_report(report, model, lambda layer: PER_BLOCK + (ROUTER_SITES if model.cfg.moe_layers[layer] else ()),
                 model_sites=MODEL_SITES)


@pytest.mark.parametrize("variant", ["base", "sigmoid_shared", "defaults"])
def test_bfloat16_is_bit_exact(checkpoints, references, variant):
    model = HookedTransformer.from_pretrained(checkpoints[variant], dtype=torch.bfloat16, progress=False)
    check_bit_exact(compare(model, references(variant, torch.bfloat16), tokens()))


@pytest.mark.parametrize("variant,padded", [("base", True), ("sigmoid_shared", False)])
def test_greedy_generation_matches_transformers(models, references, variant, padded):
    """Past the window (5): the cached keys outside it are masked as transformers masks them."""
    prompt = left_padded(5, (3, 9), (0, 3, 1)) if padded else (tokens(5, (3, 9)), None)
    check_greedy_generation(models[variant], references[variant], *prompt, new=10)


def test_parallel_block_adds_both_sublayers_to_resid_pre(base_run):
    """resid_post = resid_pre + attn_out + mlp_out, bit for bit, and the mixture reads ln1(resid_pre): its router
    logits are ln1's output times the router's weight."""
    model, _, cache = base_run
    for layer, block in enumerate(model.blocks):
        pre, post = cache[f"blocks.{layer}.hook_resid_pre"], cache[f"blocks.{layer}.hook_resid_post"]
        assert torch.equal(post, pre + cache[f"blocks.{layer}.hook_attn_out"] + cache[f"blocks.{layer}.hook_mlp_out"])
        assert f"blocks.{layer}.hook_resid_mid" not in cache.cache_dict
        if model.cfg.moe_layers[layer]:
            normed = cache[f"blocks.{layer}.ln1.hook_normalized"].double()
            by_hand = normed @ block.mlp.router.weight.detach().double().T
            torch.testing.assert_close(cache[f"blocks.{layer}.mlp.hook_router_logits"].double(), by_hand,
                                       rtol=0, atol=1e-5)


def test_hook_mlp_in_reaches_the_feed_forward_alone(models):
    """With hook_mlp_in on, an edit of it changes the block's mlp_out and leaves its attn_out as it was."""
    model = models["base"]
    toks = tokens(7, (2, 12))
    model.set_use_hook_mlp_in(True)
    try:
        with torch.no_grad():
            _, plain = model.run_with_cache(toks, names_filter=lambda n: n.startswith("blocks.1."))
            assert torch.equal(plain["blocks.1.hook_mlp_in"], plain["blocks.1.hook_resid_pre"])
            with model.hooks(fwd_hooks=[("blocks.1.hook_mlp_in", lambda t, hook: t * 0.5)]):
                _, edited = model.run_with_cache(toks, names_filter=lambda n: n.startswith("blocks.1."))
    finally:
        model.set_use_hook_mlp_in(False)
    assert torch.equal(edited["blocks.1.hook_attn_out"], plain["blocks.1.hook_attn_out"])
    assert not torch.allclose(edited["blocks.1.hook_mlp_out"], plain["blocks.1.hook_mlp_out"])


def test_layer_norm_by_hand(base_run):
    """ln1: weight * (x - mean) / sqrt(var + 1e-5), no bias, from resid_pre."""
    model, _, cache = base_run
    for layer, block in enumerate(model.blocks):
        x = cache[f"blocks.{layer}.hook_resid_pre"].double()
        centred = x - x.mean(-1, keepdim=True)
        by_hand = block.ln1.weight.detach().double() * centred / (centred.pow(2).mean(-1, keepdim=True) + 1e-5).sqrt()
        torch.testing.assert_close(cache[f"blocks.{layer}.ln1.hook_normalized"].double(), by_hand, rtol=0, atol=1e-5)


def test_rotary_on_adjacent_pairs_and_none_on_the_full_mixture_layer(base_run):
    """Layer 2 (full, a mixture) has no positions: hook_rot_q is hook_q. The others turn each pair (q0, q1),
    (q2, q3), ... by position * theta^(-2i / d_head)."""
    model, _, cache = base_run
    positions = torch.arange(12, dtype=torch.float64)
    inv = 1.0 / THETA ** (torch.arange(0, D_HEAD, 2, dtype=torch.float64) / D_HEAD)
    angles = (positions[:, None] * inv)[None, :, None, :]  # [1 pos 1 pair]
    cos, sin = angles.cos(), angles.sin()
    for layer in range(model.cfg.n_layers):
        q, rot = cache[f"blocks.{layer}.attn.hook_q"].double(), cache[f"blocks.{layer}.attn.hook_rot_q"].double()
        if layer == 2:
            assert torch.equal(rot, q)
            continue
        even, odd = q[..., 0::2], q[..., 1::2]
        by_hand = torch.stack([even * cos - odd * sin, odd * cos + even * sin], -1).flatten(-2)
        torch.testing.assert_close(rot, by_hand, rtol=0, atol=1e-5)


def test_logits_are_times_logit_scale(base_run):
    model, logits, cache = base_run
    normed = cache["ln_final.hook_normalized"].double()
    by_hand = normed @ model.embed.weight.detach().double().T * 0.125  # the tied head
    torch.testing.assert_close(logits.double(), by_hand, rtol=0, atol=1e-5)


@pytest.mark.parametrize("variant", ["base", "sigmoid_shared"])
def test_router_weights_by_hand(models, variant):
    """softmax: a softmax over the chosen k logits; sigmoid: their sigmoids divided by their sum."""
    model = models[variant]
    with torch.no_grad():
        _, cache = model.run_with_cache(tokens(7, (2, 12)))
    for layer in model.cfg.moe_layer_indices:
        logits = cache[f"blocks.{layer}.mlp.hook_router_logits"].double()
        indices = cache[f"blocks.{layer}.mlp.hook_expert_indices"]
        assert torch.equal(indices, logits.topk(3, dim=-1).indices)
        chosen = logits.gather(-1, indices)
        if variant == "base":
            expected = chosen.softmax(-1)
        else:
            expected = chosen.sigmoid() / chosen.sigmoid().sum(-1, keepdim=True)
        torch.testing.assert_close(cache[f"blocks.{layer}.mlp.hook_expert_weights"].double(), expected, rtol=0,
                                   atol=1e-6)


def test_shared_expert_is_summed(models):
    model = models["sigmoid_shared"]
    with torch.no_grad():
        _, cache = model.run_with_cache(tokens(7, (2, 12)))
    for layer in model.cfg.moe_layer_indices:
        routed, shared = cache[f"blocks.{layer}.mlp.hook_routed_out"], cache[f"blocks.{layer}.mlp.hook_shared_out"]
        assert torch.equal(cache[f"blocks.{layer}.hook_mlp_out"], routed + shared)


def test_the_feed_forwards_input_is_resid_pre(models):
    """The decompositions of what a parallel block's mixture reads (mlp_input=True) stop at resid_pre: the block's
    own attention output is not in it, and the RMSNorm variant's scale is ln1's."""
    model = models["sigmoid_shared"]
    with torch.no_grad():
        _, cache = model.run_with_cache(tokens(7, (2, 12)))
    stack, labels = cache.decompose_resid(layer=2, mlp_input=True, apply_ln=False, return_labels=True)
    assert "2_attn_out" not in labels and labels[-1] == "1_mlp_out"
    torch.testing.assert_close(stack.sum(0), cache["blocks.2.hook_resid_pre"], rtol=0, atol=1e-5)
    acc, acc_labels = cache.accumulated_resid(layer=2, mlp_input=True, apply_ln=False, return_labels=True)
    assert torch.equal(acc[-1], cache["blocks.2.hook_resid_pre"])
    normed = cache.apply_ln_to_stack(cache["blocks.2.hook_resid_pre"][None], layer=2, mlp_input=True)[0]
    torch.testing.assert_close(normed, cache["blocks.2.ln1.hook_normalized"], rtol=0, atol=1e-5)


def test_default_layer_types_are_transformers(tmp_path):
    """Without layer_types / mlp_layer_types: transformers' patterns from first_k_dense_replace and the two
    window patterns (the oracle: its config class)."""
    kwargs = dict(num_hidden_layers=7, prefix_dense_sliding_window_pattern=2, sliding_window_pattern=3,
                  first_k_dense_replace=3, num_attention_heads=4, hidden_size=64, vocab_size=96, head_dim=16)
    theirs = Cohere2MoeConfig(**kwargs)
    raw = {k: v for k, v in kwargs.items() if k != "first_k_dense_replace"}
    cfg = HookedCohere2Moe.config_from_hf({**raw, "first_k_dense_replace": 3})
    windows = tuple(4096 if t == "sliding_attention" else None for t in theirs.layer_types)
    assert cfg.attention_windows == windows
    assert cfg.moe_layers == tuple(t == "sparse" for t in theirs.mlp_layer_types)
    assert theirs.mlp_layer_types[:3] == ["dense"] * 3 and "full_attention" in theirs.layer_types[:3]


def test_refusals_name_the_field():
    raw = tiny_cohere2_moe.cohere2_moe_config().to_dict()
    for change, message in (
        ({"num_shared_experts": 1}, "shared_expert_combination_strategy = 'average' with num_shared_experts = 1"),
        ({"shared_expert_combination_strategy": "max"}, "shared_expert_combination_strategy = 'max'"),
        ({"expert_selection_fn": "sparsemixer"}, "expert_selection_fn = 'sparsemixer'"),
        ({"sliding_window": None}, "sliding_window = null"),
        ({"rope_parameters": {"rope_type": "default", "rope_theta": 1e4, "partial_rotary_factor": 0.5}},
         "partial_rotary_factor = 0.5"),
        ({"layer_types": ["sliding_attention"] * 3}, "layer_types must list 4 entries"),
        ({"mlp_layer_types": ["dense", "moe", "sparse", "sparse"]}, "mlp_layer_types must list 4 entries"),
        ({"mlp_layer_types": ["dense"] * 4}, "every block a dense MLP"),
        ({"logit_scale": 0}, "logit_scale = 0"),
    ):
        with pytest.raises(ValueError, match=message):
            HookedCohere2Moe.config_from_hf({**raw, **change})


@pytest.mark.parametrize("key", ["model.layers.1.input_layernorm.weight", "model.layers.0.mlp.up_proj.weight",
                                 "model.layers.2.mlp.experts.4.down_proj.weight", "model.layers.3.mlp.gate.weight"])
def test_missing_tensor_is_named(checkpoints, tmp_path, key):
    folder = copy_checkpoint(checkpoints, tmp_path)
    rewrite_tensors(folder, lambda t: t.pop(key))
    with pytest.raises(CheckpointError, match="missing") as info:
        HookedTransformer.from_pretrained(folder, progress=False)
    assert key in str(info.value)


def test_verify_command_and_embedded_default(tmp_path, monkeypatch, capsys):
    monkeypatch.setattr("moelens.defaults.cache_root", lambda: tmp_path)
    model = HookedTransformer.from_pretrained("tiny-cohere2-moe", progress=False)
    assert type(model) is HookedCohere2Moe and model.cfg.attention_windows == (None, 8, 8, None)
    assert model.cfg.rotary_layers == (True, True, True, False) and math.isclose(model.cfg.logit_scale, 0.0625)
    assert main(["verify", "tiny-cohere2-moe"]) == 0
    out = capsys.readouterr().out
    assert "float32: OK" in out and "bfloat16: OK" in out
