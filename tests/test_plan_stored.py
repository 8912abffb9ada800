"""`moelens plan` of quantized checkpoints: the bytes each component has as stored (block fp8, MXFP4) from
config.json alone, against a computation written out by hand and against the tensor bytes of checkpoints
built here in the Hub's formats (read from the safetensors headers, not through moelens); the placements of
both run-time modes (dequantized at load, routed experts kept as stored); and the published models' configs
at full size: their parameter counts, their stored sizes where the Hub's are known, and which placements fit
one H200 and one node of eight."""

import json
import math

import pytest
import tiny
import tiny_deepseek_v3
import tiny_gpt_oss
import tiny_qwen3_moe
import torch
from flagships import flagship
from safetensors.torch import load_file, save_file
from test_quantized_checkpoints import quantize_fp8, quantized_key

from moelens import HookedTransformer
from moelens.cli import main
from moelens.loaders.quantized import Fp8Blocks, stored_format
from moelens.plan import human, plan

H200 = "141GB"


def header_sizes(folder) -> tuple[int, int, dict[str, int]]:
    """(tensor bytes, stored elements, bytes by component) of a checkpoint, from its safetensors headers as the
    format defines them: an 8-byte little-endian length, a JSON header, each tensor's data_offsets."""
    nbytes = values = 0
    by_component: dict[str, int] = {}
    for path in sorted(folder.glob("*.safetensors")):
        with open(path, "rb") as f:
            header = json.loads(f.read(int.from_bytes(f.read(8), "little")))
        for key, entry in header.items():
            if key == "__metadata__":
                continue
            start, end = entry["data_offsets"]
            nbytes, values = nbytes + end - start, values + math.prod(entry["shape"])
            by_component[file_component(key)] = by_component.get(file_component(key), 0) + end - start
    return nbytes, values, by_component


def file_component(key: str) -> str:
    """Component of a checkpoint key (scales and MXFP4 blocks with their weight), from transformers' names."""
    if "embed_tokens" in key:
        return "embeddings"
    if key.startswith("lm_head"):
        return "unembedding"
    if key.split(".")[-2].endswith("norm"):
        return "norms"
    if ".self_attn." in key:
        return "attention"
    if ".mlp.gate." in key or ".mlp.router." in key:
        return "routers"
    if ".mlp.experts." in key:
        return "routed_experts"
    if ".mlp.shared_experts." in key:
        return "shared_experts"
    if ".mlp." in key:
        return "dense_mlp"
    raise AssertionError(f"unclassified checkpoint key {key}")


# ---- by hand --------------------------------------------------------------------------------------------------

# A DeepSeek-V3 of dimensions no 128-block divides (200, 150, 136, 260, 108 ...), a dense block and a mixture.
TINY_FP8 = {
    "model_type": "deepseek_v3", "vocab_size": 300, "hidden_size": 200, "num_hidden_layers": 2,
    "first_k_dense_replace": 1, "intermediate_size": 260, "moe_intermediate_size": 136, "n_routed_experts": 4,
    "num_experts_per_tok": 2, "n_shared_experts": 1, "n_group": 1, "topk_group": 1, "num_attention_heads": 2,
    "num_key_value_heads": 2, "q_lora_rank": 150, "kv_lora_rank": 100, "qk_nope_head_dim": 24,
    "qk_rope_head_dim": 8, "v_head_dim": 20, "tie_word_embeddings": False, "torch_dtype": "bfloat16",
    "quantization_config": {
        "quant_method": "fp8", "fmt": "e4m3", "activation_scheme": "dynamic", "weight_block_size": [128, 128],
        "modules_to_not_convert": ["model.layers.1.self_attn.kv_b_proj"],
    },
}


@pytest.mark.parametrize("scales, scale_bytes", [("float32", 4), ("bfloat16", 2), ("ue8m0", 1)])
def test_fp8_stored_bytes_by_hand(scales, scale_bytes):
    config = json.loads(json.dumps(TINY_FP8))
    if scales == "ue8m0":
        config["quantization_config"]["scale_fmt"] = "ue8m0"
    p = plan(config, cpu_memory="1GB", fp8_scale_dtype="bfloat16" if scales == "bfloat16" else "float32")

    def fp8(rows, cols):  # a byte per weight, a scale per 128 x 128 block, the last one partial
        return rows * cols + math.ceil(rows / 128) * math.ceil(cols / 128) * scale_bytes

    def bf16(*shape):
        return 2 * math.prod(shape)

    # q_a_proj [150, 200], q_b_proj [2 x (24 + 8), 150], kv_a_proj_with_mqa [100 + 8, 200], o_proj [200, 2 x 20];
    # kv_b_proj [2 x (24 + 20), 100], listed in modules_to_not_convert in block 1
    attention = 2 * (fp8(150, 200) + fp8(64, 150) + fp8(108, 200) + fp8(200, 40)) + fp8(88, 100) + bf16(88, 100)
    norms = 2 * (bf16(150) + bf16(100) + 2 * bf16(200)) + bf16(200)  # q_a, kv_a, ln1, ln2; the final norm
    expert = fp8(136, 200) + fp8(136, 200) + fp8(200, 136)  # gate, up, down, each with its own block grid
    expected = {
        "embeddings": bf16(300, 200),
        "attention": attention,
        "norms": norms,
        "routers": bf16(4, 200) + 4 * 4,  # the weight as stored (bf16), the correction bias float32 as held
        "routed_experts": 4 * expert,
        "shared_experts": expert,
        "dense_mlp": 2 * fp8(260, 200) + fp8(200, 260),
        "unembedding": bf16(300, 200),
    }
    s = p.stored
    assert {k: v["bytes"] for k, v in s["components"].items()} == expected
    assert s["bytes"] == sum(expected.values())
    assert s["format"]["scale_bytes"] == scale_bytes and s["dtype"] == "bfloat16"
    assert s["per_layer"][1]["routed_experts_bytes"] == 4 * expert
    # the dense counts (what dequantizing at load makes) do not change
    assert p.parameters == plan({k: v for k, v in TINY_FP8.items() if k != "quantization_config"}, cpu_memory="1GB").parameters


TINY_MXFP4 = {
    "model_type": "gpt_oss", "vocab_size": 100, "hidden_size": 64, "intermediate_size": 96, "head_dim": 16,
    "num_hidden_layers": 2, "num_attention_heads": 4, "num_key_value_heads": 2, "num_local_experts": 4,
    "num_experts_per_tok": 2, "torch_dtype": "bfloat16", "tie_word_embeddings": False,
    "quantization_config": {"quant_method": "mxfp4", "modules_to_not_convert": ["model.layers.*.self_attn"]},
}


def test_mxfp4_stored_bytes_by_hand():
    p = plan(dict(TINY_MXFP4), cpu_memory="1GB")

    def mxfp4(rows, cols):  # 16 bytes of e2m1 pairs and a 1-byte exponent per group of 32
        return rows * (cols // 32) * (16 + 1)

    # per layer: gate_up [4, 2 x 96, 64] and down [4, 64, 96] packed; their biases [4, 192], [4, 64] bf16
    experts = 2 * 4 * (mxfp4(192, 64) + mxfp4(64, 96) + 2 * (192 + 64))
    assert p.stored["components"]["routed_experts"]["bytes"] == experts
    assert p.stored["components"]["attention"]["bytes"] == p.components["attention"].bytes  # bf16 both
    assert p.stored["bytes"] == p.bytes - p.components["routed_experts"].bytes + experts


def test_mxfp4_of_a_width_its_groups_do_not_divide_is_refused():
    with pytest.raises(ValueError, match=r"down_proj_blocks.*last dimension must be a multiple of 32"):
        plan(dict(TINY_MXFP4, intermediate_size=72), cpu_memory="1GB")


# ---- against checkpoints built in the Hub's formats ------------------------------------------------------------


def hub_fp8(folder, block, scale_dtype, not_converted=()):
    """A float checkpoint rewritten as DeepSeek-V3's published one: linear weights float8 with a scale per block,
    embeddings, head, norms and router weights bfloat16, the correction biases float32."""
    path = folder / "model.safetensors"
    out = {}
    for key, t in load_file(path).items():
        if quantized_key(key, t) and key.removesuffix(".weight") not in not_converted:
            out[key], out[key + "_scale_inv"] = quantize_fp8(t, block, scale_dtype)
        else:
            out[key] = t.float() if key.endswith("e_score_correction_bias") else t.to(torch.bfloat16)
    save_file(out, path, metadata={"format": "pt"})
    qc = {"quant_method": "fp8", "weight_block_size": list(block), "activation_scheme": "dynamic", "fmt": "e4m3",
          "modules_to_not_convert": list(not_converted)}
    tiny.edit_config(folder, dtype="bfloat16", quantization_config=qc)
    return folder


CHECKPOINTS = {
    # q_a_proj's 192 rows and kv_a_proj_with_mqa's 576 (568 + 8) in partial 128-row blocks; float32 scales
    "deepseek_v3": (
        lambda d: hub_fp8(tiny_deepseek_v3.build(d, seed=8, q_lora_rank=192, kv_lora_rank=568), (128, 128), torch.float32,
                          ("model.layers.2.self_attn.o_proj",)),
        "float32",
    ),
    # blocks of 32 over 48-row k / v projections; bfloat16 scales
    "qwen3_moe": (lambda d: hub_fp8(tiny_qwen3_moe.build_qwen3_moe(d, seed=9), (32, 32), torch.bfloat16), "bfloat16"),
    # gpt-oss's MXFP4 experts, everything else bfloat16 as published
    "gpt_oss": (lambda d: bf16_rest(tiny_gpt_oss.to_mxfp4(tiny_gpt_oss.build_gpt_oss(d, seed=4))), "float32"),
}


def bf16_rest(folder):
    path = folder / "model.safetensors"
    save_file({k: t if t.dtype == torch.uint8 else t.to(torch.bfloat16) for k, t in load_file(path).items()}, path,
              metadata={"format": "pt"})
    tiny.edit_config(folder, dtype="bfloat16")
    return folder


@pytest.mark.parametrize("name", list(CHECKPOINTS))
def test_stored_bytes_are_the_files_tensor_bytes(tmp_path, name):
    build, scales = CHECKPOINTS[name]
    folder = build(tmp_path / name)
    # the checkpoint is one moelens reads (what it quantizes is what the format allows)
    HookedTransformer.from_pretrained(folder, dtype="bfloat16", progress=False)
    nbytes, values, by_component = header_sizes(folder)
    config = json.loads((folder / "config.json").read_text())
    for p in (plan(folder, cpu_memory="1GB", fp8_scale_dtype=scales), plan(config, cpu_memory="1GB", fp8_scale_dtype=scales)):
        s = p.stored
        assert s["bytes"] == nbytes and s["values"] == values
        assert {k: v["bytes"] for k, v in s["components"].items() if v["bytes"]} == by_component
        assert sum(layer["bytes"] for layer in s["per_layer"]) == nbytes - sum(
            by_component.get(k, 0) for k in ("embeddings", "unembedding")
        ) - 2 * p.config["d_model"]  # the final norm, bf16
    # a wrong scale dtype counts other bytes (the test can tell)
    if name != "gpt_oss":
        other = "bfloat16" if scales == "float32" else "float32"
        assert plan(config, cpu_memory="1GB", fp8_scale_dtype=other).stored["bytes"] != nbytes


# ---- the two run-time modes -----------------------------------------------------------------------------------


def test_modes_by_hand():
    """Experts kept stored: the dense plan's weights with the routed experts at their stored bytes, and a layer's
    active experts dequantized as working memory; the plan's placement is the mode asked for."""
    config = dict(GPT_OSS_120B)
    dense = plan(config, gpus=1, gpu_memory=H200, cpu_memory="2TB")
    kept = plan(config, gpus=1, gpu_memory=H200, cpu_memory="2TB", expert_storage="stored")
    s = kept.stored
    stored_experts = s["components"]["routed_experts"]["bytes"]
    assert s["modes"]["stored"]["weights"] == dense.bytes - dense.components["routed_experts"].bytes + stored_experts
    assert s["modes"]["dequantized"]["weights"] == dense.bytes
    # 2048 tokens x top-4 reach all 128 experts of a layer: each gate_up, down and biases in bf16
    assert s["modes"]["stored"]["dequantized_working"] == 128 * 2 * (3 * 2880 * 2880 + 3 * 2880)
    assert dense.placement == s["modes"]["dequantized"]["placement"] and kept.placement == s["modes"]["stored"]["placement"]
    one = kept.placement["recommended"]
    assert one["kind"] == "one_device"
    act = kept.activations["terms"]
    assert one["bytes"] == s["modes"]["stored"]["weights"] + max(
        kept.activations["peak"], act["layer_peak"]["bytes"] + s["modes"]["stored"]["dequantized_working"]
    ) + kept.kv_cache["bytes"]
    assert [o["kind"] for o in dense.placement["options"]] == ["expert_offload"]
    offload = next(o for o in kept.placement["options"] if o["kind"] == "expert_offload")
    assert offload["offloaded_bytes"] == stored_experts
    # eight ranks: each holds 16 of every layer's 128 experts as stored and dequantizes only those
    ranks = plan(config, gpus=8, gpu_memory=H200, cpu_memory="2TB", expert_storage="stored")
    ep = next(o for o in ranks.placement["options"] if o["kind"] == "expert_parallel")
    assert ep["expert_bytes_per_rank"] == stored_experts // 8 and ep["experts_per_rank"] == 16
    assert ep["per_rank_bytes"] == ep["per_rank_weight_bytes"] + max(
        kept.activations["peak"], act["layer_peak"]["bytes"] + 16 * 2 * (3 * 2880 * 2880 + 3 * 2880)
    ) + kept.kv_cache["bytes"]


def test_expert_storage_refusals(qwen_path):
    with pytest.raises(ValueError, match="no quantization_config"):
        plan(qwen_path, cpu_memory="1GB", expert_storage="stored")
    with pytest.raises(ValueError, match="stores the weights as 'mxfp4'"):
        plan(dict(TINY_MXFP4), cpu_memory="1GB", expert_storage="fp8")
    with pytest.raises(ValueError, match="expert_storage must be one of"):
        plan(dict(TINY_MXFP4), cpu_memory="1GB", expert_storage="int4")
    assert plan(dict(TINY_MXFP4), cpu_memory="1GB", expert_storage="mxfp4").stored["expert_storage"] == "stored"
    # a format moelens does not read: planned dense and said so; keeping it stored is refused
    other = dict(TINY_FP8, quantization_config={"quant_method": "compressed-tensors"})
    p = plan(other, cpu_memory="1GB")
    assert "compressed-tensors" in p.stored["error"] and "stored format not read" in str(p)
    with pytest.raises(ValueError, match="compressed-tensors"):
        plan(other, cpu_memory="1GB", expert_storage="stored")


def test_command(tmp_path, capsys, qwen_path):
    path = tmp_path / "config.json"
    path.write_text(json.dumps(TINY_FP8))
    assert main(["plan", str(path), "--gpus", "2", "--gpu-memory", "1GB", "--expert-storage", "stored", "--json"]) == 0
    out = json.loads(capsys.readouterr().out)
    assert out["stored"]["expert_storage"] == "stored" and out["placement"] == out["stored"]["modes"]["stored"]["placement"]
    assert main(["plan", str(path), "--cpu-memory", "1GB", "--fp8-scale-dtype", "bfloat16"]) == 0
    text = capsys.readouterr().out
    assert "as stored:" in text and "128x128 blocks, bfloat16 scales" in text
    assert "dequantized at load; expert_storage 'dequantized', the default): weights" in text
    assert "[this plan's placement]" in text and "kept as stored (fp8" in text
    # an unquantized checkpoint: the JSON and the text as before (no stored section)
    assert main(["plan", str(qwen_path), "--json", "--cpu-memory", "1GB"]) == 0
    assert "stored" not in json.loads(capsys.readouterr().out)
    assert main(["plan", str(qwen_path), "--cpu-memory", "1GB", "--expert-storage", "stored"]) == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and "no quantization_config" in err


def test_minimax_fp8_spelling_is_read():
    """MiniMax-M2 names the fp8 format by its torch dtype."""
    fmt = stored_format(MINIMAX_M2, "config.json")
    assert fmt == Fp8Blocks((128, 128), "float", ("gate", "e_score_correction_bias", "lm_head"))


# ---- the published models at full size ---------------------------------------------------------------------------

# The published config.json values (docs/families/flagships/)
GPT_OSS_120B = flagship("gpt_oss", "openai/gpt-oss-120b")  # MXFP4 routed experts, the rest bfloat16
DEEPSEEK_V3 = flagship("deepseek_v3", "deepseek-ai/DeepSeek-V3")  # block fp8
GLM_45 = flagship("glm4_moe", "zai-org/GLM-4.5")  # bfloat16, stored as it runs
MINIMAX_M2 = flagship("minimax_m2", "MiniMaxAI/MiniMax-M2")  # block fp8, routers listed as not converted
LLAMA4_SCOUT = flagship("llama4_text", "meta-llama/Llama-4-Scout-17B-16E")
LLAMA4_MAVERICK = flagship("llama4_text", "meta-llama/Llama-4-Maverick-17B-128E")
# moonshotai/Kimi-K2-Instruct: DeepSeek-V3's architecture ("architectures": ["DeepseekV3ForCausalLM"], its code
# DeepSeek's) under model_type "kimi_k2", which moelens, like transformers, does not register; planned (and loaded)
# as deepseek_v3, the workaround Kimi-K2's deployment guide gives: set model_type to "deepseek_v3".
KIMI_K2 = {
    "architectures": ["DeepseekV3ForCausalLM"], "model_type": "kimi_k2", "attention_bias": False,
    "first_k_dense_replace": 1, "hidden_act": "silu", "hidden_size": 7168, "intermediate_size": 18432,
    "kv_lora_rank": 512, "max_position_embeddings": 131072, "moe_intermediate_size": 2048, "n_group": 1,
    "n_routed_experts": 384, "n_shared_experts": 1, "norm_topk_prob": True, "num_attention_heads": 64,
    "num_experts_per_tok": 8, "num_hidden_layers": 61, "num_key_value_heads": 64, "num_nextn_predict_layers": 0,
    "q_lora_rank": 1536, "qk_nope_head_dim": 128, "qk_rope_head_dim": 64, "rms_norm_eps": 1e-06,
    "quantization_config": {"activation_scheme": "dynamic", "fmt": "e4m3", "quant_method": "fp8",
                            "weight_block_size": [128, 128]},
    "rope_scaling": {"beta_fast": 1.0, "beta_slow": 1.0, "factor": 32.0, "mscale": 1.0, "mscale_all_dim": 1.0,
                     "original_max_position_embeddings": 4096, "type": "yarn"},
    "rope_theta": 50000.0, "routed_scaling_factor": 2.827, "scoring_func": "sigmoid", "tie_word_embeddings": False,
    "topk_group": 1, "topk_method": "noaux_tc", "torch_dtype": "bfloat16", "v_head_dim": 128, "vocab_size": 163840,
}
# name: (config, family module, published total in billions (without MTP layers), Hub-known stored sizes,
#        {(gpus, mode): (recommended placement, every placement that fits)})
FULL_SIZE = {
    "gpt-oss-120b": (GPT_OSS_120B, "gpt_oss", 116.83,
                     # the Hub checkpoint's tensor bytes (its 15 files, headers aside)
                     {"bytes": 65_248_815_744},
                     {(1, "dequantized"): ("expert_offload", ["expert_offload"]),
                      (1, "stored"): ("one_device", ["one_device", "expert_offload"]),
                      (8, "dequantized"): ("device_map", ["device_map", "expert_parallel", "expert_offload"]),
                      (8, "stored"): ("one_device", ["one_device", "expert_parallel", "expert_offload"])}),
    # scales, one per 128 x 128 block (by hand): per layer q_a_proj [1536, 7168] 12 x 56, q_b_proj [128 x 192, 1536]
    # 192 x 12, kv_a_proj_with_mqa [576, 7168] 5 x 56, kv_b_proj [128 x 256, 512] 256 x 4, o_proj [7168, 128 x 128]
    # 56 x 128; 3 dense MLPs of 3 x 144 x 56; 58 mixtures of 257 experts (256 routed, 1 shared) of 3 x 16 x 56
    "DeepSeek-V3": (DEEPSEEK_V3, "deepseek_v3", 671.03,
                    {"scales": 61 * (672 + 2304 + 280 + 1024 + 7168) + 3 * 3 * 8064 + 58 * 257 * 3 * 896},
                    {(1, "dequantized"): ("expert_offload", ["expert_offload"]),
                     (1, "stored"): ("expert_offload", ["expert_offload"]),
                     (8, "dequantized"): ("expert_offload", ["expert_offload"]),
                     (8, "stored"): ("device_map", ["device_map", "expert_offload"])}),
    # scales as DeepSeek-V3's with 64 heads (q_b_proj 96 x 12, kv_b_proj 128 x 4, o_proj 56 x 64), 1 dense block and
    # 60 mixtures of 385 experts
    "Kimi-K2-Instruct": (KIMI_K2, "deepseek_v3", 1026.41,
                         {"scales": 61 * (672 + 1152 + 280 + 512 + 3584) + 3 * 8064 + 60 * 385 * 3 * 896},
                         {(1, "dequantized"): ("expert_offload", ["expert_offload"]),
                          (1, "stored"): ("expert_offload", ["expert_offload"]),
                          (8, "dequantized"): ("expert_offload", ["expert_offload"]),
                          (8, "stored"): ("expert_offload", ["expert_offload"])}),
    "GLM-4.5": (GLM_45, "glm4_moe", 352.80, {},
                {(1, "dequantized"): ("expert_offload", ["expert_offload"]),
                 (8, "dequantized"): ("device_map", ["device_map", "expert_parallel", "expert_offload"])}),
    "MiniMax-M2": (MINIMAX_M2, "minimax_m2", 228.69,
                   # the Hub's count of stored values: the weights and their 13,880,064 weight_scale_inv entries
                   {"values": 228_703_644_928, "scales": 62 * (1152 + 192 + 192 + 1152 + 256 * 3 * 288)},
                   {(1, "dequantized"): ("expert_offload", ["expert_offload"]),
                    (1, "stored"): ("expert_offload", ["expert_offload"]),
                    (8, "dequantized"): ("device_map", ["device_map", "expert_parallel", "expert_offload"]),
                    (8, "stored"): ("device_map", ["device_map", "expert_parallel", "expert_offload"])}),
    # the text models of the Hub's bfloat16 checkpoints
    "Llama-4-Scout-17B-16E": (LLAMA4_SCOUT, "llama4_text", 107.77, {},
                              {(1, "dequantized"): ("expert_offload", ["expert_offload"]),
                               (8, "dequantized"): ("device_map", ["device_map", "expert_parallel", "expert_offload"])}),
    "Llama-4-Maverick-17B-128E": (LLAMA4_MAVERICK, "llama4_text", 400.71, {},
                                  {(1, "dequantized"): ("expert_offload", ["expert_offload"]),
                                   (8, "dequantized"): ("device_map", ["device_map", "expert_offload"])}),
}


@pytest.mark.parametrize("name", list(FULL_SIZE))
def test_published_models_on_one_h200_and_one_node(name):
    config, family, billions, hub, expected = FULL_SIZE[name]
    pytest.importorskip(f"moelens.models.{family}")  # glm4_moe and minimax_m2 are families of their own branches
    config = dict(config, model_type=family)
    for (gpus, mode), (recommended, fitting) in expected.items():
        p = plan(config, gpus=gpus, gpu_memory=H200, cpu_memory="2TB", expert_storage=mode)
        assert p.parameters / 1e9 == pytest.approx(billions, abs=0.01)
        assert p.placement["recommended"]["kind"] == recommended, (gpus, mode)
        assert [o["kind"] for o in p.placement["options"]] == fitting, (gpus, mode)
        for key, value in hub.items():
            assert (p.stored["values"] - p.parameters if key == "scales" else p.stored[key]) == value, key
        assert (p.stored is None) == ("quantization_config" not in config)


def test_kimi_k2_is_read_as_deepseek_v3():
    from moelens.loaders.errors import CheckpointError

    with pytest.raises(CheckpointError, match="model_type 'kimi_k2' is not supported"):
        plan(dict(KIMI_K2), cpu_memory="1GB")


def test_offload_line_states_the_stored_size_beside_the_dequantized_one():
    """DeepSeek-V3 on one H200, dequantized at load: the experts offloaded to the CPU are 1.31 TB in bfloat16,
    but its fp8 files hold 654.07 GB of them; the offload line says both, and the stored mode's says 'as stored'."""
    p = plan(dict(DEEPSEEK_V3), gpus=1, gpu_memory=H200, cpu_memory="2TB")
    matrices = 58 * 256 * 3  # routed experts' gate, up and down of 58 mixture layers
    dense = matrices * 2048 * 7168 * 2  # bfloat16
    stored = matrices * (2048 * 7168 + 16 * 56 * 4)  # a byte per weight, a float32 scale per 128 x 128 block
    text = str(p)
    assert f"routed experts ({human(dense)}, dequantized in bfloat16; {human(stored)} as stored in the files) on cpu" in text
    assert f"routed experts ({human(stored)}, as stored in the files, fp8) on cpu" in text
    assert (human(dense), human(stored)) == ("1.31 TB", "654.07 GB")
