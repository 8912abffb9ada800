"""GraniteMoeSWA (HookedGraniteMoeSWA): what differs from granitemoeshared. The generic suites compare every site
with transformers; here: the sink applied to each head's output after the values, by hand; the sliding window on
the layers layer_types names; each layer's rotary base (none where layer_rope_theta is 0), by hand; the config
refusals."""

import copy
import math

import pytest
import torch
import tiny_granitemoe_swa
from family_harness import build_checkpoints, config_json, stored_keys, tokens

from moelens import HookedTransformer
from moelens.models.granitemoe_swa import GraniteSinkAttention, HookedGraniteMoeSWA

WINDOW = 5  # the tiny configs' sliding_window


@pytest.fixture(scope="module")
def ckpts(tmp_path_factory):
    wanted = {k: v for k, v in tiny_granitemoe_swa.VARIANTS.items() if k[1] in ("base", "layer_rope")}
    return build_checkpoints(tmp_path_factory, "granitemoe_swa", wanted)


def _run(folder):
    model = HookedTransformer.from_pretrained(folder, progress=False)
    with torch.no_grad():
        logits, cache = model.run_with_cache(tokens(shape=(2, 12)))
    return model, logits, cache


@pytest.fixture(scope="module")
def run(ckpts):
    return _run(ckpts["base"])


@pytest.fixture(scope="module")
def run_layer_rope(ckpts):
    return _run(ckpts["layer_rope"])


def test_variants_are_what_they_claim(ckpts):
    keys = stored_keys(ckpts["base"])
    assert "model.layers.0.self_attn.sinks" in keys and "model.layers.0.block_sparse_moe.experts.gate_up_proj" in keys
    assert "model.layers.0.shared_mlp.input_linear.weight" in keys
    base = config_json(ckpts["base"])
    # transformers' defaults written out: full attention on layer 0 (every fourth), the global base everywhere
    assert base["layer_types"] == ["full_attention"] + ["sliding_attention"] * 3
    assert base["layer_rope_theta"] == [10000.0] * 4
    model = HookedTransformer.from_pretrained(ckpts["base"], progress=False)
    assert model.cfg.attention_windows == (None, WINDOW, WINDOW, WINDOW)
    assert all(type(b.attn) is GraniteSinkAttention and b.attn.layer_rotary is None for b in model.blocks)
    assert all(not torch.equal(b.attn.sinks, torch.zeros_like(b.attn.sinks)) for b in model.blocks)
    assert config_json(ckpts["layer_rope"])["layer_rope_theta"] == [0, 10000.0, 500.0, 0]


def test_sink_scales_each_heads_output(run):
    """The pattern is the plain softmax over the keys (rows sum to 1); the head's output is pattern @ v times
    sigmoid(logsumexp(scores) - sink), which equals attention with the sink as one more key."""
    model, _, cache = run
    group = model.cfg.n_heads // model.cfg.n_kv_heads
    for l, block in enumerate(model.blocks):
        scores, pattern = cache["attn_scores", l], cache["pattern", l]
        torch.testing.assert_close(pattern.sum(-1), torch.ones_like(pattern.sum(-1)), rtol=0, atol=1e-6)
        sinks = block.attn.sinks.detach()
        scale = torch.sigmoid(torch.logsumexp(scores, -1) - sinks[:, None])
        torch.testing.assert_close(cache[f"blocks.{l}.attn.hook_sink_scale"][..., 0], scale, rtol=0, atol=1e-6)
        v = cache["v", l].repeat_interleave(group, dim=2)  # [batch key head d_head]
        by_hand = torch.einsum("bhqk,bkhd->bqhd", pattern, v) * scale.transpose(1, 2)[..., None]
        torch.testing.assert_close(cache["z", l], by_hand, rtol=0, atol=1e-5)
        # the same thing as a softmax with the sink as an extra key, its column dropped
        joined = torch.cat([scores, sinks.view(1, -1, 1, 1).expand(*scores.shape[:3], 1)], -1).softmax(-1)[..., :-1]
        torch.testing.assert_close(pattern * scale[..., None], joined, rtol=0, atol=1e-6)


def test_a_very_low_sink_leaves_plain_attention(ckpts):
    """With every sink far below the scores, the scale is 1 and the head's output is pattern @ v alone: the sink
    is the only thing between the two."""
    model, _, cache = _run(ckpts["base"])
    with torch.no_grad():
        for block in model.blocks:
            block.attn.sinks.fill_(-1e4)
        _, low = model.run_with_cache(tokens(shape=(2, 12)))
    group = model.cfg.n_heads // model.cfg.n_kv_heads
    for l in range(model.cfg.n_layers):
        assert torch.equal(low[f"blocks.{l}.attn.hook_sink_scale"], torch.ones_like(low[f"blocks.{l}.attn.hook_sink_scale"]))
        v = low["v", l].repeat_interleave(group, dim=2)
        torch.testing.assert_close(low["z", l], torch.einsum("bhqk,bkhd->bqhd", low["pattern", l], v), rtol=0, atol=1e-5)
        assert not torch.allclose(low["z", l], cache["z", l], atol=1e-3)


def test_sliding_layers_see_the_window_only(run):
    model, _, cache = run
    n = cache["pattern", 0].shape[-1]
    query, key = torch.arange(n)[:, None], torch.arange(n)[None, :]
    outside = key <= query - WINDOW
    for l in range(model.cfg.n_layers):
        pattern = cache["pattern", l]
        if model.cfg.attention_windows[l] is None:  # full attention: the far keys have weight
            assert (pattern[..., outside] > 0).all()
        else:
            assert torch.equal(pattern[..., outside], torch.zeros_like(pattern[..., outside]))


def _rotated(x, positions, theta):
    """x [batch pos head d] rotated by hand at base theta (halves rotated, as transformers' rotate_half)."""
    d = x.shape[-1]
    inv_freq = 1.0 / theta ** (torch.arange(0, d, 2, dtype=torch.float64) / d)
    angles = positions.double()[..., None] * inv_freq
    emb = torch.cat([angles, angles], -1)[:, :, None, :]
    x1, x2 = x[..., : d // 2], x[..., d // 2:]
    return (x.double() * emb.cos() + torch.cat([-x2, x1], -1).double() * emb.sin()).float()


def test_each_layer_rotates_at_its_own_base(run_layer_rope):
    """layer_rope_theta [0, 10000, 500, 0]: layers 0 and 3 keep q and k as projected, 1 and 2 rotate at their base."""
    model, _, cache = run_layer_rope
    positions = torch.arange(12).expand(2, 12)
    for l, theta in enumerate([0, 10000.0, 500.0, 0]):
        assert model.blocks[l].attn.nope == (theta == 0)
        for name in ("q", "k"):
            x, rot = cache[name, l], cache[f"blocks.{l}.attn.hook_rot_{name}"]
            want = x if theta == 0 else _rotated(x, positions, theta)
            torch.testing.assert_close(rot, want, rtol=0, atol=1e-5)
    assert model.cfg.attention_windows == (WINDOW, None, WINDOW, None)


def _raw(**changes):
    raw = copy.deepcopy(tiny_granitemoe_swa.granitemoe_swa_config().to_dict())
    raw.update(changes)
    return raw


@pytest.mark.parametrize("changes,match", [
    (dict(sliding_window=None), "sliding_window = null"),
    (dict(layer_types=["full_attention"] * 3), "layer_types must list 4"),
    (dict(layer_types=["full_attention", "chunked_attention"] * 2), "layer_types must list 4"),
    (dict(layer_rope_theta=[10000.0] * 3), "layer_rope_theta must list 4"),
    (dict(layer_rope_theta=[10000.0, -1, 0, 0]), "layer_rope_theta must list 4"),
    (dict(layer_rope_theta=[10000.0, math.inf, 0, 0]), "layer_rope_theta must list 4"),
])
def test_bad_layer_fields_are_named(changes, match):
    with pytest.raises(ValueError, match=match):
        HookedGraniteMoeSWA.config_from_hf(_raw(**changes))


def test_no_window_needed_without_sliding_layers():
    cfg = HookedGraniteMoeSWA.config_from_hf(_raw(sliding_window=None, layer_types=["full_attention"] * 4))
    assert cfg.attention_windows == (None,) * 4
