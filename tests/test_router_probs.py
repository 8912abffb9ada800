"""blocks.L.mlp.hook_router_probs: one distribution over the experts for every family (hook_router_scores is
what each family's rule computes: softmax scores, sigmoid scores or logits). Oracle: the definition written
out here, applied to transformers' own router logits on the same checkpoint."""

import pytest
import torch
from conftest import FAMILIES, family_fact, lineage

from moelens import HookedTransformer
from moelens.hooks.sites import SITE_BY_NAME
from moelens.verify import load_reference, reference_forward


def softmax(logits: torch.Tensor) -> torch.Tensor:
    return logits.double().softmax(-1)


def normalised_sigmoid(logits: torch.Tensor) -> torch.Tensor:
    scores = logits.double().sigmoid()
    return scores / scores.sum(-1, keepdim=True)


# each family's documented definition of hook_router_probs, from its router logits
DEFINITION = {
    "qwen2_moe": softmax, "hunyuan_v1_moe": softmax, "qwen3_moe": softmax, "mixtral": softmax, "olmoe": softmax,
    "gpt_oss": softmax,  # its scores are the logits; the weights are a softmax over the chosen k only
    "solar_open": normalised_sigmoid, "deepseek_v3": normalised_sigmoid, "glm4_moe": normalised_sigmoid,
    "minimax_m2": normalised_sigmoid, "deepseek_v32": normalised_sigmoid, "glm_moe_dsa": normalised_sigmoid,
    "llama4_text": normalised_sigmoid,  # its scores are the logits; each chosen one's weight is its sigmoid
    "qwen3_next": softmax, "qwen3_5_moe": softmax, "nemotron_h": normalised_sigmoid,
    "deepseek_v2": softmax, "glm4_moe_lite": normalised_sigmoid, "ernie4_5_moe": softmax,
    "granitemoe": softmax,  # its scores are the logits; the weights are a softmax over the chosen k only
    "granitemoeshared": softmax,
    "longcat_flash": softmax,  # over the real and the identity experts
    "phimoe": softmax,  # its scores are the logits; each slot's weight is a softmax over the logits near its own
    "flex_olmo": softmax,
    "mistral4": softmax,  # in the model's dtype; DeepSeek-V3's blocks, not its sigmoid router
    "afmoe": normalised_sigmoid,
    "kolibri1": normalised_sigmoid,  # its scores are the logits; each chosen one's sigmoid is its weight
    "aria_text": softmax,
    "mellum": softmax,  # its scores are the logits; the weights are a softmax over the chosen k only
    "dbrx": softmax,  # in the model's dtype; hook_router_probs is float32
    "lfm2_moe": normalised_sigmoid,  # its scores in the model's dtype; hook_router_probs is float32
    "beam": normalised_sigmoid,
    "jamba": softmax,
    "lara_mini": softmax,  # of float32 logits
    "flint": normalised_sigmoid,
    "mimo_v2_flash": normalised_sigmoid,
    "cohere2_moe": softmax,  # its scores are the logits; the weights are a softmax over the chosen k only
}
# what hook_router_scores holds, per family: the support() row says it
SCORES_SAY = {softmax: "softmax of the logits", normalised_sigmoid: "sigmoid of each logit"}


def test_every_family_has_a_definition():
    assert set(DEFINITION) <= set(FAMILIES)
    for family in FAMILIES:
        assert family_fact(DEFINITION, family) in SCORES_SAY, family


@pytest.mark.parametrize("family", FAMILIES)
def test_router_probs_are_the_documented_distribution_of_transformers_logits(checkpoints, family, tokens):
    path = checkpoints[family, "base"]
    model = HookedTransformer.from_pretrained(path, progress=False)
    references = [r for r in type(model).site_map(model.cfg).references if r.hook.endswith("mlp.hook_router_logits")]
    assert len(references) == len(model.cfg.moe_layer_indices) > 0
    _, theirs = reference_forward(load_reference(path), references, tokens)
    with torch.no_grad():
        _, cache = model.run_with_cache(tokens, names_filter=lambda name: name.endswith("hook_router_probs"))
    assert len(cache.cache_dict) == len(references)
    for layer in model.cfg.moe_layer_indices:
        probs = cache["router_probs", layer]
        assert probs.shape == (*tokens.shape, model.cfg.n_routable_experts) and probs.dtype == torch.float32
        torch.testing.assert_close(probs.double().sum(-1), torch.ones(tokens.shape, dtype=torch.float64), rtol=0, atol=1e-6)
        logits = theirs[f"blocks.{layer}.mlp.hook_router_logits"].reshape(probs.shape)
        torch.testing.assert_close(probs.double(), family_fact(DEFINITION, family)(logits), rtol=0, atol=1e-6)


@pytest.mark.parametrize("family", FAMILIES)
def test_support_says_what_the_scores_and_the_probs_are(family_models, family):
    rows = {row.name: row for row in family_models[family].support().rows}
    probs, scores = rows["blocks.L.mlp.hook_router_probs"], rows["blocks.L.mlp.hook_router_scores"]
    assert "distribution over the experts" in probs.meaning and "observation only" in probs.meaning
    if any(n in ("gpt_oss", "llama4_text", "granitemoe", "granitemoeshared", "kolibri1", "aria_text", "cohere2_moe") for n in lineage(family)):  # top-k on the logits (Kolibri 1: biased)
        assert scores.meaning.startswith("the logits the top-k is taken on")
    elif family == "phimoe":  # the sparsemixer chooses slot by slot on the logits
        assert scores.meaning.startswith("the logits the slots are chosen on")
    else:
        assert scores.meaning.startswith(SCORES_SAY[family_fact(DEFINITION, family)])
    assert SITE_BY_NAME["blocks.L.mlp.hook_router_probs"].observed
    assert not SITE_BY_NAME["blocks.L.mlp.hook_router_scores"].observed


@pytest.mark.parametrize("family", FAMILIES)
def test_editing_router_probs_changes_no_routing_but_reaches_the_cache(family_models, family, tokens):
    """An observation site: an edit, returned or in place, is what later hooks and the cache see, and the
    routing and the logits stay those of the unhooked run."""
    model = family_models[family]
    layer = model.cfg.moe_layer_indices[0]
    name = f"blocks.{layer}.mlp.hook_router_probs"
    with torch.no_grad():
        plain_logits, plain = model.run_with_cache(tokens, names_filter=[name, f"blocks.{layer}.mlp.hook_expert_indices"])

        def in_place(t, hook):
            t.mul_(0).add_(1.0 / t.shape[-1])

        for edit in (in_place, lambda t, hook: torch.full_like(t, 1.0 / t.shape[-1])):
            with model.hooks(fwd_hooks=[(name, edit)]):
                logits, cache = model.run_with_cache(tokens, names_filter=[name, f"blocks.{layer}.mlp.hook_expert_indices"])
            assert torch.equal(logits, plain_logits)
            assert torch.equal(cache["expert_indices", layer], plain["expert_indices", layer])
            assert torch.all(cache[name] == 1.0 / model.cfg.n_routable_experts) and not torch.equal(cache[name], plain[name])
