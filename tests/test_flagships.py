"""Every registered family has its published checkpoints' config.json values at full size in
docs/families/flagships/<family>.json (tests/flagships.py reads them), and moelens.plan counts each of them as
transformers does: its model built on the meta device from the same config, every parameter and buffer, in all,
in bytes and block by block, and as the checkpoint's published total says."""

from __future__ import annotations

import re

import flagships
import pytest
import torch
from test_plan import hf_component, hf_weights

from moelens.families import FAMILIES as REGISTERED
from moelens.plan import plan

# a family's name is its module's, moelens/models/<name>.py (as tests/test_registry.py has it)
OWN_NAMES = sorted({cls.__module__.rsplit(".", 1)[1] for cls in REGISTERED.values()})
# Families with no published config.json in the tests (and no checkpoint's sizes in transformers' defaults):
# GraniteMoeShared's configuration names no checkpoint of its own, and its test's config is granite-3.0-1b-a400m
# with a shared MLP added, no published model.
WITHOUT_FLAGSHIP = {"granitemoeshared": "no published GraniteMoeShared config.json to copy"}
# Families whose transformers tensor names hf_component classifies (the others: gpt-oss's mlp.router, Granite's
# block_sparse_moe, Llama 4's feed_forward, the Gated DeltaNet and Mamba-2 mixers, LongCat-Flash's paired sublayers,
# the sparse attention's indexer, Phi-3.5-MoE's norms with bias): their plan's components against transformers'.
BY_COMPONENT = {"deepseek_v2", "deepseek_v3", "ernie4_5_moe", "flex_olmo", "glm4_moe", "glm4_moe_lite",
                "hunyuan_v1_moe", "minimax_m2", "mistral4", "mixtral", "olmoe", "qwen2_moe", "qwen3_moe", "solar_open"}
# Tensors transformers allocates that moelens's parameters do not hold, per (config, layer): LongCat-Flash's fused
# gate_up_proj has gate / up rows for its identity ("zero") experts too, which nothing reads; MiniMax's lightning
# layers keep their decay tables as buffers (slope_rate, query_decay, key_decay, diagonal_decay), which moelens
# derives from the config.
TRANSFORMERS_ONLY_PER_LAYER = {
    "longcat_flash": lambda c, layer: c["zero_expert_num"] * 2 * c["expert_ffn_hidden_size"] * c["hidden_size"],
    "minimax": lambda c, layer: (c["num_attention_heads"] * (1 + 2 * c["block_size"] + c["block_size"] ** 2)
                                 if c["layer_types"][layer] == "linear_attention" else 0),
}
LAYER = re.compile(r"^(?:(?:model\.|backbone\.)?layers|transformer\.blocks)\.(\d+)\.")  # DBRX: transformer.blocks


def file_params():
    return [pytest.param(name, marks=pytest.mark.xfail(strict=True, reason=WITHOUT_FLAGSHIP[name]))
            if name in WITHOUT_FLAGSHIP else name for name in OWN_NAMES]


@pytest.mark.parametrize("name", file_params())
def test_every_registered_family_has_a_flagship_file(name):
    assert flagships.path(name).exists(), (
        f"the registered family {name!r} has no flagship file: add {flagships.path(name).relative_to(flagships.ROOT)}, a JSON list of its published "
        f"checkpoints at full size, the flagship first, each {{\"checkpoint\": Hub id, \"published_billions\": total "
        f"as published, \"published_within_billions\": how far the count may be from it, \"config\": the Hub's "
        f"config.json values}} (see docs/contributing.md)"
    )
    assert flagships.entries(name)


def test_every_flagship_file_is_a_registered_family_s():
    stray = [n for n in flagships.names() if n not in OWN_NAMES or n in WITHOUT_FLAGSHIP]
    assert not stray, f"docs/families/flagships: files of no registered family (or listed as without one): {stray}"
    for name in flagships.names():
        for entry in flagships.entries(name):
            family = REGISTERED.get(entry["config"]["model_type"])
            assert family is not None and family.__module__ == f"moelens.models.{name}", (name, entry["checkpoint"])


def entry_params():
    return [pytest.param(name, entry, id=entry["checkpoint"])
            for name in flagships.names() for entry in flagships.entries(name)]


@pytest.mark.parametrize("name, entry", entry_params())
def test_counts_match_transformers_at_full_size(name, entry):
    config = entry["config"]
    hf = hf_weights(dict(config), torch.bfloat16)
    p = plan(dict(config), dtype="bfloat16", cpu_memory="2TB")
    layers = len(p.per_layer)
    extra = [TRANSFORMERS_ONLY_PER_LAYER.get(name, lambda c, layer: 0)(config, i) for i in range(layers)]
    assert p.parameters == sum(t.numel() for t in hf.values()) - sum(extra)
    assert p.bytes == sum(t.numel() * t.element_size() for t in hf.values()) - sum(extra) * 2  # bfloat16
    by_layer = dict.fromkeys(range(layers), 0)
    for n, t in hf.items():
        if match := LAYER.match(n):
            by_layer[int(match.group(1))] += t.numel()
    assert [layer.parameters for layer in p.per_layer] == [by_layer[i] - extra[i] for i in range(layers)]
    if "published_billions" in entry:
        assert abs(p.parameters / 1e9 - entry["published_billions"]) <= entry["published_within_billions"], (
            f"{p.parameters / 1e9:.3f}B counted, published {entry['published_billions']}B")
    if name in BY_COMPONENT:
        assert {hf_component(n) for n in hf} <= set(p.components)
        for component, count in p.components.items():
            mine = [t for n, t in hf.items() if hf_component(n) == component]
            assert count.parameters == sum(t.numel() for t in mine), component
            assert count.bytes == sum(t.numel() * t.element_size() for t in mine), component


def test_a_config_typed_wrong_fails_the_published_total():
    """The published total catches what transformers' count, built from the same wrong config, cannot."""
    entry = flagships.entries("mixtral")[0]
    wrong = plan(dict(entry["config"], num_hidden_layers=31), dtype="bfloat16", cpu_memory="2TB")
    assert abs(wrong.parameters / 1e9 - entry["published_billions"]) > entry["published_within_billions"]


def test_the_loader_names_what_is_wrong(tmp_path, monkeypatch):
    monkeypatch.setattr(flagships, "FOLDER", tmp_path)
    flagships._read.cache_clear()
    try:
        (tmp_path / "toy.json").write_text('[{"checkpoint": "a/b", "published_billions": 1, "config": {"model_type": "x"}}]')
        with pytest.raises(ValueError, match="toy.json, entry 0: published_billions and published_within_billions"):
            flagships.flagship("toy")
        with pytest.raises(FileNotFoundError, match="no flagship file for the family 'nothing'"):
            flagships.flagship("nothing")
    finally:
        flagships._read.cache_clear()


def test_flagship_returns_a_copy_and_names_a_missing_checkpoint():
    first = flagships.flagship("qwen2_moe")
    first["hidden_size"] = 1
    assert flagships.flagship("qwen2_moe", "Qwen/Qwen2-57B-A14B")["hidden_size"] == 3584
    with pytest.raises(KeyError, match="has no checkpoint 'Qwen/Qwen9'"):
        flagships.flagship("qwen2_moe", "Qwen/Qwen9")
