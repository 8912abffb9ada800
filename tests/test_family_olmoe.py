"""OLMoE (HookedOlmoe) against transformers' OlmoeForCausalLM: site by site in float32, bit for bit in bfloat16,
greedy generation, the checkpoint spellings, errors, the full-size parameter count and the embedded default."""

import json
import shutil

import pytest
import torch
import tiny_olmoe
from flagships import flagship
from family_harness import (
    MODEL_SITES, References, build_checkpoints, check_bit_exact, check_greedy_generation, check_report, config_json,
    left_padded, rewrite_tensors, stored_keys, tokens,
)
from safetensors import safe_open

import moelens.models.olmoe  # noqa: F401  (registers model_type "olmoe")
from moelens import HookedTransformer
from moelens.loaders.checkpoint import expected_keys
from moelens.loaders.errors import CheckpointError
from moelens.models.components.projection_norm_attention import ProjectionQKNormAttention
from moelens.models.olmoe import HookedOlmoe
from moelens.plan import plan
from moelens.verify import compare, load_reference

VARIANTS = tiny_olmoe.VARIANTS
CLIP = tiny_olmoe.CLIP

OLMOE_1B_7B = flagship("olmoe", "allenai/OLMoE-1B-7B-0924")


@pytest.fixture(scope="module")
def ckpts(tmp_path_factory):
    return build_checkpoints(tmp_path_factory, "olmoe", VARIANTS)


@pytest.fixture(scope="module")
def refs(ckpts):
    return References(ckpts)


# ---- float32: every site against transformers ---------------------------------------------------------------

@pytest.mark.parametrize("variant", [v for _, v in VARIANTS])
def test_float32_every_site(ckpts, refs, variant):
    model = HookedTransformer.from_pretrained(ckpts[variant], progress=False)
    assert type(model) is HookedOlmoe and isinstance(model.blocks[0].attn, ProjectionQKNormAttention)
    per_block = ("hook_resid_pre", "ln1.hook_normalized", "attn.hook_q", "attn.hook_k", "attn.hook_v", "hook_attn_out",
                 "ln2.hook_normalized", "mlp.hook_router_logits", "mlp.hook_expert_weights", "mlp.hook_expert_indices",
                 "mlp.hook_routed_out", "hook_mlp_out", "hook_resid_post")
    check_report(compare(model, refs(variant), tokens()), model, lambda layer: per_block, model_sites=MODEL_SITES)


def test_references_cover_what_transformers_exposes(ckpts, refs):
    """Every transformers attention module whose output is a moelens tensor is referenced: q_norm / k_norm
    (hook_q / hook_k), v_proj (hook_v), the attention block (hook_attn_out); q_proj and k_proj's raw outputs
    have no moelens hook (the norm runs over all heads at once, before the split)."""
    model = HookedTransformer.from_pretrained(ckpts["base"], progress=False)
    ref = refs("base")
    site_map = HookedOlmoe.site_map(model.cfg)
    modules = {r.module for r in site_map.references}
    for r in site_map.references:
        ref.get_submodule(r.module)  # every reference names a real module
    for layer in range(model.cfg.n_layers):
        attn = f"model.layers.{layer}.self_attn"
        assert {attn, f"{attn}.q_norm", f"{attn}.k_norm", f"{attn}.v_proj"} <= modules
        assert {f"model.layers.{layer}.mlp.gate", f"model.layers.{layer}.mlp.experts"} <= modules
        unreferenced = {n for n, _ in ref.get_submodule(attn).named_children()} - {m.split(".")[-1] for m in modules}
        assert unreferenced == {"q_proj", "k_proj", "o_proj"}  # o_proj's output is hook_attn_out (self_attn out.0)


def test_variants_are_what_they_claim(ckpts):
    cfg = {v: HookedTransformer.from_pretrained(p, progress=False).cfg for v, p in ckpts.items()}
    assert cfg["base"].clip_qkv is None and cfg["clip"].clip_qkv == CLIP
    assert cfg["base"].n_kv_heads < cfg["base"].n_heads and not cfg["base"].norm_topk_prob
    assert cfg["norm_topk"].norm_topk_prob
    bt = cfg["biased_tied"]
    assert bt.qkv_bias and bt.o_bias and bt.tie_word_embeddings and bt.n_kv_heads == bt.n_heads
    assert not cfg["base"].qkv_bias and not cfg["base"].tie_word_embeddings
    assert len(list(ckpts["sharded"].glob("*.safetensors"))) > 1
    keys = json.dumps(stored_keys(ckpts["fused"]))
    assert "experts.gate_up_proj" in keys and "experts.0." not in keys
    assert cfg["base"].top_k_per_layer == (3,) * 3 and cfg["base"].n_experts == 8 and cfg["base"].d_expert == 32


def test_clip_qkv_clamps(ckpts, refs):
    """The clip variant's bound is below many normed queries / keys and values, in moelens and in transformers,
    and the clamp changes the logits (against the same weights unclamped)."""
    model = HookedTransformer.from_pretrained(ckpts["clip"], progress=False)
    seen = {}
    handles = [
        model.blocks[0].attn.q_norm.register_forward_hook(lambda m, a, out: seen.__setitem__("q", out.detach().clone())),
        model.blocks[0].attn.v_proj.register_forward_hook(lambda m, a, out: seen.__setitem__("v", out.detach().clone())),
    ]
    try:
        logits, cache = model.run_with_cache(tokens(), names_filter=lambda n: n.startswith("blocks.0.attn.hook_"))
    finally:
        for h in handles:
            h.remove()
    for name, raw in (("q", seen["q"]), ("v", seen["v"])):
        clamped = cache[f"blocks.0.attn.hook_{name}"]
        assert (raw.abs() > CLIP).float().mean() > 0.1, name  # the clamp acts on many entries
        assert clamped.abs().max() == CLIP and torch.equal(clamped.flatten(2), raw.clamp(-CLIP, CLIP))
    assert cache["blocks.0.attn.hook_k"].abs().max() == CLIP

    ref = refs("clip")
    before = {}
    hook = ref.model.layers[0].self_attn.q_norm.register_forward_hook(
        lambda m, a, out: before.__setitem__("q", out.detach().clone())  # before transformers' in-place clamp_
    )
    try:
        with torch.no_grad():
            ref(tokens())
    finally:
        hook.remove()
    assert torch.equal(before["q"], seen["q"])

    unclipped = HookedOlmoe(HookedOlmoe.config_from_hf({**config_json(ckpts["clip"]), "clip_qkv": None}))
    unclipped.load_state_dict(model.state_dict())
    with torch.no_grad():
        assert (unclipped(tokens()) - logits).abs().max() > 1e-2


# ---- bfloat16: bit for bit ------------------------------------------------------------------------------------

@pytest.mark.parametrize("variant", ["base", "clip", "norm_topk", "biased_tied"])
def test_bfloat16_is_bit_exact(ckpts, refs, variant):
    """Same ops in the same order as transformers (OlmoeRMSNorm computes in float32 and casts back before the
    weight, as moelens's RMSNorm; the router stays in the model dtype): identical bf16 results."""
    model = HookedTransformer.from_pretrained(ckpts[variant], dtype=torch.bfloat16, progress=False)
    ref = refs(variant, torch.bfloat16)
    assert model.blocks[0].mlp.router.weight.dtype == ref.model.layers[0].mlp.gate.weight.dtype == torch.bfloat16
    assert model.blocks[0].attn.q_norm.weight.dtype == torch.bfloat16
    check_bit_exact(compare(model, ref, tokens()))


# ---- generation -----------------------------------------------------------------------------------------------

@pytest.mark.parametrize("variant", ["base", "clip"])
def test_greedy_generation_matches_transformers(ckpts, refs, variant):
    model = HookedTransformer.from_pretrained(ckpts[variant], progress=False)
    ref = refs(variant)
    padded = left_padded(5, (3, 9), (0, 3, 1))
    runs = ((tokens(5, (3, 9)), None), padded) if variant == "base" else (padded,)
    for prompt, mask in runs:
        check_greedy_generation(model, ref, prompt, mask)


# ---- checkpoint spellings and errors --------------------------------------------------------------------------

def test_hub_spelling_is_what_transformers_saves(ckpts):
    """allenai/OLMoE-1B-7B-0924 stores per-expert tensors (model.layers.L.mlp.experts.E.{gate,up,down}_proj.weight),
    the router as mlp.gate.weight and the norms as self_attn.{q,k}_norm.weight; transformers 5 saves the same."""
    keys = set(stored_keys(ckpts["base"]))
    for key in ("model.layers.2.mlp.experts.7.gate_proj.weight", "model.layers.0.mlp.experts.0.up_proj.weight",
                "model.layers.1.mlp.experts.3.down_proj.weight", "model.layers.0.mlp.gate.weight",
                "model.layers.0.self_attn.q_norm.weight", "model.layers.0.self_attn.k_norm.weight", "lm_head.weight"):
        assert key in keys
    model = HookedTransformer.from_pretrained(ckpts["base"], progress=False)
    assert set(expected_keys(HookedOlmoe.site_map(model.cfg))) == keys
    with safe_open(ckpts["base"] / "model.safetensors", "pt") as f:
        assert f.get_slice("model.layers.0.self_attn.q_norm.weight").get_shape() == [64]  # n_heads * d_head
        assert f.get_slice("model.layers.0.self_attn.k_norm.weight").get_shape() == [32]  # n_kv_heads * d_head
        expert = f.get_tensor("model.layers.1.mlp.experts.5.up_proj.weight")
    assert torch.equal(model.blocks[1].mlp.experts.W_gate_up[5, 32:], expert)


def test_fused_and_per_expert_load_the_same(ckpts, tmp_path):
    import tiny

    fused = tiny.fused(shutil.copytree(ckpts["base"], tmp_path / "fused"))
    a = HookedTransformer.from_pretrained(ckpts["base"], progress=False)
    b = HookedTransformer.from_pretrained(fused, progress=False)
    for (name, x), (_, y) in zip(a.state_dict().items(), b.state_dict().items(), strict=True):
        assert torch.equal(x, y), name


def test_missing_norm_names_its_key(ckpts, tmp_path):
    folder = shutil.copytree(ckpts["base"], tmp_path / "ckpt")
    rewrite_tensors(folder, lambda t: t.pop("model.layers.1.self_attn.k_norm.weight"))
    with pytest.raises(CheckpointError) as info:
        HookedTransformer.from_pretrained(folder, progress=False)
    assert "model.layers.1.self_attn.k_norm.weight" in str(info.value) and "missing" in str(info.value)


def test_per_head_sized_q_norm_is_refused_with_its_key(ckpts, tmp_path):
    """A q norm of one head's size (the per-head layout of other families) is not OLMoE's."""
    folder = shutil.copytree(ckpts["base"], tmp_path / "ckpt")
    rewrite_tensors(folder, lambda t: t.update({"model.layers.0.self_attn.q_norm.weight": torch.ones(16)}))
    with pytest.raises(CheckpointError) as info:
        HookedTransformer.from_pretrained(folder, progress=False)
    message = str(info.value)
    for part in ("model.layers.0.self_attn.q_norm.weight", "(16,)", "(64,)", "model.safetensors"):
        assert part in message, message


def test_missing_expert_names_its_key(ckpts, tmp_path):
    folder = shutil.copytree(ckpts["base"], tmp_path / "ckpt")
    rewrite_tensors(folder, lambda t: t.pop("model.layers.2.mlp.experts.6.gate_proj.weight"))
    with pytest.raises(CheckpointError, match=r"model\.layers\.2\.mlp\.experts\.6\.gate_proj\.weight"):
        HookedTransformer.from_pretrained(folder, progress=False)


@pytest.mark.parametrize("change,message", [
    ({"head_dim": 32}, "head_dim"),
    ({"hidden_size": 66}, "multiple of num_attention_heads"),
    ({"clip_qkv": 0}, "clip_qkv"),
    ({"clip_qkv": -1.0}, "clip_qkv"),
    ({"rope_parameters": {"rope_type": "yarn", "factor": 2.0, "rope_theta": 10000.0}}, "not supported"),
    ({"num_experts_per_tok": 9}, "num_experts_per_tok"),
])
def test_config_refusals(ckpts, change, message):
    with pytest.raises(ValueError, match=message):
        HookedOlmoe.config_from_hf({**config_json(ckpts["base"]), **change})


# ---- plan, support, fold, embedded default ---------------------------------------------------------------------

def test_plan_counts_the_whole_projection_norms_and_the_experts_at_full_size():
    """(The total against transformers' and the published one: tests/test_flagships.py.)"""
    import transformers

    with torch.device("meta"):
        hf = transformers.OlmoeForCausalLM(_hf_config(OLMOE_1B_7B))
    p = plan(dict(OLMOE_1B_7B), dtype="bfloat16", cpu_memory="1TB")
    norms = sum(t.numel() for n, t in hf.named_parameters() if n.split(".")[-2].endswith("norm"))
    assert p.components["norms"].parameters == norms  # q_norm 2048 + k_norm 2048 per layer included
    experts = sum(t.numel() for n, t in hf.named_parameters() if ".mlp.experts." in n)
    assert p.components["routed_experts"].parameters == experts == 16 * 64 * 3 * 2048 * 1024
    assert p.components["routers"].parameters == 16 * 64 * 2048


def test_support_lists_the_family_sites(ckpts):
    model = HookedTransformer.from_pretrained(ckpts["clip"], progress=False)
    table = model.support()
    names = table.names()
    for site in ("blocks.L.attn.hook_q", "blocks.L.attn.hook_k", "blocks.L.attn.hook_v", "blocks.L.attn.hook_rot_q",
                 "blocks.L.mlp.hook_router_logits", "blocks.L.mlp.hook_expert_indices", "blocks.L.mlp.hook_routed_out"):
        assert site in names, site
    assert not any("shared" in n or "choice_scores" in n for n in names)
    rows = {r.name: r for r in table.rows}
    assert "q_norm" in rows["blocks.L.attn.hook_q"].meaning and "clip_qkv" in rows["blocks.L.attn.hook_q"].meaning
    assert "q_norm" in rows["blocks.L.attn.hook_q"].reference
    assert "clip_qkv" in table.config_fields


def test_fold_ln_keeps_the_logits(ckpts):
    """ln1's weight folds into q/k/v_proj exactly (the q/k norms come after the projections and stay)."""
    plain = HookedTransformer.from_pretrained(ckpts["clip"], progress=False)
    folded = HookedTransformer.from_pretrained(ckpts["clip"], fold_ln=True, progress=False)
    assert not torch.equal(folded.blocks[0].attn.q_norm.weight, torch.ones(64))
    with torch.no_grad():
        assert (plain(tokens()) - folded(tokens())).abs().max() <= 1e-4


def test_embedded_default(tmp_path, monkeypatch):
    from moelens.defaults import default_checkpoint

    monkeypatch.setattr("moelens.defaults.cache_root", lambda: tmp_path)
    model = HookedTransformer.from_pretrained("tiny-olmoe", progress=False)
    assert type(model) is HookedOlmoe and model.cfg.d_vocab == 260
    logits = model("Hello, OLMoE")
    assert logits.shape[-1] == 260 and torch.isfinite(logits).all()
    report = compare(model, load_reference(default_checkpoint("tiny-olmoe")), torch.randint(0, 260, (2, 16)))
    assert report.max_logit_diff <= 1e-5 and report.index_mismatches == 0


# ---- helpers ---------------------------------------------------------------------------------------------------


def _hf_config(config):
    from transformers import OlmoeConfig

    return OlmoeConfig(**{k: v for k, v in config.items() if k not in ("model_type", "architectures", "rope_scaling")})
