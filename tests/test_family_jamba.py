"""Jamba (HookedJamba) against transformers' JambaForCausalLM: the layers the periods and offsets give, every
site of each layer kind (Mamba with its normed dt / B / C, attention without positions, mixture, dense MLP) in
float32 and bit for bit in bfloat16, the Mamba scan recomputed by hand from its hooks, prefill then decode and
greedy generation across the convolution and scan states, a cached multi-token forward continuing the state,
the plan at full size (Jamba-v0.1), and bad configs named."""

import contextlib
import copy
import json

import pytest
import torch
import torch.nn.functional as F
import transformers
import tiny_jamba
from family_harness import (MODEL_SITES, ROUTER_SITES, References, build_checkpoints, check_greedy_generation,
                            check_report, left_padded, tokens)
from flagships import flagship

from moelens import HookedTransformer
from moelens.kv_cache import KVCache
from moelens.models.components import SparseMoe
from moelens.models.components.attention import NoPositionAttention
from moelens.models.components.mlp import GatedMLP
from moelens.models.jamba import HookedJamba
from moelens.models.context import LayerInputs
from moelens.models.mixers.mamba1 import Mamba1Mixer
from moelens.plan import plan
from moelens.state import RecurrentState
from moelens.verify import compare

MAMBA_SITES = ("mixer.hook_x", "mixer.hook_dt_low_rank", "mixer.hook_B", "mixer.hook_C", "mixer.hook_z")
KIND_SITES = {
    "linear_attention": ("hook_resid_pre", "ln1.hook_normalized", "hook_attn_out", "hook_resid_mid") + MAMBA_SITES,
    "full_attention": ("hook_resid_pre", "ln1.hook_normalized", "hook_attn_out", "hook_resid_mid", "attn.hook_q",
                       "attn.hook_k", "attn.hook_v", "attn.hook_z"),
}
FFN_SITES = ("ln2.hook_normalized", "hook_mlp_out", "hook_resid_post")


@pytest.fixture(scope="module")
def ckpts(tmp_path_factory):
    return build_checkpoints(tmp_path_factory, "jamba", tiny_jamba.VARIANTS)


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


def test_the_layers_follow_the_periods_and_offsets(models):
    """attention where layer % attn_layer_period == attn_layer_offset, a mixture where layer % expert_layer_period
    == expert_layer_offset, and no mixture anywhere with one expert (as transformers builds them)."""
    base = models("base")
    assert type(base) is HookedJamba
    assert base.cfg.layer_types == ("linear_attention", "full_attention", "linear_attention", "linear_attention")
    assert base.cfg.moe_layers == (False, True, False, True)
    assert [type(b.token_mixer) for b in base.blocks] == [Mamba1Mixer, NoPositionAttention, Mamba1Mixer, Mamba1Mixer]
    assert [type(b.mlp) for b in base.blocks] == [GatedMLP, SparseMoe, GatedMLP, SparseMoe]
    assert base.cfg.mamba_d_inner == 128 and base.cfg.mamba_dt_rank == 4 and not base.cfg.norm_topk_prob
    biases = models("biases")
    assert biases.cfg.layer_types == ("full_attention", "linear_attention", "linear_attention", "full_attention")
    assert biases.cfg.mamba_proj_bias and not biases.cfg.mamba_conv_bias and biases.cfg.tie_word_embeddings
    assert biases.blocks[1].mixer.in_proj.bias is not None and biases.blocks[1].mixer.conv1d.bias is None
    dense = models("dense")
    assert dense.cfg.moe_layers == (False,) * 4 and dense.cfg.n_experts == 0
    assert all(type(b.mlp) is GatedMLP for b in dense.blocks)


@contextlib.contextmanager
def one_thread():
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        yield
    finally:
        torch.set_num_threads(threads)


@pytest.mark.parametrize("variant", ["base", "biases", "dense"])
def test_float32_every_site_of_each_layer_kind_is_bit_exact_in_one_thread(models, refs, variant):
    """In one thread every site of every layer kind is transformers' to the bit in float32. (With two threads the
    routed experts' float32 sums may round a last bit apart from transformers', and the Mamba layers after them
    grow that: test_equivalence holds the logits and sites to 1e-5 there.)"""
    model = models(variant)
    with one_thread():
        report = compare(model, refs(variant), tokens(shape=(2, 20)))
    check_report(report, model, block_sites(model), 0.0, MODEL_SITES)


@pytest.mark.parametrize("variant", ["base", "biases"])
def test_bfloat16_every_site_is_bit_exact(models, refs, variant):
    """The scan's float32 products and the gating's dtypes in transformers' order: every site, the Mamba ones
    included, and the logits bit for bit."""
    model = models(variant, torch.bfloat16)
    report = compare(model, refs(variant, torch.bfloat16), tokens(shape=(2, 20)))
    check_report(report, model, block_sites(model), 0.0, MODEL_SITES)


def test_the_mamba_hooks_hold_what_the_scan_reads_and_gives(models):
    """From the hooks alone, in float64: dt = softplus(dt_proj(hook_dt_low_rank)), B and C the normed slices of
    x_proj(hook_x), the recurrence h_t = exp(dt_t A) h_{t-1} + dt_t B_t x_t read by C plus D x (hook_y, and the
    last state hook_state_out), y * silu(gate) (hook_z) and out_proj of it (hook_attn_out)."""
    model = models("base")
    _, cache = model.run_with_cache(tokens(shape=(2, 11)))
    mixer = model.blocks[0].mixer
    d = lambda name: cache[f"blocks.0.mixer.{name}"].double()  # noqa: E731
    r, n = mixer.dt_rank, mixer.d_state
    projected = F.linear(cache["blocks.0.mixer.hook_x"], mixer.x_proj.weight)
    torch.testing.assert_close(cache["blocks.0.mixer.hook_dt_low_rank"], mixer.dt_layernorm(projected[..., :r]), rtol=0, atol=0)
    torch.testing.assert_close(cache["blocks.0.mixer.hook_B"], mixer.b_layernorm(projected[..., r:r + n]), rtol=0, atol=0)
    dt = F.softplus(F.linear(d("hook_dt_low_rank"), mixer.dt_proj.weight.double(), mixer.dt_proj.bias.double()))
    torch.testing.assert_close(d("hook_dt"), dt, rtol=0, atol=1e-6)
    A = -torch.exp(mixer.A_log.double())
    x, B, C = d("hook_x"), d("hook_B"), d("hook_C")
    h = torch.zeros(2, mixer.d_inner, n, dtype=torch.float64)
    ys = []
    for t in range(x.shape[1]):
        h = torch.exp(d("hook_dt")[:, t, :, None] * A) * h + (d("hook_dt")[:, t] * x[:, t])[..., None] * B[:, t, None]
        ys.append((h * C[:, t, None]).sum(-1) + mixer.D.double() * x[:, t])
    torch.testing.assert_close(d("hook_y"), torch.stack(ys, 1), rtol=0, atol=1e-5)
    torch.testing.assert_close(d("hook_state_out"), h, rtol=0, atol=1e-5)
    assert torch.equal(cache["blocks.0.mixer.hook_state_in"], torch.zeros_like(cache["blocks.0.mixer.hook_state_out"]))
    torch.testing.assert_close(d("hook_z"), d("hook_y") * F.silu(d("hook_gate")), rtol=1e-6, atol=1e-6)
    torch.testing.assert_close(cache["attn_out", 0], mixer.out_proj(cache["blocks.0.mixer.hook_z"]), rtol=0, atol=0)


@pytest.mark.parametrize("dtype, prefill", [(torch.float32, 12), (torch.bfloat16, 12), (torch.float32, 2)])
def test_prefill_then_decode_equals_transformers_cached_run(models, refs, dtype, prefill):
    """A prefill then one-token steps (the convolution window and the scan's decode step), against transformers'
    own cached run with the same cuts: within 1e-5 in float32, bit for bit in bfloat16; a prefill shorter than
    the convolution's kernel (4) is padded to it before the convolution, as transformers' cache pads it."""
    model, ref, toks = models("base", dtype), refs("base", dtype), tokens(11, (2, 21))
    cuts = [(0, prefill)] + [(i, i + 1) for i in range(prefill, 21)]
    with torch.no_grad():
        hf_cache = transformers.DynamicCache(config=ref.config)
        expected = torch.cat([ref(toks[:, a:b], cache=hf_cache, use_cache=True).logits for a, b in cuts], dim=1)
        cache = KVCache.for_model(model)
        got = torch.cat([model(toks[:, a:b], past_kv_cache=cache) for a, b in cuts], dim=1)
    assert isinstance(cache.layers[0], RecurrentState) and cache.layers[0].length == 21
    assert cache.layers[0].recurrent.dtype == torch.float32 and cache.layers[0].conv.dtype == dtype
    if dtype == torch.float32:
        assert (got - expected).abs().max() <= 1e-5
    else:
        assert torch.equal(got, expected)


def test_a_cached_multi_token_forward_continues_the_state(models, refs):
    """Prefill then a 9-token forward is the whole sequence's forward: the scan starts from the cached state.
    transformers 5.24 restarts its sequential scan from zeros there (its convolution does see the window), so
    its cached run is not its own uncached one; moelens does not copy that."""
    model, ref, toks = models("base"), refs("base"), tokens(12, (2, 21))
    with torch.no_grad():
        whole = model(toks)
        cache = KVCache.for_model(model)
        split = torch.cat([model(toks[:, :12], past_kv_cache=cache), model(toks[:, 12:], past_kv_cache=cache)], dim=1)
        hf_cache = transformers.DynamicCache(config=ref.config)
        hf_split = torch.cat([ref(toks[:, :12], cache=hf_cache, use_cache=True).logits,
                              ref(toks[:, 12:], cache=hf_cache, use_cache=True).logits], dim=1)
        hf_whole = ref(toks).logits
    assert (split - whole).abs().max() <= 1e-5
    assert (whole - hf_whole).abs().max() <= 1e-5
    assert (hf_split - hf_whole)[:, 12:].abs().max() > 1e-2


@pytest.mark.parametrize("variant", ["base", "biases", "dense"])
def test_greedy_generation_equals_transformers(models, refs, variant):
    check_greedy_generation(models(variant), refs(variant), tokens(4, (1, 10)), new=10)


def test_bfloat16_and_left_padded_generation_equal_transformers(models, refs):
    check_greedy_generation(models("base", torch.bfloat16), refs("base", torch.bfloat16), tokens(4, (1, 10)), new=8)
    toks, mask = left_padded(8, (2, 10), (0, 3))
    check_greedy_generation(models("base"), refs("base"), toks, mask, new=8)


def test_an_edit_of_the_handed_on_state_changes_later_steps_only(models):
    """hook_state_out is what the cache keeps: zeroing it changes nothing in its own forward, and the next step."""
    model, toks = models("base"), tokens(6, (1, 9))
    zero = [("blocks.0.mixer.hook_state_out", lambda state, hook: torch.zeros_like(state))]
    with torch.no_grad():
        plain_cache, edited_cache = KVCache.for_model(model), KVCache.for_model(model)
        plain = model(toks[:, :8], past_kv_cache=plain_cache)
        edited = model.run_with_hooks(toks[:, :8], past_kv_cache=edited_cache, fwd_hooks=zero)
        assert torch.equal(plain, edited)
        assert not torch.equal(model(toks[:, 8:], past_kv_cache=plain_cache),
                               model(toks[:, 8:], past_kv_cache=edited_cache))


def test_a_cached_state_of_another_shape_is_refused_naming_the_layer(models):
    mixer = models("base").blocks[2].mixer
    state = RecurrentState()
    state.update(torch.zeros(1, 128, 4), torch.zeros(1, 128, 16), 5)
    inputs = LayerInputs(torch.zeros(1, 1, dtype=torch.long), None, None, torch.ones(1, 1, 1, 1, dtype=torch.bool),
                         state=state)
    with pytest.raises(ValueError, match=r"Mamba1Mixer \(layer 2\): cached state.recurrent has shape \(1, 128, 16\), "
                                         r"expected \(1, 128, 8\) for a batch of 1"):
        mixer(torch.zeros(1, 1, 64), inputs)


# ---- config.json ---------------------------------------------------------------------------------------------

def raw_config(ckpts) -> dict:
    return json.loads((ckpts["base"] / "config.json").read_text())


@pytest.mark.parametrize("edit, match", [
    ({"attn_layer_offset": 3}, r"attn_layer_offset \(3\) must be smaller than attn_layer_period \(3\)"),
    ({"expert_layer_offset": 2}, r"expert_layer_offset \(2\) must be smaller than expert_layer_period \(2\)"),
    ({"attn_layer_period": 0}, "attn_layer_period"),
    ({"hidden_act": "gelu"}, "hidden_act = 'gelu': it is also the Mamba convolution's activation"),
    ({"mamba_dt_rank": "full"}, "mamba_dt_rank"),
    ({"mamba_dt_rank": 0}, "mamba_dt_rank"),
    ({"num_experts_per_tok": 9}, "num_experts_per_tok"),
    ({"num_local_experts": 4}, "num_local_experts = 4 and num_experts = 8"),
])
def test_bad_configs_are_named(ckpts, edit, match):
    with pytest.raises(ValueError, match=match):
        HookedJamba.config_from_hf(copy.deepcopy(raw_config(ckpts) | edit))


def test_config_spellings_and_defaults(ckpts):
    """num_local_experts is num_experts (transformers' attribute_map); mamba_dt_rank "auto" is ceil(hidden / 16);
    hidden_act need not be silu where no layer is Mamba; the fields transformers' inference never reads are listed."""
    raw = {k: v for k, v in raw_config(ckpts).items() if k != "num_experts"} | {"num_local_experts": 8}
    assert HookedJamba.config_from_hf(raw).n_experts == 8
    cfg = HookedJamba.config_from_hf(raw_config(ckpts) | {"hidden_size": 72, "mamba_dt_rank": "auto"})
    assert cfg.mamba_dt_rank == 5 and cfg.mamba_d_inner == 144
    attention_only = raw_config(ckpts) | {"attn_layer_period": 1, "attn_layer_offset": 0, "hidden_act": "gelu"}
    assert HookedJamba.config_from_hf(attention_only).act_fn == "gelu"
    cfg = HookedJamba.config_from_hf(raw_config(ckpts) | {"use_mamba_kernels": True, "sliding_window": None})
    assert {"use_mamba_kernels", "sliding_window"} <= set(cfg.fields_ignored)


# ---- plan at full size ---------------------------------------------------------------------------------------

def test_plan_counts_attention_keys_and_the_mamba_state():
    """Jamba-v0.1: 4 attention layers (4, 12, 20, 28) cache 2 x 8 kv heads x 128 values per token; 28 Mamba layers
    hold a convolution window (8192 channels x kernel 4, bfloat16) and a float32 state (8192 x 16) per sequence."""
    p = plan(dict(flagship("jamba", "ai21labs/Jamba-v0.1")), dtype="bfloat16", gpus=1, gpu_memory="141GB", batch=1,
             seq=2048)
    per_token = 4 * 2 * 8 * 128
    assert p.kv_cache["bytes"] == (2048 * per_token + 28 * 8192 * 4) * 2 + 28 * 8192 * 16 * 4


def test_the_mamba_mixers_terms_and_state_tensors_are_what_it_holds(models):
    """Its declared parameters are transformers' JambaMambaMixer's, name by name; in a bfloat16 model the state a
    forward leaves is a bfloat16 window and a float32 state, the bytes state_tensors count."""
    from transformers.models.jamba.modeling_jamba import JambaMambaMixer

    with torch.device("meta"):
        theirs = JambaMambaMixer(tiny_jamba.jamba_config(), layer_idx=0)
    assert {t.name: t.shape for t in Mamba1Mixer.param_terms(models("base").cfg, 0)} == {
        n: tuple(p.shape) for n, p in theirs.named_parameters()}
    model = models("base", torch.bfloat16)
    cache = KVCache.for_model(model)
    with torch.no_grad():
        model(tokens(shape=(2, 9)), past_kv_cache=cache)
    state, tensors = cache.layers[0], {t.name: t for t in Mamba1Mixer.state_tensors(model.cfg)}
    assert state.recurrent.dtype == torch.float32 and state.conv.dtype == torch.bfloat16
    assert 2 * tensors["recurrent"].nbytes(torch.bfloat16, 9) == state.recurrent.numel() * 4
    assert 2 * tensors["conv"].nbytes(torch.bfloat16, 9) == state.conv.numel() * 2
