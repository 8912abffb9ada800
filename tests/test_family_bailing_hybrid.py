"""Ling's hybrid (HookedBailingHybrid) against transformers' BailingHybridForCausalLM: Kimi Delta Attention with
Ling's full-rank bounded gates and head-gated latent attention, site by site in float32 and bfloat16 (its float32
convolution and gate parameters), left padding, prefill against decode, greedy generation, the checkpoint's own
names and the config's, plan at full size from config alone."""

import pytest
import torch
import transformers
import family_harness as harness
import tiny_bailing_hybrid as tiny_ling
from flagships import flagship
from family_harness import MODEL_SITES, References, build_checkpoints, check_greedy_generation, left_padded, tokens

from moelens import HookedTransformer
from moelens.kv_cache import KVCache
from moelens.models.bailing_hybrid import HeadGatedLatentAttention, HookedBailingHybrid
from moelens.models.mixers.kimi_delta_attention import BailingDeltaAttention
from moelens.plan import plan
from moelens.verify import compare

VARIANTS = [v for (_, v) in tiny_ling.FAMILY_VARIANTS]
LINEAR_SITES = ("hook_resid_pre", "ln1.hook_normalized", "hook_attn_out", "ln2.hook_normalized", "hook_mlp_out",
                "hook_resid_post", "mixer.hook_log_decay", "mixer.hook_z")
ATTENTION_SITES = ("hook_resid_pre", "ln1.hook_normalized", "hook_attn_out", "ln2.hook_normalized", "hook_mlp_out",
                   "hook_resid_post", "attn.hook_kv_latent", "attn.hook_attn_gate", "attn.hook_z")
ROUTER_SITES = ("mlp.hook_router_logits", "mlp.hook_expert_weights", "mlp.hook_expert_indices", "mlp.hook_routed_out")


@pytest.fixture(scope="module")
def ckpts(tmp_path_factory):
    return build_checkpoints(tmp_path_factory, "bailing_hybrid", tiny_ling.FAMILY_VARIANTS)


@pytest.fixture(scope="module")
def refs(ckpts):
    return References(ckpts)


def block_sites(model):
    def sites(layer: int):
        kind = model.cfg.layer_types[layer]
        return (ATTENTION_SITES if kind == "full_attention" else LINEAR_SITES) + (
            ROUTER_SITES if model.cfg.moe_layers[layer] else ())
    return sites


@pytest.mark.parametrize("variant", VARIANTS)
def test_float32_every_site(ckpts, refs, variant):
    model = HookedTransformer.from_pretrained(ckpts[variant], progress=False)
    assert type(model) is HookedBailingHybrid
    harness.check_report(compare(model, refs(variant), tokens(shape=(2, 80))), model, block_sites(model), 1e-5,
                         MODEL_SITES)


@pytest.mark.parametrize("variant", VARIANTS)
def test_bfloat16_routing_identical_and_logits_bitwise(ckpts, refs, variant):
    """Bit for bit, with the convolution, A_log and dt_bias float32 on both sides and the forget gate's log decay
    cast to bfloat16 as transformers casts it."""
    model = HookedTransformer.from_pretrained(ckpts[variant], dtype=torch.bfloat16, progress=False)
    mixer = model.blocks[0].token_mixer
    assert mixer.conv1d.weight.dtype == mixer.A_log.weight.dtype == mixer.dt_bias.weight.dtype == torch.float32
    ref = refs(variant, torch.bfloat16)
    assert ref.model.layers[0].self_attn.conv1d.weight.dtype == torch.float32
    report = compare(model, ref, tokens(shape=(2, 80)))
    assert report.index_mismatches == 0
    assert report.max_logit_diff == 0.0, report


def test_the_layers_are_what_the_config_says(ckpts):
    base = HookedTransformer.from_pretrained(ckpts["base"], progress=False)
    assert [type(b.token_mixer) for b in base.blocks] == [BailingDeltaAttention] * 3 + [HeadGatedLatentAttention]
    assert base.cfg.moe_layers == (False, True, True, True) and base.cfg.kda_safe_gate
    other = HookedTransformer.from_pretrained(ckpts["softplus_yarn"], progress=False)
    assert other.cfg.layer_types == ("linear_attention", "linear_attention", "full_attention") * 2
    assert other.cfg.moe_layers == (False, False, True, True, True, True) and not other.cfg.kda_safe_gate
    assert other.cfg.rope.kind == "yarn" and other.cfg.q_lora_rank == 24


def test_left_padded_batch_matches_transformers_padded_run(ckpts, refs):
    model = HookedTransformer.from_pretrained(ckpts["base"], progress=False)
    toks, mask = left_padded(7, (3, 70), (0, 9, 30))
    report = compare(model, refs("base"), toks, mask)
    assert report.max_logit_diff <= 1e-5 and report.index_mismatches == 0, report


def test_prefill_then_decode_equals_transformers(ckpts, refs):
    model, ref = HookedTransformer.from_pretrained(ckpts["base"], progress=False), refs("base")
    toks = tokens(11, (2, 50))

    def hf_run(chunks):
        cache = transformers.DynamicCache(config=ref.config)
        return torch.cat([ref(toks[:, a:b], past_key_values=cache, use_cache=True).logits for a, b in chunks], dim=1)

    def our_run(chunks):
        cache = KVCache.for_model(model)
        return torch.cat([model(toks[:, a:b], past_kv_cache=cache) for a, b in chunks], dim=1)

    stepped = [(0, 30)] + [(i, i + 1) for i in range(30, 50)]
    with torch.no_grad():
        assert (our_run(stepped) - hf_run(stepped)).abs().max() <= 1e-5
        assert (our_run([(0, 30), (30, 50)]) - hf_run([(0, 30), (30, 50)])).abs().max() <= 1e-5


def test_greedy_generation_equals_transformers(ckpts, refs):
    model = HookedTransformer.from_pretrained(ckpts["base"], progress=False)
    check_greedy_generation(model, refs("base"), tokens(4, (1, 12)), new=40)
    toks, mask = left_padded(8, (2, 10), (0, 3))
    check_greedy_generation(model, refs("base"), toks, mask, new=16)


def test_the_head_gate_is_a_site_that_steers_its_head(ckpts):
    """Closing head 2's gate (a large negative hook_attn_gate) zeroes that head's hook_z and nothing else's."""
    model = HookedTransformer.from_pretrained(ckpts["base"], progress=False)
    toks = tokens(5, (1, 12))

    def close(gate, hook):
        gate[..., 2] = -1e4

    _, plain = model.run_with_cache(toks, names_filter="blocks.3.attn.hook_z")
    with model.hooks(fwd_hooks=[("blocks.3.attn.hook_attn_gate", close)]):
        _, closed = model.run_with_cache(toks, names_filter="blocks.3.attn.hook_z")
    z, z_closed = plain["blocks.3.attn.hook_z"], closed["blocks.3.attn.hook_z"]
    assert not z[:, :, 2].eq(0).all() and z_closed[:, :, 2].eq(0).all()
    assert torch.equal(z_closed[:, :, [0, 1, 3]], z[:, :, [0, 1, 3]])


def test_the_checkpoint_keeps_lings_names(ckpts):
    keys = harness.stored_keys(ckpts["base"])
    assert "model.word_embeddings.weight" in keys and "model.layers.0.attention.q_conv1d.weight" in keys
    assert "model.layers.1.mlp.gate.expert_bias" in keys and "model.layers.3.attention.dense.weight" in keys
    assert not any(".self_attn." in k or "embed_tokens" in k for k in keys)


def test_a_missing_tensor_is_named(ckpts, tmp_path):
    folder = harness.copy_checkpoint(ckpts, tmp_path)
    harness.rewrite_tensors(folder, lambda t: t.pop("model.layers.2.attention.v_conv1d.weight"))
    with pytest.raises(Exception, match="model.layers.2.attention.v_conv1d.weight"):
        HookedTransformer.from_pretrained(folder, progress=False)


def written_config() -> dict:
    return tiny_ling.bailing_hybrid_config().to_dict()


@pytest.mark.parametrize(
    ("edit", "match"),
    [
        (dict(linear_head_dim=16), "linear_head_dim = 16 disagrees with head_dim = 8"),
        (dict(linear_num_heads=2), "linear_num_heads = 2 disagrees with num_attention_heads = 4"),
        (dict(linear_conv_kernel_dim=3), "linear_conv_kernel_dim = 3 disagrees with short_conv_kernel_size = 4"),
        (dict(layer_types=["linear_attention"] * 4 + ["full_attention"]), "layer_types must list 4 entries"),
        (dict(mlp_layer_types=None, first_k_dense_replace=4), "first_k_dense_replace = 4 makes all 4 blocks"),
        (dict(rope_parameters={"rope_type": "default", "rope_theta": 1e4, "partial_rotary_factor": 0.5}),
         "partial_rotary_factor 0.5"),
        (dict(num_local_experts=16), "both num_local_experts = 16 and num_experts = 8"),
    ],
)
def test_bad_or_contradicting_fields_are_refused_naming_them(edit, match):
    with pytest.raises(ValueError, match=match):
        HookedBailingHybrid.config_from_hf({**written_config(), **edit})


def test_transformers_reads_the_kda_width_from_head_dim_as_moelens_does():
    raw = {k: v for k, v in written_config().items() if not k.startswith("linear_")}
    raw.update(head_dim=16, qk_rope_head_dim=8)
    assert transformers.BailingHybridConfig(**raw).linear_head_dim == 16
    assert HookedBailingHybrid.config_from_hf(raw).linear_d_head == 16


LING_FLASH = flagship("bailing_hybrid", "inclusionAI/Ling-3.0-Flash")


def test_plan_counts_the_latent_cache_and_the_kda_state():
    """7 latent-attention layers cache each head's decompressed key (128 + 64) and value (128) per token, bfloat16;
    35 KDA layers a convolution window (3 x 32 x 128 x kernel 4, float32 weights but a bfloat16 window) and a
    recurrent state (32 x 128 x 128, float32) per sequence."""
    p = plan(LING_FLASH, dtype="bfloat16", gpus=1, gpu_memory="141GB", batch=1, seq=1024)
    per_token = 7 * 32 * (192 + 128) * 2
    conv = 35 * 3 * 32 * 128 * 4 * 2
    recurrent = 35 * 32 * 128 * 128 * 4
    assert p.kv_cache["bytes"] == 1024 * per_token + conv + recurrent
