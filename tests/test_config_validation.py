"""config.json with wrong types or impossible values: refused at load, naming config.json, the field, the value
and what was expected; never a hang, a RecursionError or a failure at the first forward."""

import json
import shutil

import pytest

import tiny
import tiny_llama4_text
import tiny_qwen3_5_moe
from conftest import FAMILIES
from moelens import HookedTransformer
from moelens.config import HFConfig
from moelens.loaders.errors import CheckpointError
from moelens.models import FAMILIES as REGISTERED

# beside each family's base checkpoint (conftest's), the Hub's other spellings of a family
OTHER_SPELLINGS = {
    # text_config nested, keys under language_model.
    "llama4": lambda folder: tiny_llama4_text.hub_nested(tiny_llama4_text.build_llama4(folder, seed=0)),
    "qwen3_5_moe_text": lambda folder: tiny_qwen3_5_moe.build_text(folder, seed=0),
    "qwen3_5_moe": lambda folder: tiny_qwen3_5_moe.build_multimodal(folder, seed=0),  # text_config nested
}
CHECKPOINTS = sorted({*FAMILIES, *OTHER_SPELLINGS})


@pytest.fixture(scope="module")
def pristine(checkpoints, tmp_path_factory):
    root = tmp_path_factory.mktemp("config-validation")
    base = {family: checkpoints[family, "base"] for family in FAMILIES}
    return base | {name: build(root / name) for name, build in OTHER_SPELLINGS.items()}


@pytest.fixture
def edited(pristine, tmp_path):
    """edited(family, **changes): a copy of the family's tiny checkpoint with config.json changed (None: removed)."""

    def edit(family, **changes):
        folder = shutil.copytree(pristine[family], tmp_path / f"{family}-{len(list(tmp_path.iterdir()))}")
        tiny.edit_config(folder, **changes)
        return folder

    return edit


def refused(folder, *parts):
    with pytest.raises(CheckpointError) as info:
        HookedTransformer.from_pretrained(folder, progress=False)
    message = str(info.value)
    for part in ("config.json", *parts):
        assert part in message, f"{part!r} not in {message!r}"
    return message


@pytest.mark.parametrize("family", CHECKPOINTS)
def test_pristine_configs_load(pristine, family):
    HookedTransformer.from_pretrained(pristine[family], progress=False)


# ---- types: JSON ints are ints, bools are not numbers --------------------------------------------------------

QWEN_BAD = [
    ("hidden_size", "64", "'64'", "an integer"),
    ("hidden_size", True, "True", "an integer"),
    ("num_experts", 12.5, "12.5", "an integer"),
    ("num_experts_per_tok", 3.0, "3.0", "an integer"),
    ("num_experts_per_tok", 9, "9", "between 1 and 8"),
    ("num_hidden_layers", [3], "[3]", "an integer"),
    ("vocab_size", -3, "-3", ">= 1"),
    ("num_key_value_heads", 0, "0", ">= 1"),
    ("decoder_sparse_step", 0, "0", ">= 1"),
    ("head_dim", 0, "0", ">= 1"),
    ("max_position_embeddings", 256.0, "256.0", "an integer"),
    ("rms_norm_eps", -1e-6, "-1e-06", ">= 0"),
    ("rms_norm_eps", "1e-6", "'1e-6'", "a finite number"),
    ("rms_norm_eps", float("nan"), "nan", "a finite number"),
    ("qkv_bias", "yes", "'yes'", "true or false"),
    ("qkv_bias", 1, "1", "true or false"),
    ("hidden_act", 7, "7", "a string"),
    ("mlp_only_layers", 1, "1", "a list of integers"),
    ("rope_parameters", "yarn", "'yarn'", "a JSON object"),
    ("rope_parameters", [1, 2], "[1, 2]", "a JSON object"),
]


@pytest.mark.parametrize("field, value, shown, expected", QWEN_BAD, ids=[f"{f}={v!r}" for f, v, *_ in QWEN_BAD])
def test_qwen_field_of_wrong_type_or_range(edited, field, value, shown, expected):
    refused(edited("qwen2_moe", **{field: value}), field, f"= {shown} ", expected)


def test_list_entry_is_named_with_its_index(edited):
    refused(edited("qwen2_moe", mlp_only_layers=[0, "1"]), "mlp_only_layers[1]", "'1'", "an integer")
    refused(edited("qwen2_moe", mlp_only_layers=[5]), "mlp_only_layers[0]", "5", "between 0 and 2")


def test_heads_must_divide(edited):
    refused(edited("qwen2_moe", num_key_value_heads=3), "num_attention_heads (4)", "num_key_value_heads (3)")


def test_unknown_activation_is_a_config_error(edited):
    refused(edited("qwen2_moe", hidden_act="gelu_fancy"), "hidden_act", "'gelu_fancy'", "silu")


def test_model_type_that_is_not_a_string(edited):
    refused(edited("qwen2_moe", model_type=["qwen2_moe"]), "model_type", "['qwen2_moe']", "string")


@pytest.mark.parametrize(
    "changes, field, shown, expected",
    [
        ({"num_experts": "8"}, "num_experts", "'8'", "an integer"),
        ({"moe_topk": [2, 3.0, 1]}, "moe_topk[1]", "3.0", "an integer"),
        ({"moe_topk": [2, 9, 1]}, "moe_topk[1]", "9", "between 1 and 8"),
        ({"moe_topk": True}, "moe_topk", "True", "an integer"),
        ({"attention_bias": "false"}, "attention_bias", "'false'", "true or false"),
        ({"rope_parameters": {"rope_type": "dynamic", "alpha": -1.0}}, "rope_parameters.alpha", "-1.0", "> 0"),
    ],
)
def test_hunyuan_field_of_wrong_type_or_range(edited, changes, field, shown, expected):
    refused(edited("hunyuan_v1_moe", **changes), field, shown, expected)


# ---- rotary ---------------------------------------------------------------------------------------------------

YARN = {"rope_type": "yarn", "factor": 4.0, "original_max_position_embeddings": 16, "rope_theta": 10000.0}


@pytest.mark.parametrize(
    "changes, field, shown, expected",
    [
        ({"rope_parameters": {**YARN, "factor": 0}}, "rope_parameters.factor", "0", "> 0"),
        ({"rope_parameters": {**YARN, "factor": -2.0}}, "rope_parameters.factor", "-2.0", "> 0"),
        ({"rope_parameters": {**YARN, "rope_theta": 0.0}}, "rope_parameters.rope_theta", "0.0", "> 0"),
        ({"rope_parameters": {**YARN, "rope_theta": -1}}, "rope_parameters.rope_theta", "-1", "> 0"),
        ({"rope_parameters": {**YARN, "original_max_position_embeddings": 16.0}}, "original_max_position", "16.0", "integer"),
        ({"rope_parameters": {**YARN, "beta_fast": "32"}}, "rope_parameters.beta_fast", "'32'", "a finite number"),
        ({"rope_parameters": {**YARN, "rope_type": ["yarn"]}}, "rope_parameters.rope_type", "['yarn']", "a string"),
        ({"rope_parameters": {**YARN, "partial_rotary_factor": 1.5}}, "partial_rotary_factor", "1.5", "<= 1"),
        # the Hub's spelling: rope_theta at the top, the rest in rope_scaling
        ({"rope_parameters": None, "rope_theta": 0, "rope_scaling": {"type": "yarn"}}, "rope_theta", "0", "> 0"),
        ({"rope_parameters": None, "rope_scaling": {"type": "yarn", "factor": 0.0}}, "rope_scaling.factor", "0.0", "> 0"),
        ({"rope_parameters": None, "rope_scaling": "yarn"}, "rope_scaling", "'yarn'", "a JSON object"),
    ],
)
def test_solar_rope_values(edited, changes, field, shown, expected):
    refused(edited("solar_open", **changes), field, shown, expected)


def test_odd_number_of_rotated_dimensions(edited):
    # head_dim 16 x 0.5625 = 9: the rotary turns dimensions in pairs
    rope = {"rope_type": "default", "rope_theta": 500.0, "partial_rotary_factor": 0.5625}
    refused(edited("solar_open", rope_parameters=rope), "9 rotated dimensions", "even")


# ---- Solar's expert groups: what transformers' SolarOpenTopkRouter can run --------------------------------------


def test_zero_groups(edited):
    refused(edited("solar_open", n_group=0), "n_group", "= 0 ", ">= 1")


def test_topk_group_above_n_group(edited):
    refused(edited("solar_open", n_group=4, topk_group=5), "topk_group (5)", "n_group (4)")


def test_groups_must_split_the_experts(edited):
    refused(edited("solar_open", n_group=3, topk_group=2), "n_routed_experts (8)", "n_group (3)")


@pytest.mark.parametrize("n_experts, n_group", [(8, 8), (1, 1)])
def test_groups_of_one_expert(edited, n_experts, n_group):
    """A group is scored by the sum of its two best experts (topk(2) in transformers, even for one group)."""
    folder = edited("solar_open", n_routed_experts=n_experts, n_group=n_group, topk_group=1, num_experts_per_tok=1)
    refused(folder, "n_routed_experts / n_group", f"{n_experts} / {n_group} = 1", "at least 2")


def test_kept_groups_hold_fewer_experts_than_top_k(edited):
    # 4 groups of 2; keeping 1 group leaves 2 experts for num_experts_per_tok 3
    refused(edited("solar_open", n_group=4, topk_group=1), "num_experts_per_tok (3)", "topk_group (1)", "2 experts")


def test_kept_groups_holding_exactly_top_k_experts_load(edited):
    folder = edited("solar_open", n_group=4, topk_group=2, num_experts_per_tok=4)
    assert HookedTransformer.from_pretrained(folder, progress=False).cfg.top_k_per_layer[0] == 4


# ---- deep or self-referential structures -------------------------------------------------------------------------


def test_deeply_nested_config_is_refused_not_a_recursion_error(pristine, tmp_path):
    folder = shutil.copytree(pristine["qwen2_moe"], tmp_path / "deep")
    config = json.loads((folder / "config.json").read_text())
    depth = 100_000
    text = json.dumps(config)[:-1] + ', "text_config": ' + '{"text_config": ' * depth + "{}" + "}" * depth + "}"
    (folder / "config.json").write_text(text)
    refused(folder, "nested too deeply")


def test_deeply_nested_rope_type_is_named(edited):
    nested = "yarn"
    for _ in range(500):
        nested = {"rope_type": nested}
    folder = edited("solar_open", rope_parameters={**YARN, "rope_type": nested})
    message = refused(folder, "rope_parameters.rope_type", "a string")
    assert len(message) < 1000  # the bad value is abbreviated, not printed 500 levels deep


@pytest.mark.parametrize("family", CHECKPOINTS)
@pytest.mark.parametrize("section", ["rope_parameters", "rope_scaling", "text_config"])
def test_self_referential_config_neither_hangs_nor_recurses(pristine, family, section, monkeypatch):
    """A dict holding itself (impossible in JSON, possible from Python) is read like any other: each section is
    opened a bounded number of times (a reader that followed the cycle would open sections without end; the
    count turns that hang into a failure), and no RecursionError escapes."""
    raw = json.loads((pristine[family] / "config.json").read_text())
    raw[section] = raw
    opened = []
    init = HFConfig.__init__

    def counting_init(self, *args, **kwargs):
        opened.append(1)
        if len(opened) > 100:
            raise AssertionError(f"config_from_hf opened more than 100 config sections of {section}: it follows the cycle")
        init(self, *args, **kwargs)

    monkeypatch.setattr(HFConfig, "__init__", counting_init)
    try:
        REGISTERED[family].config_from_hf(raw)
    except (KeyError, ValueError) as err:
        assert len(str(err)) < 1000
    assert 1 <= len(opened) <= 20


# ---- HFConfig's typed reads, directly -----------------------------------------------------------------------------


def test_typed_reads():
    hf = HFConfig({"a": 3, "b": 2.5, "c": True, "d": None, "e": [1, 2], "f": {"g": 1.0}})
    assert hf.integer("a", at_least=1) == 3
    assert hf.number("a") == 3.0 and isinstance(hf.number("a"), float)  # a JSON int is a fine float
    assert hf.number("b", above=0) == 2.5
    assert hf.flag("c") is True
    assert hf.integer("d", 7) == 7  # null reads as absent
    assert hf.integers("e", at_least=0) == [1, 2]
    assert hf.per_layer("a", 2) == (3, 3) and hf.per_layer("e", 2) == (1, 2)
    assert hf.section("f").number("g") == 1.0 and hf.section("absent").raw == {}
    with pytest.raises(KeyError, match="'d'"):
        hf.integer("d")
    with pytest.raises(ValueError, match=r"c = True \(bool\); expected an integer"):
        hf.integer("c")
    with pytest.raises(ValueError, match=r"c = True \(bool\); expected a finite number"):
        hf.number("c")
    with pytest.raises(ValueError, match=r"f\.g = 1\.0 \(float\); expected an integer"):
        hf.section("f").integer("g")
    with pytest.raises(ValueError, match=r"e has 2 entries, expected one per layer \(3\)"):
        hf.per_layer("e", 3)
    assert hf.read == ["a", "b", "c", "d", "e", "f", "absent"]


def test_top_k_is_one_int_and_the_per_layer_tuple_has_its_own_name():
    """TransformerLens code does arithmetic with cfg.top_k: it is the mixture layers' k, an int, even with a
    dense first block; each block's (0 for a dense one) is cfg.top_k_per_layer."""
    import dataclasses

    from moelens import HookedTransformer

    cfg = HookedTransformer.from_pretrained("tiny-code-moe").cfg
    assert cfg.moe_layers == (False, True, True, True)
    assert type(cfg.top_k) is int and cfg.top_k == 2 and cfg.top_k * 3 == 6
    assert cfg.top_k_per_layer == (0, 2, 2, 2)
    uneven = dataclasses.replace(cfg, top_k_per_layer=(0, 2, 3, 2))  # Hunyuan's moe_topk may differ per layer
    with pytest.raises(ValueError, match=r"different numbers of experts \(\{1: 2, 2: 3, 3: 2\}\).*top_k_per_layer\[L\]"):
        uneven.top_k


# ---- nested sections (DBRX's attn_config / ffn_config): the message names the section and the field ----------------

DBRX_BAD = [
    ("ffn_config", "moe_num_experts", 2.5, "2.5", "an integer"),
    ("ffn_config", "moe_top_k", 0, "0", "between 1 and 8"),
    ("ffn_config", "moe_normalize_expert_weights", "2", "'2'", "a finite number"),
    ("attn_config", "kv_n_heads", "2", "'2'", "an integer"),
    ("attn_config", "clip_qkv", True, "True", "a finite number"),
]


@pytest.mark.parametrize("section, field, value, shown, expected", DBRX_BAD, ids=[f"{s}.{f}={v!r}" for s, f, v, *_ in DBRX_BAD])
def test_dbrx_nested_field_is_named_with_its_section(pristine, edited, section, field, value, shown, expected):
    config = json.loads((pristine["dbrx"] / "config.json").read_text())
    refused(edited("dbrx", **{section: {**config[section], field: value}}), f"{section}.{field}", f"= {shown} ", expected)
