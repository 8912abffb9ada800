"""DeepSeek-V3 (multi-head latent attention, sigmoid grouped router, dense first blocks, shared experts) against
transformers' own DeepseekV3ForCausalLM on the same tiny checkpoints."""

import math

import pytest
import torch

import moelens.models.deepseek_v3  # noqa: F401  (registers the family)
import tiny
import family_harness as harness
import tiny_deepseek_v3 as tiny_ds
from flagships import flagship
from family_harness import (
    References, build_checkpoints, check_bit_exact, check_greedy_generation, copy_checkpoint, left_padded,
    rewrite_tensors, stored_keys, tokens,
)
from moelens import HookedTransformer, KVCache
from moelens.loaders.errors import CheckpointError
from moelens.models.components.latent_attention import MultiHeadLatentAttention
from moelens.models.deepseek_v3 import HookedDeepseekV3
from moelens.plan import plan
from moelens.utils import get_act_name
from moelens.verify import compare

VARIANTS = [v for (_, v) in tiny_ds.VARIANTS]


@pytest.fixture(scope="module")
def checkpoints(tmp_path_factory):
    return build_checkpoints(tmp_path_factory, "deepseek_v3", tiny_ds.VARIANTS)


@pytest.fixture(scope="module")
def models(checkpoints):
    return {v: HookedTransformer.from_pretrained(p, progress=False) for v, p in checkpoints.items()}


@pytest.fixture(scope="module")
def references(checkpoints):
    return References(checkpoints)


PER_BLOCK = ("hook_resid_pre", "hook_attn_out", "hook_mlp_out", "hook_resid_post", "ln1.hook_normalized",
             "ln2.hook_normalized", "attn.hook_q", "attn.hook_kv_latent", "attn.hook_z")


def check_report(report, model, tol=1e-5):
    harness.check_report(report, model, lambda layer: PER_BLOCK, tol)
    cfg, compared = model.cfg, {s.site for s in report.sites}
    for layer in range(cfg.n_layers):
        assert (f"blocks.{layer}.attn.hook_q_latent" in compared) == (cfg.q_lora_rank is not None)
        assert (f"blocks.{layer}.mlp.hook_post" in compared) == (not cfg.moe_layers[layer])
    n_moe = sum(cfg.moe_layers)
    for site in ("hook_router_logits", "hook_expert_weights", "hook_expert_indices", "hook_routed_out",
                 "shared_expert.hook_out"):
        assert sum(s.endswith(site) for s in compared) == n_moe, site


def test_variants_are_what_they_claim(models, checkpoints):
    base, plain, msc = models["base"].cfg, models["plain_q"].cfg, models["mscale"].cfg
    assert base.q_lora_rank and plain.q_lora_rank is None
    assert base.rope.interleaved and not plain.rope.interleaved and not msc.rope.interleaved
    assert base.rope.kind == "yarn" and base.rope.original_max_position_embeddings < 40  # the tests' length
    assert base.rope.mscale == base.rope.mscale_all_dim == 1.0 and msc.rope.mscale != msc.rope.mscale_all_dim
    assert plain.rope.kind == "default" and plain.qkv_bias and plain.o_bias
    assert base.n_group > 1 and base.topk_group > 1 and base.routed_scaling_factor != 1 and base.norm_topk_prob
    assert base.moe_layers == (False, True, True) and msc.moe_layers == (False, False, True, True)
    assert base.d_shared == 2 * base.d_expert and base.d_mlp == 80
    assert base.d_head == 20 and base.d_rot == 8 and base.v_head_dim == 10
    assert type(models["base"].blocks[0].attn) is MultiHeadLatentAttention
    assert len(list(checkpoints["sharded"].glob("*.safetensors"))) > 1
    keys = stored_keys(checkpoints["fused"])
    assert "model.layers.1.mlp.experts.gate_up_proj" in keys and not any(".experts.0." in k for k in keys)
    # transformers saves the Hub's per-expert spelling; the base checkpoint is loaded in it
    assert "model.layers.1.mlp.experts.7.down_proj.weight" in stored_keys(checkpoints["base"])


@pytest.mark.parametrize("variant", VARIANTS)
def test_float32(models, references, variant):
    model = models[variant]
    assert type(model) is HookedDeepseekV3
    check_report(compare(model, references[variant], tokens()), model)


def test_float32_left_padded_and_fused_attention(models, references):
    model, ref = models["base"], references["base"]
    toks, mask = tokens(5, (3, 24)), torch.ones(3, 24, dtype=torch.long)
    mask[0, :4], mask[1, :9] = 0, 0
    report = compare(model, ref, toks, mask)
    assert report.max_logit_diff <= 1e-5 and report.index_mismatches == 0, report
    model.set_attention_backend("fused")
    try:
        report = compare(model, ref, toks)
    finally:
        model.set_attention_backend("eager")
    assert report.max_logit_diff <= 1e-5 and report.index_mismatches == 0, report


@pytest.mark.parametrize("variant", ["base", "plain_q"])
def test_attention_sites_without_a_module_of_their_own(models, references, variant):
    """The sites transformers computes inside DeepseekV3Attention.forward: the shared rotary key part (a slice of
    kv_a_proj_with_mqa), the decompressed keys and values (kv_b_proj, split per head) and the pattern."""
    model, ref = models[variant], references[variant]
    cfg, toks, store = model.cfg, tokens(), {}
    handles = []
    for layer in range(cfg.n_layers):
        attn = ref.model.layers[layer].self_attn
        for name in ("kv_a_proj_with_mqa", "kv_b_proj"):
            handles.append(getattr(attn, name).register_forward_hook(
                lambda m, a, out, key=(layer, name): store.__setitem__(key, out)))
    try:
        with torch.no_grad():
            out = ref(toks, output_attentions=True)
    finally:
        for h in handles:
            h.remove()
    _, cache = model.run_with_cache(toks)
    b, p = toks.shape
    for layer in range(cfg.n_layers):
        site = f"blocks.{layer}.attn."
        k_rope = store[layer, "kv_a_proj_with_mqa"][..., cfg.kv_lora_rank:]
        assert torch.equal(cache[site + "hook_k_rope"], k_rope)
        kv = store[layer, "kv_b_proj"].view(b, p, cfg.n_heads, -1)
        assert torch.equal(cache[site + "hook_v"], kv[..., cfg.qk_nope_head_dim:])
        k = cache[site + "hook_k"]
        assert k.shape == (b, p, cfg.n_heads, cfg.d_head)
        assert torch.equal(k[..., : cfg.qk_nope_head_dim], kv[..., : cfg.qk_nope_head_dim])
        assert torch.equal(k[..., cfg.qk_nope_head_dim:], k_rope[:, :, None].expand(b, p, cfg.n_heads, -1))
        assert (cache[site + "hook_pattern"] - out.attentions[layer]).abs().max() <= 1e-6
        assert cache[site + "hook_z"].shape == (b, p, cfg.n_heads, cfg.v_head_dim)


@pytest.mark.parametrize("variant", ["base", "plain_q"])
def test_bfloat16_is_bit_exact(checkpoints, references, variant):
    """Same ops in the same order and memory layout as transformers' eager MLA: bf16 logits and every
    reference site identical, the router float32 as transformers keeps it."""
    path = checkpoints[variant]
    model = HookedTransformer.from_pretrained(path, dtype=torch.bfloat16, progress=False)
    ref = references(variant, torch.bfloat16)
    for layer, block in enumerate(model.blocks):
        if block.is_moe:
            assert block.mlp.router.weight.dtype == ref.model.layers[layer].mlp.gate.weight.dtype == torch.float32
    check_bit_exact(compare(model, ref, tokens()))


@pytest.mark.parametrize("variant,padded", [("base", False), ("base", True), ("plain_q", True)])
def test_greedy_generation_matches_transformers(models, references, variant, padded):
    prompt = left_padded(5, (3, 9), (0, 3, 1)) if padded else (tokens(5, (3, 9)), None)
    check_greedy_generation(models[variant], references[variant], *prompt)


def test_cached_steps_match_the_uncached_forward(models):
    """The cache holds each head's keys (hook_rot_k, qk_head_dim wide) and values (hook_v, v_head_dim)."""
    model = models["base"]
    cfg = model.cfg
    toks, mask = tokens(5, (3, 9)), torch.ones(3, 9, dtype=torch.long)
    mask[1, :3] = 0
    with torch.no_grad():
        full, full_cache = model.run_with_cache(toks, attention_mask=mask, names_filter=["*hook_rot_k", "*hook_v"])
        cache = KVCache.for_model(model)
        parts = [model(toks[:, :5], attention_mask=mask[:, :5], past_kv_cache=cache)]
        parts += [model(toks[:, 5:8], past_kv_cache=cache), model(toks[:, 8:], past_kv_cache=cache)]
    real = mask.bool()
    assert (torch.cat(parts, dim=1) - full)[real].abs().max() <= 1e-5
    for layer, kv in enumerate(cache.layers):
        assert kv.keys.shape == (3, 9, cfg.n_heads, cfg.d_head)
        assert kv.values.shape == (3, 9, cfg.n_heads, cfg.v_head_dim)
        assert (kv.keys - full_cache[f"blocks.{layer}.attn.hook_rot_k"])[real].abs().max() <= 1e-5
        assert (kv.values - full_cache[f"blocks.{layer}.attn.hook_v"])[real].abs().max() <= 1e-5


def test_results_do_not_depend_on_which_hooks_are_on(models):
    model, toks = models["base"], tokens()
    with torch.no_grad():
        plain = model(toks)
        cached, _ = model.run_with_cache(toks)
        read = model.run_with_hooks(toks, fwd_hooks=[(lambda name: True, lambda t, hook: None)])
    assert torch.equal(plain, cached) and torch.equal(plain, read)


def test_latent_sites_are_live(models):
    """An edit at a latent site moves the logits, and one at hook_k_rope only where the rotary key is read."""
    model, toks = models["base"], tokens()
    with torch.no_grad():
        plain = model(toks)
        for site in ("hook_q_latent", "hook_kv_latent", "hook_k_rope"):
            edited = model.run_with_hooks(toks, fwd_hooks=[(f"blocks.1.attn.{site}", lambda t, hook: t * 0.5)])
            assert not torch.allclose(edited, plain), site


def test_softmax_scale_is_transformers(models):
    """qk_head_dim**-0.5 times mscale(factor, mscale_all_dim)**2 (YaRN with mscale_all_dim), exactly transformers'
    DeepseekV3Attention.scaling; DeepSeek-V3's own: 192**-0.5 * (1 + 0.1 * ln 40)**2, cos / sin unscaled."""
    from transformers import DeepseekV3Config
    from transformers.models.deepseek_v3.modeling_deepseek_v3 import DeepseekV3Attention

    flagship = DeepseekV3Config(**{k: v for k, v in DEEPSEEK_V3.items() if k != "model_type"})
    for config in (tiny_ds.deepseek_v3_config(), flagship):
        with torch.device("meta"):
            ref = DeepseekV3Attention(config, 0)
        ours = HookedDeepseekV3.config_from_hf(config.to_dict())
        with torch.device("meta"):
            attn = MultiHeadLatentAttention(ours, 0)
        assert attn.scale == ref.scaling
    assert attn.scale == 192**-0.5 * (1 + 0.1 * math.log(40)) ** 2
    assert models["mscale"].blocks[0].attn.scale != models["mscale"].cfg.d_head ** -0.5
    assert models["plain_q"].blocks[0].attn.scale == models["plain_q"].cfg.d_head ** -0.5


# ---- checkpoints the loader refuses --------------------------------------------------------------------


@pytest.fixture
def broken(checkpoints, tmp_path):
    def copy(variant="base"):
        return copy_checkpoint(checkpoints, tmp_path, variant)

    return copy


@pytest.mark.parametrize("key", [
    "model.layers.0.self_attn.kv_b_proj.weight",
    "model.layers.2.self_attn.q_a_layernorm.weight",
    "model.layers.1.mlp.gate.e_score_correction_bias",
    "model.layers.2.mlp.experts.5.gate_proj.weight",
    "model.layers.1.mlp.shared_experts.down_proj.weight",
    "model.layers.0.mlp.up_proj.weight",
])
def test_missing_tensor_is_named(broken, key):
    folder = broken()
    rewrite_tensors(folder, lambda t: t.pop(key))
    with pytest.raises(CheckpointError, match="missing") as info:
        HookedTransformer.from_pretrained(folder, progress=False)
    assert key in str(info.value)


def test_multi_token_prediction_layer_is_skipped_only_when_the_config_has_one(broken, models):
    """The Hub checkpoint stores num_nextn_predict_layers extra layers after the last block, which neither
    transformers nor moelens runs: they load past them; any other extra layer is refused."""
    folder = broken()
    n_layers = models["base"].cfg.n_layers
    rewrite_tensors(folder, lambda t: t.update({
        f"model.layers.{n_layers}.eh_proj.weight": torch.ones(4, 4),
        f"model.layers.{n_layers}.self_attn.kv_b_proj.weight": torch.ones(4, 4),
    }))
    tiny.edit_config(folder, num_nextn_predict_layers=0)
    with pytest.raises(CheckpointError, match=f"unexpected .*model.layers.{n_layers}.eh_proj.weight"):
        HookedTransformer.from_pretrained(folder, progress=False)
    tiny.edit_config(folder, num_nextn_predict_layers=1)
    model = HookedTransformer.from_pretrained(folder, progress=False)
    ids = tokens()
    assert torch.equal(model(ids), models["base"](ids))


def test_misshapen_tensor_is_named(broken):
    folder, key = broken(), "model.layers.1.self_attn.kv_a_proj_with_mqa.weight"
    rewrite_tensors(folder, lambda t: t.update({key: torch.zeros(20, 64)}))  # kv_lora_rank + qk_rope_head_dim is 24
    with pytest.raises(CheckpointError) as info:
        HookedTransformer.from_pretrained(folder, progress=False)
    assert all(part in str(info.value) for part in (key, "(20, 64)", "(24, 64)", "config.json"))


def test_plain_q_checkpoint_with_a_bottleneck_tensor_is_refused(broken):
    folder = broken("plain_q")
    rewrite_tensors(folder, lambda t: t.update({"model.layers.0.self_attn.q_a_proj.weight": torch.zeros(24, 64)}))
    with pytest.raises(CheckpointError, match="unexpected"):
        HookedTransformer.from_pretrained(folder, progress=False)


@pytest.mark.parametrize("first_dense", [3, 5])
def test_first_k_dense_replace_at_or_past_the_layer_count_is_named(broken, first_dense):
    """All 3 blocks dense: it failed as the dense blocks' "missing" tensors; now the field is named."""
    folder = broken()
    tiny.edit_config(folder, first_k_dense_replace=first_dense)
    with pytest.raises(CheckpointError, match=rf"first_k_dense_replace = {first_dense} makes all 3 blocks .* dense MLPs"):
        HookedTransformer.from_pretrained(folder, progress=False)


def test_config_refusals():
    raw = tiny_ds.deepseek_v3_config().to_dict()
    for change, message in (
        ({"num_key_value_heads": 2}, "num_key_value_heads"),
        ({"n_group": 3}, "multiple of n_group"),
        ({"topk_group": 5}, "topk_group"),
        ({"partial_rotary_factor": 0.5}, "partial_rotary_factor"),
    ):
        with pytest.raises(ValueError, match=message):
            HookedDeepseekV3.config_from_hf({**raw, **change})


# ---- plan, support, embedded default -------------------------------------------------------------------

DEEPSEEK_V3 = flagship("deepseek_v3", "deepseek-ai/DeepSeek-V3")


def test_plan_at_full_size_dense_first_blocks_and_cache():
    """(Its counts against transformers' and the published total: tests/test_flagships.py.)"""
    p = plan(dict(DEEPSEEK_V3), dtype="bfloat16", cpu_memory="2TB")
    assert [layer.kind for layer in p.per_layer] == ["dense"] * 3 + ["moe"] * 58
    # the cache holds every head's decompressed key (128 nope + 64 rope) and value (128), bf16, seq 2048
    assert p.kv_cache["bytes"] == 61 * 1 * 2048 * 128 * (128 + 64 + 128) * 2


def test_kv_cache_holds_what_plan_counts(models):
    model = models["base"]
    cache = KVCache.for_model(model)
    model(tokens(shape=(1, 6)), past_kv_cache=cache)
    held = sum(t.numel() for layer in cache.layers for t in (layer.keys, layer.values))
    cfg = model.cfg
    assert held == cfg.n_layers * 6 * cfg.n_heads * (cfg.qk_nope_head_dim + cfg.qk_rope_head_dim + cfg.v_head_dim)


def test_support_lists_the_latent_sites(models):
    table = models["base"].support(print_table=False)
    rows = {r.name: r for r in table.rows}
    assert rows["blocks.L.attn.hook_q_latent"].shape == "[batch, pos, 24]"
    assert rows["blocks.L.attn.hook_kv_latent"].shape == "[batch, pos, 16]"
    assert rows["blocks.L.attn.hook_k_rope"].shape == "[batch, pos, 8]"
    assert rows["blocks.L.attn.hook_q"].shape == rows["blocks.L.attn.hook_rot_k"].shape == "[batch, pos, 4, 20]"
    assert rows["blocks.L.attn.hook_v"].shape == rows["blocks.L.attn.hook_z"].shape == "[batch, pos, 4, 10]"
    assert rows["blocks.L.attn.hook_q_latent"].reference == "model.layers.L.self_attn.q_a_layernorm"
    assert rows["blocks.L.mlp.hook_router_logits"].layers == "1,2"
    assert rows["blocks.L.mlp.hook_post"].layers == "0"
    assert get_act_name("kv_latent", 1) == "blocks.1.attn.hook_kv_latent"
    _, cache = models["base"].run_with_cache(tokens(), names_filter="*latent")
    assert torch.equal(cache["kv_latent", 1], cache["blocks.1.attn.hook_kv_latent"])
    assert "topk_method" in HookedDeepseekV3.config_from_hf(DEEPSEEK_V3).fields_ignored
    plain = {r.name for r in models["plain_q"].support(print_table=False).rows}
    assert "blocks.L.attn.hook_q_latent" not in plain and "blocks.L.attn.hook_kv_latent" in plain


def test_embedded_default_loads_and_runs():
    model = HookedTransformer.from_pretrained("tiny-deepseek-v3", progress=False)
    assert type(model) is HookedDeepseekV3 and model.cfg.moe_layers == (False, True, True, True)
    logits, cache = model.run_with_cache("Hello, latent attention", names_filter="*hook_kv_latent")
    assert logits.shape[-1] == 260 and torch.isfinite(logits).all()
    assert cache["blocks.3.attn.hook_kv_latent"].shape[-1] == 16
    assert model.generate("Hi", max_new_tokens=3, stop_at_eos=False, do_sample=False)
