"""DeepSeek-V2 (latent attention with in-place pair rotary, softmax greedy / group-limited router, dense first
blocks, shared experts) against transformers' own DeepseekV2ForCausalLM on the same tiny checkpoints."""

import pytest
import torch

import tiny
import tiny_deepseek_v2 as tiny_ds2
from flagships import flagship
from family_harness import (
    References, build_checkpoints, check_bit_exact, check_greedy_generation, copy_checkpoint, left_padded,
    rewrite_tensors, stored_keys, tokens,
)
from moelens import HookedTransformer, KVCache
from moelens.cli import main
from moelens.loaders.errors import CheckpointError
from moelens.models.components.rotary import PolarRotary
from moelens.models.deepseek_v2 import HookedDeepseekV2, PairRotaryLatentAttention, SoftmaxGroupLimitedTopK
from moelens.plan import plan
from moelens.verify import compare
from test_family_deepseek_v3 import check_report

VARIANTS = [v for (_, v) in tiny_ds2.VARIANTS]


@pytest.fixture(scope="module")
def checkpoints(tmp_path_factory):
    return build_checkpoints(tmp_path_factory, "deepseek_v2", tiny_ds2.VARIANTS)


@pytest.fixture(scope="module")
def models(checkpoints):
    return {v: HookedTransformer.from_pretrained(p, progress=False) for v, p in checkpoints.items()}


@pytest.fixture(scope="module")
def references(checkpoints):
    return References(checkpoints)


def test_variants_are_what_they_claim(models, checkpoints):
    base, grouped = models["base"].cfg, models["grouped"].cfg
    assert base.q_lora_rank is None and grouped.q_lora_rank == 24
    assert (base.n_group, base.topk_group) == (1, 1) and (grouped.n_group, grouped.topk_group) == (4, 2)
    assert grouped.routed_scaling_factor == 16.0 and not grouped.norm_topk_prob and grouped.qkv_bias and grouped.o_bias
    assert base.rope.kind == "yarn" and base.rope.mscale == base.rope.mscale_all_dim == 0.707
    assert base.moe_layers == (False, True, True) and base.d_shared == 2 * base.d_expert
    model = models["base"]
    assert type(model.rotary) is PolarRotary and type(model.blocks[0].attn) is PairRotaryLatentAttention
    assert type(model.blocks[1].mlp.router) is SoftmaxGroupLimitedTopK
    assert len(list(checkpoints["sharded"].glob("*.safetensors"))) > 1
    keys = stored_keys(checkpoints["fused"])
    assert "model.layers.1.mlp.experts.gate_up_proj" in keys and not any(".experts.0." in k for k in keys)
    assert "model.layers.1.mlp.experts.7.down_proj.weight" in stored_keys(checkpoints["base"])


@pytest.mark.parametrize("variant", VARIANTS)
def test_float32(models, references, variant):
    model = models[variant]
    assert type(model) is HookedDeepseekV2
    check_report(compare(model, references[variant], tokens()), model)


def test_group_limited_choice_is_live(models):
    """The grouped variant's choice differs from a greedy choice over all experts for some tokens, and every chosen
    expert lies in one of the topk_group groups with the best maxima (transformers' indices are compared above)."""
    model = models["grouped"]
    _, cache = model.run_with_cache(tokens(), names_filter=["*hook_router_scores", "*hook_expert_indices"])
    scores, chosen = cache["blocks.1.mlp.hook_router_scores"], cache["blocks.1.mlp.hook_expert_indices"]
    greedy = scores.topk(3, dim=-1).indices.sort(-1).values
    assert (greedy != chosen.sort(-1).values).any()
    groups = scores.unflatten(-1, (4, 2)).amax(-1).topk(2, dim=-1).indices
    assert (chosen[..., :, None] // 2 == groups[..., None, :]).any(-1).all()


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


def test_rotated_heads_keep_the_checkpoint_order(models, references):
    """hook_rot_q's rotary dims are transformers' q_pe (interleaved pairs turned in place), not de-interleaved."""
    from transformers.models.deepseek_v2 import modeling_deepseek_v2 as hf

    model, ref = models["grouped"], references["grouped"]
    seen = {}
    original = hf.apply_rotary_emb

    def spy(xq, xk, freqs):
        q, k = original(xq, xk, freqs)
        seen.setdefault("q", q)
        return q, k

    hf.apply_rotary_emb = spy
    try:
        with torch.no_grad():
            ref(tokens())
    finally:
        hf.apply_rotary_emb = original
    _, cache = model.run_with_cache(tokens(), names_filter="blocks.0.attn.hook_rot_q")
    mine = cache["blocks.0.attn.hook_rot_q"][..., model.cfg.qk_nope_head_dim:]
    assert torch.equal(mine, seen["q"].transpose(1, 2))


@pytest.mark.parametrize("variant", ["base", "grouped"])
def test_bfloat16_is_bit_exact(checkpoints, references, variant):
    model = HookedTransformer.from_pretrained(checkpoints[variant], dtype=torch.bfloat16, progress=False)
    ref = references(variant, torch.bfloat16)
    for layer, block in enumerate(model.blocks):
        if block.is_moe:
            assert block.mlp.router.weight.dtype == ref.model.layers[layer].mlp.gate.weight.dtype == torch.float32
    check_bit_exact(compare(model, ref, tokens()))


@pytest.mark.parametrize("variant,padded", [("base", False), ("base", True), ("grouped", True)])
def test_greedy_generation_matches_transformers(models, references, variant, padded):
    prompt = left_padded(5, (3, 9), (0, 3, 1)) if padded else (tokens(5, (3, 9)), None)
    check_greedy_generation(models[variant], references[variant], *prompt, new=64)


def test_cached_steps_match_the_uncached_forward(models):
    """transformers caches the latents and decompresses every step; moelens caches the decompressed keys and values
    (hook_rot_k, hook_v): the same logits."""
    model = models["grouped"]
    toks, mask = tokens(5, (3, 9)), torch.ones(3, 9, dtype=torch.long)
    mask[1, :3] = 0
    with torch.no_grad():
        full = model(toks, attention_mask=mask)
        cache = KVCache.for_model(model)
        parts = [model(toks[:, :5], attention_mask=mask[:, :5], past_kv_cache=cache)]
        parts += [model(toks[:, 5:8], past_kv_cache=cache), model(toks[:, 8:], past_kv_cache=cache)]
    assert (torch.cat(parts, dim=1) - full)[mask.bool()].abs().max() <= 1e-5


# ---- config spellings and refusals --------------------------------------------------------------------


def test_hub_config_spelling_loads_the_same_model(checkpoints, models, tmp_path):
    """DeepSeek-V2-Lite's config.json spelling: rope_theta and rope_scaling ("type") at the top level, the routing
    rule's names, groups that greedy routing does not read."""
    folder = copy_checkpoint(checkpoints, tmp_path)
    rope = dict(tiny.json.loads((folder / "config.json").read_text())["rope_parameters"])
    theta = rope.pop("rope_theta")
    rope["type"] = rope.pop("rope_type")
    tiny.edit_config(folder, rope_parameters=None, rope_theta=theta, rope_scaling=rope, n_group=8, topk_group=3,
                     scoring_func="softmax", aux_loss_alpha=0.001, seq_aux=True, norm_topk_prob=False)
    model = HookedTransformer.from_pretrained(folder, progress=False)
    assert model.cfg == models["base"].cfg
    assert {"n_group", "topk_group", "scoring_func", "aux_loss_alpha", "seq_aux"} <= set(model.cfg.fields_ignored)
    assert torch.equal(model(tokens()), models["base"](tokens()))
    check_report(compare(model, References({"hub": folder})["hub"], tokens()), model)


def test_config_refusals():
    raw = tiny_ds2.deepseek_v2_config().to_dict()
    for change, message in (
        ({"topk_method": "noaux_tc"}, "topk_method 'noaux_tc'"),
        ({"topk_method": "group_limited_greedy", "n_group": None, "topk_group": 2}, "needs n_group"),
        ({"norm_topk_prob": True}, "norm_topk_prob"),
        ({"mlp_bias": True}, "mlp_bias"),
        ({"num_key_value_heads": 2}, "num_key_value_heads"),
        ({"topk_method": "group_limited_greedy", "n_group": 3, "topk_group": 2}, "multiple of n_group"),
        ({"topk_method": "group_limited_greedy", "n_group": 4, "topk_group": 1}, "num_experts_per_tok"),
        ({"rope_interleave": False}, "rope_interleave"),
        ({"num_experts_per_tok": None}, "num_experts_per_tok"),
    ):
        with pytest.raises((ValueError, KeyError), match=message):
            HookedDeepseekV2.config_from_hf({**raw, **change})


@pytest.mark.parametrize("key", [
    "model.layers.0.self_attn.kv_b_proj.weight",
    "model.layers.2.self_attn.q_proj.weight",
    "model.layers.1.mlp.gate.weight",
    "model.layers.2.mlp.experts.5.gate_proj.weight",
    "model.layers.1.mlp.shared_experts.down_proj.weight",
    "model.layers.0.mlp.up_proj.weight",
])
def test_missing_tensor_is_named(checkpoints, tmp_path, key):
    folder = copy_checkpoint(checkpoints, tmp_path)
    rewrite_tensors(folder, lambda t: t.pop(key))
    with pytest.raises(CheckpointError, match="missing") as info:
        HookedTransformer.from_pretrained(folder, progress=False)
    assert key in str(info.value)


def test_a_correction_bias_is_refused(checkpoints, tmp_path):
    """DeepSeek-V2's router has no e_score_correction_bias (DeepSeek-V3's): a checkpoint with one is not V2's."""
    folder = copy_checkpoint(checkpoints, tmp_path)
    rewrite_tensors(folder, lambda t: t.update({"model.layers.1.mlp.gate.e_score_correction_bias": torch.zeros(8)}))
    with pytest.raises(CheckpointError, match="unexpected .*e_score_correction_bias"):
        HookedTransformer.from_pretrained(folder, progress=False)


# ---- plan, support, embedded default -------------------------------------------------------------------

DEEPSEEK_V2_LITE = flagship("deepseek_v2", "deepseek-ai/DeepSeek-V2-Lite")


def test_plan_at_full_size_dense_first_block_and_cache():
    """(Its counts against transformers' and the published total: tests/test_flagships.py.)"""
    p = plan(dict(DEEPSEEK_V2_LITE), dtype="bfloat16", cpu_memory="2TB")
    assert [layer.kind for layer in p.per_layer] == ["dense"] + ["moe"] * 26
    assert p.kv_cache["bytes"] == 27 * 2048 * 16 * (128 + 64 + 128) * 2


def test_support_lists_the_family_sites(models):
    table = models["grouped"].support(print_table=False)
    rows = {r.name: r for r in table.rows}
    assert rows["blocks.L.mlp.hook_router_logits"].reference == "model.layers.L.mlp.gate (out.0)"
    assert rows["blocks.L.mlp.hook_router_logits"].layers == "1,2"
    assert "blocks.L.mlp.hook_choice_scores" not in rows
    assert rows["blocks.L.attn.hook_q_latent"].reference == "model.layers.L.self_attn.q_a_layernorm"
    assert "topk_method" in table.config_fields


def test_verify_command_and_embedded_default(tmp_path, monkeypatch, capsys):
    monkeypatch.setattr("moelens.defaults.cache_root", lambda: tmp_path)
    model = HookedTransformer.from_pretrained("tiny-deepseek-v2", progress=False)
    assert type(model) is HookedDeepseekV2 and model.cfg.moe_layers == (False, True, True, True)
    logits = model("Hello, latent attention")
    assert logits.shape[-1] == 260 and torch.isfinite(logits).all()
    assert main(["verify", "tiny-deepseek-v2"]) == 0  # the Hub's spelling, read by transformers too
    out = capsys.readouterr().out
    assert "float32: OK" in out and "bfloat16: OK" in out
