"""FlexOlmo (OLMo-2's post-norm blocks, q/k norm over the whole projection, OLMo-2's norms and float32 rotary,
OLMoE's router) against transformers' own FlexOlmoForCausalLM on the same tiny checkpoints."""

import pytest
import torch

import tiny
import tiny_flex_olmo
from flagships import flagship
from family_harness import (
    MODEL_SITES, References, build_checkpoints, check_bit_exact, check_greedy_generation, check_report, copy_checkpoint,
    left_padded, rewrite_tensors, stored_keys, tokens,
)
from moelens import HookedTransformer
from moelens.cli import main
from moelens.loaders.errors import CheckpointError
from moelens.models.components.norm import CastAfterWeightRMSNorm
from moelens.models.components.post_norm_block import PostNormBlock
from moelens.models.components.rotary import Float32Rotary
from moelens.models.flex_olmo import HookedFlexOlmo, Olmo2ProjectionNormAttention
from moelens.plan import plan
from moelens.verify import compare

VARIANTS = [v for (_, v) in tiny_flex_olmo.VARIANTS]
PER_BLOCK = ("hook_resid_pre", "attn.hook_q", "attn.hook_k", "attn.hook_v", "ln1_post.hook_normalized", "hook_attn_out",
             "mlp.hook_router_logits", "mlp.hook_expert_weights", "mlp.hook_expert_indices", "mlp.hook_routed_out",
             "ln2_post.hook_normalized", "hook_mlp_out", "hook_resid_post")


@pytest.fixture(scope="module")
def checkpoints(tmp_path_factory):
    return build_checkpoints(tmp_path_factory, "flex_olmo", tiny_flex_olmo.VARIANTS)


@pytest.fixture(scope="module")
def models(checkpoints):
    return {v: HookedTransformer.from_pretrained(p, progress=False) for v, p in checkpoints.items()}


@pytest.fixture(scope="module")
def references(checkpoints):
    return References(checkpoints)


def test_variants_are_what_they_claim(models, checkpoints):
    base, bt = models["base"].cfg, models["biased_tied"].cfg
    assert base.n_kv_heads < base.n_heads and not base.norm_topk_prob and not base.qkv_bias
    assert bt.qkv_bias and bt.o_bias and bt.tie_word_embeddings and bt.norm_topk_prob and bt.n_kv_heads == bt.n_heads
    model = models["base"]
    assert type(model.rotary) is Float32Rotary and type(model.ln_final) is CastAfterWeightRMSNorm
    block = model.blocks[0]
    assert type(block) is PostNormBlock and type(block.attn) is Olmo2ProjectionNormAttention
    assert not hasattr(block, "ln1") and not hasattr(block, "ln2")
    assert type(block.ln1_post) is type(block.ln2_post) is type(block.attn.q_norm) is CastAfterWeightRMSNorm
    assert len(list(checkpoints["sharded"].glob("*.safetensors"))) > 1
    keys = stored_keys(checkpoints["fused"])
    assert "model.layers.0.mlp.experts.gate_up_proj" in keys and not any(".experts.0." in k for k in keys)


@pytest.mark.parametrize("variant", VARIANTS)
def test_float32_every_site(models, references, variant):
    model = models[variant]
    assert type(model) is HookedFlexOlmo
    check_report(compare_with(model, references[variant]), model, lambda layer: PER_BLOCK, model_sites=MODEL_SITES)


def compare_with(model, ref, *args):
    return compare(model, ref, tokens(), *args)


@pytest.mark.parametrize("variant", ["base", "biased_tied"])
def test_bfloat16_is_bit_exact(checkpoints, references, variant):
    """OLMo-2's norms (the weight times the float32 normed input, then the cast) and its float32 rotary, op for op."""
    model = HookedTransformer.from_pretrained(checkpoints[variant], dtype=torch.bfloat16, progress=False)
    check_bit_exact(compare_with(model, references(variant, torch.bfloat16)))


def test_post_norms_make_the_outputs_the_stream_adds(models):
    """resid_mid = resid_pre + ln1_post(attention output), resid_post = resid_mid + ln2_post(mixture output): the
    post-norms' outputs are hook_attn_out / hook_mlp_out, and the mixture reads the stream unnormed."""
    model = models["base"]
    _, cache = model.run_with_cache(tokens())
    for layer in range(model.cfg.n_layers):
        c = lambda name: cache[f"blocks.{layer}.{name}"]  # noqa: E731
        assert torch.equal(c("ln1_post.hook_normalized"), c("hook_attn_out"))
        assert torch.equal(c("ln2_post.hook_normalized"), c("hook_mlp_out"))
        assert torch.equal(c("hook_resid_mid"), c("hook_resid_pre") + c("hook_attn_out"))
        assert torch.equal(c("hook_resid_post"), c("hook_resid_mid") + c("hook_mlp_out"))
        router = model.blocks[layer].mlp.router
        torch.testing.assert_close(c("mlp.hook_router_logits"), c("hook_resid_mid") @ router.weight.T, rtol=0, atol=1e-5)
    # a hook that doubles ln1_post's scale halves what the attention adds
    with model.hooks([("blocks.0.ln1_post.hook_scale", lambda s, hook: 2 * s)]):
        _, edited = model.run_with_cache(tokens(), names_filter="blocks.0.hook_attn_out")
    torch.testing.assert_close(edited["blocks.0.hook_attn_out"], cache["blocks.0.hook_attn_out"] / 2, rtol=1e-6, atol=1e-7)


def test_decompositions_take_each_part_through_the_frozen_post_norm(models):
    """The cache's decompositions of post-norm blocks: each part (head, expert, neuron, o_proj bias) times the
    post-norm's weight over its cached scale, so the parts sum to the stream and, through the final norm, to the
    logits; the o_proj bias row and a projected stack written out by hand."""
    model = models["biased_tied"]  # o_proj biases, so the bias row goes through the post-norms too
    toks = tokens()
    with torch.no_grad():
        logits, cache = model.run_with_cache(toks)
    bias_by_hand = sum(b.attn.o_proj.bias.detach() * b.ln1_post.weight.detach() / cache[f"blocks.{l}.ln1_post.hook_scale"]
                       for l, b in enumerate(model.blocks))
    final = cache["resid_post", -1]
    answer = logits.gather(-1, toks[..., None])[..., 0]
    for expand in (False, True):
        stack, labels = cache.get_full_resid_decomposition(expand_neurons=expand, return_labels=True)
        torch.testing.assert_close(stack.sum(0), final, rtol=0, atol=1e-5)
        torch.testing.assert_close(stack[labels.index("bias")], bias_by_hand, rtol=0, atol=1e-6)
        torch.testing.assert_close(cache.logit_attrs(stack, toks).sum(0), answer, rtol=0, atol=1e-5)
    # a projection applies after the per-token factor: the same as projecting the full stack
    project = torch.randn(model.cfg.d_model, 3, generator=torch.Generator().manual_seed(0))
    full = cache.get_full_resid_decomposition(pos_slice=-1)
    projected = cache.get_full_resid_decomposition(pos_slice=-1, project_output_onto=project)
    torch.testing.assert_close(projected, full @ project, rtol=0, atol=1e-5)
    neurons = cache.stack_neuron_results(2, pos_slice=-1)
    torch.testing.assert_close(cache.stack_neuron_results(2, pos_slice=-1, project_output_onto=project), neurons @ project,
                               rtol=0, atol=1e-5)
    # the heads of block 0 with its bias are what block 0's attention adds
    heads, labels = cache.stack_head_results(layer=1, return_labels=True)
    b0 = model.blocks[0]
    bias0 = b0.attn.o_proj.bias.detach() * b0.ln1_post.weight.detach() / cache["blocks.0.ln1_post.hook_scale"]
    torch.testing.assert_close(heads.sum(0) + bias0, cache["attn_out", 0], rtol=0, atol=1e-5)
    # a post-norm block's sublayers read the stream itself: apply_ln there leaves the stack as it is
    assert torch.equal(cache.apply_ln_to_stack(heads, layer=1), heads)


@pytest.mark.parametrize("variant,padded", [("base", True), ("biased_tied", True)])
def test_greedy_generation_matches_transformers(models, references, variant, padded):
    prompt = left_padded(5, (3, 9), (0, 3, 1)) if padded else (tokens(5, (3, 9)), None)
    check_greedy_generation(models[variant], references[variant], *prompt, new=16)


def test_fold_ln_folds_the_final_norm_and_leaves_the_post_norms(checkpoints, models):
    """The sublayers read the stream unnormed: fold_ln has only ln_final to fold; the post-norms keep their weights;
    the logits are unchanged up to rounding."""
    folded = HookedTransformer.from_pretrained(checkpoints["base"], fold_ln=True, progress=False)
    base = models["base"]
    assert torch.equal(folded.ln_final.weight, torch.ones_like(folded.ln_final.weight))
    assert torch.equal(folded.blocks[1].ln2_post.weight, base.blocks[1].ln2_post.weight)
    with torch.no_grad():
        assert (folded(tokens()) - base(tokens())).abs().max() <= 1e-4


# ---- config spellings and refusals --------------------------------------------------------------------


def test_hub_config_spelling_loads_the_same_model(checkpoints, models, tmp_path):
    """rope_theta at the top level and the attribute_map's num_local_experts."""
    folder = copy_checkpoint(checkpoints, tmp_path)
    raw = tiny.json.loads((folder / "config.json").read_text())
    tiny.edit_config(folder, rope_parameters=None, rope_theta=raw["rope_parameters"]["rope_theta"], num_experts=None,
                     num_local_experts=8)
    model = HookedTransformer.from_pretrained(folder, progress=False)
    assert model.cfg == models["base"].cfg
    assert torch.equal(model(tokens()), models["base"](tokens()))


def test_config_refusals():
    raw = tiny_flex_olmo.flex_olmo_config().to_dict()
    for change, message in (
        ({"num_experts_per_tok": 9}, "num_experts_per_tok"),
        ({"num_local_experts": 16}, "num_experts = 8 and num_local_experts = 16 disagree"),
        ({"attention_bias": "no"}, "attention_bias"),
        ({"rope_parameters": {"rope_type": "default", "rope_theta": 1e4, "partial_rotary_factor": 0.5}},
         "partial_rotary_factor"),
        ({"rope_parameters": {"rope_type": "dynamic", "rope_theta": 1e4, "factor": 2.0}}, "rope type 'dynamic'"),
    ):
        with pytest.raises((ValueError, KeyError), match=message):
            HookedFlexOlmo.config_from_hf({**raw, **change})


@pytest.mark.parametrize("key", [
    "model.layers.0.post_attention_layernorm.weight",
    "model.layers.2.post_feedforward_layernorm.weight",
    "model.layers.1.self_attn.k_norm.weight",
    "model.layers.1.mlp.experts.5.gate_proj.weight",
])
def test_missing_tensor_is_named(checkpoints, tmp_path, key):
    folder = copy_checkpoint(checkpoints, tmp_path)
    rewrite_tensors(folder, lambda t: t.pop(key))
    with pytest.raises(CheckpointError, match="missing") as info:
        HookedTransformer.from_pretrained(folder, progress=False)
    assert key in str(info.value)


def test_a_pre_norm_is_refused(checkpoints, tmp_path):
    """FlexOlmo has no norm before attention (OLMoE's input_layernorm): a checkpoint with one is not FlexOlmo's."""
    folder = copy_checkpoint(checkpoints, tmp_path)
    rewrite_tensors(folder, lambda t: t.update({"model.layers.0.input_layernorm.weight": torch.ones(64)}))
    with pytest.raises(CheckpointError, match="unexpected .*input_layernorm"):
        HookedTransformer.from_pretrained(folder, progress=False)


# ---- plan, support, embedded default -------------------------------------------------------------------

FLEX_OLMO_7X7B = flagship("flex_olmo", "allenai/FlexOlmo-7x7B-1T")


def test_plan_at_full_size_by_hand():
    """32 x (4 x 4096^2 attention + 7 x 3 x 4096 x 11008 experts) + 2 x 100352 x 4096 embeddings, and the norms:
    per layer the q and k norms over the whole projection (2 x 4096) and the two post-norms (2 x 4096), and the final
    one. (Its counts against transformers' and the published total: tests/test_flagships.py.)"""
    p = plan(dict(FLEX_OLMO_7X7B), dtype="bfloat16", cpu_memory="2TB")
    weights = 32 * (4 * 4096**2 + 7 * 3 * 4096 * 11008 + 7 * 4096) + 2 * 100352 * 4096
    assert p.parameters == weights + 32 * 4 * 4096 + 4096


def test_support_lists_the_family_sites(models):
    table = models["base"].support(print_table=False)
    rows = {r.name: r for r in table.rows}
    assert rows["blocks.L.hook_attn_out"].reference == "model.layers.L.post_attention_layernorm"
    assert rows["blocks.L.ln2_post.hook_normalized"].reference == "model.layers.L.post_feedforward_layernorm"
    assert "blocks.L.ln1.hook_normalized" not in rows and "blocks.L.ln2.hook_normalized" not in rows


def test_verify_command_and_embedded_default(tmp_path, monkeypatch, capsys):
    monkeypatch.setattr("moelens.defaults.cache_root", lambda: tmp_path)
    model = HookedTransformer.from_pretrained("tiny-flex-olmo", progress=False)
    assert type(model) is HookedFlexOlmo and model.cfg.n_experts == 7
    logits = model("Hello, FlexOlmo")
    assert logits.shape[-1] == 260 and torch.isfinite(logits).all()
    assert main(["verify", "tiny-flex-olmo"]) == 0
    out = capsys.readouterr().out
    assert "float32: OK" in out and "bfloat16: OK" in out
