"""Absurd or wrong sizes in config.json: loading checks them against the checkpoint's own tensors (safetensors
headers) before anything per layer or per expert is built, naming the field, its value and the tensor that
contradicts it; `moelens plan`, which has no weights to compare with, bounds them. Each is one line from the
command. That nothing is built first is checked by making the builders fail, not by timing."""

import json
import shutil

import pytest
import tiny

from moelens import HookedTransformer, defaults, pretrained
from moelens import plan as plan_module
from moelens.cli import main
from moelens.loaders.errors import CheckpointError
from moelens.models.qwen2_moe import HookedQwen2Moe

HUGE = {"num_experts": 10**9, "num_hidden_layers": 10**9, "vocab_size": 10**11, "hidden_size": 10**15}


@pytest.fixture
def checkpoint(tmp_path):
    """edit(**changes): a copy of the embedded tiny Qwen2-MoE (4 layers, 8 experts, vocab 260, d_model 64)."""
    source = defaults.default_checkpoint("tiny-qwen2-moe")

    def edit(fused=False, **changes):
        folder = shutil.copytree(source, tmp_path / f"ckpt{len(list(tmp_path.iterdir()))}")
        if fused:
            tiny.fuse_experts(folder)
        tiny.edit_config(folder, **changes)
        return folder

    return edit


def forbid(monkeypatch, owner, *names):
    for name in names:
        def fail(*args, _name=name, **kwargs):
            raise AssertionError(f"{_name} ran before the sizes were checked")

        monkeypatch.setattr(owner, name, fail)


@pytest.mark.parametrize("field", HUGE)
def test_an_absurd_size_is_refused_before_the_config_is_built(checkpoint, monkeypatch, field):
    folder = checkpoint(**{field: HUGE[field]})
    forbid(monkeypatch, HookedQwen2Moe, "config_from_hf", "site_map", "build")
    with pytest.raises(CheckpointError) as info:
        HookedTransformer.from_pretrained(folder, progress=False)
    message = str(info.value)
    assert f"config.json: {field} = {HUGE[field]:,}, but" in message and "\n" not in message
    # the evidence: the largest tensor (for a width) or the tensor count (for a count), with its shape
    assert "largest dimension is 260" in message and "(260, 64)" in message


@pytest.mark.parametrize(
    "changes, message",
    [
        ({"num_experts": 16}, "num_experts = 16, but layer 0 of the checkpoint stores 8 experts (experts 0 to 7; "
                              "no 'model.layers.0.mlp.experts.8.gate_proj.weight')"),
        ({"num_experts": 4}, "num_experts = 4, but layer 0 of the checkpoint stores 8 experts"),
        ({"num_hidden_layers": 5}, "num_hidden_layers = 5, but the checkpoint"),
        ({"vocab_size": 200}, "vocab_size = 200, but the checkpoint's embedding 'model.embed_tokens.weight' has shape (260, 64)"),
        ({"num_experts": 16, "fused": True},
         "num_experts = 16, but layer 0's 'model.layers.0.mlp.experts.gate_up_proj' has shape (8, 64, 64) (8 experts)"),
    ],
)
def test_a_wrong_count_names_the_tensor_before_the_key_map_or_the_model(checkpoint, monkeypatch, changes, message):
    folder = checkpoint(**changes)
    forbid(monkeypatch, HookedQwen2Moe, "build")
    forbid(monkeypatch, pretrained, "key_map")  # lists every expert's tensors
    with pytest.raises(CheckpointError, match=None) as info:
        HookedTransformer.from_pretrained(folder, progress=False)
    assert message in str(info.value)


def test_layers_named_by_the_last_one_present(checkpoint):
    with pytest.raises(CheckpointError) as info:
        HookedTransformer.from_pretrained(checkpoint(num_hidden_layers=5), progress=False)
    assert "holds layers 0 to 3 (no 'model.layers.4.input_layernorm.weight')" in str(info.value)


def test_a_wrong_width_is_refused_before_memory_is_allocated(checkpoint, monkeypatch):
    """An expert width the config inflates (2**20 rows per expert: gigabytes) fails on the headers."""
    forbid(monkeypatch, pretrained, "materialize")
    with pytest.raises(CheckpointError, match=r"'model.layers.0.mlp.experts.0.gate_proj.weight' has shape \(32, 64\), but "
                                              r"the config .* needs \(1048576, 64\)"):
        HookedTransformer.from_pretrained(checkpoint(moe_intermediate_size=2**20), progress=False)


def test_the_command_says_it_in_one_line(checkpoint, capsys):
    assert main(["inspect", str(checkpoint(num_experts=10**9))]) == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and "num_experts = 1,000,000,000, but" in err


# ---- moelens plan: sane bounds -----------------------------------------------------------------------------------

PLAN_BAD = [
    ("hidden_size", 10**15, "hidden_size = 1,000,000,000,000,000: more than moelens accepts for it (131,072"),
    ("vocab_size", 1e38, "vocab_size = 1e+38 (float); expected an integer"),
    ("vocab_size", 10**11, "vocab_size = 100,000,000,000: more than moelens accepts for it (4,194,304"),
    ("num_experts", 10**9, "num_experts = 1,000,000,000: more than moelens accepts for it (16,384"),
    ("num_hidden_layers", 10**9, "num_hidden_layers = 1,000,000,000: more than moelens accepts for it (1,024"),
]


@pytest.mark.parametrize("field, value, message", PLAN_BAD, ids=[f"{f}={v}" for f, v, _ in PLAN_BAD])
def test_plan_bounds_each_size(tmp_path, monkeypatch, capsys, field, value, message):
    config = json.loads((defaults.default_checkpoint("tiny-qwen2-moe") / "config.json").read_text())
    path = tmp_path / "config.json"
    path.write_text(json.dumps({**config, field: value}))
    forbid(monkeypatch, plan_module, "build_meta_model")
    assert main(["plan", str(path)]) == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and message in err


def test_plan_bounds_layers_times_experts(monkeypatch):
    config = json.loads((defaults.default_checkpoint("tiny-qwen2-moe") / "config.json").read_text())
    forbid(monkeypatch, plan_module, "build_meta_model")
    with pytest.raises(CheckpointError, match=r"1,024 mixture layers x 16,384 experts = 16,777,216 experts in all"):
        plan_module.plan({**config, "num_hidden_layers": 1024, "num_experts": 16384})


def test_plan_bounds_the_gpu_count(monkeypatch, capsys):
    forbid(monkeypatch, plan_module, "Device")
    assert main(["plan", "tiny-qwen2-moe", "--gpus", "100000000", "--gpu-memory", "80GB"]) == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and "gpus = 100,000,000: moelens plans for at most 4,096 GPUs" in err
