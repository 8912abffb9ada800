"""MiniMax-M2 (HookedMiniMaxM2) against transformers' MiniMaxM2ForCausalLM: site by site in float32, bit for bit
in bfloat16, the partial rotary, the biased sigmoid router, greedy generation, both checkpoint and config
spellings, bad checkpoints and configs, the plan's counts at full size, support(), verify and the embedded
default."""

import json
import shutil

import pytest
import torch
import family_harness as harness
import tiny_minimax_m2 as tiny_mm
from flagships import flagship
from family_harness import (
    MODEL_SITES, References, build_checkpoints, check_bit_exact, check_greedy_generation, config_json, copy_checkpoint,
    left_padded, rewrite_tensors, stored_keys, tokens,
)
from safetensors import safe_open

import tiny
from moelens import CheckpointError, HookedTransformer
from moelens.cli import main
from moelens.loaders.checkpoint import expected_keys
from moelens.models.components import SparseMoe
from moelens.models.components.projection_norm_attention import ProjectionQKNormAttention
from moelens.models.minimax_m2 import HookedMiniMaxM2, SigmoidTopKFloat32Weights
from moelens.plan import plan
from moelens.verify import compare, load_reference

VARIANTS = [v for (_, v) in tiny_mm.VARIANTS]
D_ROT = 16  # the tiny models' rotary_dim: half of head_dim 32


@pytest.fixture(scope="module")
def ckpts(tmp_path_factory):
    return build_checkpoints(tmp_path_factory, "minimax_m2", tiny_mm.VARIANTS)


@pytest.fixture(scope="module")
def refs(ckpts):
    return References(ckpts)


PER_BLOCK = (
    "hook_resid_pre", "ln1.hook_normalized", "attn.hook_q", "attn.hook_k", "attn.hook_v", "attn.hook_z",
    "hook_attn_out", "ln2.hook_normalized", "mlp.hook_router_logits", "mlp.hook_expert_weights",
    "mlp.hook_expert_indices", "mlp.hook_routed_out", "hook_mlp_out", "hook_resid_post",
)


def check_report(report, model, tol=1e-5):
    harness.check_report(report, model, lambda layer: PER_BLOCK, tol, MODEL_SITES)


# ---- float32: every site, every variant ---------------------------------------------------------------------


@pytest.mark.parametrize("variant", VARIANTS)
def test_float32_every_site(ckpts, refs, variant):
    model = HookedTransformer.from_pretrained(ckpts[variant], progress=False)
    assert type(model) is HookedMiniMaxM2
    check_report(compare(model, refs(variant), tokens()), model)


def test_float32_left_padded_and_fused_attention(ckpts, refs):
    model, ref = HookedTransformer.from_pretrained(ckpts["base"], progress=False), refs("base")
    toks, mask = tokens(5, (3, 24)), torch.ones(3, 24, dtype=torch.long)
    mask[0, :4], mask[1, :9] = 0, 0
    report = compare(model, ref, toks, mask)
    assert report.max_logit_diff <= 1e-5 and report.index_mismatches == 0, report
    model.set_attention_backend("fused")
    report = compare(model, ref, toks, mask)
    assert report.max_logit_diff <= 1e-5 and report.index_mismatches == 0, report


def test_variants_are_what_they_claim(ckpts):
    cfg = {v: HookedTransformer.from_pretrained(p, progress=False).cfg for v, p in ckpts.items()}
    base = cfg["base"]
    assert (base.d_head, base.d_rot, base.n_kv_heads, base.n_heads, base.top_k_per_layer) == (32, D_ROT, 2, 4, (3, 3, 3))
    assert 2 * base.d_model == base.n_heads * base.d_head  # head_dim is its own size, as in MiniMax-M2
    assert not base.tie_word_embeddings and base.clip_qkv is None and base.mtp_layers == 0
    full = cfg["full_rotary_tied"]
    assert full.d_rot == full.d_head and full.n_kv_heads == full.n_heads and full.tie_word_embeddings
    assert full.top_k_per_layer == (1, 1, 1)
    assert cfg["hub_config"].d_rot == D_ROT and cfg["hub_config"].rope.theta == 1000.0
    hub = json.loads((ckpts["hub_config"] / "config.json").read_text())
    assert "rope_parameters" not in hub and hub["rotary_dim"] == D_ROT and hub["use_qk_norm"] is True
    assert len(list(ckpts["sharded"].glob("*.safetensors"))) > 1
    fused = stored_keys(ckpts["fused"])
    assert "model.layers.0.mlp.experts.gate_up_proj" in fused and "model.layers.0.mlp.e_score_correction_bias" in fused
    assert not any("block_sparse_moe" in k or "experts.0." in k for k in fused)
    prefixed = stored_keys(ckpts["mlp_prefix"])
    assert "model.layers.2.mlp.experts.7.w2.weight" in prefixed and not any("block_sparse_moe" in k for k in prefixed)


def test_references_cover_what_transformers_exposes(ckpts, refs):
    """Every reference names a real transformers module; of each attention block only q_proj and k_proj (whose
    raw outputs the whole-projection norms consume) have no moelens hook."""
    model = HookedTransformer.from_pretrained(ckpts["base"], device="meta", progress=False)
    ref = refs("base")
    site_map = HookedMiniMaxM2.site_map(model.cfg)
    modules = {r.module for r in site_map.references}
    for r in site_map.references:
        ref.get_submodule(r.module)
    for layer in range(model.cfg.n_layers):
        attn = f"model.layers.{layer}.self_attn"
        assert {f"{attn}.q_norm", f"{attn}.k_norm", f"{attn}.v_proj", f"{attn}.o_proj"} <= modules
        assert {f"model.layers.{layer}.mlp.gate", f"model.layers.{layer}.mlp.experts"} <= modules
        unreferenced = {n for n, _ in ref.get_submodule(attn).named_children()} - {m.split(".")[-1] for m in modules}
        assert unreferenced == {"q_proj", "k_proj"}


# ---- the partial rotary and the router -----------------------------------------------------------------------


def test_components():
    cfg = HookedMiniMaxM2.config_from_hf(tiny_mm.minimax_m2_config().to_dict())
    for spec in HookedMiniMaxM2.recipe(cfg).layers:
        assert spec.mixer is ProjectionQKNormAttention and spec.ffn.moe is SparseMoe
        assert spec.ffn.router is SigmoidTopKFloat32Weights
    assert SigmoidTopKFloat32Weights.choice_bias and not SigmoidTopKFloat32Weights.float32_weight


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_rotary_turns_the_first_rotary_dim_dims_as_transformers(ckpts, refs, dtype, monkeypatch):
    """transformers rotates queries and keys inside the attention forward (no module to hook): its
    apply_rotary_pos_emb's outputs equal hook_rot_q / hook_rot_k, and its probabilities hook_pattern; the dims
    past rotary_dim pass through untouched."""
    import transformers.models.minimax_m2.modeling_minimax_m2 as modeling

    seen = []
    original = modeling.apply_rotary_pos_emb
    monkeypatch.setattr(modeling, "apply_rotary_pos_emb", lambda *a, **k: seen.append(original(*a, **k)) or seen[-1])
    model = HookedTransformer.from_pretrained(ckpts["base"], dtype=dtype, progress=False)
    ref = refs("base", dtype)
    with torch.no_grad():
        out = ref(tokens(), output_attentions=True)
    _, cache = model.run_with_cache(tokens(), names_filter=["*hook_q", "*hook_k", "*rot_q", "*rot_k", "*pattern"])
    tol = 1e-5 if dtype == torch.float32 else 0.0
    for layer, (q_embed, k_embed) in enumerate(seen):
        rot_q, rot_k = cache["rot_q", layer], cache["rot_k", layer]
        assert (rot_q - q_embed.transpose(1, 2)).abs().max() <= tol
        assert (rot_k - k_embed.transpose(1, 2)).abs().max() <= tol
        assert (cache["pattern", layer] - out.attentions[layer]).abs().max() <= tol
        assert torch.equal(rot_q[..., D_ROT:], cache["q", layer][..., D_ROT:])
        assert torch.equal(rot_k[..., D_ROT:], cache["k", layer][..., D_ROT:])
        assert not torch.allclose(rot_q[..., :D_ROT], cache["q", layer][..., :D_ROT])
    assert len(seen) == model.cfg.n_layers


@pytest.mark.parametrize("rotary_dim", [130, 0, 7])
def test_rotary_dim_overridden_by_partial_rotary_factor_loads_as_transformers(ckpts, tmp_path, rotary_dim):
    """rope_parameters.partial_rotary_factor wins over rotary_dim in transformers, which then loads whatever
    rotary_dim says (it was refused here as out of range or odd): the factor is used, the same logits as
    transformers', and rotary_dim is reported unused."""
    folder = copy_checkpoint(ckpts, tmp_path)
    tiny.edit_config(folder, rotary_dim=rotary_dim)
    model = HookedTransformer.from_pretrained(folder, progress=False)
    assert model.cfg.rope.partial_rotary_factor == config_json(folder)["rope_parameters"]["partial_rotary_factor"]
    assert "rotary_dim" in model.cfg.fields_ignored
    report = compare(model, load_reference(folder), tokens())
    assert report.max_logit_diff <= 1e-5 and report.index_mismatches == 0, report


def test_layer_types_of_full_attention_load_as_transformers(ckpts, tmp_path):
    folder = copy_checkpoint(ckpts, tmp_path)
    tiny.edit_config(folder, layer_types=["full_attention"] * 3)
    report = compare(HookedTransformer.from_pretrained(folder, progress=False), load_reference(folder), tokens())
    assert report.max_logit_diff <= 1e-5 and report.index_mismatches == 0, report


def test_rotary_dim_matters(ckpts):
    """The same weights with the rotary over whole heads give other logits: the partial rotary is live."""
    model = HookedTransformer.from_pretrained(ckpts["base"], progress=False)
    raw = json.loads((ckpts["base"] / "config.json").read_text())
    raw["rope_parameters"] = {**raw["rope_parameters"], "partial_rotary_factor": 1.0}
    whole = HookedMiniMaxM2(HookedMiniMaxM2.config_from_hf(raw))
    whole.load_state_dict(model.state_dict())
    with torch.no_grad():
        assert (whole(tokens()) - model(tokens())).abs().max() > 1e-2


def test_router_rule_by_hand(ckpts):
    """From the cached logits, by the published rule: sigmoid scores, the top-k of scores + bias, the chosen
    unbiased scores over their sum; the bias changes the choice for many tokens (so the checkpoints test it)."""
    model = HookedTransformer.from_pretrained(ckpts["base"], progress=False)
    _, cache = model.run_with_cache(tokens())
    k = model.cfg.top_k_per_layer[0]
    for layer, block in enumerate(model.blocks):
        bias = block.mlp.router.e_score_correction_bias
        scores = torch.sigmoid(cache["router_logits", layer])
        chosen = (scores + bias).topk(k, dim=-1).indices.sort(-1).values
        indices = cache["expert_indices", layer]
        assert torch.equal(indices.sort(-1).values, chosen)
        picked = scores.gather(-1, indices)
        assert (cache["expert_weights", layer] - picked / picked.sum(-1, keepdim=True)).abs().max() <= 1e-7
        unbiased = scores.topk(k, dim=-1).indices.sort(-1).values
        assert (unbiased != chosen).any(-1).float().mean() > 0.2


def test_bias_changes_the_choice_not_the_weights(ckpts):
    """Banning an expert at hook_choice_scores re-routes; the scores stay, and a kept expert's weight is its
    unbiased score over the new chosen set's sum."""
    model = HookedTransformer.from_pretrained(ckpts["base"], progress=False)
    _, clean = model.run_with_cache(tokens())
    banned = int(clean["expert_indices", 0].flatten().mode().values)
    ban = lambda choice, hook: choice.index_fill(-1, torch.tensor([banned]), float("-inf"))  # noqa: E731
    with model.hooks([("blocks.0.mlp.hook_choice_scores", ban)]):
        _, cache = model.run_with_cache(tokens())
    idx, w = cache["expert_indices", 0], cache["expert_weights", 0]
    assert not (idx == banned).any() and (clean["expert_indices", 0] == banned).any()
    assert torch.equal(cache["router_scores", 0], clean["router_scores", 0])
    picked = clean["router_scores", 0].gather(-1, idx)
    assert (w - picked / picked.sum(-1, keepdim=True)).abs().max() <= 1e-7


# ---- bfloat16: bit for bit --------------------------------------------------------------------------------


# mlp_prefix's seed rounds a bf16 score differently if the keys are not laid out as transformers' (see Attention)
@pytest.mark.parametrize("variant,seeds", [("base", (3, 0, 1)), ("full_rotary_tied", (3,)), ("mlp_prefix", (3,))])
def test_bfloat16_is_bit_exact(ckpts, refs, variant, seeds):
    """The router weight and the correction bias are bfloat16 like the model (transformers casts the buffer
    too), the logits bfloat16, the sigmoid and the top-k weights float32 (the expert outputs are scaled in
    float32, as transformers' experts): identical bf16 results, on several inputs."""
    model = HookedTransformer.from_pretrained(ckpts[variant], dtype=torch.bfloat16, progress=False)
    ref = refs(variant, torch.bfloat16)
    for layer, block in enumerate(model.blocks):
        theirs = ref.model.layers[layer].mlp
        assert block.mlp.router.weight.dtype == theirs.gate.weight.dtype == torch.bfloat16
        assert block.mlp.router.e_score_correction_bias.dtype == theirs.e_score_correction_bias.dtype == torch.bfloat16
    _, cache = model.run_with_cache(tokens(), names_filter=lambda n: n.endswith(("router_logits", "expert_weights")))
    assert cache["router_logits", 0].dtype == torch.bfloat16 and cache["expert_weights", 0].dtype == torch.float32
    for seed in seeds:
        check_bit_exact(compare(model, ref, tokens(seed)))


# ---- generation --------------------------------------------------------------------------------------------


@pytest.mark.parametrize("variant,padded", [("base", True), ("full_rotary_tied", False)])
def test_greedy_generation_matches_transformers(ckpts, refs, variant, padded):
    model = HookedTransformer.from_pretrained(ckpts[variant], progress=False)
    prompt = left_padded(5, (3, 9), (0, 3, 1)) if padded else (tokens(5, (3, 9)), None)
    check_greedy_generation(model, refs(variant), *prompt)


# ---- checkpoint and config spellings ---------------------------------------------------------------------------


def test_hub_spelling_is_what_transformers_saves(ckpts):
    """MiniMaxAI/MiniMax-M2 stores model.layers.L.block_sparse_moe.{gate.weight, e_score_correction_bias,
    experts.E.w1/w3/w2.weight} (w1 gate, w3 up, w2 down) and self_attn.{q,k}_norm.weight over the whole
    projection; transformers 5's save_pretrained writes the same, and moelens expects exactly those keys."""
    stored = set(stored_keys(ckpts["base"]))
    for key in ("model.layers.0.block_sparse_moe.gate.weight", "model.layers.2.block_sparse_moe.e_score_correction_bias",
                "model.layers.1.block_sparse_moe.experts.7.w1.weight", "model.layers.0.block_sparse_moe.experts.0.w3.weight",
                "model.layers.2.block_sparse_moe.experts.3.w2.weight", "model.layers.0.self_attn.q_norm.weight",
                "model.layers.0.self_attn.k_norm.weight", "lm_head.weight"):
        assert key in stored
    model = HookedTransformer.from_pretrained(ckpts["base"], progress=False)
    assert set(expected_keys(HookedMiniMaxM2.site_map(model.cfg))) == stored  # the Hub's spelling first
    with safe_open(ckpts["base"] / "model.safetensors", "pt") as f:
        assert f.get_slice("model.layers.0.self_attn.q_norm.weight").get_shape() == [128]  # n_heads * d_head
        assert f.get_slice("model.layers.0.self_attn.k_norm.weight").get_shape() == [64]  # n_kv_heads * d_head
        w1, w3 = f.get_tensor("model.layers.1.block_sparse_moe.experts.5.w1.weight"), f.get_tensor(
            "model.layers.1.block_sparse_moe.experts.5.w3.weight")
        bias = f.get_tensor("model.layers.2.block_sparse_moe.e_score_correction_bias")
    assert torch.equal(model.blocks[1].mlp.experts.W_gate_up[5], torch.cat([w1, w3]))
    assert torch.equal(model.blocks[2].mlp.router.e_score_correction_bias, bias)


def test_all_spellings_load_the_same(ckpts, tmp_path):
    """One checkpoint rewritten in transformers' fused layout and under the `mlp` prefix loads bit for bit the same."""
    folder = ckpts["base"]
    fused = tiny_mm.fused(shutil.copytree(folder, tmp_path / "fused"))
    prefixed = tiny_mm.mlp_prefix(shutil.copytree(folder, tmp_path / "prefixed"))
    a = HookedTransformer.from_pretrained(folder, progress=False).state_dict()
    for other in (fused, prefixed):
        b = HookedTransformer.from_pretrained(other, progress=False).state_dict()
        assert a.keys() == b.keys() and all(torch.equal(a[n], b[n]) for n in a)


def test_both_config_spellings_read_as_transformers(ckpts):
    """rotary_dim (the Hub's) and rope_parameters.partial_rotary_factor (transformers'), rope_theta at the top or
    inside: the rotated width and theta are transformers' own reading of each spelling, precedence included."""
    from transformers import MiniMaxM2Config

    base = json.loads((ckpts["base"] / "config.json").read_text())
    plain = {k: v for k, v in base.items() if k not in ("rope_parameters", "rotary_dim", "partial_rotary_factor")}
    cases = [
        {"rotary_dim": 8, "rope_theta": 500.0},  # the Hub's
        {"rope_parameters": {"rope_type": "default", "rope_theta": 500.0, "partial_rotary_factor": 0.5}},
        {"rotary_dim": 4, "rope_parameters": {"rope_type": "default", "rope_theta": 500.0, "partial_rotary_factor": 0.5}},
        {"rotary_dim": 4, "partial_rotary_factor": 0.75},  # the explicit factor wins; theta transformers' 5e6
        {"rotary_dim": 12},
        {},  # the whole head
    ]
    widths = []
    for case in cases:
        raw = {**plain, **case}
        theirs = MiniMaxM2Config(**{k: v for k, v in raw.items() if k not in ("architectures", "model_type")})
        params = theirs.rope_parameters
        ours = HookedMiniMaxM2.config_from_hf(raw)
        assert ours.d_rot == int(theirs.head_dim * params.get("partial_rotary_factor", 1.0)), case
        assert ours.rope.theta == params["rope_theta"], case
        widths.append(ours.d_rot)
    assert widths == [8, 16, 16, 24, 12, 32]
    assert HookedMiniMaxM2.config_from_hf({**plain, "rotary_dim": 4, "partial_rotary_factor": 0.75}).rope.theta == 5e6
    hub = json.loads((ckpts["hub_config"] / "config.json").read_text())
    assert HookedMiniMaxM2.config_from_hf(hub) == HookedMiniMaxM2.config_from_hf(base)


# ---- bad checkpoints and configs ---------------------------------------------------------------------------


@pytest.mark.parametrize("key", [
    "model.layers.1.block_sparse_moe.experts.3.w3.weight",
    "model.layers.2.block_sparse_moe.e_score_correction_bias",
    "model.layers.0.block_sparse_moe.gate.weight",
    "model.layers.1.self_attn.k_norm.weight",
])
def test_missing_tensor_is_named_in_the_hub_spelling(ckpts, tmp_path, key):
    folder = copy_checkpoint(ckpts, tmp_path)
    rewrite_tensors(folder, lambda t: t.pop(key))
    with pytest.raises(CheckpointError, match="missing") as info:
        HookedTransformer.from_pretrained(folder, progress=False)
    assert key in str(info.value)


def test_per_head_sized_q_norm_is_refused_with_its_key(ckpts, tmp_path):
    """A q norm of one head's size (qk_norm_type "per_head", the layout of other families) is not MiniMax-M2's."""
    folder = copy_checkpoint(ckpts, tmp_path)
    key = "model.layers.0.self_attn.q_norm.weight"
    rewrite_tensors(folder, lambda t: t.update({key: torch.ones(32)}))
    with pytest.raises(CheckpointError) as info:
        HookedTransformer.from_pretrained(folder, progress=False)
    assert all(part in str(info.value) for part in (key, "(32,)", "(128,)", "model.safetensors"))


def test_fused_checkpoint_missing_down_proj_is_named(ckpts, tmp_path):
    folder = copy_checkpoint(ckpts, tmp_path, "fused")
    rewrite_tensors(folder, lambda t: t.pop("model.layers.0.mlp.experts.down_proj"))
    with pytest.raises(CheckpointError, match=r"model\.layers\.0\.mlp\.experts\.down_proj"):
        HookedTransformer.from_pretrained(folder, progress=False)


def test_multi_token_prediction_modules_are_skipped_only_when_the_config_has_them(ckpts, tmp_path):
    """Layers stored after the last block are the MTP modules (num_mtp_modules), which neither transformers nor
    moelens runs; without them in the config they are unexpected tensors, named."""
    folder = copy_checkpoint(ckpts, tmp_path)
    key = "model.layers.3.block_sparse_moe.experts.0.w1.weight"
    rewrite_tensors(folder, lambda t: t.update({key: torch.ones(32, 64), "model.layers.4.self_attn.q_proj.weight": torch.ones(4)}))
    with pytest.raises(CheckpointError, match=rf"unexpected .*{key}"):
        HookedTransformer.from_pretrained(folder, progress=False)
    tiny.edit_config(folder, num_mtp_modules=2)
    model = HookedTransformer.from_pretrained(folder, progress=False)
    clean = HookedTransformer.from_pretrained(ckpts["base"], progress=False)
    assert torch.equal(model(tokens()), clean(tokens()))


def test_published_fp8_config_is_read(ckpts, tmp_path):
    """MiniMax-M2's published quantization_config (block-scaled fp8) is a format moelens reads; its fp8
    weights are loaded and compared with transformers' dequantizing load in tests/test_quantized_checkpoints.py."""
    folder = copy_checkpoint(ckpts, tmp_path)
    tiny.edit_config(folder, quantization_config=MINIMAX_M2["quantization_config"])
    assert type(HookedTransformer.from_pretrained(folder, progress=False)) is HookedMiniMaxM2


@pytest.mark.parametrize("change,message", [
    ({"use_qk_norm": False}, "use_qk_norm = False"),
    ({"qk_norm_type": "per_head"}, "qk_norm_type = 'per_head'"),
    ({"scoring_func": "softmax"}, "scoring_func = 'softmax'"),
    ({"use_routing_bias": False}, "use_routing_bias = False"),
    ({"shared_intermediate_size": 1536}, "shared_intermediate_size = 1536"),
    ({"use_qk_norm": 1}, "use_qk_norm = 1"),
    ({"attn_type_list": [1, 0, 1]}, r"attn_type_list .*\[1\]"),
    ({"attn_type_list": [1, 2, 1]}, "attn_type_list"),
    ({"rotary_dim": 130}, "rotary_dim = 130"),
    ({"layer_types": ["sliding_attention"] + ["full_attention"] * 61}, r"layer_types lists 'sliding_attention' at layers \[0\]"),
    ({"layer_types": ["full_attention"] * 61}, "layer_types = .*a list of 62 entries"),
    ({"rotary_dim": 7}, "7 rotated dimensions; the rotary needs an even number"),
    ({"num_experts_per_tok": 257}, "num_experts_per_tok"),
    ({"num_mtp_modules": -1}, "num_mtp_modules"),
])
def test_config_refusals(change, message):
    raw = {k: v for k, v in MINIMAX_M2.items() if k != "quantization_config"}
    with pytest.raises(ValueError, match=message):
        HookedMiniMaxM2.config_from_hf({**raw, **change})


# ---- plan, support, verify, embedded default ------------------------------------------------------------------

MINIMAX_M2 = flagship("minimax_m2", "MiniMaxAI/MiniMax-M2")
# transformers' count, by hand: 62 x (attention 44,040,192 + q/k/ln norms 13,312 + gate 786,432 + bias 256 +
# experts 256 x 3 x 3072 x 1536) + 2 x 200064 x 3072 + 3072. The Hub reports 228,703,644,928 stored values: these
# plus the fp8 weights' 13,880,064 weight_scale_inv entries (one per 128 x 128 block); no MTP tensors.
MINIMAX_M2_PARAMETERS = 228_689_764_864


def test_plan_counts_by_hand_at_full_size():
    """(The counts against transformers' and the published total: tests/test_flagships.py.)"""
    p = plan(dict(MINIMAX_M2), dtype="bfloat16", cpu_memory="1TB")
    assert p.parameters == MINIMAX_M2_PARAMETERS
    assert p.bytes == 2 * MINIMAX_M2_PARAMETERS
    assert p.components["routed_experts"].parameters == 62 * 256 * 3 * 3072 * 1536
    assert p.components["routers"].parameters == 62 * (256 * 3072 + 256)  # the correction bias included
    # rotary over 64 of 128 dims; the cache holds every kv head's whole key and value, bf16, seq 2048
    cfg = HookedMiniMaxM2.config_from_hf(MINIMAX_M2)
    assert (cfg.d_rot, cfg.rope.theta, cfg.mtp_layers) == (64, 5e6, 3)
    assert p.kv_cache["bytes"] == 62 * 2048 * 2 * 8 * 128 * 2


def test_support_lists_the_family_sites(ckpts):
    model = HookedTransformer.from_pretrained(ckpts["hub_config"], progress=False)
    table = model.support(print_table=False)
    names = set(table.names())
    for site in ("blocks.L.attn.hook_q", "blocks.L.attn.hook_rot_q", "blocks.L.mlp.hook_router_logits",
                 "blocks.L.mlp.hook_router_scores", "blocks.L.mlp.hook_choice_scores", "blocks.L.mlp.hook_expert_indices",
                 "blocks.L.mlp.hook_expert_weights", "blocks.L.mlp.hook_routed_out", "blocks.L.mlp.experts.hook_post"):
        assert site in names, site
    assert not any("shared" in n for n in names)
    rows = {r.name: r for r in table.rows}
    assert "q_norm" in rows["blocks.L.attn.hook_q"].meaning and "clip_qkv" not in rows["blocks.L.attn.hook_q"].meaning
    assert rows["blocks.L.attn.hook_q"].reference == "model.layers.L.self_attn.q_norm"
    assert rows["blocks.L.mlp.hook_router_logits"].reference.startswith("model.layers.L.mlp.gate")
    assert "rotary_dim" in table.config_fields and "use_qk_norm" in table.config_fields
    assert {"mlp_intermediate_size", "use_mtp", "mtp_transformer_layers"} <= set(table.ignored_fields)


def test_embedded_default_verify_and_generate(tmp_path, monkeypatch, capsys):
    from moelens.defaults import default_checkpoint

    monkeypatch.setattr("moelens.defaults.cache_root", lambda: tmp_path)
    model = HookedTransformer.from_pretrained("tiny-minimax-m2", progress=False)
    assert type(model) is HookedMiniMaxM2 and model.cfg.d_vocab == 260 and model.cfg.d_rot == 16
    logits = model("Hello, MiniMax")
    assert logits.shape[-1] == 260 and torch.isfinite(logits).all()
    assert model.generate("Hi", max_new_tokens=3, stop_at_eos=False, do_sample=False)
    folder = default_checkpoint("tiny-minimax-m2")
    assert "model.layers.0.block_sparse_moe.experts.0.w1.weight" in stored_keys(folder)  # written in the Hub's spelling
    report = compare(model, load_reference(folder), torch.randint(0, 260, (2, 16)))
    assert report.max_logit_diff <= 1e-5 and report.index_mismatches == 0
    assert main(["verify", "tiny-minimax-m2"]) == 0
    out = capsys.readouterr().out
    assert "float32: OK" in out and "bfloat16: OK" in out and "blocks.3.mlp.hook_router_logits" in out
