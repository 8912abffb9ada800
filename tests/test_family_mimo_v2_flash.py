"""MiMo-V2-Flash (HookedMiMoV2Flash): what only it has. The generic suites compare every site with transformers;
here, by hand: the sink in the sliding layers' softmax and none in the full layers', each layer type's kv heads
and rotary (its own base and rotated share), the values scaled as projected and narrower than the keys, the
window; the Hub's config.json fields read against what transformers derives; the config refusals."""

import copy
import math

import flagships
import pytest
import torch
import tiny_mimo_v2_flash
from family_harness import build_checkpoints, config_json, stored_keys, tokens

from moelens import HookedTransformer
from moelens.models.mimo_v2_flash import HookedMiMoV2Flash, MiMoAttention, MiMoSinkAttention

WINDOW = tiny_mimo_v2_flash.WINDOW


@pytest.fixture(scope="module")
def ckpts(tmp_path_factory):
    wanted = {k: v for k, v in tiny_mimo_v2_flash.VARIANTS.items() if k[1] in ("base", "layers")}
    return build_checkpoints(tmp_path_factory, "mimo_v2_flash", wanted)


def _run(folder):
    model = HookedTransformer.from_pretrained(folder, progress=False)
    with torch.no_grad():
        logits, cache = model.run_with_cache(tokens(shape=(2, 12)))
    return model, logits, cache


@pytest.fixture(scope="module")
def run(ckpts):
    return _run(ckpts["base"])


@pytest.fixture(scope="module")
def run_layers(ckpts):
    return _run(ckpts["layers"])


def test_variants_are_what_they_claim(ckpts):
    keys = stored_keys(ckpts["base"])
    # transformers saves the sinks under the Hub's name, on the sliding layers only
    assert [k for k in keys if "sink" in k] == [f"model.layers.{l}.self_attn.attention_sink_bias" for l in (1, 2, 3)]
    base = config_json(ckpts["base"])
    assert base["layer_types"] == ["full_attention"] + ["sliding_attention"] * 3
    assert base["mlp_layer_types"] == ["dense", "sparse", "sparse", "sparse"]
    model = HookedTransformer.from_pretrained(ckpts["base"], progress=False)
    assert [type(b.attn) for b in model.blocks] == [MiMoAttention] + [MiMoSinkAttention] * 3
    assert [b.attn.n_kv_heads for b in model.blocks] == [1, 2, 2, 2]
    assert model.cfg.attention_windows == (None, WINDOW, WINDOW, WINDOW) and model.cfg.value_scale == 0.6
    layers = config_json(ckpts["layers"])
    assert layers["attention_value_scale"] is None and layers["attention_bias"] is True


def test_each_layer_type_has_its_kv_heads_and_value_width(run):
    model, _, cache = run
    for l, block in enumerate(model.blocks):
        kv = 1 if l == 0 else 2
        assert block.attn.k_proj.weight.shape == (kv * 24, 64) and block.attn.v_proj.weight.shape == (kv * 16, 64)
        assert block.attn.o_proj.weight.shape == (64, 4 * 16)
        assert cache["k", l].shape == (2, 12, kv, 24) and cache["v", l].shape == (2, 12, kv, 16)
        assert cache["q", l].shape == (2, 12, 4, 24) and cache["z", l].shape == (2, 12, 4, 16)


def test_values_are_scaled_as_projected(run):
    """hook_v is v_proj(x) times attention_value_scale; z is the pattern over those values."""
    model, _, cache = run
    for l, block in enumerate(model.blocks):
        x = cache[f"blocks.{l}.ln1.hook_normalized"]
        kv = block.attn.n_kv_heads
        v = (x @ block.attn.v_proj.weight.T).view(2, 12, kv, 16) * 0.6
        torch.testing.assert_close(cache["v", l], v, rtol=0, atol=1e-6)
        by_hand = torch.einsum("bhqk,bkhd->bqhd", cache["pattern", l], v.repeat_interleave(4 // kv, dim=2))
        torch.testing.assert_close(cache["z", l], by_hand, rtol=0, atol=1e-5)


def test_the_sink_joins_the_sliding_layers_softmax_only(run):
    """A sliding layer's pattern is the softmax over the keys and its sink, the sink's column dropped (rows sum to
    less than one); a full layer's is the plain softmax (rows sum to one) and has no sink."""
    model, _, cache = run
    for l, block in enumerate(model.blocks):
        scores, pattern = cache["attn_scores", l], cache["pattern", l]
        if l == 0:
            assert not hasattr(block.attn, "sinks")
            torch.testing.assert_close(pattern, scores.softmax(-1), rtol=0, atol=1e-6)
            continue
        sinks = block.attn.sinks.detach()
        torch.testing.assert_close(cache[f"blocks.{l}.attn.hook_sink_scores"][..., 0],
                                   sinks.view(1, -1, 1).expand(2, -1, 12), rtol=0, atol=0)
        joined = torch.cat([scores, sinks.view(1, -1, 1, 1).expand(*scores.shape[:3], 1)], -1).softmax(-1)[..., :-1]
        torch.testing.assert_close(pattern, joined, rtol=0, atol=1e-6)
        assert (pattern.sum(-1) < 1 - 1e-4).all()


def test_sliding_layers_see_the_window_only(run_layers):
    model, _, cache = run_layers
    query, key = torch.arange(12)[:, None], torch.arange(12)[None, :]
    outside = key <= query - WINDOW
    assert model.cfg.attention_windows == (WINDOW, None, WINDOW, WINDOW, None)
    for l in range(model.cfg.n_layers):
        pattern = cache["pattern", l]
        if model.cfg.attention_windows[l] is None:
            assert (pattern[..., outside] > 0).all()
        else:
            assert torch.equal(pattern[..., outside], torch.zeros_like(pattern[..., outside]))


def _rotated(x, positions, theta, d_rot):
    """x [batch pos head d] with its first d_rot dims rotated by hand at base theta (halves, as rotate_half)."""
    inv_freq = 1.0 / theta ** (torch.arange(0, d_rot, 2, dtype=torch.float64) / d_rot)
    angles = positions.double()[..., None] * inv_freq
    emb = torch.cat([angles, angles], -1)[:, :, None, :]
    rot = x[..., :d_rot].double()
    x1, x2 = rot[..., : d_rot // 2], rot[..., d_rot // 2:]
    turned = rot * emb.cos() + torch.cat([-x2, x1], -1) * emb.sin()
    return torch.cat([turned.float(), x[..., d_rot:]], -1)


def test_each_layer_type_rotates_its_share_at_its_base(run):
    """Full layers: int(24 * 0.334) = 8 dims at 50000; sliding layers: int(24 * 0.5) = 12 dims at 100; the other
    dims pass unchanged."""
    model, _, cache = run
    positions = torch.arange(12).expand(2, 12)
    for l in range(model.cfg.n_layers):
        theta, d_rot = (50000.0, 8) if l == 0 else (100.0, 12)
        for name in ("q", "k"):
            x, rot = cache[name, l], cache[f"blocks.{l}.attn.hook_rot_{name}"]
            torch.testing.assert_close(rot, _rotated(x, positions, theta, d_rot), rtol=0, atol=1e-5)
            assert torch.equal(rot[..., d_rot:], x[..., d_rot:])


def test_no_value_scale_and_biases(run_layers):
    """attention_value_scale null: the values as projected (with their bias)."""
    model, _, cache = run_layers
    assert model.cfg.value_scale == 1.0 and model.cfg.qkv_bias
    attn = model.blocks[1].attn
    x = cache["blocks.1.ln1.hook_normalized"]
    torch.testing.assert_close(cache["v", 1], (x @ attn.v_proj.weight.T + attn.v_proj.bias).view(2, 12, 2, 16),
                               rtol=0, atol=1e-6)
    assert [b.is_moe for b in model.blocks] == [False, True, False, True, True]


def test_the_hubs_config_reads_as_transformers_reads_it():
    """The published config.json: no rope_parameters (transformers' per-type defaults), sliding_window_size 128
    (a window of 129: the previous 128 positions and the query), the Hub's pattern fields agreeing."""
    cfg = HookedMiMoV2Flash.config_from_hf(copy.deepcopy(flagships.flagship("mimo_v2_flash")))
    full = [l for l in range(48) if l == 0 or (l + 1) % 6 == 0]
    assert cfg.attention_windows == tuple(None if l in full else 129 for l in range(48))
    assert (cfg.n_kv_heads, cfg.sliding_kv_heads, cfg.d_head, cfg.d_head_v) == (4, 8, 192, 128)
    assert (cfg.rope.theta, cfg.sliding_rope.theta, cfg.d_rot) == (5e6, 1e4, 64)
    assert cfg.moe_layers == (False,) + (True,) * 47 and cfg.routed_scaling_factor == 1.0
    assert cfg.value_scale == 0.707 and cfg.norm_eps == 1e-5
    assert set(cfg.fields_ignored) == {"scoring_func", "topk_method", "sliding_window"}


def _raw(**changes):
    raw = copy.deepcopy(tiny_mimo_v2_flash.mimo_v2_flash_config().to_dict())
    raw.update(changes)
    return raw


def _hub(**changes):
    raw = copy.deepcopy(flagships.flagship("mimo_v2_flash"))
    raw.update(changes)
    return raw


@pytest.mark.parametrize("raw,match", [
    (_raw(layer_types=["full_attention"] * 3), "layer_types must list 4"),
    (_raw(layer_types=["full_attention", "chunked_attention"] * 2), "layer_types must list 4"),
    (_raw(mlp_layer_types=["dense"] * 4), "every block a dense MLP"),
    (_raw(mlp_layer_types=["dense", "moe", "sparse", "sparse"]), "mlp_layer_types must list 4"),
    (_raw(sliding_window=None), "sliding_window = null"),
    (_raw(num_key_value_heads=4), r"multiple of the sliding layers' kv heads \(8"),
    (_raw(rope_parameters={"rope_type": "default", "rope_theta": 10000.0}), "rope_parameters must map each of"),
    (_raw(rope_parameters={"full_attention": {"rope_type": "yarn", "rope_theta": 1.0, "factor": 2.0},
                           "sliding_attention": {"rope_type": "default", "rope_theta": 1.0}}),
     "rope_parameters.full_attention.rope_type = 'yarn'"),
    (_raw(rope_parameters={"full_attention": {"rope_type": "default", "rope_theta": 1.0, "partial_rotary_factor": 0.3},
                           "sliding_attention": {"rope_type": "default", "rope_theta": 1.0}}), "rotary needs an even"),
    (_raw(rope_parameters={"full_attention": {"rope_type": "default"},
                           "sliding_attention": {"rope_type": "default", "rope_theta": 1.0}}), "rope_theta"),
    (_hub(hybrid_layer_pattern=[0] * 48), r"hybrid_layer_pattern = .* disagrees with layer_types"),
    (_hub(moe_layer_freq=[1] * 48), "moe_layer_freq = .* disagrees with mlp_layer_types"),
    (_hub(swa_num_key_value_heads=4), r"swa_num_key_value_heads = 4 disagrees with twice num_key_value_heads \(8\)"),
    (_hub(swa_v_head_dim=192), "swa_v_head_dim = 192 disagrees with v_head_dim"),
    (_hub(add_full_attention_sink_bias=True), "add_full_attention_sink_bias = True disagrees"),
    (_hub(swa_rope_theta=20000), "swa_rope_theta = 20000 disagrees with rope_parameters.sliding_attention"),
    (_hub(rope_theta=10000000), "rope_theta = 10000000 disagrees"),
    (_hub(layernorm_epsilon=1e-6), "layernorm_epsilon = 1e-06 disagrees with rms_norm_eps"),
    (_hub(n_shared_experts=1), "n_shared_experts = 1 disagrees"),
])
def test_bad_configs_are_refused_naming_the_field(raw, match):
    with pytest.raises((ValueError, KeyError), match=match):
        HookedMiMoV2Flash.config_from_hf(raw)


def test_no_window_needed_without_sliding_layers():
    cfg = HookedMiMoV2Flash.config_from_hf(_raw(sliding_window=None, layer_types=["full_attention"] * 4))
    assert cfg.attention_windows == (None,) * 4


def test_a_window_of_sliding_window_size_plus_one():
    assert HookedMiMoV2Flash.config_from_hf(_raw(sliding_window_size=7)).attention_windows == (None, 8, 8, 8)


def test_value_views_are_the_scaled_projection(run):
    """W_V and b_V map the normed stream to hook_v, scale included, so OV is W_V @ W_O; they are new tensors."""
    model, _, _ = run
    attn = model.blocks[1].attn
    assert torch.equal(attn.W_V_grouped, attn._heads_in(attn.v_proj, 2) * 0.6)
    assert attn.W_V_grouped.data_ptr() != attn.v_proj.weight.data_ptr()
    assert math.isclose(model.OV[1][0].AB.norm().item(), (attn.W_V[0] @ attn.W_O[0]).norm().item(), rel_tol=1e-5)
