"""Errors that name what is at fault and what to do: a cache miss on a full hook name, an assignment to the
frozen cfg, bad arguments to the interventions and to from_pretrained."""

from __future__ import annotations

import dataclasses

import pytest

import moelens


@pytest.fixture(scope="module")
def trained():
    return moelens.HookedTransformer.from_pretrained("tiny-code-moe")


@pytest.fixture(scope="module")
def cache(trained):
    return trained.run_with_cache("def f(x):")[1]


def test_full_name_miss_lists_similar_names_like_the_short_form(trained, cache):
    assert trained.cfg.moe_layers[1]  # block 1 is a mixture: it has no dense blocks.1.mlp.hook_pre
    messages = {}
    for key in ["blocks.1.mlp.hook_pre", ("pre", 1)]:
        with pytest.raises(KeyError) as err:
            cache[key]
        messages[key if isinstance(key, str) else "short"] = str(err.value)
    full = messages["blocks.1.mlp.hook_pre"]
    assert "names_filter" not in full, full  # nothing was filtered out: the model has no such site
    assert "no hook site" in full and "blocks.1.mlp.experts.hook_pre" in full, full
    assert messages["short"].split(" is not in this cache")[1] == full.split(" is not in this cache")[1]


def test_filtered_out_site_still_asks_about_names_filter(trained):
    _, filtered = trained.run_with_cache("def f(x):", names_filter=["blocks.0.hook_resid_pre"])
    with pytest.raises(KeyError, match="names_filter"):
        filtered["blocks.0.mlp.hook_pre"]  # block 0 is dense: the site exists, the filter left it out


@pytest.mark.parametrize("name", ["tiny-code-moe", "tiny-gpt-oss"])  # MoeConfig and a family's subclass
def test_assigning_a_frozen_cfg_field_points_to_its_setter(name):
    model = moelens.HookedTransformer.from_pretrained(name)
    with pytest.raises(dataclasses.FrozenInstanceError, match=r"cfg\.use_attn_result.*frozen.*set_use_attn_result\(True\)"):
        model.cfg.use_attn_result = True
    with pytest.raises(dataclasses.FrozenInstanceError, match=r"cfg\.d_model.*frozen.*dataclasses\.replace"):
        model.cfg.d_model = 8
    with pytest.raises(dataclasses.FrozenInstanceError, match=r"n_expert.*not one of its fields.*did you mean 'n_experts'"):
        model.cfg.n_expert = 8
    model.set_use_attn_result(True)  # the way that works
    assert model.cfg.use_attn_result
