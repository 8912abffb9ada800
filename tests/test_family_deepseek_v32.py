"""DeepSeek-V3.2 (DeepSeek Sparse Attention: a lightning indexer beside multi-head latent attention) against
transformers' own DeepseekV32ForCausalLM on the same tiny checkpoints. transformers' indexer returns only the
top-k indices, so its scores are checked by hand from its submodules' outputs."""

import json

import pytest
import torch
from safetensors.torch import load_file

import tiny
import family_harness as harness
import tiny_deepseek_v32 as tiny_dsa
from dsa_checks import captured, index_scores_by_hand, window_selection
from flagships import flagship
from family_harness import (
    References, build_checkpoints, check_bit_exact, check_greedy_generation, copy_checkpoint, left_padded,
    rewrite_tensors, stored_keys, tokens,
)
from moelens import HookedTransformer, KVCache
from moelens.loaders.errors import CheckpointError
from moelens.models.components.sparse_latent_attention import IndexedLatentAttention
from moelens.models.deepseek_v32 import HookedDeepseekV32
from moelens.plan import plan
from moelens.state import IndexedKVState
from moelens.verify import compare

VARIANTS = [v for (_, v) in tiny_dsa.VARIANTS]
PER_BLOCK = ("hook_resid_pre", "hook_attn_out", "hook_mlp_out", "hook_resid_post", "ln1.hook_normalized",
             "ln2.hook_normalized", "attn.hook_q", "attn.hook_q_latent", "attn.hook_kv_latent", "attn.hook_z",
             "attn.hook_index_topk")


@pytest.fixture(scope="module")
def checkpoints(tmp_path_factory):
    return build_checkpoints(tmp_path_factory, "deepseek_v32", tiny_dsa.VARIANTS)


@pytest.fixture(scope="module")
def models(checkpoints):
    return {v: HookedTransformer.from_pretrained(p, progress=False) for v, p in checkpoints.items()}


@pytest.fixture(scope="module")
def references(checkpoints):
    return References(checkpoints)


def test_variants_are_what_they_claim(models, checkpoints):
    base = models["base"].cfg
    assert base.index_topk == 3 < 40 and base.index_n_heads == 4 and base.index_head_dim == 16
    assert base.indexer_layers == (True, True, True) and not base.index_rope_interleaved and base.rope.interleaved
    assert all(type(b.attn) is IndexedLatentAttention for b in models["base"].blocks)
    assert "model.layers.1.mlp.experts.gate_up_proj" in stored_keys(checkpoints["fused"])
    assert "model.layers.2.self_attn.indexer.k_norm.bias" in stored_keys(checkpoints["base"])
    hub = json.loads((checkpoints["hub"] / "config.json").read_text())
    assert "rope_parameters" not in hub and "mlp_layer_types" not in hub and "rope_scaling" in hub
    assert models["hub"].cfg == models["hub"].cfg.__class__(**{**vars(models["hub"].cfg)})
    assert models["hub"].cfg.rope == base.rope and models["hub"].cfg.moe_layers == base.moe_layers


@pytest.mark.parametrize("variant", VARIANTS)
def test_float32(models, references, variant):
    """Logits and every site, the chosen keys of every layer included, against transformers'."""
    model = models[variant]
    assert type(model) is HookedDeepseekV32
    harness.check_report(compare(model, references[variant], tokens()), model, lambda layer: PER_BLOCK)


def test_float32_left_padded(models, references):
    toks, mask = tokens(5, (3, 24)), torch.ones(3, 24, dtype=torch.long)
    mask[0, :4], mask[1, :9] = 0, 0
    report = compare(models["base"], references["base"], toks, mask)
    assert report.max_logit_diff <= 1e-5 and report.index_mismatches == 0, report
    assert all(s.max_abs_diff == 0 for s in report.sites if s.site.endswith("hook_index_topk")), report


@pytest.mark.parametrize("layer", [0, 2])
def test_index_scores_are_transformers_by_hand(models, references, layer):
    from transformers.models.deepseek_v32.modeling_deepseek_v32 import apply_rotary_pos_emb

    toks = tokens()
    expected = index_scores_by_hand(references["base"], toks, layer, lambda q, k, c, s: apply_rotary_pos_emb(q, k, c, s, 2))
    _, cache = models["base"].run_with_cache(toks, names_filter="*hook_index_scores")
    ours = cache[f"blocks.{layer}.attn.hook_index_scores"]
    assert ours.shape == (2, 40, 40) and ours.dtype == torch.float32
    assert (ours.double() - expected).abs().max() <= 1e-5


def test_bfloat16_is_bit_exact(checkpoints, references):
    model = HookedTransformer.from_pretrained(checkpoints["base"], dtype=torch.bfloat16, progress=False)
    check_bit_exact(compare(model, references("base", torch.bfloat16), tokens()))


@pytest.mark.parametrize("padded", [False, True])
def test_greedy_generation_matches_transformers(models, references, padded):
    prompt = left_padded(5, (3, 9), (0, 3, 1)) if padded else (tokens(5, (3, 9)), None)
    check_greedy_generation(models["base"], references["base"], *prompt, new=64)


def transformers_in_chunks(ref, toks, mask, bounds):
    """transformers' logits of each chunk, its DynamicCache carried from one to the next."""
    from moelens.positions import positions_from_mask

    positions, cache, out = positions_from_mask(mask), None, []
    with torch.no_grad():
        for start, stop in bounds:
            step = ref(toks[:, start:stop], attention_mask=mask[:, :stop], position_ids=positions[:, start:stop],
                       cache=cache, use_cache=True)
            cache = step.cache
            out.append(step.logits)
    return out


def test_cached_steps_match_transformers_cached_steps(models, references):
    """Chunk by chunk with a cache, the logits of transformers' cached forward on the same chunks (the indexer's
    top-k is discontinuous: a cached forward rounds its scores as transformers' cached forward does, not always
    as the uncached one, so transformers' cached run is the reference). The cache holds MLA's keys and values
    and the indexer's keys (one index_head_dim key per position); a forward that fails leaves them as they were."""
    model, ref = models["base"], references["base"]
    cfg = model.cfg
    toks, mask = tokens(5, (3, 12)), torch.ones(3, 12, dtype=torch.long)
    mask[1, :3] = 0
    bounds = [(0, 5), (5, 8), (8, 12)]
    expected = transformers_in_chunks(ref, toks, mask, bounds)
    with torch.no_grad():
        cache = KVCache.for_model(model)
        parts = [model(toks[:, :5], attention_mask=mask[:, :5], past_kv_cache=cache)]
        parts += [model(toks[:, 5:8], past_kv_cache=cache)]
        held = [(s.keys.clone(), s.index_keys.clone()) for s in cache.layers]

        def boom(t, hook):
            raise RuntimeError("boom")

        with pytest.raises(RuntimeError, match="boom"):
            model.run_with_hooks(toks[:, 8:], past_kv_cache=cache, fwd_hooks=[("blocks.2.attn.hook_index_topk", boom)])
        assert all(s.length == s.index_length == 8 for s in cache.layers)
        parts += [model(toks[:, 8:], past_kv_cache=cache)]
    real = mask.bool()
    for (start, stop), ours, theirs in zip(bounds, parts, expected):
        assert (ours - theirs)[real[:, start:stop]].abs().max() <= 1e-5, (start, stop)
    for layer, state in enumerate(cache.layers):
        assert isinstance(state, IndexedKVState) and state.index_keys.shape == (3, 12, cfg.index_head_dim)
        assert torch.equal(state.index_keys[:, :8], held[layer][1]) and torch.equal(state.keys[:, :8], held[layer][0])
    per_token = cfg.n_heads * (cfg.qk_nope_head_dim + cfg.qk_rope_head_dim + cfg.v_head_dim) + cfg.index_head_dim
    assert cache.nbytes == cfg.n_layers * 3 * 12 * per_token * 4


def dense_copy_as_deepseek_v3(folder, dest):
    """The same weights as a DeepSeek-V3 checkpoint (no indexer): plain MLA over every key."""
    dest = copy_checkpoint({"x": folder}, dest, "x")
    rewrite_tensors(dest, lambda t: [t.pop(k) for k in [k for k in t if ".indexer." in k]])
    tiny.edit_config(dest, model_type="deepseek_v3", architectures=["DeepseekV3ForCausalLM"], rope_interleave=True,
                     mlp_layer_types=None, layer_types=None)
    return dest


def test_selecting_every_key_is_plain_latent_attention(checkpoints, models, tmp_path):
    """With index_topk at least the keys, every query keeps every key it may see: DeepSeek-V3's MLA on the same
    weights, bit for bit; with index_topk 3 the selection changes the logits."""
    wide = copy_checkpoint(checkpoints, tmp_path, "base")
    tiny.edit_config(wide, index_topk=64)
    dense = HookedTransformer.from_pretrained(dense_copy_as_deepseek_v3(checkpoints["base"], tmp_path / "v3"), progress=False)
    assert type(dense).__name__ == "HookedDeepseekV3"
    toks = tokens()
    with torch.no_grad():
        assert torch.equal(HookedTransformer.from_pretrained(wide, progress=False)(toks), dense(toks))
        assert not torch.allclose(models["base"](toks), dense(toks), atol=1e-3)


def test_an_edited_selection_is_what_attention_sees(models, references):
    """A selection written at hook_index_topk (each query's 3 most recent keys) gives transformers' logits with
    the same selection forced on its indexers; editing in place means the same as returning."""
    model, toks = models["base"], tokens()
    window = window_selection(2, 40, model.cfg.index_topk)
    expected, _ = captured(references["base"], toks, {}, indexer_output=lambda layer, out: window.to(out.dtype))
    returned = model.run_with_hooks(toks, fwd_hooks=[("blocks.*.attn.hook_index_topk", lambda t, hook: window.clone())])
    in_place = model.run_with_hooks(toks, fwd_hooks=[("blocks.*.attn.hook_index_topk", lambda t, hook: t.copy_(window))])
    assert (returned - expected).abs().max() <= 1e-5 and torch.equal(returned, in_place)
    assert not torch.allclose(returned, model(toks), atol=1e-3)


def test_edited_scores_reselect(models):
    """An edit of hook_index_scores is what the top-k reads: negated scores choose the lowest-scored keys."""
    model, toks = models["base"], tokens()
    _, plain = model.run_with_cache(toks, names_filter=["blocks.1.attn.hook_index_scores"])
    store = {}
    model.run_with_hooks(toks, fwd_hooks=[
        ("blocks.1.attn.hook_index_scores", lambda t, hook: -t),
        ("blocks.1.attn.hook_index_topk", lambda t, hook: store.__setitem__("topk", t.clone())),
    ])
    causal = torch.ones(40, 40, dtype=torch.bool).tril()
    expected = (-plain["blocks.1.attn.hook_index_scores"]).masked_fill(~causal, torch.finfo(torch.float32).min).topk(model.cfg.index_topk).indices
    assert torch.equal(store["topk"], expected)


def test_a_selection_outside_the_keys_is_refused(models):
    with pytest.raises(ValueError, match=r"blocks\.0\.attn\.hook_index_topk.*\[0, 40\)"):
        models["base"].run_with_hooks(tokens(), fwd_hooks=[("blocks.0.attn.hook_index_topk", lambda t, hook: t + 40)])


# ---- checkpoints and configs the loader refuses ------------------------------------------------------------------


@pytest.mark.parametrize("key", [
    "model.layers.1.self_attn.indexer.wq_b.weight",
    "model.layers.0.self_attn.indexer.k_norm.bias",
    "model.layers.2.self_attn.indexer.weights_proj.weight",
])
def test_missing_indexer_tensor_is_named(checkpoints, tmp_path, key):
    folder = copy_checkpoint(checkpoints, tmp_path)
    rewrite_tensors(folder, lambda t: t.pop(key))
    with pytest.raises(CheckpointError, match="missing") as info:
        HookedTransformer.from_pretrained(folder, progress=False)
    assert key in str(info.value)


def test_misshapen_indexer_tensor_is_named(checkpoints, tmp_path):
    folder, key = copy_checkpoint(checkpoints, tmp_path), "model.layers.1.self_attn.indexer.wk.weight"
    rewrite_tensors(folder, lambda t: t.update({key: torch.zeros(12, 64)}))
    with pytest.raises(CheckpointError) as info:
        HookedTransformer.from_pretrained(folder, progress=False)
    assert all(part in str(info.value) for part in (key, "(12, 64)", "(16, 64)"))


def test_config_refusals():
    raw = tiny_dsa.deepseek_v32_config().to_dict()
    for change, message in (
        ({"q_lora_rank": None}, "q_lora_rank"),
        ({"rope_interleave": False}, "rope_interleave"),
        ({"mlp_layer_types": ["dense", "dense", "sparse"]}, "mlp_layer_types"),
        ({"layer_types": ["full_attention"] * 3}, "layer_types"),
        ({"index_head_dim": 4}, "index_head_dim"),
        ({"index_topk": 0}, "index_topk"),
    ):
        with pytest.raises(ValueError, match=message):
            HookedDeepseekV32.config_from_hf({**raw, **change})


# ---- fp8, plan, support, embedded default --------------------------------------------------------------------------

FP8 = {"quant_method": "fp8", "fmt": "e4m3", "activation_scheme": "dynamic", "weight_block_size": [128, 128]}


def test_fp8_checkpoint_equals_transformers_dequantized(tmp_path):
    """DeepSeek-V3.2 publishes block fp8 (DeepSeek-V3's format): the linear weights, the indexer's wq_b, wk and
    weights_proj included, stored float8_e4m3fn with weight_scale_inv; loaded as transformers dequantizes them."""
    from test_quantized_checkpoints import assert_params_equal, check_logits, quantize_folder, transformers_dequantized

    folder = tiny_dsa.build(tmp_path / "fp8", seed=5)
    quantize_folder(folder, (128, 128))
    stored = load_file(folder / "model.safetensors")
    assert stored["model.layers.1.self_attn.indexer.wq_b.weight"].dtype == torch.float8_e4m3fn
    assert "model.layers.1.self_attn.indexer.wk.weight_scale_inv" in stored
    for dtype in (torch.float32, torch.bfloat16):
        hf = transformers_dequantized(folder, dtype)
        model = HookedTransformer.from_pretrained(folder, dtype=dtype, progress=False)
        assert_params_equal(model, hf.state_dict())
        check_logits(model, hf, dtype)  # float32 within 1e-5 (transformers' fp8 linear rounds its own way), bf16 bitwise


DEEPSEEK_V32 = flagship("deepseek_v32", "deepseek-ai/DeepSeek-V3.2")


def full_size_plan(config: dict):
    """The cache's values per token, and the published fp8 checkpoint's placements: one 141 GB GPU (experts
    offloaded), one node of eight (a device map). (The counts against transformers' and the published total:
    tests/test_flagships.py.)"""
    p = plan(dict(config), dtype="bfloat16", cpu_memory="2TB")
    per_token = config["num_attention_heads"] * (
        config["qk_nope_head_dim"] + config["qk_rope_head_dim"] + config["v_head_dim"]) + config["index_head_dim"]
    assert p.kv_cache["bytes"] == config["num_hidden_layers"] * 2048 * per_token * 2
    one = plan(dict(config, quantization_config=FP8), gpus=1, gpu_memory="141GB", cpu_memory="2TB", expert_storage="fp8")
    node = plan(dict(config, quantization_config=FP8), gpus=8, gpu_memory="141GB", cpu_memory="2TB", expert_storage="fp8")
    assert one.stored["bytes"] > 141e9 and one.placement["recommended"]["kind"] == "expert_offload"
    assert node.placement["recommended"]["kind"] == "device_map"
    return one.stored["bytes"]


def test_plan_at_full_size():
    """674.0 GB as fp8."""
    assert full_size_plan(DEEPSEEK_V32) / 1e9 == pytest.approx(674.0, abs=0.1)


def test_support_lists_the_index_sites(models):
    rows = {r.name: r for r in models["base"].support(print_table=False).rows}
    assert rows["blocks.L.attn.hook_index_scores"].shape == "[batch, query, key]"
    assert rows["blocks.L.attn.hook_index_topk"].shape == "[batch, query, 3]"
    assert rows["blocks.L.attn.hook_index_topk"].reference == "model.layers.L.self_attn.indexer"


def test_embedded_default_loads_and_runs():
    model = HookedTransformer.from_pretrained("tiny-deepseek-v32", progress=False)
    assert type(model) is HookedDeepseekV32 and model.cfg.index_topk == 16
    logits, cache = model.run_with_cache("Hello, sparse latent attention; hello again", names_filter="*hook_index_topk")
    assert torch.isfinite(logits).all() and cache["blocks.3.attn.hook_index_topk"].shape[-1] == 16
    assert model.generate("Hi", max_new_tokens=3, stop_at_eos=False, do_sample=False)
