"""gpt-oss (HookedGptOss) against transformers' GptOssForCausalLM: site by site in float32, bfloat16, greedy
generation, the sinks, the sliding layers, the clamped SwiGLU, the stored expert layouts, errors, the full-size
parameter count and the embedded default."""

import json
import shutil

import pytest
import torch
import torch.nn.functional as F
import family_harness as harness
import tiny_gpt_oss
from flagships import flagship
from family_harness import (
    MODEL_SITES, References, build_checkpoints, check_greedy_generation, check_report, config_json, rewrite_tensors,
    stored_keys,
)
from safetensors import safe_open

from moelens import HookedTransformer
from moelens.experts.spec import ClampedSwiGLU
from moelens.loaders.checkpoint import expected_keys
from moelens.loaders.errors import CheckpointError
from moelens.models.gpt_oss import HookedGptOss, SinkAttention
from moelens.plan import plan
from moelens.verify import compare, load_reference

VARIANTS = tiny_gpt_oss.VARIANTS
WINDOW = tiny_gpt_oss.WINDOW

GPT_OSS_20B = flagship("gpt_oss", "openai/gpt-oss-20b")


@pytest.fixture(scope="module")
def ckpts(tmp_path_factory):
    return build_checkpoints(tmp_path_factory, "gpt_oss", VARIANTS)


@pytest.fixture(scope="module")
def refs(ckpts):
    return References(ckpts)


def tokens(seed=3, shape=(2, 24)):
    return harness.tokens(seed, shape)


# ---- float32: every site against transformers ---------------------------------------------------------------

@pytest.mark.parametrize("variant", [v for _, v in VARIANTS])
def test_float32_every_site(ckpts, refs, variant):
    model = HookedTransformer.from_pretrained(ckpts[variant], progress=False)
    assert type(model) is HookedGptOss and isinstance(model.blocks[0].attn, SinkAttention)
    per_block = ("hook_resid_pre", "ln1.hook_normalized", "attn.hook_q", "attn.hook_k", "attn.hook_v", "attn.hook_z",
                 "hook_attn_out", "ln2.hook_normalized", "mlp.hook_router_logits", "mlp.hook_expert_weights",
                 "mlp.hook_expert_indices", "mlp.hook_routed_out", "hook_mlp_out", "hook_resid_post")
    check_report(compare(model, refs(variant), tokens()), model, lambda layer: per_block, model_sites=MODEL_SITES)


def test_variants_are_what_they_claim(ckpts):
    cfg = {v: HookedTransformer.from_pretrained(p, progress=False).cfg for v, p in ckpts.items()}
    assert cfg["base"].attention_windows == (WINDOW, None, WINDOW)
    assert cfg["full_only"].attention_windows == (None, None, None)
    assert cfg["base"].qkv_bias and cfg["base"].o_bias and cfg["base"].rope.kind == "yarn"
    spec = cfg["base"].expert_spec()
    assert spec.bias and spec.activation == ClampedSwiGLU(1.702, 1.5)
    assert len(list(ckpts["sharded"].glob("*.safetensors"))) > 1


# ---- bfloat16 ------------------------------------------------------------------------------------------------

@pytest.mark.parametrize("variant", ["base", "full_only"])
def test_bfloat16_routing_identical_and_logits_bit_exact(ckpts, refs, variant):
    """Same ops in the same order as transformers (the norm's weight applied before the cast; the router,
    sinks and experts in bfloat16; the sink softmax in the scores' dtype), so routing is identical and the
    logits equal. The one place the op order can differ is the expert GEMM: transformers multiplies by its
    stored [E, d_model, 2*d_expert] layout, moelens by the [E, 2*d_expert, d_model] one, which can round a
    routed output differently in its last bfloat16 bit (at most one ulp at a site: checked here)."""
    model = HookedTransformer.from_pretrained(ckpts[variant], dtype=torch.bfloat16, progress=False)
    ref = refs(variant, torch.bfloat16)
    report = compare(model, ref, tokens())
    assert report.index_mismatches == 0
    assert report.max_logit_diff == 0.0, report
    for site in report.sites:
        if site.site.endswith(("hook_routed_out", "hook_mlp_out")):
            # at most one bfloat16 ulp of these outputs (all below 2 in magnitude: ulp 2**-7); measured 2**-10
            assert site.max_abs_diff <= 2**-7, report
        else:
            assert site.max_abs_diff == 0.0, report


# ---- what only gpt-oss has --------------------------------------------------------------------------------

def test_sinks_take_their_share_and_are_hookable(ckpts):
    """A pattern row sums to 1 minus the sink's share, written out by hand from the cached scores and the
    sinks; raising the sink logits through hook_sink_scores lowers every row's mass and changes the logits."""
    model = HookedTransformer.from_pretrained(ckpts["base"], progress=False)
    logits, cache = model.run_with_cache(tokens())
    scores, pattern = cache["blocks.1.attn.hook_attn_scores"], cache["blocks.1.attn.hook_pattern"]
    sinks = model.blocks[1].attn.sinks.detach()
    by_hand = torch.softmax(torch.cat([scores, sinks.view(1, -1, 1, 1).expand(*scores.shape[:3], 1)], -1), -1)
    assert (pattern - by_hand[..., :-1]).abs().max() <= 1e-6
    assert (pattern.sum(-1) < 1).all() and cache["blocks.1.attn.hook_sink_scores"].shape == (2, 4, 24, 1)
    raised = model.run_with_hooks(tokens(), fwd_hooks=[("blocks.1.attn.hook_sink_scores", lambda t, hook: t + 5.0)])
    in_place = model.run_with_hooks(tokens(), fwd_hooks=[("blocks.1.attn.hook_sink_scores", lambda t, hook: t.add_(5.0))])
    assert torch.equal(raised, in_place) and (raised - logits).abs().max() > 1e-3


def test_sliding_layers_see_only_the_window(ckpts):
    """In a sliding layer a query's pattern is zero beyond WINDOW positions back; in a full layer it is not."""
    model = HookedTransformer.from_pretrained(ckpts["base"], progress=False)
    _, cache = model.run_with_cache(tokens())
    q = torch.arange(24)[:, None]
    k = torch.arange(24)[None, :]
    outside = (k <= q - WINDOW) & (k <= q)
    assert (cache["blocks.0.attn.hook_pattern"][..., outside] == 0).all()
    assert (cache["blocks.1.attn.hook_pattern"][..., outside] > 0).all()


def test_expert_neurons_are_the_clamped_swiglu_by_hand(ckpts):
    """hook_post is (clamp(up) + 1) * g * sigmoid(alpha * g), g = clamp(gate, max=limit), from the cached
    pre-activations (which include the expert biases), and the clamps act on this model."""
    model = HookedTransformer.from_pretrained(ckpts["base"], progress=False)
    _, cache = model.run_with_cache(tokens())
    gate, up = cache["blocks.2.mlp.experts.hook_pre"], cache["blocks.2.mlp.experts.hook_pre_linear"]
    limit, alpha = 1.5, 1.702
    assert (gate > limit).any() and (up.abs() > limit).any()
    g = gate.clamp(max=limit)
    assert torch.equal(cache["blocks.2.mlp.experts.hook_post"], (up.clamp(-limit, limit) + 1) * (g * torch.sigmoid(g * alpha)))


def test_router_weights_are_a_softmax_over_the_chosen_logits(ckpts):
    model = HookedTransformer.from_pretrained(ckpts["base"], progress=False)
    _, cache = model.run_with_cache(tokens())
    logits = cache["blocks.0.mlp.hook_router_logits"]
    top = torch.topk(logits, 3, dim=-1)
    assert torch.equal(cache["blocks.0.mlp.hook_expert_indices"], top.indices)
    assert torch.equal(cache["blocks.0.mlp.hook_expert_weights"], F.softmax(top.values, dim=-1))


def test_biased_expert_decomposition_sums_to_the_routed_output(ckpts):
    """The neuron decomposition of a biased mixture has each expert's weighted output bias as a component
    ("L{l}.E{e}.bias"), so the components of a layer sum to its routed output."""
    model = HookedTransformer.from_pretrained(ckpts["base"], progress=False)
    _, cache = model.run_with_cache(tokens())
    ffn = next(sub for sub in model.blocks[1].sublayers() if sub.kind == "ffn")
    parts, labels = cache._mlp_neuron_parts(1, ffn, None, None)
    stack = torch.cat(parts)
    assert sum(lab.endswith(".bias") for lab in labels) == 8
    assert (stack.sum(0) - cache["blocks.1.mlp.hook_routed_out"]).abs().max() <= 1e-5


# ---- generation -----------------------------------------------------------------------------------------------

def test_greedy_generation_matches_transformers(ckpts, refs):
    model = HookedTransformer.from_pretrained(ckpts["base"], progress=False)
    check_greedy_generation(model, refs("base"), tokens(5, (2, 9)))


# ---- checkpoint layouts and errors ----------------------------------------------------------------------------

def test_stored_layout_is_mapped_onto_the_spec(ckpts):
    """transformers saves gate_up_proj [E, d_model, 2*d_expert] with gate and up interleaved, down_proj [E,
    d_expert, d_model]; moelens holds W_gate_up [E, 2*d_expert, d_model] gate rows first, W_down [E, d_model,
    d_expert] and the biases gate first."""
    model = HookedTransformer.from_pretrained(ckpts["base"], progress=False)
    assert set(expected_keys(HookedGptOss.site_map(model.cfg))) == set(stored_keys(ckpts["base"]))
    with safe_open(ckpts["base"] / "model.safetensors", "pt") as f:
        gate_up = f.get_tensor("model.layers.1.mlp.experts.gate_up_proj")
        bias = f.get_tensor("model.layers.1.mlp.experts.gate_up_proj_bias")
        down = f.get_tensor("model.layers.1.mlp.experts.down_proj")
    experts = model.blocks[1].mlp.experts
    assert torch.equal(experts.W_gate_up[3, :32], gate_up[3, :, 0::2].T)  # gate: the even columns
    assert torch.equal(experts.W_gate_up[3, 32:], gate_up[3, :, 1::2].T)  # up: the odd columns
    assert torch.equal(experts.b_gate_up[3], torch.cat([bias[3, 0::2], bias[3, 1::2]]))
    assert torch.equal(experts.W_down[3], down[3].T)


def test_misshapen_expert_tensor_names_its_key_and_stored_shape(ckpts, tmp_path):
    folder = shutil.copytree(ckpts["base"], tmp_path / "ckpt")
    rewrite_tensors(folder, lambda t: t.update({"model.layers.0.mlp.experts.down_proj": torch.zeros(8, 64, 32)}))
    with pytest.raises(CheckpointError) as info:
        HookedTransformer.from_pretrained(folder, progress=False)
    message = str(info.value)
    for part in ("model.layers.0.mlp.experts.down_proj", "(8, 64, 32)", "(8, 32, 64)"):
        assert part in message, message


def test_missing_sinks_and_expert_bias_name_their_keys(ckpts, tmp_path):
    for key in ("model.layers.2.self_attn.sinks", "model.layers.1.mlp.experts.down_proj_bias"):
        folder = shutil.copytree(ckpts["base"], tmp_path / key)
        rewrite_tensors(folder, lambda t: t.pop(key))
        with pytest.raises(CheckpointError, match="missing") as info:
            HookedTransformer.from_pretrained(folder, progress=False)
        assert key in str(info.value)


@pytest.mark.parametrize("change,message", [
    ({"layer_types": ["full_attention"] * 2}, "layer_types"),
    ({"layer_types": ["local"] * 3}, "layer_types"),
    ({"swiglu_limit": 0}, "swiglu_limit"),
    ({"num_experts_per_tok": 9}, "num_experts_per_tok"),
])
def test_config_refusals(ckpts, change, message):
    with pytest.raises(ValueError, match=message):
        HookedGptOss.config_from_hf({**config_json(ckpts["base"]), **change})


def with_config(ckpts, tmp_path, **changes):
    """A copy of the base checkpoint whose config.json has `changes` (None: the field written as null)."""
    folder = shutil.copytree(ckpts["base"], tmp_path / "edited")
    (folder / "config.json").write_text(json.dumps({**config_json(folder), **changes}))
    return folder


def test_layer_types_null_is_transformers_alternating_default(ckpts, tmp_path):
    """layer_types null: transformers' GptOssConfig makes it sliding, full, sliding, ... (was refused here)."""
    folder = with_config(ckpts, tmp_path, layer_types=None)
    model = HookedTransformer.from_pretrained(folder, progress=False)
    assert model.cfg.attention_windows == (WINDOW, None, WINDOW)
    report = compare(model, load_reference(folder), tokens())
    assert report.max_logit_diff <= 1e-5 and report.index_mismatches == 0, report


@pytest.mark.parametrize("layer_types", [None, ["full_attention"] * 3])
def test_sliding_window_null_is_refused_naming_it(ckpts, tmp_path, layer_types):
    """sliding_window null was read as a 128-token window; transformers cannot run that config (with sliding
    layers or without): refused, naming the field."""
    folder = with_config(ckpts, tmp_path, sliding_window=None, layer_types=layer_types)
    with pytest.raises(Exception):  # noqa: B017 (transformers raises a TypeError or a ValueError: it fails either way)
        load_reference(folder)(tokens())
    with pytest.raises(CheckpointError, match="sliding_window = null: gpt-oss's attention needs a window length"):
        HookedTransformer.from_pretrained(folder, progress=False)


def test_triton_backend_computes_the_clamped_biased_experts_and_auto_uses_torch(ckpts):
    """The Triton kernels add the biases and compute ClampedSwiGLU: the logits within 1e-5 of the torch path's
    (float32; every hook is compared in test_triton_kernels' per-family test). "auto" stays on the torch path
    on CPU: the same bits as before."""
    model = HookedTransformer.from_pretrained(ckpts["base"], progress=False)
    expected = model(tokens())
    model.set_experts_backend("triton")
    assert (model(tokens()) - expected).abs().max() <= 1e-5
    model.set_experts_backend("auto")
    assert torch.equal(model(tokens()), expected)


# ---- plan and support ------------------------------------------------------------------------------------------

def test_plan_counts_the_routed_experts_at_full_size():
    """(The total against transformers' and the published one: tests/test_flagships.py.)"""
    import transformers

    with torch.device("meta"):
        hf = transformers.GptOssForCausalLM(_hf_config(GPT_OSS_20B))
    p = plan(dict(GPT_OSS_20B), dtype="bfloat16", cpu_memory="1TB")
    experts = sum(t.numel() for n, t in hf.named_parameters() if ".mlp.experts." in n)
    assert p.components["routed_experts"].parameters == experts


def test_support_lists_the_sink_site(ckpts):
    model = HookedTransformer.from_pretrained(ckpts["base"], progress=False)
    rows = {r.name: r for r in model.support().rows}
    assert "blocks.L.attn.hook_sink_scores" in rows
    assert "sink" in rows["blocks.L.attn.hook_pattern"].meaning
    assert "clamp" in rows["blocks.L.mlp.experts.hook_post"].meaning


# ---- helpers ---------------------------------------------------------------------------------------------------


def _hf_config(config):
    from transformers import GptOssConfig

    return GptOssConfig(**{k: v for k, v in config.items() if k not in ("model_type", "architectures", "rope_scaling", "experts_per_token")})


def test_embedded_default(tmp_path, monkeypatch):
    from moelens.defaults import default_checkpoint

    monkeypatch.setattr("moelens.defaults.cache_root", lambda: tmp_path)
    model = HookedTransformer.from_pretrained("tiny-gpt-oss", progress=False)
    assert type(model) is HookedGptOss and model.cfg.d_vocab == 260
    report = compare(model, load_reference(default_checkpoint("tiny-gpt-oss")), torch.randint(0, 260, (2, 20)))
    assert report.max_logit_diff <= 1e-5 and report.index_mismatches == 0


# ---- the published MXFP4 experts -------------------------------------------------------------------------------

@pytest.fixture(scope="module")
def mxfp4(tmp_path_factory):
    return tiny_gpt_oss.to_mxfp4(tiny_gpt_oss.build_gpt_oss(tmp_path_factory.mktemp("gpt_oss_mxfp4") / "ckpt", seed=4))


def test_mxfp4_checkpoint_loads_as_transformers_dequantizes_it(mxfp4):
    """First, transformers' own dequantizing load reads the files back to the values written out by hand;
    then moelens's parameters are those values in moelens's layout, and the logits match transformers'."""
    from transformers import GptOssForCausalLM, Mxfp4Config

    ref = GptOssForCausalLM.from_pretrained(mxfp4, quantization_config=Mxfp4Config(dequantize=True), dtype=torch.float32).eval()
    with safe_open(mxfp4 / "model.safetensors", "pt") as f:
        blocks, scales = f.get_tensor("model.layers.1.mlp.experts.gate_up_proj_blocks"), f.get_tensor("model.layers.1.mlp.experts.gate_up_proj_scales")
        down = tiny_gpt_oss.dequantize_mxfp4_by_hand(f.get_tensor("model.layers.1.mlp.experts.down_proj_blocks"), f.get_tensor("model.layers.1.mlp.experts.down_proj_scales"))
    gate_up = tiny_gpt_oss.dequantize_mxfp4_by_hand(blocks, scales)  # [E, 2 * d_expert interleaved, d_model]
    assert torch.equal(ref.model.layers[1].mlp.experts.gate_up_proj, gate_up.transpose(1, 2))
    assert torch.equal(ref.model.layers[1].mlp.experts.down_proj, down.transpose(1, 2))
    model = HookedTransformer.from_pretrained(mxfp4, progress=False)
    experts = model.blocks[1].mlp.experts
    assert torch.equal(experts.W_gate_up, torch.cat([gate_up[:, 0::2], gate_up[:, 1::2]], dim=1))
    assert torch.equal(experts.W_down, down)
    report = compare(model, ref, tokens())
    assert report.index_mismatches == 0 and report.max_logit_diff <= 1e-5, report


def test_mxfp4_experts_offloaded_and_bfloat16(mxfp4):
    """Offloaded to disk, each expert is dequantized from its own rows of the blocks and scales: the same bits
    as the resident model's, in float32 and bfloat16."""
    for dtype in (torch.float32, torch.bfloat16):
        resident = HookedTransformer.from_pretrained(mxfp4, dtype=dtype, progress=False)
        offloaded = HookedTransformer.from_pretrained(mxfp4, dtype=dtype, progress=False, expert_offload="disk", expert_cache_bytes=0)
        assert torch.equal(offloaded(tokens()), resident(tokens()))


def test_mxfp4_blocks_of_the_wrong_shape_name_their_key(mxfp4, tmp_path):
    folder = shutil.copytree(mxfp4, tmp_path / "ckpt")
    rewrite_tensors(folder, lambda t: t.update({"model.layers.2.mlp.experts.down_proj_scales": torch.zeros(8, 64, 2, dtype=torch.uint8)}))
    with pytest.raises(CheckpointError, match=r"model\.layers\.2\.mlp\.experts\.down_proj_scales"):
        HookedTransformer.from_pretrained(folder, progress=False)
