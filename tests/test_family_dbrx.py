"""DBRX (HookedDbrx) against transformers' DbrxForCausalLM: site by site in float32, bit for bit in bfloat16,
greedy generation; the fused Wqkv and the flat experts read through the loader's SplitWeight; clip_qkv (null: no
clamp); the router's p-norm; the nested config's errors; what is refused (Triton, per-expert reads)."""

import json
import shutil
import warnings

import pytest
import torch
import tiny_dbrx
from family_harness import (
    MODEL_SITES, References, build_checkpoints, check_bit_exact, check_greedy_generation, check_report, config_json,
    left_padded, rewrite_tensors, stored_keys, tokens,
)
from safetensors import safe_open

from moelens import HookedTransformer
from moelens.cache_analysis import NormNotDecomposable
from moelens.loaders.checkpoint import expected_keys
from moelens.loaders.errors import CheckpointError
from moelens.models.components.layer_norm import BiasFreeLayerNorm
from moelens.models.dbrx import ClampedQKVAttention, HookedDbrx
from moelens.verify import compare, load_reference

VARIANTS = tiny_dbrx.VARIANTS
CLIP = tiny_dbrx.CLIP
PER_BLOCK = ("hook_resid_pre", "ln1.hook_normalized", "attn.hook_z", "hook_attn_out", "ln2.hook_normalized",
             "mlp.hook_router_logits", "mlp.hook_expert_weights", "mlp.hook_expert_indices", "mlp.hook_routed_out",
             "hook_mlp_out", "hook_resid_post")


@pytest.fixture(scope="module")
def ckpts(tmp_path_factory):
    return build_checkpoints(tmp_path_factory, "dbrx", VARIANTS)


@pytest.fixture(scope="module")
def refs(ckpts):
    return References(ckpts)


# ---- float32: every site against transformers ---------------------------------------------------------------

@pytest.mark.parametrize("variant", [v for _, v in VARIANTS])
def test_float32_every_site(ckpts, refs, variant):
    model = HookedTransformer.from_pretrained(ckpts[variant], progress=False)
    assert type(model) is HookedDbrx and isinstance(model.blocks[0].ln1, BiasFreeLayerNorm)
    assert model.blocks[0].ln1.bias is None and isinstance(model.blocks[0].attn, ClampedQKVAttention)
    check_report(compare(model, refs(variant), tokens()), model, lambda layer: PER_BLOCK, model_sites=MODEL_SITES)


def test_variants_are_what_they_claim(ckpts):
    cfg = {v: HookedTransformer.from_pretrained(p, progress=False).cfg for v, p in ckpts.items()}
    base = cfg["base"]
    assert base.clip_qkv == CLIP and base.topk_norm_p == 1.0 and base.n_kv_heads == 2 < base.n_heads == 4
    assert base.n_experts == 8 and base.top_k == 3 and base.d_expert == 32 and base.norm_eps == 1e-5
    assert cfg["p2"].topk_norm_p == 2.0 and cfg["unnormalised"].topk_norm_p is None
    mha = cfg["mha_gelu"]
    assert mha.n_kv_heads == 4 and mha.act_fn == "gelu" and mha.rope.theta == 500.0
    assert len(list(ckpts["sharded"].glob("*.safetensors"))) > 1


def test_weights_are_read_from_the_fused_and_flat_tensors(ckpts):
    """Wqkv's rows are q_proj's, k_proj's, v_proj's; w1 / v1 hold each expert's gate / up rows in turn, w2 its
    down projection transposed; the site map expects exactly the keys transformers saves."""
    model = HookedTransformer.from_pretrained(ckpts["base"], progress=False)
    assert set(expected_keys(HookedDbrx.site_map(model.cfg))) == set(stored_keys(ckpts["base"]))
    src = "transformer.blocks.1"
    with safe_open(ckpts["base"] / "model.safetensors", "pt") as f:
        wqkv = f.get_tensor(f"{src}.norm_attn_norm.attn.Wqkv.weight")
        w1, v1, w2 = (f.get_tensor(f"{src}.ffn.experts.mlp.{n}") for n in ("w1", "v1", "w2"))
    attn, experts = model.blocks[1].attn, model.blocks[1].mlp.experts
    assert wqkv.shape == (64 + 2 * 2 * 16, 64)
    assert torch.equal(attn.q_proj.weight, wqkv[:64]) and torch.equal(attn.k_proj.weight, wqkv[64:96])
    assert torch.equal(attn.v_proj.weight, wqkv[96:])
    assert w1.shape == (8 * 32, 64)
    for e in (0, 4):
        rows = slice(32 * e, 32 * (e + 1))
        assert torch.equal(experts.W_gate_up[e, :32], w1[rows]) and torch.equal(experts.W_gate_up[e, 32:], v1[rows])
        assert torch.equal(experts.W_down[e], w2[rows].T)


def test_clip_qkv_clamps_q_k_and_v(ckpts):
    model = HookedTransformer.from_pretrained(ckpts["base"], progress=False)
    _, cache = model.run_with_cache(tokens(), names_filter=lambda n: n.startswith("blocks.0.") and "ln1" in n)
    x = cache["blocks.0.ln1.hook_normalized"]
    _, cache = model.run_with_cache(tokens(), names_filter=lambda n: n.startswith("blocks.0.attn.hook_"))
    attn = model.blocks[0].attn
    for name, proj in (("q", attn.q_proj), ("k", attn.k_proj), ("v", attn.v_proj)):
        raw = proj(x)
        assert (raw.abs() > CLIP).float().mean() > 0.1, name  # the clamp acts on many entries
        hooked = cache[f"blocks.0.attn.hook_{name}"]
        assert hooked.abs().max() == CLIP and torch.equal(hooked.flatten(2), raw.clamp(-CLIP, CLIP)), name


def test_null_clip_qkv_clamps_nothing(ckpts, tmp_path):
    """clip_qkv null: no clamp (transformers raises on it: torch.clamp(min=None, max=None)); the oracle is
    transformers' run of the same weights with a bound nothing reaches. The clamp of the base variant changes
    the logits."""
    unclipped = tiny_dbrx.without_clip(shutil.copytree(ckpts["base"], tmp_path / "null"))
    far = shutil.copytree(ckpts["base"], tmp_path / "far")
    config = config_json(far)
    config["attn_config"]["clip_qkv"] = tiny_dbrx.NO_CLIP
    (far / "config.json").write_text(json.dumps(config))
    model = HookedTransformer.from_pretrained(unclipped, progress=False)
    assert model.cfg.clip_qkv is None and type(model.blocks[0].attn).__name__ == "Attention"
    report = compare(model, load_reference(far), tokens())
    check_report(report, model, lambda layer: PER_BLOCK, model_sites=MODEL_SITES)
    with pytest.raises(RuntimeError, match="min.*max"):
        with torch.no_grad():
            load_reference(unclipped)(tokens())
    clipped = HookedTransformer.from_pretrained(ckpts["base"], progress=False)
    with torch.no_grad():
        assert (clipped(tokens()) - model(tokens())).abs().max() > 1e-2


def test_router_p_norm(ckpts):
    """moe_normalize_expert_weights p: the k weights' p-norm is 1 (p = 1: they sum to 1); null: the softmax's
    top-k scores as they are."""
    for variant, p in (("base", 1), ("p2", 2)):
        model = HookedTransformer.from_pretrained(ckpts[variant], progress=False)
        _, cache = model.run_with_cache(tokens(), names_filter="blocks.1.mlp.hook_expert_weights")
        w = cache["blocks.1.mlp.hook_expert_weights"]
        torch.testing.assert_close(w.pow(p).sum(-1), torch.ones(w.shape[:-1]), rtol=0, atol=1e-6)
    model = HookedTransformer.from_pretrained(ckpts["unnormalised"], progress=False)
    names = ["blocks.1.mlp.hook_expert_weights", "blocks.1.mlp.hook_router_logits", "blocks.1.mlp.hook_expert_indices"]
    _, cache = model.run_with_cache(tokens(), names_filter=names)
    probs = cache[names[1]].softmax(-1).gather(-1, cache[names[2]])
    torch.testing.assert_close(cache[names[0]], probs)
    assert (cache[names[0]].sum(-1) < 0.99).all()


# ---- bfloat16: bit for bit ------------------------------------------------------------------------------------

@pytest.mark.parametrize("variant", ["base", "p2", "unnormalised", "mha_gelu"])
def test_bfloat16_is_bit_exact(ckpts, refs, variant):
    """The LayerNorms, the router's softmax and p-norm in bfloat16, the experts added in ascending order in
    bfloat16, as transformers: identical results."""
    model = HookedTransformer.from_pretrained(ckpts[variant], dtype=torch.bfloat16, progress=False)
    assert model.blocks[0].mlp.router.weight.dtype == torch.bfloat16
    check_bit_exact(compare(model, refs(variant, torch.bfloat16), tokens()))


# ---- generation -----------------------------------------------------------------------------------------------

def test_greedy_generation_matches_transformers(ckpts, refs):
    model = HookedTransformer.from_pretrained(ckpts["base"], progress=False)
    for prompt, mask in ((tokens(5, (3, 9)), None), left_padded(5, (3, 9), (0, 3, 1))):
        check_greedy_generation(model, refs("base"), prompt, mask)


# ---- what is refused, named -----------------------------------------------------------------------------------

def test_triton_backend_is_refused(ckpts):
    """The Triton kernels sum a token's slots in slot order (their combine); DBRX's reference adds the experts in
    ascending expert order in the model's dtype, which they cannot."""
    with pytest.raises(ValueError, match="experts_backend='triton' computes real experts only, their outputs summed"):
        HookedTransformer.from_pretrained(ckpts["base"], progress=False, experts_backend="triton")


@pytest.mark.parametrize("option", [{"expert_offload": "disk"}, {"expert_offload": "cpu"}])
def test_per_expert_reads_of_flat_experts_are_refused(ckpts, option):
    with pytest.raises(CheckpointError, match="stored flat.*load without expert_offload"):
        HookedTransformer.from_pretrained(ckpts["base"], progress=False, **option)


def test_fold_ln_folds_the_bias_free_norms_and_stack_norms_are_refused(ckpts):
    """Without a bias, a LayerNorm's weight folds into its readers as an RMSNorm's (the centring stays in the
    norm); a stack of components cannot be put through a norm that centres (NormNotDecomposable)."""
    plain = HookedTransformer.from_pretrained(ckpts["base"], progress=False)
    folded = HookedTransformer.from_pretrained(ckpts["base"], fold_ln=True, progress=False)
    assert torch.equal(folded.blocks[0].ln1.weight, torch.ones(64)) and folded.blocks[0].ln1.bias is None
    for b, r in zip(folded.blocks, plain.blocks):
        assert torch.equal(b.attn.k_proj.weight, r.attn.k_proj.weight * r.ln1.weight)
        assert torch.equal(b.mlp.router.weight, r.mlp.router.weight * r.ln2.weight)
        assert torch.equal(b.mlp.experts.W_down, r.mlp.experts.W_down)
        assert torch.equal(b.mlp.experts.W_gate_up, r.mlp.experts.W_gate_up * r.ln2.weight)
    with torch.no_grad():
        torch.testing.assert_close(folded(tokens()).softmax(-1), plain(tokens()).softmax(-1), rtol=0, atol=1e-4)
    _, cache = plain.run_with_cache(tokens())
    with pytest.raises(NormNotDecomposable, match="ln_final is a LayerNorm \\(it centres its input\\)"):
        cache.apply_ln_to_stack(cache.decompose_resid(), layer=-1)


def test_wrong_wqkv_shape_names_the_key(ckpts, tmp_path):
    folder = shutil.copytree(ckpts["base"], tmp_path / "ckpt")
    key = "transformer.blocks.2.norm_attn_norm.attn.Wqkv.weight"
    rewrite_tensors(folder, lambda t: t.update({key: t[key][:96]}))
    with pytest.raises(CheckpointError) as info:
        HookedTransformer.from_pretrained(folder, progress=False)
    for part in (key, "(96, 64)", "(128, 64)", "q_proj.weight + blocks.2.attn.k_proj.weight"):
        assert part in str(info.value), str(info.value)


def test_missing_flat_experts_name_their_key(ckpts, tmp_path):
    folder = shutil.copytree(ckpts["base"], tmp_path / "ckpt")
    rewrite_tensors(folder, lambda t: t.pop("transformer.blocks.1.ffn.experts.mlp.v1"))
    with pytest.raises(CheckpointError, match=r"missing 1 tensor.*transformer\.blocks\.1\.ffn\.experts\.mlp\.v1"):
        HookedTransformer.from_pretrained(folder, progress=False)


@pytest.mark.parametrize("change,message", [
    ({"ffn_config": {"moe_num_experts": 0}}, "ffn_config.moe_num_experts"),
    ({"ffn_config": {"moe_top_k": 9}}, "ffn_config.moe_top_k"),
    ({"ffn_config": {"ffn_hidden_size": 0}}, "ffn_config.ffn_hidden_size"),
    ({"ffn_config": {"moe_normalize_expert_weights": -1}}, "ffn_config.moe_normalize_expert_weights"),
    ({"ffn_config": {"ffn_act_fn": {"name": "tanh"}}}, "ffn_config.ffn_act_fn.name"),
    ({"ffn_config": {"ffn_act_fn": "silu"}}, "ffn_config.ffn_act_fn"),
    ({"attn_config": {"kv_n_heads": 3}}, "attn_config.kv_n_heads"),
    ({"attn_config": {"clip_qkv": 0}}, "attn_config.clip_qkv"),
    ({"attn_config": 8}, "attn_config"),
    ({"d_model": 66}, "d_model .66. must be a multiple of n_heads"),
    ({"n_heads": 0}, "n_heads"),
    ({"head_dim": 8}, "head_dim"),
    ({"tie_word_embeddings": True}, "tie_word_embeddings"),
    ({"rope_parameters": {"rope_type": "default", "rope_theta": 1e4, "partial_rotary_factor": 0.5}}, "partial_rotary"),
])
def test_config_refusals_name_the_nested_field(ckpts, change, message):
    config = config_json(ckpts["base"])
    for section in ("attn_config", "ffn_config"):
        if isinstance(change.get(section), dict):
            change = {**change, section: {**config[section], **change[section]}}
    with pytest.raises(ValueError, match=message):
        HookedDbrx.config_from_hf({**config, **change})


def test_attn_config_rope_theta_is_ignored_as_transformers_does(ckpts):
    """transformers 5 builds the rotary from the top-level rope_theta / rope_parameters (10000 where absent) and
    never reads attn_config.rope_theta's value: moelens does the same, and warns where the two differ."""
    config = config_json(ckpts["base"])
    config["attn_config"]["rope_theta"] = 500000.0
    with pytest.warns(UserWarning, match="attn_config.rope_theta = 500000 is ignored"):
        cfg = HookedDbrx.config_from_hf(config)
    assert cfg.rope.theta == 10000.0 and "attn_config.rope_theta" in cfg.fields_ignored
    del config["rope_parameters"]
    with pytest.warns(UserWarning):
        assert HookedDbrx.config_from_hf(config).rope.theta == 10000.0
    from transformers import DbrxConfig, DbrxForCausalLM

    with torch.device("meta"):
        hf = DbrxForCausalLM(DbrxConfig(**{k: v for k, v in config.items() if k != "model_type"}))
    assert hf.config.rope_parameters["rope_theta"] == 10000.0
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        HookedDbrx.config_from_hf(config_json(ckpts["base"]))  # equal thetas: no warning


# ---- embedded default -----------------------------------------------------------------------------------------

def test_embedded_default(tmp_path, monkeypatch):
    from moelens.defaults import default_checkpoint

    monkeypatch.setattr("moelens.defaults.cache_root", lambda: tmp_path)
    model = HookedTransformer.from_pretrained("tiny-dbrx", progress=False)
    assert type(model) is HookedDbrx and model.cfg.d_vocab == 260
    logits = model("Hello, DBRX")
    assert logits.shape[-1] == 260 and torch.isfinite(logits).all()
    report = compare(model, load_reference(default_checkpoint("tiny-dbrx")), torch.randint(0, 260, (2, 16)))
    assert report.max_logit_diff <= 1e-5 and report.index_mismatches == 0
