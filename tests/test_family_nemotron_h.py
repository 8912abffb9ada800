"""Nemotron-H (HookedNemotronH) against transformers' NemotronHForCausalLM: every layer kind (Mamba-2, attention
without positions, mixture, MLP) site by site in float32 and bfloat16, the latent mixture, left padding,
prefill then decode, greedy generation, both expert spellings and both config spellings, offload and expert
parallelism bit for bit, plan at full size (Nemotron-3 Nano 30B-A3B, Super 120B-A12B) from config alone,
support(), verify and the embedded default, bad checkpoints and bad configs."""

import json
import os
import shutil

import pytest
import torch
import torch.distributed as dist
import torch.multiprocessing as mp
import transformers
from safetensors.torch import load_file, save_file
import family_harness as harness
import tiny_nemotron_h as tiny_nh
from flagships import flagship
from family_harness import MODEL_SITES, References, build_checkpoints, check_greedy_generation, left_padded, tokens

from moelens import HookedTransformer
from moelens.cli import main
from moelens.experts.spec import Ungated
from moelens.kv_cache import KVCache
from moelens.loaders.errors import CheckpointError
from moelens.models.components.mlp import UngatedMLP
from moelens.models.mixers.mamba2 import Mamba2Mixer
from moelens.models.nemotron_h import HookedNemotronH, NemotronHMoe, NoPositionAttention
from moelens.plan import plan
from moelens.state import RecurrentState
from moelens.verify import compare, load_reference

VARIANTS = [v for (_, v) in tiny_nh.FAMILY_VARIANTS]
KIND_SITES = {
    "linear_attention": ("hook_resid_pre", "ln1.hook_normalized", "hook_attn_out", "hook_resid_post"),
    "full_attention": ("hook_resid_pre", "ln1.hook_normalized", "hook_attn_out", "hook_resid_post", "attn.hook_q",
                       "attn.hook_k", "attn.hook_v", "attn.hook_z"),
    "moe": ("hook_resid_pre", "ln2.hook_normalized", "hook_mlp_out", "hook_resid_post", "mlp.hook_router_logits",
            "mlp.hook_expert_weights", "mlp.hook_expert_indices", "mlp.hook_routed_out", "mlp.shared_expert.hook_out"),
    "mlp": ("hook_resid_pre", "ln2.hook_normalized", "hook_mlp_out", "hook_resid_post", "mlp.hook_post"),
}


@pytest.fixture(scope="module")
def ckpts(tmp_path_factory):
    return build_checkpoints(tmp_path_factory, "nemotron_h", tiny_nh.FAMILY_VARIANTS)


@pytest.fixture(scope="module")
def refs(ckpts):
    return References(ckpts)


@pytest.fixture(scope="module")
def base(ckpts):
    return HookedTransformer.from_pretrained(ckpts["base"], progress=False)


def block_sites(model):
    return lambda layer: KIND_SITES[model.cfg.layer_types[layer]]


@pytest.mark.parametrize("variant", VARIANTS)
def test_float32_every_site(ckpts, refs, variant):
    model = HookedTransformer.from_pretrained(ckpts[variant], progress=False)
    assert type(model) is HookedNemotronH
    harness.check_report(compare(model, refs(variant), tokens(shape=(2, 80))), model, block_sites(model), 1e-5, MODEL_SITES)


@pytest.mark.parametrize("length", [40, 80])
def test_float32_mamba_layers_are_bit_for_bit(ckpts, refs, length):
    """The Mamba-2 mixer runs transformers' convolution and scan products in its order: a Mamba-2 layer given
    transformers' input to the bit gives its output to the bit, in float32, at lengths that leave the last chunk
    of 32 partly padded and run the convolution at other lengths. (Summed per group instead of per head, the scan
    put this eight-layer stream 2.4e-5 away at blocks.7.hook_resid_post. The routed experts' float32 sums may
    still round apart with the thread count, which is why a layer's input is checked first.)"""
    model = HookedTransformer.from_pretrained(ckpts["latent_long"], progress=False)
    report = compare(model, refs("latent_long"), tokens(shape=(2, length)))
    harness.check_report(report, model, block_sites(model), 1e-5, MODEL_SITES)
    diff = {site.site: site.max_abs_diff for site in report.sites}
    mamba = [layer for layer, kind in enumerate(model.cfg.layer_types) if kind == "linear_attention"]
    exact_inputs = [layer for layer in mamba if diff[f"blocks.{layer}.hook_resid_pre"] == 0]
    assert exact_inputs[:1] == [0]
    for layer in exact_inputs:
        assert diff[f"blocks.{layer}.hook_attn_out"] == 0, (layer, diff[f"blocks.{layer}.hook_attn_out"])


def test_the_layers_are_what_the_config_says(ckpts, base):
    kinds = {"M": "linear_attention", "*": "full_attention", "E": "moe", "-": "mlp"}
    assert base.cfg.layer_types == tuple(kinds[c] for c in tiny_nh.PATTERN)
    for block, kind in zip(base.blocks, base.cfg.layer_types):
        mixer = {"linear_attention": Mamba2Mixer, "full_attention": NoPositionAttention}.get(kind)
        assert type(block.token_mixer) is mixer if mixer else block.token_mixer is None
        assert hasattr(block, "hook_attn_out") == (mixer is not None) and hasattr(block, "hook_mlp_out") == (mixer is None)
        assert not hasattr(block, "hook_resid_mid")  # one sublayer a block
        if kind == "moe":
            assert type(block.mlp) is NemotronHMoe and type(block.mlp.shared_expert) is UngatedMLP
        if kind == "mlp":
            assert type(block.mlp) is UngatedMLP
    spec = base.blocks[1].mlp.experts.spec
    assert spec.activation == Ungated("relu2") and spec.shapes()["W_gate_up"] == (8, 32, 64)
    assert base.cfg.n_group == 2 and base.cfg.routed_scaling_factor == 2.5
    latent = HookedTransformer.from_pretrained(ckpts["latent"], progress=False)
    assert latent.cfg.layer_types == ("linear_attention", "moe", "full_attention", "moe")
    assert latent.blocks[1].mlp.experts.spec.shapes()["W_gate_up"] == (8, 32, 24)
    assert latent.blocks[1].mlp.fc1_latent_proj.weight.shape == (24, 64)


def test_ungated_sites_hold_what_relu2_reads(base):
    """A routed ungated expert's up projection is experts.hook_pre_linear (TransformerLens's per-expert hook_pre
    views its rows), hook_post relu2 of it, and experts.hook_pre (a gate) never fires; the dense MLP's and the
    shared expert's hook_pre hold up(x), as TransformerLens's non-gated MLP. Zeroing hook_post removes the
    routed term."""
    toks = tokens(shape=(1, 12))
    _, cache = base.run_with_cache(toks, names_filter=lambda n: n.startswith(("blocks.1.mlp", "blocks.3.mlp")))
    up, post = cache["blocks.1.mlp.experts.hook_pre_linear"], cache["blocks.1.mlp.experts.hook_post"]
    assert torch.equal(post, torch.square(torch.relu(up)))
    assert "blocks.1.mlp.experts.hook_pre" not in cache
    expert = int(cache["blocks.1.mlp.hook_expert_indices"][0, 0, 0])
    assert torch.equal(cache[f"blocks.1.mlp.experts.{expert}.hook_pre"][0], up[0, 0, 0])
    for mlp in ("blocks.3.mlp", "blocks.1.mlp.shared_expert"):
        assert torch.equal(cache[f"{mlp}.hook_post"], torch.square(torch.relu(cache[f"{mlp}.hook_pre"])))
    routed = []
    base.run_with_hooks(toks, fwd_hooks=[("blocks.1.mlp.experts.hook_post", lambda t, hook: t * 0),
                                         ("blocks.1.mlp.hook_routed_out", lambda t, hook: routed.append(t))])
    assert routed[0].abs().max() == 0


@pytest.mark.parametrize("variant", VARIANTS)
def test_bfloat16_is_bit_exact(ckpts, refs, variant):
    """In bfloat16 the same experts on every mixture layer, and the logits and every compared site (the Mamba-2
    layers', the latent mixture's included) bit for bit with transformers."""
    model = HookedTransformer.from_pretrained(ckpts[variant], dtype=torch.bfloat16, progress=False)
    harness.check_bit_exact(compare(model, refs(variant, torch.bfloat16), tokens(shape=(2, 80))))


def test_left_padded_batch_matches_transformers_padded_run(base, refs):
    """transformers zeroes padded positions' inputs (and convolved channels) of the Mamba-2 layers and masks
    padded keys in attention; moelens does the same, so the real positions agree with its padded run."""
    toks, mask = left_padded(7, (3, 70), (0, 9, 30))
    report = compare(base, refs("base"), toks, mask)
    assert report.max_logit_diff <= 1e-5 and report.index_mismatches == 0, report


def test_prefill_then_decode_equals_transformers_cached_runs(base, refs):
    """A 40-token prefill then 30 one-token steps (the Mamba-2 recurrence), and a prefill then one 30-token step,
    each against transformers' own cached run; the gap between the stepped and the whole forward is transformers'
    own (the chunked and recurrent forms round differently, and transformers clamps dt differently in them)."""
    ref, toks = refs("base"), tokens(11, (2, 70))

    def hf_run(chunks):
        cache = transformers.DynamicCache(config=ref.config)
        return torch.cat([ref(toks[:, a:b], past_key_values=cache, use_cache=True).logits for a, b in chunks], dim=1)

    def our_run(chunks):
        cache = KVCache.for_model(base)
        out = torch.cat([base(toks[:, a:b], past_kv_cache=cache) for a, b in chunks], dim=1)
        assert isinstance(cache.layers[0], RecurrentState) and cache.layers[0].length == 70
        return out

    stepped = [(0, 40)] + [(i, i + 1) for i in range(40, 70)]
    with torch.no_grad():
        whole, hf_whole = base(toks), ref(toks).logits
        ours, theirs = our_run(stepped), hf_run(stepped)
        continued, hf_continued = our_run([(0, 40), (40, 70)]), hf_run([(0, 40), (40, 70)])
    assert (whole - hf_whole).abs().max() <= 1e-5
    assert (ours - theirs).abs().max() <= 1e-5
    assert (continued - hf_continued).abs().max() <= 1e-5
    gap, hf_gap = float((ours - whole).abs().max()), float((theirs - hf_whole).abs().max())
    assert abs(gap - hf_gap) <= 1e-5, (gap, hf_gap)


def test_greedy_generation_equals_transformers(base, refs):
    check_greedy_generation(base, refs("base"), tokens(4, (1, 12)), new=64)
    toks, mask = left_padded(8, (2, 10), (0, 3))
    check_greedy_generation(base, refs("base"), toks, mask, new=16)


def test_per_expert_and_stacked_experts_and_both_prefixes_load_the_same(ckpts, base, tmp_path):
    """The Hub's per-expert keys (backbone.), the stacked pair transformers holds (experts.up_proj [E, I, H],
    experts.down_proj [E, H, I]) and transformers' own prefix (model.) give the same model."""
    from safetensors.torch import load_file, save_file

    stacked = tiny_nh.fused(harness.copy_checkpoint(ckpts, tmp_path / "s"))
    assert "backbone.layers.1.mixer.experts.up_proj" in harness.stored_keys(stacked)
    renamed = harness.copy_checkpoint(ckpts, tmp_path / "r")
    path = renamed / "model.safetensors"
    tensors = load_file(path)
    save_file({k.replace("backbone.", "model.", 1): t for k, t in tensors.items()}, path, metadata={"format": "pt"})
    toks = tokens(shape=(2, 20))
    with torch.no_grad():
        expected = base(toks)
        for folder in (stacked, renamed):
            assert torch.equal(HookedTransformer.from_pretrained(folder, progress=False)(toks), expected)


HUB_SPELLING = dict(  # NVIDIA's config.json spelling: the pattern string, num_hidden_layers, the mamba_* aliases
    hybrid_override_pattern=tiny_nh.PATTERN, num_hidden_layers=len(tiny_nh.PATTERN), mamba_n_groups=2,
    mamba_d_conv=4, mamba_chunk_size=32, mamba_dt_min=0.001, mamba_conv_bias=True,
)


def test_both_config_spellings_read_as_transformers():
    saved = tiny_nh.nemotron_h_config().to_dict()  # transformers' spelling: layers_block_type
    hub = {k: v for k, v in saved.items() if k not in ("layers_block_type", "n_groups", "conv_kernel", "chunk_size",
                                                         "time_step_min", "use_conv_bias")} | HUB_SPELLING
    legacy = saved | {"layers_block_type": [{"linear_attention": "mamba", "full_attention": "attention"}.get(k, k)
                                            for k in saved["layers_block_type"]]}
    ours = [HookedNemotronH.config_from_hf(raw) for raw in (saved, hub, legacy)]
    assert ours[0] == ours[1] == ours[2]
    # transformers' attention has no biases whatever attention_bias says: read as it reads it, reported unused
    biased = HookedNemotronH.config_from_hf(saved | {"attention_bias": True})
    assert biased == ours[0] and "attention_bias" in biased.fields_ignored
    assert transformers.NemotronHForCausalLM(tiny_nh.nemotron_h_config(attention_bias=True)).model.layers[2].mixer.q_proj.bias is None
    theirs = transformers.NemotronHConfig(**{k: v for k, v in hub.items() if k != "model_type"})
    assert list(ours[1].layer_types) == theirs.layers_block_type
    assert (ours[1].mamba_n_groups, ours[1].mamba_d_conv, ours[1].mamba_chunk_size) == (
        theirs.n_groups, theirs.conv_kernel, theirs.chunk_size)


@pytest.mark.parametrize(
    ("edit", "match"),
    [
        (dict(hybrid_override_pattern="ME*X", layers_block_type=None), "hybrid_override_pattern = 'ME\\*X': unknown layer characters \\['X'\\]"),
        (dict(layers_block_type=["mamba", "moe", "sliding_attention"]), "layers_block_type: unknown layer kinds \\['sliding_attention'\\]"),
        (dict(layers_block_type="ME*"), "layers_block_type = 'ME\\*'"),
        (dict(num_hidden_layers=5), "num_hidden_layers = 5, but layers_block_type gives 8 layers"),
        (dict(mlp_bias=True), "mlp_bias = true"),
        (dict(mamba_hidden_act="gelu"), "mamba_hidden_act = 'gelu'"),
        (dict(n_group=3), "n_routed_experts \\(8\\) must be a multiple of n_group \\(3\\)"),
        (dict(mamba_num_heads=6, n_groups=4), "mamba_num_heads \\(6\\) must be a multiple of n_groups \\(4\\)"),
    ],
)
def test_inconsistent_fields_are_refused_naming_the_field(edit, match):
    raw = {**tiny_nh.nemotron_h_config().to_dict(), **edit}
    with pytest.raises(ValueError, match=match):
        HookedNemotronH.config_from_hf(raw)


@pytest.mark.parametrize("key", [
    "backbone.layers.0.mixer.A_log",
    "backbone.layers.1.mixer.experts.5.up_proj.weight",
    "backbone.layers.1.mixer.gate.e_score_correction_bias",
    "backbone.layers.2.mixer.k_proj.weight",
    "backbone.layers.3.mixer.down_proj.weight",
    "backbone.norm_f.weight",
])
def test_missing_tensor_is_named_in_the_hub_spelling(ckpts, tmp_path, key):
    folder = harness.copy_checkpoint(ckpts, tmp_path)
    harness.rewrite_tensors(folder, lambda t: t.pop(key))
    with pytest.raises(CheckpointError, match=f"'{key}'"):
        HookedTransformer.from_pretrained(folder, progress=False)


def test_stacked_checkpoint_missing_down_proj_is_named(ckpts, tmp_path):
    folder = harness.copy_checkpoint(ckpts, tmp_path, "fused")
    harness.rewrite_tensors(folder, lambda t: t.pop("backbone.layers.5.mixer.experts.down_proj"))
    with pytest.raises(CheckpointError, match="'backbone.layers.5.mixer.experts.down_proj'"):
        HookedTransformer.from_pretrained(folder, progress=False)


# NVIDIA's Nemotron-3 FP8 checkpoints, as ModelOpt exports them: each quantized linear's weight float8_e4m3fn with
# one float32 weight_scale and the activations' input_scale, the K/V cache's k_scale / v_scale on k_proj / v_proj
MODELOPT_QC = {"quant_method": "modelopt", "quant_algo": "FP8", "kv_cache_quant_algo": "FP8",
               "exclude_modules": ["lm_head", "*.mixer.gate"], "producer": {"name": "modelopt", "version": "0.40.0"}}
FP8_MAX = 448.0
QUANTIZED = (".in_proj.weight", ".out_proj.weight", "_proj.weight")  # Mamba-2, attention, MLPs and experts


def quantize_per_tensor(weight: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """One float32 scale for the tensor, amax / 448, and the weight divided by it in float8_e4m3fn."""
    scale = weight.float().abs().max() / FP8_MAX
    return (weight.float() / scale).clamp(-FP8_MAX, FP8_MAX).to(torch.float8_e4m3fn), scale


def modelopt_fp8_and_dequantized(ckpts, tmp_path) -> tuple:
    """The base checkpoint in ModelOpt's FP8 layout, and beside it a float32 copy of the weights it stores,
    dequantized by hand (code * scale in float32): transformers' reference."""
    fp8 = harness.copy_checkpoint(ckpts, tmp_path)
    dense = shutil.copytree(fp8, tmp_path / "dequantized")
    tensors = load_file(fp8 / "model.safetensors")
    quantized, dequantized = {}, {}
    for key, value in tensors.items():
        module = key.removesuffix(".weight")
        if value.dim() == 2 and key.endswith(QUANTIZED) and not key.endswith("mixer.gate.weight"):
            code, scale = quantize_per_tensor(value)
            quantized |= {key: code, f"{module}.weight_scale": scale, f"{module}.input_scale": torch.tensor(0.02)}
            if module.endswith(("k_proj", "v_proj")):
                quantized[f"{module}.{module[-6]}_scale"] = torch.tensor(0.05)
            dequantized[key] = code.float() * scale
        else:
            quantized[key], dequantized[key] = value, value.float()
    assert sum(k.endswith(".weight_scale") for k in quantized) > 50
    save_file(quantized, fp8 / "model.safetensors", metadata={"format": "pt"})
    save_file(dequantized, dense / "model.safetensors", metadata={"format": "pt"})
    config = json.loads((fp8 / "config.json").read_text())
    (fp8 / "config.json").write_text(json.dumps(config | {"quantization_config": MODELOPT_QC}))
    return fp8, dense


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["float32", "bfloat16"])
def test_modelopt_fp8_checkpoint_is_its_dequantized_weights(ckpts, tmp_path, dtype):
    """Loaded from ModelOpt's per-tensor FP8 layout, every weight is the hand-dequantized one (code * scale in
    float32, cast once to the dtype) bit for bit, and the model is transformers' on those weights: in float32
    every site within 1e-5 (the routed experts' sums round with the thread count), in bfloat16 the same experts
    and every site bit for bit."""
    fp8, dense = modelopt_fp8_and_dequantized(ckpts, tmp_path)
    model = HookedTransformer.from_pretrained(fp8, dtype=dtype, progress=False)
    expected = HookedTransformer.from_pretrained(dense, dtype=dtype, progress=False).state_dict()
    for name, value in model.state_dict().items():
        assert value.dtype == expected[name].dtype and torch.equal(value, expected[name]), name
    report = compare(model, load_reference(dense, dtype), tokens(shape=(2, 80)))
    if dtype == torch.float32:
        harness.check_report(report, model, block_sites(model), 1e-5, MODEL_SITES)
    else:
        harness.check_bit_exact(report)
    original = HookedTransformer.from_pretrained(ckpts["base"], dtype=dtype, progress=False)
    assert not torch.equal(model.blocks[0].mixer.in_proj.weight, original.blocks[0].mixer.in_proj.weight)


def test_plan_counts_a_modelopt_fp8_checkpoint_as_its_files(ckpts, tmp_path):
    """The plan of the ModelOpt FP8 checkpoint: its bytes and stored values are the files' tensors' (fp8 weights,
    a float32 weight_scale and input_scale each, k_scale / v_scale, the rest as stored), from the folder and from
    config.json alone; only the dequantized mode is placed."""
    fp8, _ = modelopt_fp8_and_dequantized(ckpts, tmp_path)
    stored = load_file(fp8 / "model.safetensors").values()
    nbytes, values = sum(t.numel() * t.element_size() for t in stored), sum(t.numel() for t in stored)
    config = json.loads((fp8 / "config.json").read_text())
    for p in (plan(fp8, cpu_memory="1GB"), plan(config, cpu_memory="1GB")):
        assert (p.stored["bytes"], p.stored["values"]) == (nbytes, values)
        assert p.stored["format"]["method"] == "modelopt" and list(p.stored["modes"]) == ["dequantized"]
    with pytest.raises(ValueError, match="ModelOpt FP8 weights are dequantized at load"):
        plan(config, cpu_memory="1GB", expert_storage="stored")


def test_modelopt_fp8_in_hf_quant_config_reads_the_same(ckpts, tmp_path):
    """ModelOpt's older export: no quantization_config in config.json, hf_quant_config.json beside it."""
    fp8, _ = modelopt_fp8_and_dequantized(ckpts, tmp_path)
    config = json.loads((fp8 / "config.json").read_text())
    qc = config.pop("quantization_config")
    (fp8 / "config.json").write_text(json.dumps(config))
    (fp8 / "hf_quant_config.json").write_text(json.dumps({"producer": qc["producer"], "quantization": {
        k: v for k, v in qc.items() if k not in ("quant_method", "producer")}}))
    with_file = HookedTransformer.from_pretrained(fp8, progress=False)
    (fp8 / "config.json").write_text(json.dumps(config | {"quantization_config": qc}))
    (fp8 / "hf_quant_config.json").unlink()
    in_config = HookedTransformer.from_pretrained(fp8, progress=False)
    for (name, a), b in zip(with_file.state_dict().items(), in_config.state_dict().values()):
        assert torch.equal(a, b), name


SCALE = "backbone.layers.3.mixer.up_proj.weight_scale"


@pytest.mark.parametrize("edit,match", [
    (lambda t: t.pop(SCALE), r"'backbone.layers.3.mixer.up_proj.weight' is stored as F8_E4M3 but its scale "
                             r"'backbone.layers.3.mixer.up_proj.weight_scale' is in no file"),
    (lambda t: t.__setitem__(SCALE, torch.ones(4)), r"scale 'backbone.layers.3.mixer.up_proj.weight_scale' is F32 of "
                                                    r"shape \(4,\); .* shape \[\] or \[1\]"),
    (lambda t: t.__setitem__("backbone.layers.3.mixer.up_proj.input_scale", torch.ones(2, 2)),
     r"scale 'backbone.layers.3.mixer.up_proj.input_scale' is F32 of shape \(2, 2\)"),
    (lambda t: t.__setitem__(SCALE, torch.ones((), dtype=torch.int32)), r"weight_scale' is I32 of shape \(\)"),
    (lambda t: t.__setitem__("backbone.layers.1.mixer.gate.weight_scale", torch.ones(())),
     r"'backbone.layers.1.mixer.gate.weight_scale' scales 'backbone.layers.1.mixer.gate.weight', which .* stores as "
     r"F32, not F8_E4M3"),
    (lambda t: t.__setitem__("backbone.layers.1.mixer.gate.weight", t["backbone.layers.1.mixer.gate.weight"].to(
        torch.float8_e4m3fn)), r"'backbone.layers.1.mixer.gate.weight' is stored as F8_E4M3, but "
                               r"quantization_config.exclude_modules lists '\*.mixer.gate'"),
], ids=["missing_scale", "scale_shape", "input_scale_shape", "scale_dtype", "scale_of_a_dense_weight", "excluded_but_fp8"])
def test_bad_modelopt_scales_are_named(ckpts, tmp_path, edit, match):
    fp8, _ = modelopt_fp8_and_dequantized(ckpts, tmp_path)
    harness.rewrite_tensors(fp8, edit)
    with pytest.raises(CheckpointError, match=match):
        HookedTransformer.from_pretrained(fp8, progress=False)


@pytest.mark.parametrize("edit,match", [
    ({"quant_algo": "NVFP4"}, r"quantization_config.quant_algo = 'NVFP4'; moelens reads ModelOpt's 'FP8'"),
    ({"kv_cache_quant_algo": "INT8"}, r"kv_cache_quant_algo = 'INT8'; expected null or 'FP8'"),
    ({"exclude_modules": "lm_head"}, r"exclude_modules = 'lm_head'; expected a list"),
], ids=["quant_algo", "kv_cache_quant_algo", "exclude_modules"])
def test_bad_modelopt_config_is_named(ckpts, tmp_path, edit, match):
    folder = harness.copy_checkpoint(ckpts, tmp_path)
    config = json.loads((folder / "config.json").read_text())
    (folder / "config.json").write_text(json.dumps(config | {"quantization_config": MODELOPT_QC | edit}))
    with pytest.raises(CheckpointError, match=match):
        HookedTransformer.from_pretrained(folder, progress=False)


def test_multi_token_prediction_weights_are_skipped(ckpts, tmp_path):
    folder = harness.copy_checkpoint(ckpts, tmp_path)
    harness.rewrite_tensors(folder, lambda t: t.update({"mtp.layers.0.norm.weight": torch.ones(64)}))
    HookedTransformer.from_pretrained(folder, progress=False)


def test_offloaded_experts_are_bit_for_bit_the_resident_model(ckpts, base):
    toks = tokens(shape=(2, 30))
    for variant in ("base", "latent"):
        resident = base if variant == "base" else HookedTransformer.from_pretrained(ckpts[variant], progress=False)
        for where in ("cpu", "disk"):
            offloaded = HookedTransformer.from_pretrained(ckpts[variant], progress=False, expert_offload=where,
                                                          expert_cache_bytes=0)
            with torch.no_grad():
                assert torch.equal(offloaded(toks), resident(toks)), (variant, where)
        assert torch.equal(offloaded.generate(toks[:1, :6], max_new_tokens=6, do_sample=False),
                           resident.generate(toks[:1, :6], max_new_tokens=6, do_sample=False))


def _ep_worker(rank: int, world: int, port: int, path: str, out: str) -> None:
    os.environ.update(RANK=str(rank), WORLD_SIZE=str(world), MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    torch.set_num_threads(1)
    model = HookedTransformer.from_pretrained(path, progress=False, expert_parallel=True)
    toks = tokens(shape=(2, 20))
    logits, cache = model.run_with_cache(toks, names_filter=lambda n: ".mlp." in n)
    torch.save({"logits": logits, "cache": dict(cache.items()),
                "generated": model.generate(toks[:, :6], max_new_tokens=5, do_sample=False)}, f"{out}/rank{rank}.pt")
    dist.destroy_process_group()


@pytest.mark.slow
def test_expert_parallel_ranks_equal_one_process(ckpts, tmp_path):
    from test_expert_parallel import free_port

    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        model = HookedTransformer.from_pretrained(ckpts["latent"], progress=False)
        toks = tokens(shape=(2, 20))
        logits, cache = model.run_with_cache(toks, names_filter=lambda n: ".mlp." in n)
        generated = model.generate(toks[:, :6], max_new_tokens=5, do_sample=False)
    finally:
        torch.set_num_threads(threads)
    mp.spawn(_ep_worker, args=(2, free_port(), str(ckpts["latent"]), str(tmp_path)), nprocs=2, start_method="spawn")
    for rank in range(2):
        got = torch.load(tmp_path / f"rank{rank}.pt")
        assert torch.equal(got["logits"], logits) and torch.equal(got["generated"], generated)
        for name, t in cache.items():
            assert torch.equal(got["cache"][name], t), (rank, name)


# ---- plan at full size, support, verify, the embedded default --------------------------------------------------

NANO = flagship("nemotron_h", "nvidia/NVIDIA-Nemotron-3-Nano-30B-A3B-BF16")
SUPER = flagship("nemotron_h", "nvidia/NVIDIA-Nemotron-3-Super-120B-A12B-BF16")  # latent experts


def test_plan_places_nano_on_one_gpu_and_super_not():
    """bfloat16: Nano (63 GB) fits one 141 GB GPU; Super (241 GB) does not, and fits a node of eight."""
    nano = plan(dict(NANO), dtype="bfloat16", cpu_memory="2TB", gpus=1, gpu_memory="141GB")
    assert nano.placement["recommended"]["kind"] == "one_device"
    one = plan(dict(SUPER), dtype="bfloat16", cpu_memory="2TB", gpus=1, gpu_memory="141GB")
    assert "one_device" not in [o["kind"] for o in one.placement["options"]]
    node = plan(dict(SUPER), dtype="bfloat16", cpu_memory="2TB", gpus=8, gpu_memory="141GB")
    assert node.placement["recommended"]["kind"] == "device_map"


def test_plan_counts_attention_keys_and_the_mamba_state():
    """6 attention layers cache 2 x 2 kv heads x 128 values per token; 23 Mamba-2 layers hold a convolution window
    (64 x 64 + 2 x 8 x 128 channels x kernel 4) and a float32 state (64 heads x 64 x 128) per sequence."""
    p = plan(dict(NANO), dtype="bfloat16", gpus=1, gpu_memory="141GB", batch=1, seq=2048)
    per_token = 6 * 2 * 2 * 128  # bfloat16
    conv_window = (64 * 64 + 2 * 8 * 128) * 4  # bfloat16
    state = 64 * 64 * 128  # float32: 4 bytes a value
    assert p.kv_cache["bytes"] == (2048 * per_token + 23 * conv_window) * 2 + 23 * state * 4


def test_support_lists_each_layer_kinds_sites(base):
    rows = {r.name: r for r in base.support(print_table=False).rows}
    assert rows["blocks.L.hook_attn_out"].layers == "0,2,4,6" and rows["blocks.L.hook_attn_out"].reference == "model.layers.L.mixer"
    assert rows["blocks.L.hook_mlp_out"].layers == "1,3,5,7"
    assert rows["blocks.L.mixer.hook_state_out"].layers == "0,4" and rows["blocks.L.attn.hook_pattern"].layers == "2,6"
    assert rows["blocks.L.mlp.experts.hook_pre"].meaning.startswith("never fires")
    assert rows["blocks.L.mlp.experts.hook_post"].meaning == "expert neurons per slot: relu2(up), no gate"
    assert rows["blocks.L.mlp.hook_post"].meaning == "neurons: act(up)" and rows["blocks.L.mlp.hook_post"].layers == "3"
    assert "blocks.L.hook_resid_mid" not in rows


def test_embedded_default_verify_and_generate(tmp_path, monkeypatch, capsys):
    from moelens.defaults import default_checkpoint

    monkeypatch.setattr("moelens.defaults.cache_root", lambda: tmp_path)
    model = HookedTransformer.from_pretrained("tiny-nemotron-h", progress=False)
    assert type(model) is HookedNemotronH and model.cfg.d_vocab == 260
    assert model.generate("Hi", max_new_tokens=3, stop_at_eos=False, do_sample=False)
    folder = default_checkpoint("tiny-nemotron-h")
    assert json.loads((folder / "config.json").read_text())["hybrid_override_pattern"] == "ME*-E"
    report = compare(model, load_reference(folder), torch.randint(0, 260, (2, 16)))
    assert report.max_logit_diff <= 1e-5 and report.index_mismatches == 0
    assert main(["verify", "tiny-nemotron-h"]) == 0
    out = capsys.readouterr().out
    assert "float32: OK" in out and "bfloat16: OK" in out and "blocks.1.mlp.hook_router_logits" in out


def test_triton_backend_is_refused_naming_the_ungated_experts(base):
    """The Triton kernels compute gated experts only; "auto" takes the torch path for these, "triton" is refused."""
    assert all(b.mlp.experts.executor == "torch" for b in base.blocks if b.is_moe)
    with pytest.raises(ValueError, match="relu2\\(up\\), no gate"):
        base.set_experts_backend("triton")


@pytest.mark.parametrize("variant", ["base", "latent"])
def test_fold_ln_keeps_the_logits(ckpts, variant):
    """Each block's one norm folds into what reads it: a Mamba-2 layer's in_proj, attention's q/k/v, a mixture's
    router and shared expert and its experts' up rows (a latent mixture's fc1_latent_proj instead), a dense MLP's
    up projection."""
    plain = HookedTransformer.from_pretrained(ckpts[variant], progress=False)
    folded = HookedTransformer.from_pretrained(ckpts[variant], progress=False, fold_ln=True)
    assert all(torch.equal(sub.norm.weight, torch.ones_like(sub.norm.weight)) for b in folded.blocks for sub in b.sublayers())
    toks = tokens(shape=(2, 30))
    with torch.no_grad():
        assert (plain(toks) - folded(toks)).abs().max() <= 1e-5


def test_ungated_expert_views_reproduce_the_hooks(base):
    """W_gate is refused (no gate); W_in is the up stack and W_out the down stack: each slot's up projection and
    weighted output recomputed from them and the cached inputs."""
    toks = tokens(21, (2, 9))
    with torch.no_grad():
        _, cache = base.run_with_cache(toks)
        with pytest.raises(ValueError, match="W_gate: this model's routed experts have no gate"):
            base.W_gate
        W_in, W_out = base.W_in, base.W_out
        for l in base.cfg.moe_layer_indices:
            x, idx = cache[f"blocks.{l}.ln2.hook_normalized"], cache["expert_indices", l]
            up = torch.einsum("bpm,bpkmi->bpki", x, W_in[l][idx])
            torch.testing.assert_close(up, cache[f"blocks.{l}.mlp.experts.hook_pre_linear"], rtol=0, atol=1e-5)
            out = torch.einsum("bpki,bpkim->bpkm", cache[f"blocks.{l}.mlp.experts.hook_post"], W_out[l][idx])
            weighted = out * cache["expert_weights", l][..., None].to(out.dtype)
            torch.testing.assert_close(weighted, cache["expert_outputs", l], rtol=0, atol=1e-5)
