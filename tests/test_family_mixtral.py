"""Mixtral (HookedMixtral) against transformers' MixtralForCausalLM: site by site in float32, bit for bit in
bfloat16, greedy generation, the sliding window, checkpoint spellings, bad checkpoints, the plan's counts at
full size, support() and the embedded default."""

import json

import pytest
import torch
import family_harness as harness
import tiny_mixtral as tiny_mixtral
from flagships import flagship
from family_harness import (
    ATTENTION_SITES, BLOCK_SITES, ROUTER_SITES, References, build_checkpoints, check_bit_exact, check_greedy_generation,
    copy_checkpoint, left_padded, rewrite_tensors, stored_keys, tokens,
)

import moelens.models.mixtral  # noqa: F401  (registers model_type "mixtral")
from moelens import HookedTransformer
from moelens.loaders.errors import CheckpointError
from moelens.models.components import SparseMoe
from moelens.models.components.sliding_window_attention import SlidingWindowAttention
from moelens.models.mixtral import HookedMixtral, SoftmaxTopKFloat32Weights
from moelens.plan import plan
from moelens.verify import compare

VARIANTS = [v for (f, v) in tiny_mixtral.VARIANTS if f == "mixtral"]
WINDOW = 7  # the sliding_window variant's


@pytest.fixture(scope="module")
def ckpts(tmp_path_factory):
    return build_checkpoints(tmp_path_factory, "mixtral", tiny_mixtral.VARIANTS)


@pytest.fixture(scope="module")
def refs(ckpts):
    return References(ckpts)


def check_report(report, model, tol=1e-5):
    harness.check_report(report, model, lambda layer: BLOCK_SITES + ATTENTION_SITES + ROUTER_SITES, tol)


# ---- float32: every site, every variant -------------------------------------------------------------


@pytest.mark.parametrize("variant", VARIANTS)
def test_float32_every_site(ckpts, refs, variant):
    model = HookedTransformer.from_pretrained(ckpts[variant], progress=False)
    assert type(model) is HookedMixtral
    check_report(compare(model, refs(variant), tokens()), model)


def test_variants_are_what_they_claim(ckpts):
    cfg = {v: HookedTransformer.from_pretrained(p, progress=False).cfg for v, p in ckpts.items()}
    assert cfg["base"].n_kv_heads < cfg["base"].n_heads and cfg["base"].sliding_window is None
    assert cfg["sliding_window"].sliding_window == WINDOW < 40  # shorter than the tests' sequences
    assert cfg["mha_tied"].tie_word_embeddings and cfg["mha_tied"].n_kv_heads == 4 and cfg["mha_tied"].top_k_per_layer[0] == 3
    assert not cfg["base"].qkv_bias and cfg["base"].norm_topk_prob and cfg["base"].d_mlp == 0
    base = stored_keys(ckpts["base"])  # what transformers 5's save_pretrained writes: the Hub's spelling
    assert "model.layers.0.block_sparse_moe.experts.0.w1.weight" in base
    assert "model.layers.0.block_sparse_moe.gate.weight" in base and not any(".mlp." in k for k in base)
    fused = stored_keys(ckpts["fused"])  # transformers 5's module names, fused experts
    assert "model.layers.0.mlp.experts.gate_up_proj" in fused and "model.layers.0.mlp.gate.weight" in fused
    assert not any("block_sparse_moe" in k or "experts.0." in k for k in fused)
    prefixed = stored_keys(ckpts["mlp_prefix"])
    assert "model.layers.2.mlp.experts.7.w2.weight" in prefixed and not any("block_sparse_moe" in k for k in prefixed)
    assert len(list(ckpts["sharded"].glob("*.safetensors"))) > 1


def test_site_map_references_cover_every_transformers_site(ckpts, refs):
    model = HookedTransformer.from_pretrained(ckpts["base"], device="meta", progress=False)
    found = {r.hook: r for r in HookedMixtral.site_map(model.cfg).references}
    assert {"ln_final.hook_normalized", "hook_logits"} <= set(found)
    for layer in range(model.cfg.n_layers):
        for site in BLOCK_SITES + ATTENTION_SITES + ROUTER_SITES:
            assert f"blocks.{layer}.{site}" in found, site
        # transformers' Mixtral modules: the router returns (logits, weights, indices); o_proj reads z
        assert found[f"blocks.{layer}.mlp.hook_router_logits"].module == f"model.layers.{layer}.mlp.gate"
        assert found[f"blocks.{layer}.attn.hook_z"].read == "in"
    hf = refs("base")
    for ref in found.values():  # every module path exists in transformers' model
        hf.get_submodule(ref.module)


# ---- bfloat16: bit for bit --------------------------------------------------------------------------


@pytest.mark.parametrize("variant", ["base", "sliding_window"])
def test_bfloat16_is_bit_exact(ckpts, refs, variant):
    """The router weight is bfloat16 like the model (logits bfloat16), its softmax float32 and the top-k
    weights stay float32, as transformers' MixtralTopKRouter: the slot sum then runs in float32."""
    model = HookedTransformer.from_pretrained(ckpts[variant], dtype=torch.bfloat16, progress=False)
    ref = refs(variant, torch.bfloat16)
    for layer, block in enumerate(model.blocks):
        assert block.mlp.router.weight.dtype == ref.model.layers[layer].mlp.gate.weight.dtype == torch.bfloat16
    _, cache = model.run_with_cache(tokens(), names_filter=lambda n: n.endswith(("router_logits", "expert_weights")))
    assert cache["blocks.0.mlp.hook_router_logits"].dtype == torch.bfloat16
    assert cache["blocks.0.mlp.hook_expert_weights"].dtype == torch.float32
    check_bit_exact(compare(model, ref, tokens()))


def test_router_rule():
    cfg = HookedMixtral.config_from_hf(tiny_mixtral.mixtral_config().to_dict())
    for spec in HookedMixtral.recipe(cfg).layers:
        assert spec.ffn.router is SoftmaxTopKFloat32Weights and spec.ffn.moe is SparseMoe
    assert not SoftmaxTopKFloat32Weights.float32_weight


# ---- the sliding window ---------------------------------------------------------------------------------


def test_sliding_window_pattern_equals_transformers(ckpts, refs):
    """Each query attends to the last WINDOW positions only, with the probabilities of transformers' eager
    attention (its second output), head by head."""
    model = HookedTransformer.from_pretrained(ckpts["sliding_window"], progress=False)
    assert isinstance(model.blocks[0].attn, SlidingWindowAttention)
    ref = refs("sliding_window")
    toks = tokens(shape=(2, 24))
    theirs = {}
    handles = [
        layer.self_attn.register_forward_hook(lambda m, a, out, i=i: theirs.__setitem__(i, out[1]))
        for i, layer in enumerate(ref.model.layers)
    ]
    try:
        with torch.no_grad():
            ref(toks)
    finally:
        for h in handles:
            h.remove()
    _, cache = model.run_with_cache(toks, names_filter=lambda n: n.endswith("hook_pattern"))
    q = torch.arange(24)[:, None]
    k = torch.arange(24)[None, :]
    outside = (k > q) | (k <= q - WINDOW)
    for layer in range(model.cfg.n_layers):
        ours = cache[f"blocks.{layer}.attn.hook_pattern"]
        assert ours[..., outside].abs().max() == 0
        assert (ours - theirs[layer]).abs().max() <= 1e-6
    # and the window matters: without it the logits move
    model.blocks[0].attn.sliding_window = None
    assert (model(toks) - ref(toks).logits).abs().max() > 1e-3


def test_sliding_window_left_padded_and_fused_backend(ckpts, refs):
    """Window positions count the padding, as transformers' cache positions do; SDPA gives the same."""
    model = HookedTransformer.from_pretrained(ckpts["sliding_window"], progress=False)
    ref = refs("sliding_window")
    toks = tokens(seed=5, shape=(2, 24))
    mask = torch.ones_like(toks)
    mask[1, :6] = 0
    report = compare(model, ref, toks, mask)
    assert report.max_logit_diff <= 1e-5 and report.index_mismatches == 0, report
    model.set_attention_backend("fused")
    report = compare(model, ref, toks, mask)
    assert report.max_logit_diff <= 1e-5 and report.index_mismatches == 0, report


# ---- generation -------------------------------------------------------------------------------------


@pytest.mark.parametrize("variant", ["base", "sliding_window"])
def test_greedy_generation_matches_transformers(ckpts, refs, variant):
    """9 prompt tokens + 8 new, past the window of 7: the cached steps must mask the old keys too."""
    model = HookedTransformer.from_pretrained(ckpts[variant], progress=False)
    check_greedy_generation(model, refs(variant), *left_padded(7, (2, 9), (0, 2)))


# ---- checkpoints --------------------------------------------------------------------------------------


def test_missing_expert_tensor_is_named_in_the_hub_spelling(ckpts, tmp_path):
    folder = copy_checkpoint(ckpts, tmp_path)
    key = "model.layers.1.block_sparse_moe.experts.3.w3.weight"
    rewrite_tensors(folder, lambda t: t.pop(key))
    with pytest.raises(CheckpointError, match="missing") as info:
        HookedTransformer.from_pretrained(folder, progress=False)
    assert key in str(info.value)


def test_misshapen_router_is_named(ckpts, tmp_path):
    folder = copy_checkpoint(ckpts, tmp_path)
    key = "model.layers.2.block_sparse_moe.gate.weight"
    rewrite_tensors(folder, lambda t: t.update({key: torch.zeros(7, 64)}))
    with pytest.raises(CheckpointError) as info:
        HookedTransformer.from_pretrained(folder, progress=False)
    assert key in str(info.value) and "(7, 64)" in str(info.value) and "(8, 64)" in str(info.value)


def test_fused_checkpoint_missing_down_proj_is_named(ckpts, tmp_path):
    folder = copy_checkpoint(ckpts, tmp_path, "fused")
    rewrite_tensors(folder, lambda t: t.pop("model.layers.0.mlp.experts.down_proj"))
    with pytest.raises(CheckpointError, match="model.layers.0.mlp.experts.down_proj"):
        HookedTransformer.from_pretrained(folder, progress=False)


# ---- config, plan, support, default ----------------------------------------------------------------------

MIXTRAL_8X7B = flagship("mixtral", "mistralai/Mixtral-8x7B-v0.1")


def test_config_at_full_size():
    """(The plan's counts against transformers' and the published total: tests/test_flagships.py.)"""
    p = plan(dict(MIXTRAL_8X7B), dtype="bfloat16", cpu_memory="1TB")
    assert p.bytes == 2 * p.parameters  # every weight bfloat16, the routers included
    cfg = HookedMixtral.config_from_hf(dict(MIXTRAL_8X7B))
    assert (cfg.d_head, cfg.d_expert, cfg.rope.theta, cfg.sliding_window) == (128, 14336, 1e6, None)


def test_config_defaults_and_checks():
    raw = {k: v for k, v in MIXTRAL_8X7B.items() if k not in ("rope_theta", "num_local_experts", "num_experts_per_tok")}
    cfg = HookedMixtral.config_from_hf(raw)  # transformers' defaults: theta 1e6, 8 experts, top-2
    assert (cfg.rope.theta, cfg.n_experts, cfg.top_k_per_layer[0]) == (1e6, 8, 2)
    assert HookedMixtral.config_from_hf({**raw, "sliding_window": 4096}).sliding_window == 4096
    with pytest.raises(ValueError, match="sliding_window"):
        HookedMixtral.config_from_hf({**raw, "sliding_window": 0})
    with pytest.raises(ValueError, match="num_experts_per_tok"):
        HookedMixtral.config_from_hf({**raw, "num_experts_per_tok": 9})


def test_support_lists_the_family_sites(ckpts):
    model = HookedTransformer.from_pretrained(ckpts["sliding_window"], progress=False)
    table = model.support(print_table=False)
    names = set(table.names())
    for site in ("blocks.L.mlp.hook_router_logits", "blocks.L.mlp.hook_router_scores", "blocks.L.mlp.hook_expert_indices",
                 "blocks.L.mlp.hook_expert_weights", "blocks.L.mlp.experts.hook_post", "blocks.L.mlp.hook_routed_out",
                 "blocks.L.attn.hook_rot_q", "blocks.L.attn.hook_pattern"):
        assert site in names, site
    assert not any("shared" in n or "choice_scores" in n for n in names)
    assert any("shared_expert" in a for a in table.absent)
    text = str(table)
    assert "model.layers.L.mlp.gate" in text and "sliding_window" in text


def test_embedded_default_loads_and_runs(tmp_path, monkeypatch):
    monkeypatch.setenv("MOELENS_CACHE", str(tmp_path))
    model = HookedTransformer.from_pretrained("tiny-mixtral", progress=False)
    assert type(model) is HookedMixtral and model.cfg.n_experts == 8
    logits = model(model.to_tokens("Hello mixture"))
    assert logits.shape[-1] == 260 and torch.isfinite(logits).all()
    folder = tmp_path / "defaults"
    stored = [k for path in folder.rglob("model.safetensors") for k in stored_keys(path.parent)]
    assert "model.layers.0.block_sparse_moe.experts.0.w1.weight" in stored  # written in the Hub's spelling
    assert json.loads(next(folder.rglob("config.json")).read_text())["model_type"] == "mixtral"
