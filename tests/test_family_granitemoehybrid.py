"""Granite-4.0-H (HookedGraniteMoeHybrid): what differs from granitemoeshared. The generic suites compare every
variant with transformers; here: the layers config.json's names give, each layer kind's sites against
transformers, nope against rope, the dense layers (no experts) by hand, time_step_limit (its JSON spellings,
a clamp that bites in the chunked form and not in a decode step, as transformers), prefill then decode and greedy
generation across the Mamba-2 state, the plan at full size, and bad configs named."""

import copy
import json

import pytest
import torch
import torch.nn.functional as F
import transformers
import tiny_granitemoehybrid as tiny_gh
from family_harness import MODEL_SITES, References, build_checkpoints, check_greedy_generation, check_report, left_padded, tokens
from flagships import flagship

from moelens import HookedTransformer
from moelens.kv_cache import KVCache
from moelens.models.components.mlp import FusedGateUpMLP
from moelens.models.components.multiplier_attention import MultiplierScaledAttention
from moelens.models.granitemoehybrid import HookedGraniteMoeHybrid, NoPositionMultiplierAttention
from moelens.models.granitemoeshared import FusedSharedExpertMoe
from moelens.models.mixers.mamba2 import Mamba2Mixer
from moelens.plan import plan
from moelens.state import RecurrentState
from moelens.verify import compare

M = tiny_gh.MULTIPLIERS["residual_multiplier"]
CLAMPED = (0.0, 0.3)  # below most of the tiny model's softplus(dt): the clamp bites
BUILDERS = dict(tiny_gh.VARIANTS) | {
    ("granitemoehybrid", "clamped"): lambda d: tiny_gh.build_granitemoehybrid(d, seed=5, time_step_limit=CLAMPED),
}
KIND_SITES = {
    "linear_attention": ("hook_resid_pre", "ln1.hook_normalized", "hook_attn_out", "hook_resid_mid"),
    "full_attention": ("hook_resid_pre", "ln1.hook_normalized", "hook_attn_out", "hook_resid_mid", "attn.hook_q",
                       "attn.hook_k", "attn.hook_v", "attn.hook_z"),
}
MIXTURE_SITES = ("ln2.hook_normalized", "hook_mlp_out", "hook_resid_post", "mlp.hook_router_logits",
                 "mlp.hook_expert_indices", "mlp.hook_routed_out", "mlp.hook_shared_out")
DENSE_SITES = ("ln2.hook_normalized", "hook_mlp_out", "hook_resid_post", "mlp.hook_post")


@pytest.fixture(scope="module")
def ckpts(tmp_path_factory):
    return build_checkpoints(tmp_path_factory, "granitemoehybrid", BUILDERS)


@pytest.fixture(scope="module")
def refs(ckpts):
    return References(ckpts)


@pytest.fixture(scope="module")
def models(ckpts):
    loaded = {}

    def get(variant):
        if variant not in loaded:
            loaded[variant] = HookedTransformer.from_pretrained(ckpts[variant], progress=False)
        return loaded[variant]
    return get


def block_sites(model):
    ffn = MIXTURE_SITES if model.cfg.n_experts else DENSE_SITES
    return lambda layer: KIND_SITES[model.cfg.layer_types[layer]] + ffn


def test_the_layers_are_what_config_json_says(ckpts, models):
    """config.json as the Hub spells it (mamba / attention, transformers' tagged Infinity); the mixers, the
    attention's positions and the feed-forwards the variants claim."""
    raw = json.loads((ckpts["base"] / "config.json").read_text())
    assert raw["layer_types"] == ["mamba", "attention", "mamba"]
    assert raw["time_step_limit"] == [0.0, {"__float__": "Infinity"}]
    base = models("base")
    assert type(base) is HookedGraniteMoeHybrid
    assert base.cfg.layer_types == ("linear_attention", "full_attention", "linear_attention")
    assert base.cfg.mamba_time_step_limit == (0.0, float("inf")) and base.cfg.mamba_d_head == 16
    assert [type(b.token_mixer) for b in base.blocks] == [Mamba2Mixer, NoPositionMultiplierAttention, Mamba2Mixer]
    assert all(type(b.mlp) is FusedSharedExpertMoe for b in base.blocks)
    rope = models("rope")
    assert [type(b.token_mixer) for b in rope.blocks] == [MultiplierScaledAttention, Mamba2Mixer, MultiplierScaledAttention]
    assert rope.cfg.qkv_bias and rope.cfg.tie_word_embeddings
    dense = models("dense")
    assert dense.cfg.n_experts == 0 and dense.cfg.d_mlp == 48 and dense.cfg.d_shared == 0
    assert all(type(b.mlp) is FusedGateUpMLP and not b.is_moe for b in dense.blocks)
    assert models("clamped").cfg.mamba_time_step_limit == CLAMPED


@pytest.mark.parametrize("variant", ["base", "rope", "dense", "clamped"])
def test_float32_every_site_of_each_layer_kind(models, refs, variant):
    """A prompt of 20 crosses the chunks of 8 of the chunked scan."""
    model = models(variant)
    check_report(compare(model, refs(variant), tokens(shape=(2, 20))), model, block_sites(model), 1e-5, MODEL_SITES)


def test_nope_leaves_q_and_k_as_projected_and_rope_turns_them(models):
    _, cache = models("base").run_with_cache(tokens(shape=(1, 10)))
    assert torch.equal(cache["blocks.1.attn.hook_rot_q"], cache["blocks.1.attn.hook_q"])
    assert torch.equal(cache["blocks.1.attn.hook_rot_k"], cache["blocks.1.attn.hook_k"])
    _, cache = models("rope").run_with_cache(tokens(shape=(1, 10)))
    assert not torch.allclose(cache["blocks.0.attn.hook_rot_q"][:, 1:], cache["blocks.0.attn.hook_q"][:, 1:])
    assert torch.equal(cache["blocks.0.attn.hook_rot_q"][:, 0], cache["blocks.0.attn.hook_q"][:, 0])  # position 0


def test_dense_layers_by_hand(models):
    """No experts: each layer's feed-forward is the shared MLP alone, gate rows then up rows of one matrix, and
    the stream receives its output times the residual multiplier."""
    model = models("dense")
    _, cache = model.run_with_cache(tokens(shape=(2, 9)))
    for layer, block in enumerate(model.blocks):
        x = cache[f"blocks.{layer}.ln2.hook_normalized"]
        W, d = block.mlp.gate_up_proj.weight, model.cfg.d_mlp
        by_hand = F.linear(F.silu(x @ W[:d].T) * (x @ W[d:].T), block.mlp.down_proj.weight)
        torch.testing.assert_close(cache["mlp_out", layer], by_hand * M, rtol=0, atol=1e-5)
        torch.testing.assert_close(cache["resid_post", layer], cache[f"blocks.{layer}.hook_resid_mid"] + cache["mlp_out", layer],
                                   rtol=0, atol=0)


def test_time_step_limit_clamps_the_chunked_form_only(models):
    """dt is clamped to time_step_limit in a multi-token forward (and the clamp bites on the tiny model); a decode
    step clamps nothing, as transformers' GraniteMoeHybridMambaLayer."""
    model = models("clamped")
    toks = tokens(shape=(1, 6))
    _, cache = model.run_with_cache(toks)
    dt = cache["blocks.0.mixer.hook_dt"]
    assert dt.max() == CLAMPED[1]
    kv = KVCache.for_model(model)
    model(toks[:, :5], past_kv_cache=kv)
    _, step = model.run_with_cache(toks[:, 5:], past_kv_cache=kv)
    assert step["blocks.0.mixer.hook_dt"].max() > CLAMPED[1]


def test_prefill_then_decode_equals_transformers_cached_runs(models, refs):
    """A 12-token prefill then one-token steps (the Mamba-2 recurrence), and a prefill then one 9-token step,
    each against transformers' own cached run with the same cuts, where time_step_limit clamps the prefill and
    not the steps (so the cuts change the result, the same way in both)."""
    model, ref, toks = models("clamped"), refs("clamped"), tokens(11, (2, 21))

    def hf_run(cuts):
        cache = transformers.DynamicCache(config=ref.config)
        return torch.cat([ref(toks[:, a:b], cache=cache, use_cache=True).logits for a, b in cuts], dim=1)

    def our_run(cuts):
        cache = KVCache.for_model(model)
        out = torch.cat([model(toks[:, a:b], past_kv_cache=cache) for a, b in cuts], dim=1)
        assert isinstance(cache.layers[0], RecurrentState) and cache.layers[0].length == 21
        return out

    stepped = [(0, 12)] + [(i, i + 1) for i in range(12, 21)]
    with torch.no_grad():
        assert (our_run(stepped) - hf_run(stepped)).abs().max() <= 1e-5
        assert (our_run([(0, 12), (12, 21)]) - hf_run([(0, 12), (12, 21)])).abs().max() <= 1e-5


@pytest.mark.parametrize("variant", ["base", "rope", "dense"])
def test_greedy_generation_equals_transformers(models, refs, variant):
    check_greedy_generation(models(variant), refs(variant), tokens(4, (1, 10)), new=16)


def test_left_padded_generation_equals_transformers(models, refs):
    toks, mask = left_padded(8, (2, 10), (0, 3))
    check_greedy_generation(models("base"), refs("base"), toks, mask, new=8)


# ---- config.json ---------------------------------------------------------------------------------------------

def raw_config(ckpts) -> dict:
    return json.loads((ckpts["base"] / "config.json").read_text())


@pytest.mark.parametrize("limit, expected", [
    ([0.0, {"__float__": "Infinity"}], (0.0, float("inf"))),
    ([0.001, float("inf")], (0.001, float("inf"))),  # Python's json reads a bare Infinity so
    ([0, 100], (0.0, 100.0)),
])
def test_time_step_limit_spellings(ckpts, limit, expected):
    cfg = HookedGraniteMoeHybrid.config_from_hf(raw_config(ckpts) | {"time_step_limit": limit})
    assert cfg.mamba_time_step_limit == expected and cfg.mamba_decode_time_step_limit == (0.0, float("inf"))
    absent = {k: v for k, v in raw_config(ckpts).items() if k != "time_step_limit"}
    assert HookedGraniteMoeHybrid.config_from_hf(absent).mamba_time_step_limit == (0.0, float("inf"))


@pytest.mark.parametrize("edit, match", [
    ({"time_step_limit": None}, "time_step_limit is null"),
    ({"time_step_limit": [0.0, {"__float__": "NaN"}]}, "time_step_limit = "),
    ({"time_step_limit": [1.0, 0.5]}, "0 <= min <= max"),
    ({"time_step_limit": [0.0]}, "a \\[min, max\\] pair"),
    ({"layer_types": ["mamba", "hybrid", "mamba"]}, "unknown layer kinds \\['hybrid'\\]"),
    ({"layer_types": ["mamba", "attention"]}, "layer_types has 2 entries, num_hidden_layers is 3"),
    ({"layers_block_type": ["mamba", "mamba"], "layer_types": None}, "layers_block_type has 2 entries"),
    ({"position_embedding_type": "alibi"}, "position_embedding_type = 'alibi'"),
    ({"hidden_act": "gelu"}, "hidden_act = 'gelu': it is also the Mamba-2 convolution's activation"),
    ({"mamba_n_heads": 6}, "mamba_n_heads \\(6\\) must divide mamba_expand \\* hidden_size \\(128\\)"),
    ({"mamba_d_head": 8}, "mamba_d_head \\(8\\) \\* mamba_n_heads \\(8\\)"),
    ({"mamba_n_groups": 3}, "multiple of mamba_n_groups \\(3\\)"),
    ({"partial_rotary_factor": 0.5}, "partial_rotary_factor"),
])
def test_bad_configs_are_named(ckpts, edit, match):
    raw = {k: v for k, v in (raw_config(ckpts) | edit).items() if v is not None or k == "time_step_limit"}
    with pytest.raises(ValueError, match=match):
        HookedGraniteMoeHybrid.config_from_hf(copy.deepcopy(raw))


def test_all_attention_layers_need_no_silu(ckpts):
    """hidden_act is the convolution's activation only where a layer is Mamba-2."""
    raw = raw_config(ckpts) | {"layer_types": ["attention"] * 3, "hidden_act": "gelu"}
    assert HookedGraniteMoeHybrid.config_from_hf(raw).act_fn == "gelu"


# ---- plan at full size ---------------------------------------------------------------------------------------

SMALL = flagship("granitemoehybrid", "ibm-granite/granite-4.0-h-small")


def test_plan_counts_attention_keys_and_the_mamba_state():
    """granite-4.0-h-small: 4 attention layers cache 2 x 8 kv heads x 128 values per token; 36 Mamba-2 layers
    hold a convolution window (128 x 64 + 2 x 1 x 128 channels x kernel 4) and a float32 state (128 heads x 64 x
    128) per sequence."""
    p = plan(dict(SMALL), dtype="bfloat16", gpus=1, gpu_memory="141GB", batch=1, seq=2048)
    per_token = 4 * 2 * 8 * 128  # bfloat16
    conv_window = (128 * 64 + 2 * 1 * 128) * 4  # bfloat16
    state = 128 * 64 * 128  # float32
    assert p.kv_cache["bytes"] == (2048 * per_token + 36 * conv_window) * 2 + 36 * state * 4
