"""Qwen3-MoE (HookedQwen3Moe) against transformers' Qwen3MoeForCausalLM: site by site in float32, bit for bit
in bfloat16, greedy generation, the q/k norms before the rotary, checkpoint spellings, bad checkpoints, the
plan's counts at full size, support() and the embedded default."""

import json

import pytest
import torch
import family_harness as harness
import tiny_qwen3_moe as tiny_qwen3
from flagships import flagship
from family_harness import (
    ATTENTION_SITES, BLOCK_SITES, ROUTER_SITES, References, build_checkpoints, check_bit_exact, check_greedy_generation,
    copy_checkpoint, left_padded, rewrite_tensors, stored_keys, tokens,
)

import moelens.models.qwen3_moe  # noqa: F401  (registers model_type "qwen3_moe")
from moelens import HookedTransformer
from moelens.loaders.errors import CheckpointError
from moelens.models.components import SoftmaxTopK, SparseMoe
from moelens.models.components.qk_norm_attention import QKNormBeforeRotaryAttention
from moelens.models.components.rotary import apply_rotary
from moelens.models.qwen3_moe import HookedQwen3Moe
from moelens.plan import plan
from moelens.verify import compare

VARIANTS = [v for (f, v) in tiny_qwen3.VARIANTS if f == "qwen3_moe"]


@pytest.fixture(scope="module")
def ckpts(tmp_path_factory):
    return build_checkpoints(tmp_path_factory, "qwen3_moe", tiny_qwen3.VARIANTS)


@pytest.fixture(scope="module")
def refs(ckpts):
    return References(ckpts)


def check_report(report, model, tol=1e-5):
    def sites(layer):
        return BLOCK_SITES + ATTENTION_SITES + (ROUTER_SITES if model.cfg.moe_layers[layer] else ("mlp.hook_post",))

    harness.check_report(report, model, sites, tol)


# ---- float32: every site, every variant -------------------------------------------------------------


@pytest.mark.parametrize("variant", VARIANTS)
def test_float32_every_site(ckpts, refs, variant):
    model = HookedTransformer.from_pretrained(ckpts[variant], progress=False)
    assert type(model) is HookedQwen3Moe
    check_report(compare(model, refs(variant), tokens()), model)


def test_variants_are_what_they_claim(ckpts):
    cfg = {v: HookedTransformer.from_pretrained(p, progress=False).cfg for v, p in ckpts.items()}
    base = cfg["base"]
    assert base.d_head == 24 != base.d_model // base.n_heads and base.n_kv_heads < base.n_heads
    assert base.norm_topk_prob and not cfg["unnormalised"].norm_topk_prob and not base.qkv_bias
    assert cfg["dense_block"].moe_layers == (True, False, True) and cfg["dense_block"].d_mlp == 80
    assert cfg["sparse_step_biased"].moe_layers == (False, True, False)
    assert cfg["sparse_step_biased"].qkv_bias and cfg["sparse_step_biased"].o_bias
    assert cfg["tied"].tie_word_embeddings
    assert "model.layers.0.mlp.experts.0.gate_proj.weight" in stored_keys(ckpts["base"])  # the Hub's spelling
    fused = stored_keys(ckpts["fused"])
    assert "model.layers.0.mlp.experts.gate_up_proj" in fused and not any("experts.0." in k for k in fused)
    assert len(list(ckpts["sharded"].glob("*.safetensors"))) > 1
    # transformers 5 saves num_experts as num_local_experts (its attribute_map); the Hub says num_experts
    assert "num_local_experts" in json.loads((ckpts["base"] / "config.json").read_text())


def test_site_map_references_cover_every_transformers_site(ckpts, refs):
    model = HookedTransformer.from_pretrained(ckpts["dense_block"], device="meta", progress=False)
    found = {r.hook: r for r in HookedQwen3Moe.site_map(model.cfg).references}
    assert {"ln_final.hook_normalized", "hook_logits"} <= set(found)
    for layer in range(model.cfg.n_layers):
        sites = BLOCK_SITES + ATTENTION_SITES + (ROUTER_SITES if model.cfg.moe_layers[layer] else ("mlp.hook_post",))
        for site in sites:
            assert f"blocks.{layer}.{site}" in found, site
    # hook_q / hook_k are the projections, before the norms
    assert found["blocks.0.attn.hook_q"].module == "model.layers.0.self_attn.q_proj"
    hf = refs("dense_block")
    for ref in found.values():
        hf.get_submodule(ref.module)


# ---- bfloat16: bit for bit --------------------------------------------------------------------------


@pytest.mark.parametrize("variant", ["base", "unnormalised"])
def test_bfloat16_is_bit_exact(ckpts, refs, variant):
    """Router weight and logits bfloat16, softmax float32, top-k weights cast back to bfloat16 (as
    transformers' Qwen3MoeTopKRouter)."""
    model = HookedTransformer.from_pretrained(ckpts[variant], dtype=torch.bfloat16, progress=False)
    ref = refs(variant, torch.bfloat16)
    for layer, block in enumerate(model.blocks):
        assert block.mlp.router.weight.dtype == ref.model.layers[layer].mlp.gate.weight.dtype == torch.bfloat16
    check_bit_exact(compare(model, ref, tokens()))


def test_components():
    cfg = HookedQwen3Moe.config_from_hf(tiny_qwen3.qwen3_moe_config().to_dict())
    for layer, spec in enumerate(HookedQwen3Moe.recipe(cfg).layers):
        assert spec.mixer is QKNormBeforeRotaryAttention
        assert (spec.ffn.moe, spec.ffn.router) == (SparseMoe, SoftmaxTopK) if cfg.moe_layers[layer] else not spec.is_moe


def test_q_and_k_are_normed_before_the_rotary(ckpts):
    """hook_rot_q = rotary(q_norm(hook_q)); editing hook_q goes through the norm."""
    model = HookedTransformer.from_pretrained(ckpts["base"], progress=False)
    toks = tokens(shape=(2, 12))
    _, cache = model.run_with_cache(toks, names_filter=lambda n: n.startswith("blocks.0.attn.hook_"))
    attn = model.blocks[0].attn
    cos, sin = model.rotary(torch.arange(12).expand(2, 12), torch.float32)
    expected = apply_rotary(attn.q_norm(cache["blocks.0.attn.hook_q"]), cos, sin)
    assert torch.equal(cache["blocks.0.attn.hook_rot_q"], expected)
    expected_k = apply_rotary(attn.k_norm(cache["blocks.0.attn.hook_k"]), cos, sin)
    assert torch.equal(cache["blocks.0.attn.hook_rot_k"], expected_k)
    # scaling a query head leaves its normed (rotated) query unchanged, up to rounding
    with model.hooks([("blocks.0.attn.hook_q", lambda q, hook: q * 3.0)]):
        _, scaled = model.run_with_cache(toks, names_filter="blocks.0.attn.hook_rot_q")
    assert (scaled["blocks.0.attn.hook_rot_q"] - cache["blocks.0.attn.hook_rot_q"]).abs().max() <= 1e-5


# ---- generation -------------------------------------------------------------------------------------


@pytest.mark.parametrize("variant", ["base", "dense_block"])
def test_greedy_generation_matches_transformers(ckpts, refs, variant):
    model = HookedTransformer.from_pretrained(ckpts[variant], progress=False)
    check_greedy_generation(model, refs(variant), *left_padded(7, (2, 9), (0, 2)))


# ---- checkpoints --------------------------------------------------------------------------------------


def test_missing_q_norm_is_named(ckpts, tmp_path):
    folder = copy_checkpoint(ckpts, tmp_path)
    key = "model.layers.1.self_attn.q_norm.weight"
    rewrite_tensors(folder, lambda t: t.pop(key))
    with pytest.raises(CheckpointError, match="missing") as info:
        HookedTransformer.from_pretrained(folder, progress=False)
    assert key in str(info.value)


def test_misshapen_expert_is_named(ckpts, tmp_path):
    folder = copy_checkpoint(ckpts, tmp_path)
    key = "model.layers.2.mlp.experts.5.up_proj.weight"
    rewrite_tensors(folder, lambda t: t.update({key: torch.zeros(16, 64)}))
    with pytest.raises(CheckpointError) as info:
        HookedTransformer.from_pretrained(folder, progress=False)
    assert key in str(info.value) and "(16, 64)" in str(info.value) and "(32, 64)" in str(info.value)


def test_hub_config_spelling_loads(ckpts, tmp_path):
    """The Hub's config.json: num_experts (not num_local_experts), rope_theta at the top level."""
    folder = copy_checkpoint(ckpts, tmp_path)
    config = json.loads((folder / "config.json").read_text())
    config["num_experts"] = config.pop("num_local_experts")
    config["rope_theta"] = config.pop("rope_parameters")["rope_theta"]
    (folder / "config.json").write_text(json.dumps(config))
    model = HookedTransformer.from_pretrained(folder, progress=False)
    assert model.cfg.n_experts == 8 and model.cfg.rope.theta == 1000.0
    assert torch.equal(model(tokens()), HookedTransformer.from_pretrained(ckpts["base"], progress=False)(tokens()))


# ---- config, plan, support, default ----------------------------------------------------------------------

QWEN3_30B_A3B = flagship("qwen3_moe", "Qwen/Qwen3-30B-A3B")


def test_plan_at_full_size_counts_the_per_head_qk_norms():
    """(The counts against transformers' and the published total: tests/test_flagships.py.)"""
    import transformers

    hf_config = transformers.AutoConfig.for_model(**QWEN3_30B_A3B)
    assert hf_config.head_dim == 128 and hf_config.num_experts == 128
    with torch.device("meta"):
        hf = transformers.Qwen3MoeForCausalLM(hf_config)
    p = plan(dict(QWEN3_30B_A3B), dtype="bfloat16", cpu_memory="1TB")
    assert p.bytes == 2 * p.parameters
    norms = sum(p.numel() for n, p in hf.named_parameters() if "q_norm" in n or "k_norm" in n)
    assert norms == 48 * 2 * 128


def test_config_reads_and_refusals():
    cfg = HookedQwen3Moe.config_from_hf(dict(QWEN3_30B_A3B))
    assert (cfg.d_head, cfg.n_experts, cfg.top_k_per_layer[0], cfg.d_expert, cfg.d_mlp) == (128, 128, 8, 768, 6144)
    assert cfg.norm_topk_prob and all(cfg.moe_layers) and cfg.rope.theta == 1e6
    assert set(cfg.fields_ignored) == {"sliding_window", "max_window_layers"}
    with pytest.raises(ValueError, match="use_sliding_window"):
        HookedQwen3Moe.config_from_hf({**QWEN3_30B_A3B, "use_sliding_window": True})
    with pytest.raises(ValueError, match="num_local_experts"):
        HookedQwen3Moe.config_from_hf({**QWEN3_30B_A3B, "num_local_experts": 64})
    steps = HookedQwen3Moe.config_from_hf({**QWEN3_30B_A3B, "num_hidden_layers": 4, "decoder_sparse_step": 2})
    assert steps.moe_layers == (False, True, False, True)


def test_support_lists_the_family_sites(ckpts):
    model = HookedTransformer.from_pretrained(ckpts["dense_block"], progress=False)
    table = model.support(print_table=False)
    names = set(table.names())
    for site in ("blocks.L.mlp.hook_router_logits", "blocks.L.mlp.hook_expert_indices", "blocks.L.mlp.hook_routed_out",
                 "blocks.L.mlp.experts.hook_post", "blocks.L.mlp.hook_post", "blocks.L.attn.hook_q",
                 "blocks.L.attn.hook_rot_q", "blocks.L.attn.hook_pattern"):
        assert site in names, site
    assert not any("shared" in n for n in names)
    assert "model.layers.L.self_attn.q_proj" in str(table)


def test_embedded_default_loads_and_runs(tmp_path, monkeypatch):
    monkeypatch.setenv("MOELENS_CACHE", str(tmp_path))
    model = HookedTransformer.from_pretrained("tiny-qwen3-moe", progress=False)
    assert type(model) is HookedQwen3Moe and model.cfg.d_head == 32 and model.cfg.n_experts == 8
    logits = model(model.to_tokens("Hello mixture"))
    assert logits.shape[-1] == 260 and torch.isfinite(logits).all()
