"""Errors that name what is at fault and what to do: a cache miss on a full hook name, an assignment to the
frozen cfg, bad arguments to the interventions and to from_pretrained."""

from __future__ import annotations

import dataclasses

import pytest

import moelens
import moelens.analysis


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


@pytest.mark.parametrize(
    "kwargs, error, match",
    [
        (dict(value="2"), TypeError, r"steer_router: value must be a real number, got str '2'"),
        (dict(value=float("nan")), ValueError, r"steer_router: value"),
        (dict(value=True), TypeError, r"steer_router: value"),
        (dict(expert="2"), TypeError, r"steer_router: expert must be an expert id"),
        (dict(expert=[1.5]), TypeError, r"steer_router: expert"),
        (dict(expert=[]), TypeError, r"steer_router: expert"),
        (dict(expert=99), IndexError, r"steer_router: expert: experts must lie in \[0, "),
    ],
)
def test_steer_router_names_a_bad_argument(trained, kwargs, error, match):
    args = dict(layers=1, expert=2, value=2.0) | kwargs
    with pytest.raises(error, match=match):
        moelens.analysis.steer_router(trained, "def f(x):", **args)


def test_steer_router_takes_numbers_of_any_kind(trained):
    import torch

    as_float = moelens.analysis.steer_router(trained, "def f(x):", layers=1, expert=2, value=2.0)
    for value in (2, torch.tensor(2.0)):
        other = moelens.analysis.steer_router(trained, "def f(x):", layers=1, expert=[2], value=value)
        assert torch.equal(other.logits, as_float.logits)


def test_force_route_names_bad_experts(trained):
    with pytest.raises(TypeError, match="force_route: experts"):
        moelens.analysis.force_route(trained, "def f(x):", layers=1, experts=["0", "1"])


def test_unknown_from_pretrained_keyword_suggests_the_closest():
    with pytest.raises(TypeError, match=r"dtyp \(did you mean dtype\?\)"):
        moelens.HookedTransformer.from_pretrained("tiny-code-moe", dtyp="bfloat16")


def test_kimi_k2_config_names_the_documented_mapping(tmp_path):
    import json
    import shutil

    from moelens.defaults import default_checkpoint
    from moelens.plan import plan

    folder = tmp_path / "kimi"
    shutil.copytree(default_checkpoint("tiny-deepseek-v3"), folder)
    config = json.loads((folder / "config.json").read_text())
    config["model_type"] = "kimi_k2"
    (folder / "config.json").write_text(json.dumps(config))
    for load in (lambda: moelens.HookedTransformer.from_pretrained(str(folder)), lambda: plan(config)):
        with pytest.raises(ValueError, match=r"'kimi_k2' is not supported.*DeepSeek-V3's architecture.*\"model_type\": \"deepseek_v3\""):
            load()
