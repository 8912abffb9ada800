"""The keys TransformerLens's ActivationCache.__getitem__ takes (a full name, else utils.get_act_name(key) for a
str and get_act_name(*key) for a tuple, a negative layer counted from the end), and names_filter with a name
the model lacks: TransformerLens's get_caching_hooks turns a list into `name in list` and silently caches
nothing for an unknown name; moelens refuses it, naming it (see README, Differences from TransformerLens).
The expected full names are written out by hand from TransformerLens's rules."""

from __future__ import annotations

import pytest
import torch

from moelens import HookedTransformer

N_LAYERS = 4  # tiny-qwen2-moe


@pytest.fixture(scope="module")
def model() -> HookedTransformer:
    return HookedTransformer.from_pretrained("tiny-qwen2-moe", progress=False)


@pytest.fixture(scope="module")
def cache(model):
    with torch.no_grad():
        return model.run_with_cache(model.to_tokens("Hello there"))[1]


@pytest.mark.parametrize(
    "key, full",
    [
        ("blocks.1.hook_resid_pre", "blocks.1.hook_resid_pre"),
        ("k1", "blocks.1.attn.hook_k"),  # compact: name, layer
        ("scale2ln1", "blocks.2.ln1.hook_scale"),  # compact: name, layer, layer type
        ("normalized3ln2", "blocks.3.ln2.hook_normalized"),
        ("embed", "hook_embed"),
        ("scale", "ln_final.hook_scale"),  # scale / normalized without a layer: the final norm's
        ("normalized", "ln_final.hook_normalized"),
        (("resid_pre", 3), "blocks.3.hook_resid_pre"),
        (("resid_post", -1), f"blocks.{N_LAYERS - 1}.hook_resid_post"),  # negative layers from the end
        (("q", 2, "attn"), "blocks.2.attn.hook_q"),
        (("q", 2, "a"), "blocks.2.attn.hook_q"),
        (("pattern", -2, "a"), f"blocks.{N_LAYERS - 2}.attn.hook_pattern"),
        (("attn", 0), "blocks.0.attn.hook_pattern"),  # TL's alias: attn -> pattern
        (("attn_logits", 1), "blocks.1.attn.hook_attn_scores"),
        (("key", 0), "blocks.0.attn.hook_k"),
        (("value", 0), "blocks.0.attn.hook_v"),
        (("query", 0), "blocks.0.attn.hook_q"),
        (("rot_k", 1), "blocks.1.attn.hook_rot_k"),
        (("z", 1), "blocks.1.attn.hook_z"),
        (("normalized", 1, "ln1"), "blocks.1.ln1.hook_normalized"),
        (("scale", 0, "ln2"), "blocks.0.ln2.hook_scale"),
        (("embed",), "hook_embed"),
        (("attn_out", 2), "blocks.2.hook_attn_out"),
        (("mlp_out", -1), f"blocks.{N_LAYERS - 1}.hook_mlp_out"),
        # moelens's own aliases keep working
        (("router_logits", 1), "blocks.1.mlp.hook_router_logits"),
        (("layer_output", 0), "blocks.0.hook_resid_post"),
        (("expert_indices", -1), f"blocks.{N_LAYERS - 1}.mlp.hook_expert_indices"),
    ],
)
def test_transformer_lens_cache_keys(cache, key, full):
    assert cache[key] is cache.cache_dict[full]
    assert key in cache


def test_a_per_block_name_without_a_layer_asks_for_one(cache):
    with pytest.raises(KeyError, match=r"'resid_pre' is a per-block site: give a layer"):
        cache["resid_pre"]
    assert "resid_pre" not in cache


def test_a_key_that_is_not_cached_says_so(model):
    with torch.no_grad():
        _, cache = model.run_with_cache(model.to_tokens("Hi"), names_filter=["blocks.0.hook_resid_pre"])
    with pytest.raises(KeyError, match=r"blocks.1.attn.hook_k.*not in this cache"):
        cache["k1"]
    with pytest.raises(KeyError, match=r"hook_result\) is not in this cache.*set_use_attn_result\(True\)"):
        cache["result", 0]
    with pytest.raises(KeyError, match="cache keys are a hook name or"):
        cache[3]


def test_names_filter_with_a_name_the_model_lacks_is_refused_naming_it(model):
    """TransformerLens would cache the names it knows and skip this one silently; moelens's lookups refuse a
    name the model lacks, so a misspelt site cannot leave an analysis quietly empty."""
    tokens = model.to_tokens("Hi")
    with pytest.raises(KeyError, match=r"no hook point named 'blocks.0.hook_resid_pree'"):
        model.run_with_cache(tokens, names_filter=["blocks.0.hook_resid_pre", "blocks.0.hook_resid_pree"])
    with pytest.raises(KeyError, match=r"no hook point named 'blocks.9.hook_resid_pre'"):
        model.run_with_cache(tokens, names_filter="blocks.9.hook_resid_pre")
    with torch.no_grad():
        _, cache = model.run_with_cache(tokens, names_filter=lambda name: name == "not a hook")
    assert len(cache) == 0  # a predicate selects what it selects, as in TransformerLens
