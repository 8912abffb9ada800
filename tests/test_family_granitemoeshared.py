"""Granite MoE with a shared MLP (HookedGraniteMoeShared): what differs from granitemoe. The generic suites
compare every site with transformers; here: the shared MLP's fused gate/up matrix by hand, the mixture output as
transformers adds it, the layout without a shared MLP, the weight views, and the plan's count."""

import pytest
import torch
import torch.nn.functional as F
import tiny_granitemoeshared
from family_harness import build_checkpoints, stored_keys, tokens

from moelens import HookedTransformer
from moelens.models.components import SparseMoe
from moelens.models.granitemoeshared import FusedSharedExpertMoe, HookedGraniteMoeShared
from moelens.plan import plan

M = tiny_granitemoeshared.MULTIPLIERS["residual_multiplier"]


@pytest.fixture(scope="module")
def ckpts(tmp_path_factory):
    wanted = {k: v for k, v in tiny_granitemoeshared.VARIANTS.items() if k[1] in ("base", "no_shared")}
    return build_checkpoints(tmp_path_factory, "granitemoeshared", wanted)


@pytest.fixture(scope="module")
def run(ckpts):
    model = HookedTransformer.from_pretrained(ckpts["base"], progress=False)
    with torch.no_grad():
        logits, cache = model.run_with_cache(tokens(shape=(2, 12)))
    return model, logits, cache


def test_variants_are_what_they_claim(ckpts):
    keys = stored_keys(ckpts["base"])
    assert "model.layers.0.shared_mlp.input_linear.weight" in keys  # the Hub's spelling, [2 * d_shared, d_model]
    assert not any("shared_mlp" in k for k in stored_keys(ckpts["no_shared"]))
    model = HookedTransformer.from_pretrained(ckpts["no_shared"], progress=False)
    assert model.cfg.d_shared == 0 and all(type(b.mlp) is SparseMoe for b in model.blocks)
    assert model.cfg.qkv_bias and model.cfg.tie_word_embeddings


def test_shared_mlp_by_hand(run):
    """gate and up are the two halves of one matrix (gate rows first); the mixture adds the shared output to the
    routed one, and the stream receives that sum times the residual multiplier."""
    model, _, cache = run
    for l, block in enumerate(model.blocks):
        assert type(block.mlp) is FusedSharedExpertMoe
        x = cache[f"blocks.{l}.ln2.hook_normalized"]
        W = block.mlp.shared_expert.gate_up_proj.weight  # [2 * d_shared, d_model]
        d = model.cfg.d_shared
        by_hand = F.linear(F.silu(x @ W[:d].T) * (x @ W[d:].T), block.mlp.shared_expert.down_proj.weight)
        assert torch.allclose(cache["shared_out", l], by_hand, atol=1e-5)
        assert torch.equal(cache["mlp_out", l], (cache["routed_out", l] + cache["shared_out", l]) * M)
        assert torch.allclose(cache[f"blocks.{l}.mlp.shared_expert.hook_pre"], x @ W[:d].T, atol=1e-6)
        assert torch.allclose(cache[f"blocks.{l}.mlp.shared_expert.hook_pre_linear"], x @ W[d:].T, atol=1e-6)


def test_weight_views_read_the_fused_rows(run):
    """W_shared_gate / W_shared_in are the gate and up rows of gate_up_proj, and fold_ln-style in-place edits of
    them reach the model's matrix."""
    model, _, _ = run
    W = model.blocks[1].mlp.shared_expert.gate_up_proj.weight
    d = model.cfg.d_shared
    assert torch.equal(model.W_shared_gate[1], W[:d].T) and torch.equal(model.W_shared_in[1], W[d:].T)
    assert model.blocks[1].mlp.shared_expert.up_proj.weight.data_ptr() == W[d:].data_ptr()


def test_decomposition_names_the_shared_expert(run):
    model, logits, cache = run
    stack, labels = cache.get_full_resid_decomposition(expand_neurons=False, return_labels=True)
    comp = dict(zip(labels, stack))
    assert torch.allclose(comp["L0.shared"], cache["shared_out", 0] * M, atol=1e-6)
    assert torch.allclose(stack.sum(0), cache["resid_post", -1], atol=1e-5)
    neurons = cache.get_neuron_results(0, shared=True).sum(-2)  # each shared neuron as the stream receives it
    assert torch.allclose(neurons, cache["shared_out", 0] * M, atol=1e-5)


def test_plan_counts_match_transformers():
    import transformers

    raw = {"model_type": "granitemoeshared", "hidden_size": 1024, "intermediate_size": 512,
           "shared_intermediate_size": 1024, "num_hidden_layers": 24, "num_attention_heads": 16,
           "num_key_value_heads": 8, "num_local_experts": 32, "num_experts_per_tok": 8, "vocab_size": 49155,
           "tie_word_embeddings": True, "embedding_multiplier": 12.0, "residual_multiplier": 0.22,
           "attention_multiplier": 0.015625, "logits_scaling": 6.0}
    hf_config = transformers.GraniteMoeSharedConfig(**{k: v for k, v in raw.items() if k != "model_type"})
    with torch.device("meta"):
        hf = transformers.GraniteMoeSharedForCausalLM(hf_config)
    assert plan(dict(raw), dtype="bfloat16", cpu_memory="1TB").parameters == sum(p.numel() for p in hf.parameters())
    cfg = HookedGraniteMoeShared.config_from_hf(dict(raw))
    assert cfg.d_shared == 1024


def test_negative_shared_width_is_named():
    with pytest.raises(ValueError, match="shared_intermediate_size"):
        HookedGraniteMoeShared.config_from_hf({"hidden_size": 64, "num_attention_heads": 4, "num_hidden_layers": 2,
                                               "vocab_size": 96, "shared_intermediate_size": -1})
