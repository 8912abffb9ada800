"""Kimi-Linear (HookedKimiLinear) against transformers' KimiLinearForCausalLM: the Kimi Delta Attention rule
against transformers' own functions bit for bit, the hybrid layers site by site in float32 and bfloat16, left
padding, prefill against token-by-token decode, greedy generation, the config's spellings and layer lists, plan
at full size from config alone."""

import pytest
import torch
import transformers
from transformers.models.kimi_linear import modeling_kimi_linear as hf_kimi
import family_harness as harness
import tiny_kimi_linear as tiny_kimi
from flagships import flagship
from family_harness import MODEL_SITES, References, build_checkpoints, check_greedy_generation, left_padded, tokens

from moelens import HookedTransformer
from moelens.kv_cache import KVCache
from moelens.models.kimi_linear import HookedKimiLinear, NoRotaryLatentAttention
from moelens.models.mixers.kda_rule import chunked_kda_rule, recurrent_kda_rule
from moelens.models.mixers.kimi_delta_attention import KimiLinearDeltaAttention
from moelens.plan import plan
from moelens.state import RecurrentState
from moelens.verify import compare

VARIANTS = [v for (_, v) in tiny_kimi.FAMILY_VARIANTS]
LINEAR_SITES = ("hook_resid_pre", "ln1.hook_normalized", "hook_attn_out", "ln2.hook_normalized", "hook_mlp_out",
                "hook_resid_post", "mixer.hook_log_decay", "mixer.hook_z")
ATTENTION_SITES = ("hook_resid_pre", "ln1.hook_normalized", "hook_attn_out", "ln2.hook_normalized", "hook_mlp_out",
                   "hook_resid_post", "attn.hook_kv_latent", "attn.hook_z")
ROUTER_SITES = ("mlp.hook_router_logits", "mlp.hook_expert_weights", "mlp.hook_expert_indices", "mlp.hook_routed_out")


@pytest.fixture(scope="module")
def ckpts(tmp_path_factory):
    return build_checkpoints(tmp_path_factory, "kimi_linear", tiny_kimi.FAMILY_VARIANTS)


@pytest.fixture(scope="module")
def refs(ckpts):
    return References(ckpts)


def block_sites(model):
    def sites(layer: int):
        kind = model.cfg.layer_types[layer]
        return (ATTENTION_SITES if kind == "full_attention" else LINEAR_SITES) + (
            ROUTER_SITES if model.cfg.moe_layers[layer] else ())
    return sites


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("n_pos", [1, 7, 64, 130])
def test_the_kda_rule_is_transformers_bit_for_bit(dtype, n_pos):
    """Both forms against transformers' torch chunk_kimi_delta_attention / recurrent_kimi_delta_attention on
    random inputs from a random state: equal bit for bit (outputs and the state after the last token), over one
    chunk, a partial chunk and several."""
    gen = torch.Generator().manual_seed(n_pos)
    b, h, d_k, d_v = 2, 3, 8, 6
    q, k = (torch.randn(b, n_pos, h, d_k, generator=gen).to(dtype) for _ in range(2))
    v = torch.randn(b, n_pos, h, d_v, generator=gen).to(dtype)
    g = -torch.rand(b, n_pos, h, d_k, generator=gen)
    beta = torch.rand(b, n_pos, h, generator=gen).to(dtype)
    state = torch.randn(b, h, d_k, d_v, generator=gen)
    for ours, theirs in ((chunked_kda_rule, hf_kimi.chunk_kimi_delta_attention),
                         (recurrent_kda_rule, hf_kimi.recurrent_kimi_delta_attention)):
        out, final = ours(q, k, v, g, beta, state)
        ref_out, ref_final = theirs(q, k, v, g=g, beta=beta, initial_state=state, output_final_state=True,
                                    use_qk_l2norm_in_kernel=True)
        assert out.dtype == dtype and final.dtype == torch.float32
        assert torch.equal(out, ref_out) and torch.equal(final, ref_final), ours.__name__


def test_the_rule_refuses_mismatched_shapes():
    q = torch.zeros(1, 3, 2, 4)
    with pytest.raises(ValueError, match="log decay"):
        chunked_kda_rule(q, q, q, torch.zeros(1, 3, 2, 1), torch.zeros(1, 3, 2), torch.zeros(1, 2, 4, 4))
    with pytest.raises(ValueError, match="beta"):
        recurrent_kda_rule(q, q, q, q, torch.zeros(1, 3, 3), torch.zeros(1, 2, 4, 4))


@pytest.mark.parametrize("variant", VARIANTS)
def test_float32_every_site(ckpts, refs, variant):
    model = HookedTransformer.from_pretrained(ckpts[variant], progress=False)
    assert type(model) is HookedKimiLinear
    harness.check_report(compare(model, refs(variant), tokens(shape=(2, 80))), model, block_sites(model), 1e-5,
                         MODEL_SITES)


def test_the_layers_are_what_the_config_says(ckpts):
    base = HookedTransformer.from_pretrained(ckpts["base"], progress=False)
    assert [type(b.token_mixer) for b in base.blocks] == [KimiLinearDeltaAttention] * 3 + [NoRotaryLatentAttention]
    assert [b.mixer_attribute for b in base.blocks] == ["mixer", "mixer", "mixer", "attn"]
    assert base.cfg.moe_layers == (False, True, True, True)
    assert (base.cfg.linear_n_heads, base.cfg.linear_d_head, base.cfg.linear_conv_kernel) == (3, 8, 4)
    grouped = HookedTransformer.from_pretrained(ckpts["grouped"], progress=False)
    # transformers' default without the layer lists: full attention on layer 4 (from 0)
    assert grouped.cfg.layer_types == ("linear_attention",) * 4 + ("full_attention", "linear_attention")
    assert grouped.cfg.linear_conv_kernel == 3 and grouped.cfg.q_lora_rank == 24 and grouped.cfg.n_group == 4


def test_the_dt_bias_stays_float32_as_transformers_keeps_it(ckpts, refs):
    model = HookedTransformer.from_pretrained(ckpts["base"], dtype=torch.bfloat16, progress=False)
    mixer = model.blocks[0].token_mixer
    assert mixer.dt_bias.weight.dtype == torch.float32 and mixer.A_log.dtype == torch.bfloat16
    ref = refs("base", torch.bfloat16)
    assert ref.model.layers[0].self_attn.forget_gate.dt_bias.dtype == torch.float32


def test_bfloat16_routing_identical_and_logits_bitwise(ckpts, refs):
    model = HookedTransformer.from_pretrained(ckpts["base"], dtype=torch.bfloat16, progress=False)
    report = compare(model, refs("base", torch.bfloat16), tokens(shape=(2, 80)))
    assert report.index_mismatches == 0
    assert report.max_logit_diff == 0.0, report


def test_left_padded_batch_matches_transformers_padded_run(ckpts, refs):
    """transformers zeroes padded positions' inputs to the KDA layers and masks them in attention; so does
    moelens."""
    model = HookedTransformer.from_pretrained(ckpts["base"], progress=False)
    toks, mask = left_padded(7, (3, 70), (0, 9, 30))
    report = compare(model, refs("base"), toks, mask)
    assert report.max_logit_diff <= 1e-5 and report.index_mismatches == 0, report


def test_chunked_prefill_then_recurrent_decode_equals_transformers(ckpts, refs):
    """A 40-token prefill followed by 30 one-token steps (the recurrent form), and by one 30-token step (the
    chunked form from the cached state), each against transformers' run with its own cache."""
    model, ref = HookedTransformer.from_pretrained(ckpts["base"], progress=False), refs("base")
    toks = tokens(11, (2, 70))

    def hf_run(chunks):
        cache = transformers.DynamicCache(config=ref.config)
        return torch.cat([ref(toks[:, a:b], past_key_values=cache, use_cache=True).logits for a, b in chunks], dim=1)

    def our_run(chunks):
        cache = KVCache.for_model(model)
        out = torch.cat([model(toks[:, a:b], past_kv_cache=cache) for a, b in chunks], dim=1)
        assert isinstance(cache.layers[0], RecurrentState) and cache.layers[0].length == 70
        return out

    stepped = [(0, 40)] + [(i, i + 1) for i in range(40, 70)]
    with torch.no_grad():
        assert (our_run(stepped) - hf_run(stepped)).abs().max() <= 1e-5
        assert (our_run([(0, 40), (40, 70)]) - hf_run([(0, 40), (40, 70)])).abs().max() <= 1e-5


def test_greedy_generation_equals_transformers(ckpts, refs):
    model = HookedTransformer.from_pretrained(ckpts["base"], progress=False)
    check_greedy_generation(model, refs("base"), tokens(4, (1, 12)), new=40)
    toks, mask = left_padded(8, (2, 10), (0, 3))
    check_greedy_generation(model, refs("base"), toks, mask, new=16)


def test_the_state_handed_on_is_a_site_and_an_edit_there_is_what_later_tokens_see(ckpts):
    model = HookedTransformer.from_pretrained(ckpts["base"], progress=False)
    prompt, nxt = tokens(12, (1, 20)), tokens(13, (1, 1))

    def halve(state, hook):
        state.mul_(0.5)

    with torch.no_grad():
        edited = KVCache.for_model(model)
        model.run_with_hooks(prompt, past_kv_cache=edited, fwd_hooks=[("blocks.0.mixer.hook_state_out", halve)])
        by_hook = model(nxt, past_kv_cache=edited)
        plain_cache, by_hand = KVCache.for_model(model), KVCache.for_model(model)
        model(prompt, past_kv_cache=plain_cache)
        plain = model(nxt, past_kv_cache=plain_cache)
        model(prompt, past_kv_cache=by_hand)
        by_hand.layers[0].recurrent = by_hand.layers[0].recurrent * 0.5
        expected = model(nxt, past_kv_cache=by_hand)
    assert torch.equal(by_hook, expected)
    assert (by_hook - plain).abs().max() > 1e-4  # the edit mattered


def published_spelling() -> dict:
    """The tiny config as Kimi's config.json spells it (transformers' save_pretrained writes these names too)."""
    return tiny_kimi.kimi_linear_config().to_dict()


def test_kimis_spellings_and_deepseeks_give_one_config():
    raw = published_spelling()
    assert {"num_experts", "num_experts_per_token", "moe_renormalize", "num_expert_group", "num_shared_experts",
            "model_max_length"} <= set(raw)
    renamed = {k: v for k, v in raw.items() if k not in ("num_experts", "num_experts_per_token", "moe_renormalize",
                                                       "num_expert_group", "num_shared_experts", "model_max_length")}
    renamed.update(num_local_experts=raw["num_experts"], num_experts_per_tok=raw["num_experts_per_token"],
                   norm_topk_prob=raw["moe_renormalize"], n_group=raw["num_expert_group"],
                   n_shared_experts=raw["num_shared_experts"], max_position_embeddings=raw["model_max_length"])
    ours, theirs = HookedKimiLinear.config_from_hf(raw), HookedKimiLinear.config_from_hf(renamed)
    assert (ours.n_experts, ours.top_k, ours.n_group, ours.d_shared) == (8, 3, 1, 2 * 24)
    assert (theirs.n_experts, theirs.top_k, theirs.n_group, theirs.d_shared, theirs.max_position_embeddings) == (
        ours.n_experts, ours.top_k, ours.n_group, ours.d_shared, ours.max_position_embeddings)


def test_linear_attn_config_wins_over_the_top_level_sizes_as_in_transformers():
    raw = published_spelling()
    raw.pop("linear_head_dim"), raw.pop("linear_num_heads"), raw.pop("linear_conv_kernel_dim")
    cfg = HookedKimiLinear.config_from_hf(raw)
    assert (cfg.linear_n_heads, cfg.linear_d_head, cfg.linear_conv_kernel) == (3, 8, 4)
    hf = transformers.KimiLinearConfig(**{**raw, "linear_attn_config": {**raw["linear_attn_config"], "head_dim": 16},
                                          "linear_head_dim": 4})
    assert hf.linear_head_dim == 16  # transformers reads the section's


@pytest.mark.parametrize(
    ("edit", "match"),
    [
        (dict(linear_head_dim=16), "linear_attn_config.head_dim = 8 disagrees with linear_head_dim = 16"),
        (dict(linear_attn_config={"num_heads": 0}), "linear_attn_config.num_heads = 0"),
        (dict(layer_types=None, linear_attn_config={"full_attn_layers": [4], "kda_layers": [1, 2]}),
         r"in neither: \[3\]"),
        (dict(layer_types=None, linear_attn_config={"full_attn_layers": [4, 5], "kda_layers": [1, 2, 3]}),
         "full_attn_layers = \\[4, 5\\]; expected layer numbers from 1 to 4"),
        (dict(layer_types=["linear_attention"] * 3 + ["sliding_attention"]), "layer_types must list 4 entries"),
        (dict(mlp_layer_types=["dense", "dense", "sparse", "sparse"]),
         "first_k_dense_replace = 1 disagrees with mlp_layer_types"),
        (dict(mla_use_nope=False), "mla_use_nope = False; transformers' Kimi-Linear always runs mla_use_nope = True"),
        (dict(moe_router_activation_func="softmax"), "moe_router_activation_func = 'softmax'"),
        (dict(num_local_experts=16), "both num_local_experts = 16 and num_experts = 8"),
    ],
)
def test_bad_or_contradicting_fields_are_refused_naming_them(edit, match):
    raw = {**published_spelling(), **edit}
    with pytest.raises(ValueError, match=match):
        HookedKimiLinear.config_from_hf(raw)


def test_a_missing_conv_part_is_named(ckpts, tmp_path):
    folder = harness.copy_checkpoint(ckpts, tmp_path)
    harness.rewrite_tensors(folder, lambda t: t.pop("model.layers.1.self_attn.k_conv1d.weight"))
    with pytest.raises(Exception, match="model.layers.1.self_attn.k_conv1d.weight"):
        HookedTransformer.from_pretrained(folder, progress=False)


KIMI_LINEAR_48B = flagship("kimi_linear", "moonshotai/Kimi-Linear-48B-A3B-Instruct")


def test_plan_counts_the_latent_cache_and_the_kda_state():
    """7 latent-attention layers cache each head's key (qk_nope_head_dim + qk_rope_head_dim = 192) and value (128)
    per token, bfloat16 (moelens's latent attention keeps them decompressed, as for DeepSeek-V3; transformers'
    Kimi-Linear cache keeps the 576-wide latent instead); 20 KDA layers hold a convolution window (3 x 32 x 128
    channels x kernel 4, bfloat16) and a recurrent state (32 x 128 x 128, float32) per sequence."""
    p = plan(KIMI_LINEAR_48B, dtype="bfloat16", gpus=1, gpu_memory="141GB", batch=1, seq=2048)
    per_token = 7 * 32 * (192 + 128) * 2
    conv = 20 * 3 * 32 * 128 * 4 * 2
    recurrent = 20 * 32 * 128 * 128 * 4
    assert p.kv_cache["bytes"] == 2048 * per_token + conv + recurrent
