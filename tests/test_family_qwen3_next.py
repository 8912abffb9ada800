"""Qwen3-Next (HookedQwen3Next) against transformers' Qwen3NextForCausalLM: the hybrid layers (Gated DeltaNet and
gated full attention) site by site in float32 and in bfloat16, left padding, prefill in the chunked form against
token-by-token decode, greedy generation, the recurrent state as a site, the config's layer kinds, plan at full
size from config alone."""

import pytest
import torch
import transformers
import family_harness as harness
import tiny
import tiny_qwen3_next as tiny_q3n
from flagships import flagship
from family_harness import MODEL_SITES, References, build_checkpoints, check_greedy_generation, left_padded, tokens

from moelens import HookedTransformer
from moelens.kv_cache import KVCache
from moelens.models.components.gated_attention import OutputGatedAttention
from moelens.models.mixers.gated_deltanet import FusedProjectionsGatedDeltaNet
from moelens.models.qwen3_next import HookedQwen3Next
from moelens.plan import plan
from moelens.state import RecurrentState
from moelens.verify import compare

VARIANTS = [v for (_, v) in tiny_q3n.FAMILY_VARIANTS]
# five layers, two of them full attention before Gated DeltaNet layers, which amplify the attention's float32
# rounding: compared within transformers' own eager-vs-SDPA noise (test_interval_variant_...)
SITE_VARIANTS = [v for v in VARIANTS if v != "interval"]
LINEAR_SITES = ("hook_resid_pre", "ln1.hook_normalized", "hook_attn_out", "ln2.hook_normalized", "hook_mlp_out",
                "hook_resid_post")
ATTENTION_SITES = LINEAR_SITES + ("attn.hook_k", "attn.hook_v", "attn.hook_z")
ROUTER_SITES = ("mlp.hook_router_logits", "mlp.hook_expert_weights", "mlp.hook_expert_indices", "mlp.hook_routed_out")


@pytest.fixture(scope="module")
def ckpts(tmp_path_factory):
    return build_checkpoints(tmp_path_factory, "qwen3_next", tiny_q3n.FAMILY_VARIANTS)


@pytest.fixture(scope="module")
def refs(ckpts):
    return References(ckpts)


def block_sites(model):
    def sites(layer: int):
        kind = model.cfg.layer_types[layer]
        return (ATTENTION_SITES if kind == "full_attention" else LINEAR_SITES) + (
            ROUTER_SITES if model.cfg.moe_layers[layer] else ())
    return sites


@pytest.mark.parametrize("variant", SITE_VARIANTS)
def test_float32_every_site(ckpts, refs, variant):
    model = HookedTransformer.from_pretrained(ckpts[variant], progress=False)
    assert type(model) is HookedQwen3Next
    harness.check_report(compare(model, refs(variant), tokens(shape=(2, 80))), model, block_sites(model), 1e-5, MODEL_SITES)



def test_interval_variant_within_transformers_own_attention_noise(ckpts, refs):
    """On the five-layer variant transformers' eager and SDPA attention differ by 3.1e-5 in the logits (the linear
    layers after them amplify it); moelens against transformers' eager run stays within that, routing identical."""
    import transformers

    toks = tokens(shape=(2, 80))
    model = HookedTransformer.from_pretrained(ckpts["interval"], progress=False)
    sdpa = transformers.AutoModelForCausalLM.from_pretrained(ckpts["interval"], dtype=torch.float32, attn_implementation="sdpa")
    with torch.no_grad():
        noise = float((refs("interval")(toks).logits - sdpa(toks).logits).abs().max())
    report = compare(model, refs("interval"), toks)
    assert report.index_mismatches == 0
    assert report.max_logit_diff <= max(1e-5, noise), (report.max_logit_diff, noise)


def test_the_layers_are_what_the_config_says(ckpts):
    base = HookedTransformer.from_pretrained(ckpts["base"], progress=False)
    assert [type(b.token_mixer) for b in base.blocks] == [FusedProjectionsGatedDeltaNet] * 3 + [OutputGatedAttention]
    assert [b.mixer_attribute for b in base.blocks] == ["mixer", "mixer", "mixer", "attn"]
    assert base.cfg.d_rot == 4 and base.cfg.norm_topk_prob  # a quarter of head_dim 16; transformers' defaults
    interval = HookedTransformer.from_pretrained(ckpts["interval"], progress=False)
    assert interval.cfg.layer_types == ("linear_attention", "full_attention") * 2 + ("linear_attention",)
    dense = HookedTransformer.from_pretrained(ckpts["dense_block"], progress=False)
    assert dense.cfg.moe_layers == (True, False, True, True) and not dense.blocks[1].is_moe


def test_bfloat16_routing_identical_and_close(ckpts, refs):
    """The linear layers and the mixtures equal transformers' bit for bit in bfloat16; the gated attention's
    output gate is the only place the op order differs (transformers multiplies the flat [batch pos heads*d]
    output, moelens [batch pos head d]: the same elementwise products), so the whole model is bitwise too."""
    model = HookedTransformer.from_pretrained(ckpts["base"], dtype=torch.bfloat16, progress=False)
    report = compare(model, refs("base", torch.bfloat16), tokens(shape=(2, 80)))
    assert report.index_mismatches == 0
    assert report.max_logit_diff == 0.0, report


def test_left_padded_batch_matches_transformers_padded_run(ckpts, refs):
    """transformers zeroes padded positions' inputs to the linear layers (so the state of a left-padded row
    starts from zeros at its first real token) and masks them in attention; moelens does the same."""
    model = HookedTransformer.from_pretrained(ckpts["base"], progress=False)
    toks, mask = left_padded(7, (3, 70), (0, 9, 30))
    report = compare(model, refs("base"), toks, mask)
    assert report.max_logit_diff <= 1e-5 and report.index_mismatches == 0, report


def test_chunked_prefill_then_recurrent_decode_equals_one_forward(ckpts, refs):
    """A 70-token forward (the chunked form, two chunks of 64) against a 40-token prefill followed by 30 one-token
    steps (the recurrent form), and a 40-token prefill followed by one 30-token step (the chunked form from the
    cached state). The two forms round differently in float32: transformers' own stepped run differs from its
    whole forward by 1.4e-4 on these random weights. moelens's stepped and continued runs equal transformers'
    (each with its own cache) within 1e-5, so the gap between the forms is transformers' own."""
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
        whole, hf_whole = model(toks), ref(toks).logits
        ours, theirs = our_run(stepped), hf_run(stepped)
        continued, hf_continued = our_run([(0, 40), (40, 70)]), hf_run([(0, 40), (40, 70)])
    assert (whole - hf_whole).abs().max() <= 1e-5
    assert (ours - theirs).abs().max() <= 1e-5
    assert (continued - hf_continued).abs().max() <= 1e-5
    gap, hf_gap = float((ours - whole).abs().max()), float((theirs - hf_whole).abs().max())
    assert abs(gap - hf_gap) <= 1e-5, (gap, hf_gap)


def test_greedy_generation_equals_transformers(ckpts, refs):
    model = HookedTransformer.from_pretrained(ckpts["base"], progress=False)
    check_greedy_generation(model, refs("base"), tokens(4, (1, 12)), new=64)
    toks, mask = left_padded(8, (2, 10), (0, 3))
    check_greedy_generation(model, refs("base"), toks, mask, new=16)


def test_the_state_handed_on_is_a_site_and_an_edit_there_is_what_later_tokens_see(ckpts):
    """Halving blocks.0.mixer.hook_state_out after the prompt (in place) changes every later token exactly as a
    decode from a cache holding the halved state does."""
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


@pytest.mark.parametrize(
    ("edit", "match"),
    [
        (dict(layer_types=["linear_attention"] * 3), "layer_types has 3 entries, expected one per layer \\(4\\)"),
        (dict(layer_types=["linear_attention"] * 3 + ["sliding_attention"]), "layer_types: unknown layer kinds"),
        (dict(layer_types="full_attention"), "layer_types = 'full_attention'"),
        (dict(full_attention_interval=0, layer_types=None), "full_attention_interval = 0"),
    ],
)
def test_inconsistent_layer_kinds_are_refused_naming_the_field(edit, match):
    raw = {**tiny_q3n.qwen3_next_config().to_dict(), **edit}
    with pytest.raises(ValueError, match=match):
        HookedQwen3Next.config_from_hf(raw)


QWEN3_NEXT_80B = flagship("qwen3_next", "Qwen/Qwen3-Next-80B-A3B-Instruct")


def test_plan_counts_the_attention_layers_keys_and_the_linear_layers_recurrent_state():
    """12 full-attention layers cache 2 x 2 kv heads x 256 values per token (bfloat16); 36 Gated DeltaNet layers hold
    a convolution window (q|k|v: 2 x 16 x 128 + 32 x 128 channels x kernel 4, bfloat16) and a recurrent state (32
    value heads x 128 x 128, float32 whatever the model's dtype) per sequence, whatever its length."""
    p = plan(QWEN3_NEXT_80B, dtype="bfloat16", gpus=1, gpu_memory="141GB", batch=1, seq=2048)
    per_token = 12 * 2 * 2 * 256 * 2
    conv = 36 * (2 * 16 * 128 + 32 * 128) * 4 * 2
    recurrent = 36 * 32 * 128 * 128 * 4
    assert p.kv_cache["bytes"] == 2048 * per_token + conv + recurrent == 2048 * 24_576 + 2_359_296 + 75_497_472


def hf_cache_bytes(config, dtype, batch: int, seq: int) -> int:
    """The bytes of every tensor transformers' cache holds after a forward of batch x seq tokens: keys and values
    of the attention layers, convolution and recurrent states of the linear ones, each in its own dtype."""
    from transformers import Qwen3NextForCausalLM

    model = tiny.new_model(Qwen3NextForCausalLM, config, 0).to(dtype).eval()
    with torch.no_grad():
        cache = model(torch.randint(0, config.vocab_size, (batch, seq)), use_cache=True).past_key_values
    tensors = []
    for layer in cache.layers:
        for value in vars(layer).values():
            tensors += [value] if isinstance(value, torch.Tensor) else [
                t for t in (value.values() if isinstance(value, dict) else ()) if isinstance(t, torch.Tensor)]
    assert any(t.dtype == torch.float32 for t in tensors) or dtype == torch.float32  # the recurrent state
    return sum(t.numel() * t.element_size() for t in tensors)


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
def test_plan_cache_is_what_transformers_cache_holds(dtype):
    """The plan's cache against transformers' own after a forward, in bfloat16 (the recurrent state float32 all the
    same) and float32; the linear layers' state counted per sequence (batch scales it, seq does not), the attention
    layer's keys and values per token."""
    config = tiny_q3n.qwen3_next_config()
    raw = config.to_dict()
    sizes = [(1, 5), (2, 5), (2, 13)]
    planned = {bs: plan(dict(raw), dtype=dtype, batch=bs[0], seq=bs[1], cpu_memory="1GB").kv_cache["bytes"] for bs in sizes}
    for bs in sizes:
        assert planned[bs] == hf_cache_bytes(config, dtype, *bs), bs
    element = torch.finfo(dtype).bits // 8
    per_token = 2 * 2 * 16 * element  # the one full-attention layer: keys and values of 2 kv heads x 16
    per_sequence = 3 * ((2 * 2 * 8 + 4 * 12) * 4 * element + 4 * 8 * 12 * 4)  # 3 linear layers: conv, recurrent
    assert planned[1, 5] == 5 * per_token + per_sequence
    assert planned[2, 5] == 2 * planned[1, 5]
    assert planned[2, 13] - planned[2, 5] == 2 * 8 * per_token  # longer sequences add keys and values only