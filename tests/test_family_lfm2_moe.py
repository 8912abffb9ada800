"""LFM2-MoE (HookedLfm2Moe): what differs from the families before it. The generic suites compare every variant
with transformers; here: the layers config.json gives, each layer kind's sites against transformers, the short
convolution's gates and convolution against transformers' own tensors, prefill then decode (the convolution
window) and greedy generation, the router in bfloat16 with and without its expert bias, the window as a state
handed on, the plan at full size, and bad configs named."""

import copy
import json

import pytest
import torch
import torch.nn.functional as F
import transformers
import tiny_lfm2_moe as tiny_lfm
from family_harness import (ROUTER_SITES, MODEL_SITES, References, build_checkpoints, check_bit_exact,
                            check_greedy_generation, check_report, copy_checkpoint, left_padded, rewrite_tensors, tokens)
from flagships import flagship

from moelens import HookedTransformer
from moelens.kv_cache import KVCache
from moelens.models.components.mlp import GatedMLP
from moelens.models.components.qk_norm_attention import QKNormBeforeRotaryAttention
from moelens.models.lfm2_moe import HookedLfm2Moe, Lfm2BiasedSigmoidTopK, Lfm2SigmoidTopK
from moelens.models.mixers.short_conv import ShortConvMixer
from moelens.plan import plan
from moelens.state import ConvWindowState
from moelens.verify import compare

KIND_SITES = {
    "conv": ("hook_resid_pre", "ln1.hook_normalized", "hook_attn_out", "mixer.hook_y"),
    "full_attention": ("hook_resid_pre", "ln1.hook_normalized", "hook_attn_out", "attn.hook_q", "attn.hook_k",
                       "attn.hook_v", "attn.hook_z"),
}
FFN_SITES = ("ln2.hook_normalized", "hook_mlp_out", "hook_resid_post")


@pytest.fixture(scope="module")
def ckpts(tmp_path_factory):
    return build_checkpoints(tmp_path_factory, "lfm2_moe", tiny_lfm.VARIANTS)


@pytest.fixture(scope="module")
def refs(ckpts):
    return References(ckpts)


@pytest.fixture(scope="module")
def models(ckpts):
    loaded = {}

    def get(variant, dtype=torch.float32):
        if (variant, dtype) not in loaded:
            loaded[variant, dtype] = HookedTransformer.from_pretrained(ckpts[variant], dtype=dtype, progress=False)
        return loaded[variant, dtype]
    return get


def block_sites(model):
    def sites(layer):
        ffn = ROUTER_SITES if model.cfg.moe_layers[layer] else ("mlp.hook_post",)
        return KIND_SITES[model.cfg.layer_types[layer]] + FFN_SITES + ffn
    return sites


def test_the_layers_are_what_config_json_says(ckpts, models):
    base = models("base")
    assert type(base) is HookedLfm2Moe
    assert base.cfg.layer_types == tuple(tiny_lfm.LAYER_TYPES) and base.cfg.conv_kernel == 3
    assert [type(b.token_mixer) for b in base.blocks] == [ShortConvMixer, QKNormBeforeRotaryAttention, ShortConvMixer,
                                                          ShortConvMixer]
    assert type(base.blocks[0].mlp) is GatedMLP and not base.blocks[0].is_moe  # num_dense_layers = 1
    assert all(type(b.mlp.router) is Lfm2BiasedSigmoidTopK for b in base.blocks[1:])
    assert base.cfg.tie_word_embeddings and base.cfg.rope.theta == 10000.0
    biased = base.blocks[1].mlp.router.e_score_correction_bias
    assert biased.abs().max() > 0  # the checkpoint's expert_bias, read
    hub = json.loads((ckpts["conv_bias"] / "config.json").read_text())
    assert "tie_embedding" in hub and "rope_theta" in hub and "rope_parameters" not in hub
    conv_bias = models("conv_bias")
    assert conv_bias.cfg.conv_bias and not conv_bias.cfg.tie_word_embeddings and conv_bias.cfg.rope.theta == 10000.0
    assert conv_bias.blocks[1].mixer.conv.bias is not None and conv_bias.blocks[1].mixer.in_proj.bias is not None
    unbiased = models("unbiased")
    assert all(type(b.mlp.router) is Lfm2SigmoidTopK for b in unbiased.blocks) and unbiased.cfg.conv_kernel == 4
    assert unbiased.cfg.routed_scaling_factor == 2.5 and not unbiased.cfg.norm_topk_prob


@pytest.fixture
def one_thread():
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(threads)


@pytest.mark.parametrize("variant", ["base", "conv_bias", "unbiased"])
def test_float32_every_site_of_each_layer_kind(models, refs, variant, one_thread):
    """On one thread, where both run their matrix products in the same order: with two, the routed sums of the
    unbiased variant (weights unnormalised, times 2.5, summing to about 9) round apart by about 1e-5."""
    model = models(variant)
    check_report(compare(model, refs(variant), tokens(shape=(2, 20))), model, block_sites(model), 1e-5, MODEL_SITES)


@pytest.mark.parametrize("variant", ["conv_bias", "unbiased"])
def test_bfloat16_is_bit_exact(models, refs, variant):
    """The generic suite holds the base variant to this; here the router without the expert bias (its top-k on
    bfloat16 scores), the projection and convolution biases."""
    model, ref = models(variant, torch.bfloat16), refs(variant, torch.bfloat16)
    assert model.blocks[1].mlp.router.weight.dtype == torch.bfloat16
    check_bit_exact(compare(model, ref, tokens(shape=(2, 40))))


def test_expert_bias_stays_float32_and_changes_the_choice(models):
    model = models("base", torch.bfloat16)
    router = model.blocks[1].mlp.router
    assert router.e_score_correction_bias.dtype == torch.float32 and router.weight.dtype == torch.bfloat16
    _, cache = models("base").run_with_cache(tokens(shape=(2, 20)))
    scores, choice = cache["blocks.1.mlp.hook_router_scores"], cache["blocks.1.mlp.hook_choice_scores"]
    k = models("base").cfg.top_k
    unbiased = scores.topk(k, dim=-1).indices.sort(-1).values
    chosen = cache["blocks.1.mlp.hook_expert_indices"].sort(-1).values
    assert torch.equal(chosen, choice.topk(k, dim=-1).indices.sort(-1).values)
    assert (chosen != unbiased).any(-1).float().mean() > 0.2  # the bias decides for many tokens


@pytest.mark.parametrize("variant", ["base", "conv_bias"])
def test_short_conv_sites_against_transformers_tensors(models, refs, variant):
    """hook_x, hook_B, hook_C are the thirds (B, C, x in that order) of transformers' in_proj output; hook_conv_in
    is B * x; hook_conv_out is the causal depthwise convolution of B * x with transformers' conv weight (and bias),
    computed here with torch's conv1d; hook_y is C times it. Padding: rows left-padded, the input zeroed there."""
    model, ref = models(variant), refs(variant)
    toks, mask = left_padded(6, (2, 12), (0, 4))
    layer = model.cfg.layer_types.index("conv")
    seen = {}
    handle = ref.model.layers[layer].conv.in_proj.register_forward_hook(lambda m, i, o: seen.setdefault("bcx", o))
    try:
        with torch.no_grad():
            ref(toks, attention_mask=mask)
    finally:
        handle.remove()
    _, cache = model.run_with_cache(toks, attention_mask=mask)
    B, C, x = seen["bcx"].chunk(3, dim=-1)
    site = lambda name: cache[f"blocks.{layer}.mixer.hook_{name}"]  # noqa: E731
    for name, theirs in (("x", x), ("B", B), ("C", C), ("conv_in", B * x)):
        torch.testing.assert_close(site(name), theirs, rtol=0, atol=1e-5)
    conv = ref.model.layers[layer].conv.conv
    k = conv.weight.shape[-1]
    by_torch = F.conv1d(F.pad((B * x).transpose(1, 2), (k - 1, 0)), conv.weight, conv.bias, groups=conv.weight.shape[0])
    # the same sums, rounded in torch's order for another input length: float32 noise, within the 1e-5 bound
    torch.testing.assert_close(site("conv_out"), by_torch.transpose(1, 2), rtol=0, atol=1e-5)
    torch.testing.assert_close(site("y"), C * by_torch.transpose(1, 2), rtol=0, atol=1e-5)
    if not model.cfg.conv_bias:  # padding adds nothing: B * x is zero there
        assert site("conv_in")[1, :4].abs().max() == 0


@pytest.mark.parametrize("variant", ["base", "unbiased"])
@pytest.mark.parametrize("cuts", [
    [(0, 9)] + [(i, i + 1) for i in range(9, 17)],  # a prefill, then decode steps (the window's update)
    [(0, 2)] + [(i, i + 1) for i in range(2, 8)] + [(8, 17)],  # a prefill shorter than the kernel; a chunk after steps
    [(0, 1), (1, 2), (2, 17)],
])
def test_prefill_then_decode_equals_transformers_cached_runs(models, refs, variant, cuts):
    model, ref, toks = models(variant), refs(variant), tokens(11, (2, 17))

    def hf_run():
        cache = transformers.DynamicCache(config=ref.config)
        return torch.cat([ref(toks[:, a:b], cache=cache, use_cache=True).logits for a, b in cuts], dim=1)

    def our_run():
        cache = KVCache.for_model(model)
        out = torch.cat([model(toks[:, a:b], past_kv_cache=cache) for a, b in cuts], dim=1)
        state = cache.layers[model.cfg.layer_types.index("conv")]
        assert isinstance(state, ConvWindowState) and state.length == 17
        assert state.conv.shape == (2, model.cfg.d_model, model.cfg.conv_kernel)
        return out

    with torch.no_grad():
        ours, theirs = our_run(), hf_run()
    assert (ours - theirs).abs().max() <= 1e-5
    with torch.no_grad():
        assert (ours - model(toks)).abs().max() <= 1e-5  # the same as the whole sequence at once


@pytest.mark.parametrize("variant", ["base", "conv_bias", "unbiased"])
def test_greedy_generation_equals_transformers(models, refs, variant):
    check_greedy_generation(models(variant), refs(variant), tokens(4, (1, 10)), new=16)


def test_left_padded_generation_equals_transformers(models, refs):
    toks, mask = left_padded(8, (2, 10), (0, 3))
    check_greedy_generation(models("base"), refs("base"), toks, mask, new=8)


def test_bfloat16_greedy_generation_equals_transformers(models, refs):
    check_greedy_generation(models("base", torch.bfloat16), refs("base", torch.bfloat16), tokens(4, (1, 10)), new=12)


def test_the_window_is_handed_on(models):
    """An edit of hook_conv_in at the prompt's last position is what the cache keeps: the next step sees it (its
    output changes), and that step's output is what the whole sequence gives with the same edit."""
    model, toks = models("base"), tokens(2, (1, 9))
    bump = [("blocks.0.mixer.hook_conv_in", _edit_position(-1))]
    with torch.no_grad():
        plain_cache = KVCache.for_model(model)
        model(toks[:, :8], past_kv_cache=plain_cache)
        plain = model(toks[:, 8:], past_kv_cache=plain_cache)
        cache = KVCache.for_model(model)
        model.run_with_hooks(toks[:, :8], past_kv_cache=cache, fwd_hooks=bump)
        edited = model(toks[:, 8:], past_kv_cache=cache)
        whole = model.run_with_hooks(toks, fwd_hooks=[("blocks.0.mixer.hook_conv_in", _edit_position(7))])
    assert (edited - plain).abs().max() > 1e-3
    assert (edited[:, -1] - whole[:, -1]).abs().max() <= 1e-5


def _edit_position(position):
    def edit(x, hook):
        x = x.clone()
        x[:, position] += 1.0
        return x
    return edit


# ---- config.json ---------------------------------------------------------------------------------------------

def raw_config(ckpts) -> dict:
    return json.loads((ckpts["base"] / "config.json").read_text())


def test_tie_embedding_spelling_wins(ckpts):
    raw = raw_config(ckpts)
    assert HookedLfm2Moe.config_from_hf(raw | {"tie_embedding": False}).tie_word_embeddings is False
    assert HookedLfm2Moe.config_from_hf({k: v for k, v in raw.items() if k != "tie_word_embeddings"}).tie_word_embeddings


def test_all_dense_reads_no_mixture_fields(ckpts):
    cfg = HookedLfm2Moe.config_from_hf(raw_config(ckpts) | {"num_dense_layers": 9})
    assert cfg.moe_layers == (False,) * 4 and cfg.n_experts == 0 and "num_experts" not in cfg.fields_read


@pytest.mark.parametrize("edit, match", [
    ({"layer_types": None}, "layer_types is missing"),
    ({"layer_types": ["conv", "attention", "conv", "conv"]}, "unknown layer kinds \\['attention'\\]"),
    ({"layer_types": ["conv", "conv"]}, "layer_types has 2 entries, num_hidden_layers is 4"),
    ({"layer_types": "conv"}, "expected a list of layer kinds"),
    ({"conv_L_cache": 0}, "conv_L_cache"),
    ({"partial_rotary_factor": 0.5}, "partial_rotary_factor = 0.5"),
    ({"num_experts_per_tok": 9}, "num_experts_per_tok"),
    ({"use_expert_bias": "yes"}, "use_expert_bias"),
])
def test_bad_configs_are_named(ckpts, edit, match):
    raw = {k: v for k, v in (raw_config(ckpts) | edit).items() if v is not None}
    with pytest.raises(ValueError, match=match):
        HookedLfm2Moe.config_from_hf(copy.deepcopy(raw))


def test_a_missing_expert_bias_is_named(ckpts, tmp_path):
    folder = copy_checkpoint(ckpts, tmp_path)
    rewrite_tensors(folder, lambda t: t.pop("model.layers.2.feed_forward.expert_bias"))
    with pytest.raises(Exception, match="model.layers.2.feed_forward.expert_bias"):
        HookedTransformer.from_pretrained(folder, progress=False)


# ---- plan at full size ---------------------------------------------------------------------------------------

FLAGSHIP = flagship("lfm2_moe", "LiquidAI/LFM2-8B-A1B")


def test_plan_counts_attention_keys_and_the_convolution_windows():
    """LFM2-8B-A1B: 6 attention layers cache 2 x 8 kv heads x 64 values per token; 18 convolution layers hold a
    window of 2048 channels x 3 positions per sequence; bfloat16 throughout."""
    p = plan(dict(FLAGSHIP), dtype="bfloat16", gpus=1, gpu_memory="141GB", batch=1, seq=2048)
    per_token = 6 * 2 * 8 * 64
    window = 18 * 2048 * 3
    assert p.kv_cache["bytes"] == (2048 * per_token + window) * 2


def test_state_tensors_are_the_window_a_forward_leaves(models):
    """What plan counts per convolution layer (ShortConvMixer.state_tensors) is what a bfloat16 forward leaves in the
    cache: the window, d_model x conv_L_cache values per sequence, in the model's dtype, whatever the length."""
    model = models("base", torch.bfloat16)
    cache = KVCache.for_model(model)
    model(tokens(shape=(2, 13)), past_kv_cache=cache)
    (window,) = ShortConvMixer.state_tensors(model.cfg)
    for layer, kind in enumerate(model.cfg.layer_types):
        if kind == "conv":
            state = cache.layers[layer]
            assert state.conv.dtype == torch.bfloat16
            assert state.nbytes == 2 * window.nbytes(torch.bfloat16, 13) == 2 * 64 * 3 * 2
