"""moelens.plan and `moelens plan`: counts against transformers' own models (tiny checkpoints here; every
published config at full size in tests/test_flagships.py), the placement options against their memory budgets,
and the command."""

import json
import math
import shutil
from pathlib import Path

import huggingface_hub.constants as hub_constants
import pytest
import torch
from flagships import entries, flagship

from moelens.cli import main
from moelens.plan import parse_size, plan
from moelens.verify import causal_lm_class

# The seed checkpoints at full size (their config.json values: docs/families/flagships/)
SOLAR = flagship("solar_open")
QWEN15_MOE = flagship("qwen2_moe", "Qwen/Qwen1.5-MoE-A2.7B")
QWEN2_57B = flagship("qwen2_moe", "Qwen/Qwen2-57B-A14B")


def hf_component(name: str) -> str:
    """Component of a transformers parameter or buffer, from transformers' module names."""
    if "embed_tokens" in name:
        return "embeddings"
    if name.startswith("lm_head"):
        return "unembedding"
    if name.split(".")[-2].endswith("norm"):  # input_layernorm, post_attention_layernorm, norm, q/k layernorms
        return "norms"
    if ".self_attn." in name:
        return "attention"
    if ".mlp.gate." in name or name.endswith(".mlp.e_score_correction_bias"):  # MiniMax's bias sits beside the gate
        return "routers"
    if ".mlp.experts." in name:
        return "routed_experts"
    if ".mlp.shared_expert" in name or ".mlp.shared_mlp." in name:  # incl. Qwen's shared_expert_gate
        return "shared_experts"
    if ".mlp." in name:
        return "dense_mlp"
    raise AssertionError(f"unclassified transformers tensor {name}")


def hf_weights(config: dict, dtype: torch.dtype) -> dict[str, torch.Tensor]:
    """transformers' model on the meta device, built as from_pretrained(dtype=...) builds it: under the default
    dtype (modules that ask for float32 keep it) and with _keep_in_fp32_modules_strict upcast. Every weight:
    parameters (tied ones once) and buffers except the rotary's."""
    import transformers

    # as transformers reads a config.json file: its tagged floats ({"__float__": "Infinity"}) decoded
    hf_config = transformers.AutoConfig.for_model(**transformers.PreTrainedConfig._decode_special_floats(config))
    cls = causal_lm_class(hf_config)  # AutoModelForCausalLM's class, or Mistral 4's, which it does not map
    default = torch.get_default_dtype()
    torch.set_default_dtype(dtype)
    try:
        with torch.device("meta"):
            model = cls(hf_config)
    finally:
        torch.set_default_dtype(default)
    keep = getattr(model, "_keep_in_fp32_modules_strict", None) or []
    # the rotary's buffers (under rotary_emb, or LFM2's pos_emb: inv_freq, original_inv_freq) are no checkpoint's
    tensors = dict(model.named_parameters()) | {
        n: b for n, b in model.named_buffers() if "rotary_emb" not in n and not n.endswith("inv_freq")
    }
    return {n: t.float() if any(k in n for k in keep) else t for n, t in tensors.items()}


@pytest.mark.parametrize("name", ["solar_open", "hunyuan_v1_moe", "qwen2_moe"])
def test_the_seed_checkpoints_have_a_mixture_in_every_block(name):
    """(Their counts against transformers' and the published totals: tests/test_flagships.py.)"""
    for entry in entries(name):
        assert {layer.kind for layer in plan(entry["config"], cpu_memory="2TB").per_layer} == {"moe"}, entry["checkpoint"]


def test_dense_blocks_and_tied_head(checkpoints):
    """A Qwen checkpoint with a dense block, and a tied Hunyuan one, against transformers' loaded models."""
    from transformers import HunYuanMoEV1ForCausalLM, Qwen2MoeForCausalLM

    for (family, variant), cls in [(("qwen2_moe", "dense_block"), Qwen2MoeForCausalLM),
                                   (("hunyuan_v1_moe", "base"), HunYuanMoEV1ForCausalLM)]:
        folder = checkpoints[family, variant]
        hf = cls.from_pretrained(folder)
        p = plan(folder, dtype="float32", cpu_memory="1GB")
        assert p.parameters == sum(t.numel() for t in hf.parameters()) + sum(
            b.numel() for n, b in hf.named_buffers() if "rotary_emb" not in n
        )
        assert p.on_disk["parameters"] == p.parameters  # what is stored is what the model holds
        dense = [n for n, _ in hf.named_parameters() if hf_component(n) == "dense_mlp"]
        assert p.components["dense_mlp"].parameters == sum(hf.get_parameter(n).numel() for n in dense)
    assert [layer.kind for layer in plan(checkpoints["qwen2_moe", "dense_block"]).per_layer] == ["moe", "dense", "moe"]


SOLAR_EXPERT_BYTES = 3 * 4096 * 1280 * 2  # gate, up, down of one expert, bfloat16 (by hand)


def test_activations_and_kv_cache_by_hand():
    p = plan(dict(SOLAR), batch=8, seq=2048, cpu_memory="1TB")
    assert p.kv_cache["bytes"] == 2 * 48 * 8 * 2048 * 8 * 128 * 2
    terms = p.activations["terms"]
    assert terms["logits"]["bytes"] == 8 * 2048 * 196608 * (2 + 4)
    assert terms["attention"]["bytes"] >= 8 * 64 * 2048 * 2048 * (2 + 2 + 4)  # scores, pattern, float32 softmax
    assert terms["routed_experts"]["bytes"] >= 8 * 2048 * 8 * 2 * 1280 * 2
    assert p.activations["peak"] == terms["residual"]["bytes"] + max(
        terms["attention"]["bytes"], terms["routed_experts"]["bytes"], terms["shared_or_dense_mlp"]["bytes"],
        terms["logits"]["bytes"],
    )


def check_device_map(p, option, tied=False):
    """Budgets kept, blocks in order once each, embedding on the first device and unembedding on the last; and
    the bytes each device reports are its weights (from the per-layer counts) plus working memory."""
    devices = option["devices"]
    budgets = {d["device"]: d["budget"] for d in p.placement["devices"]}
    assert all(d["bytes"] <= budgets[d["device"]] for d in devices)
    blocks = [b for d in devices if d["blocks"] for b in range(d["blocks"][0], d["blocks"][1] + 1)]
    assert blocks == list(range(len(p.per_layer)))
    assert [d["embedding"] for d in devices] == [True] + [False] * (len(devices) - 1)
    assert [d["unembedding"] for d in devices] == [False] * (len(devices) - 1) + [True]
    order = [d["device"] for d in devices]
    assert order == sorted(order, key=list(budgets).index)
    layer_peak = p.activations["terms"]["layer_peak"]["bytes"]
    kv_per_layer = p.kv_cache["bytes"] // len(p.per_layer)
    weights = sum(d["bytes"] - layer_peak for d in devices) - kv_per_layer * len(p.per_layer)
    logits_extra = p.activations["peak"] - layer_peak
    # every weight placed once; a tied unembedding away from the embedding's device is a second copy of it
    copy = p.components["embeddings"].bytes if tied else 0
    assert weights - logits_extra == p.bytes + copy


@pytest.mark.parametrize("name", ["solar_open", "hunyuan_v1_moe"])
@pytest.mark.parametrize("gpus, memory", [(2, "141GB"), (4, "80GB"), (8, "40GiB"), (3, "100GB")])
def test_device_map_respects_budgets(name, gpus, memory):
    config = flagship(name)
    p = plan(dict(config), gpus=gpus, gpu_memory=memory, cpu_memory="1TB", batch=2, seq=1024)
    option = next(o for o in p.placement["options"] if o["kind"] == "device_map")
    check_device_map(p, option, tied=config["tie_word_embeddings"])
    assert p.placement["recommended"]["kind"] == "device_map"  # 205 GB fits on none of these alone
    assert len(option["devices"]) >= math.ceil(p.bytes / (parse_size(memory) * 0.9))


def test_device_map_for_a_model_of_two_sizes_of_blocks():
    """Blocks of different sizes (dense and mixture): the map still respects each budget."""
    config = dict(QWEN2_57B, mlp_only_layers=[0, 1, 2, 3])
    p = plan(config, gpus=5, gpu_memory="30GB", cpu_memory="1TB", seq=512)
    assert {layer.kind for layer in p.per_layer} == {"moe", "dense"}
    check_device_map(p, next(o for o in p.placement["options"] if o["kind"] == "device_map"))


def test_impossible_budget_has_no_option_and_says_why():
    # a Solar block alone is 4.2 GB: no device map on 4 GB GPUs, no offload (the rest is 12 GB), no EP
    p = plan(dict(SOLAR), gpus=8, gpu_memory="4GB", cpu_memory="64GB", seq=128)
    assert p.placement["options"] == [] and p.placement["recommended"] is None
    reasons = {r["kind"]: r["reason"] for r in p.placement["rejected"]}
    assert "block 0" in reasons["device_map"]
    assert p.placement["message"].startswith("nothing fits")
    assert "nothing fits" in str(p)


def test_offload_when_only_the_experts_do_not_fit():
    p = plan(dict(SOLAR), gpus=1, gpu_memory="80GB", cpu_memory="256GB", seq=1024)
    option = p.placement["recommended"]
    assert option["kind"] == "expert_offload" and option["experts_on"] == "cpu"
    assert [o["kind"] for o in p.placement["options"]] == ["expert_offload"]
    experts = p.components["routed_experts"].bytes
    assert experts == 48 * 128 * SOLAR_EXPERT_BYTES
    assert option["offloaded_bytes"] == experts
    assert option["device_bytes"] == p.bytes - experts + p.activations["peak"] + p.kv_cache["bytes"]
    cache = option["expert_cache"]
    assert 0 < cache["experts"] < 48 * 128
    assert option["device_bytes"] + cache["bytes"] <= 80e9 * 0.9 < option["device_bytes"] + cache["bytes"] + SOLAR_EXPERT_BYTES
    assert option["peak_bytes"] == option["device_bytes"] + cache["bytes"]  # the routed experts take only the cache
    moved = option["moved_per_forward"]
    assert moved["prefill_max"] == experts  # 1024 tokens x top-8 reach every expert of every layer
    assert moved["decode_step_max"] == 48 * 8 * SOLAR_EXPERT_BYTES  # batch 1: top_k experts per layer
    # CPU memory too small for 193 GB of experts: they stay on disk
    small = plan(dict(SOLAR), gpus=1, gpu_memory="80GB", cpu_memory="64GB", seq=1024)
    assert small.placement["recommended"]["experts_on"] == "disk"


def test_expert_parallel_per_rank_bytes_by_hand():
    p = plan(dict(SOLAR), gpus=8, gpu_memory="141GB", cpu_memory="1TB", seq=256)
    option = next(o for o in p.placement["options"] if o["kind"] == "expert_parallel")
    experts = 48 * 128 * SOLAR_EXPERT_BYTES
    assert option["replicated_bytes"] == p.bytes - experts
    assert option["expert_bytes_per_rank"] == experts // 8 and option["experts_per_rank"] == 16
    assert option["per_rank_weight_bytes"] == p.bytes - experts + experts // 8
    assert option["per_rank_bytes"] == option["per_rank_weight_bytes"] + p.activations["peak"] + p.kv_cache["bytes"]
    kinds = [o["kind"] for o in p.placement["options"]]
    assert kinds == ["device_map", "expert_parallel", "expert_offload"]  # preference order


def test_one_device_first_and_cpu_only():
    p = plan(dict(QWEN15_MOE), gpus=2, gpu_memory="80GB", cpu_memory="1TB")
    assert p.placement["recommended"] == p.placement["options"][0]
    assert p.placement["recommended"]["kind"] == "one_device" and p.placement["recommended"]["device"] == "cuda:0"
    cpu = plan(dict(QWEN15_MOE), cpu_memory="64GB")
    assert cpu.placement["recommended"] == {**cpu.placement["recommended"], "kind": "one_device", "device": "cpu"}
    disk = plan(dict(QWEN15_MOE), cpu_memory="16GB")
    assert disk.placement["recommended"]["kind"] == "expert_offload"
    assert disk.placement["recommended"]["experts_on"] == "disk"


@pytest.mark.parametrize("text, value", [
    ("141GB", 141 * 10**9), ("80GiB", 80 * 2**30), ("256G", 256 * 10**9), ("1.5TB", 1.5e12), ("512 MiB", 512 * 2**20),
])
def test_sizes(text, value):
    assert parse_size(text) == value


@pytest.mark.parametrize("text", ["80", "lots", "12XB", "-3GB", "0GB", ""])
def test_bad_sizes(text):
    with pytest.raises(ValueError):
        parse_size(text)


# ---- the command ----------------------------------------------------------------------------------------


def test_plan_json_of_a_checkpoint(qwen_path, capsys):
    from transformers import Qwen2MoeForCausalLM

    assert main(["plan", str(qwen_path), "--json", "--dtype", "float32", "--cpu-memory", "8GB"]) == 0
    out = json.loads(capsys.readouterr().out)
    assert {"parameters", "bytes", "components", "per_layer", "activations", "kv_cache", "placement"} <= set(out)
    hf = Qwen2MoeForCausalLM.from_pretrained(qwen_path)
    assert out["parameters"] == sum(t.numel() for t in hf.parameters())
    assert out["bytes"] == 4 * out["parameters"]
    assert out["on_disk"]["parameters"] == out["parameters"] and out["on_disk"]["dtypes"] == {"F32": out["bytes"]}
    assert set(out["per_layer"][0]) >= {"layer", "parameters", "bytes", "kind"}
    assert sum(layer["parameters"] for layer in out["per_layer"]) == sum(
        t.numel() for n, t in hf.named_parameters() if n.startswith("model.layers.")
    )
    assert out["placement"]["recommended"]["kind"] == "one_device"
    assert set(out["components"]["routed_experts"]) == {"parameters", "bytes"}


def test_plan_of_an_embedded_default(tmp_path, monkeypatch, capsys):
    import transformers

    import moelens.defaults
    from moelens.defaults import CONFIGS

    monkeypatch.setattr("moelens.defaults.cache_root", lambda: tmp_path)
    assert main(["plan", "tiny-qwen2-moe", "--gpus", "2", "--gpu-memory", "1GB"]) == 0
    out = capsys.readouterr().out
    config = json.loads((Path(moelens.defaults.__file__).parent / CONFIGS["tiny-qwen2-moe"]).read_text())
    hf = transformers.Qwen2MoeForCausalLM(transformers.Qwen2MoeConfig(**config))
    assert f"{sum(t.numel() for t in hf.parameters()):,} parameters" in out
    assert "HookedQwen2Moe" in out and "recommended: one device: everything on cuda:0" in out


def test_plan_of_a_hub_id_from_the_cache(tmp_path, monkeypatch, qwen_path):
    """A Hub id whose snapshot is cached: its config.json is read there, and its weights' headers."""
    commit = "0123456789abcdef0123456789abcdef01234567"
    for repo, files in (("full", None), ("config-only", ["config.json"])):
        folder = tmp_path / f"models--org--{repo}"
        snapshot = folder / "snapshots" / commit
        if files is None:
            shutil.copytree(qwen_path, snapshot)
        else:
            snapshot.mkdir(parents=True)
            shutil.copy(qwen_path / "config.json", snapshot)
        (folder / "refs").mkdir()
        (folder / "refs" / "main").write_text(commit)
    monkeypatch.setattr(hub_constants, "HF_HUB_CACHE", str(tmp_path))
    monkeypatch.setattr(hub_constants, "HF_HUB_OFFLINE", True)
    full, config_only = plan("org/full", cpu_memory="1GB"), plan("org/config-only", cpu_memory="1GB")
    assert full.parameters == config_only.parameters == full.on_disk["parameters"]
    assert config_only.on_disk is None and "Hub" in full.where
    with pytest.raises(FileNotFoundError, match="org/absent"):
        plan("org/absent")


def test_plan_errors_are_one_line(tmp_path, capsys):
    assert main(["plan", str(tmp_path / "nowhere" / "model")]) == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and "no checkpoint folder or config file" in err
    with pytest.raises(SystemExit) as exit_info:
        main(["plan", "tiny-qwen2-moe", "--gpus", "2", "--gpu-memory", "lots"])
    assert exit_info.value.code == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and "--gpu-memory" in err and "'lots'" in err
    assert main(["plan", str(tmp_path), "--cpu-memory", "1GB"]) == 2  # a folder without config.json
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and "config.json" in err
    if torch.cuda.device_count() < 8:  # a device whose memory cannot be read here
        assert main(["plan", "tiny-qwen2-moe", "--devices", "cuda:7"]) == 2
        err = capsys.readouterr().err
        assert err.count("\n") == 1 and "--gpu-memory" in err


def test_devices_take_their_memory_from_torch_cuda(monkeypatch):
    """--devices reads each GPU's memory from torch.cuda (faked here: no GPU needed); --gpu-memory overrides."""
    from types import SimpleNamespace

    from moelens.plan import gpu_devices

    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "device_count", lambda: 2)
    monkeypatch.setattr(torch.cuda, "get_device_properties", lambda i: SimpleNamespace(total_memory=(i + 1) * 2**30))
    assert [(d.name, d.memory) for d in gpu_devices("cuda:0,cuda:1", None, None)] == [("cuda:0", 2**30), ("cuda:1", 2**31)]
    assert [d.memory for d in gpu_devices(None, 2, None)] == [2**30, 2**31]
    assert [d.memory for d in gpu_devices(["cuda:1"], None, "5GB")] == [5 * 10**9]
    with pytest.raises(ValueError, match="--gpu-memory"):
        gpu_devices("cuda:2", None, None)
    p = plan("tiny-solar-open", devices="cuda:0,cuda:1", cpu_memory="1GB")
    assert p.placement["recommended"]["device"] == "cuda:0"


def test_a_hub_id_asks_the_local_cache_then_the_hub_for_config_json_only(monkeypatch, tmp_path):
    """Where the planner asks the Hub (moelens.plan.source): the cache first, then config.json alone; a name
    that is no Hub id asks neither."""
    import moelens.plan.source as source

    calls = []

    def record(kind):
        def call(repo, *args, **kwargs):
            calls.append((kind, repo, kwargs.get("local_files_only"), kwargs.get("allow_patterns")))
            raise OSError("no network")
        return call

    monkeypatch.setattr(source, "hf_hub_download", record("file"))
    monkeypatch.setattr(source, "snapshot_download", record("snapshot"))
    monkeypatch.chdir(tmp_path)
    with pytest.raises(FileNotFoundError, match="someone/some-moe"):
        plan("someone/some-moe")
    assert calls == [("file", "someone/some-moe", True, None), ("snapshot", "someone/some-moe", None, ["config.json"])]
    calls.clear()
    with pytest.raises(FileNotFoundError):
        plan("./nowhere")
    assert calls == []
