"""What is special about Hunyuan and Solar: config spellings, rotary variants, the Solar choice bias."""

import json
import math

import pytest
import torch
from safetensors.torch import load_file, save_file

import tiny
from moelens import CheckpointError, HookedTransformer
from moelens.verify import compare, load_reference


def test_solar_bias_changes_the_choice_for_many_tokens(family_models, tokens):
    model = family_models["solar_open"]
    _, cache = model.run_with_cache(tokens)
    router = model.blocks[0].mlp.router
    changed = []
    for layer in range(model.cfg.n_layers):
        scores = cache["router_scores", layer]
        unbiased = router.choose(scores).sort(-1).values
        changed.append((unbiased != cache["expert_indices", layer].sort(-1).values).any(-1).float().mean())
    assert min(changed) > 0.2, changed


def test_solar_choice_scores_move_the_choice_not_the_weights(family_models, tokens):
    model = family_models["solar_open"]
    _, clean = model.run_with_cache(tokens)
    banned = int(clean["expert_indices", 0].flatten().mode().values)  # the most used expert

    def ban(choice, hook):
        return choice.index_fill(-1, torch.tensor([banned]), float("-inf"))

    with model.hooks([("blocks.0.mlp.hook_choice_scores", ban)]):
        _, cache = model.run_with_cache(tokens)
    idx, w = cache["expert_indices", 0], cache["expert_weights", 0]
    assert not (idx == banned).any() and (clean["expert_indices", 0] == banned).any()
    torch.testing.assert_close(cache["router_scores", 0], clean["router_scores", 0], rtol=0, atol=0)
    # with norm_topk_prob false, a weight is the expert's own scaled sigmoid: those that stay are unchanged
    scores = clean["router_scores", 0] * model.cfg.routed_scaling_factor
    torch.testing.assert_close(w, scores.gather(-1, idx), rtol=0, atol=0)
    for b in range(idx.shape[0]):
        for p in range(idx.shape[1]):
            old = dict(zip(clean["expert_indices", 0][b, p].tolist(), clean["expert_weights", 0][b, p].tolist()))
            for e, weight in zip(idx[b, p].tolist(), w[b, p].tolist()):
                if e in old:
                    assert weight == old[e]


def _standard_to_hub_spelling(folder, family):
    config = json.loads((folder / "config.json").read_text())
    params = config.pop("rope_parameters")
    config["rope_theta"] = params.pop("rope_theta")
    kind = params.pop("rope_type")
    config["rope_scaling"] = {"type": kind, **params}
    if family == "hunyuan_v1_moe":  # Tencent's own config: attention_head_dim, no head_dim
        config["attention_head_dim"] = config.pop("head_dim")
    else:
        config["partial_rotary_factor"] = 1.0
    (folder / "config.json").write_text(json.dumps(config))


@pytest.mark.parametrize("family", ["hunyuan_v1_moe", "solar_open"])
def test_hub_config_spelling_loads_the_same_model(checkpoints, copy_checkpoint, family, tokens):
    hub = copy_checkpoint(family)
    _standard_to_hub_spelling(hub, family)
    model = HookedTransformer.from_pretrained(hub, progress=False)
    reference = load_reference(checkpoints[family, "base"])  # transformers needs its own spelling
    report = compare(model, reference, tokens)
    assert report.max_logit_diff <= 1e-5 and report.index_mismatches == 0


def test_hunyuan_alpha_stretches_the_rotary_base(family_models):
    model = family_models["hunyuan_v1_moe"]
    d = model.cfg.d_head
    base = 10000.0 * 1000.0 ** (d / (d - 2))
    expected = 1.0 / base ** (torch.arange(0, d, 2).float() / d)
    torch.testing.assert_close(model.rotary.inv_freq(torch.device("cpu")), expected)


def test_hunyuan_dynamic_rope_without_alpha_is_refused(copy_checkpoint):
    folder = copy_checkpoint("hunyuan_v1_moe")
    tiny.edit_config(folder, rope_parameters={"rope_type": "dynamic", "factor": 2.0, "rope_theta": 10000.0})
    with pytest.raises(CheckpointError, match="alpha"):
        HookedTransformer.from_pretrained(folder, progress=False)


def test_solar_yarn_matches_the_formula(family_models):
    """inv_freq and attention factor against YaRN written out by hand for this config."""
    model = family_models["solar_open"]
    rope = model.cfg.rope
    d, theta, factor, original = model.cfg.d_rot, rope.theta, rope.factor, rope.original_max_position_embeddings
    assert model.rotary.attention_scaling == pytest.approx(0.1 * math.log(factor) + 1)
    dims = lambda rot: d * math.log(original / (rot * 2 * math.pi)) / (2 * math.log(theta))  # noqa: E731
    low, high = max(math.floor(dims(32)), 0), min(math.ceil(dims(1)), d - 1)
    expected = []
    for i in range(d // 2):
        freq = theta ** (-2 * i / d)
        ramp = min(max((i - low) / (high - low), 0.0), 1.0)
        expected.append(freq / factor * ramp + freq * (1 - ramp))
    torch.testing.assert_close(model.rotary.inv_freq(torch.device("cpu")), torch.tensor(expected), rtol=1e-6, atol=0)


def test_partial_rotary_against_hand_written_rotation(copy_checkpoint, tokens):
    """partial_rotary_factor < 1 (transformers crashes on it): the first d_rot dims of each head rotate
    pair-wise (i, i + d_rot/2) by position * theta ** (-2i/d_rot); the rest pass through."""
    folder = copy_checkpoint("solar_open")
    tiny.edit_config(folder, rope_parameters={"rope_type": "default", "rope_theta": 500.0, "partial_rotary_factor": 0.5})
    model = HookedTransformer.from_pretrained(folder, progress=False)
    d_rot, half = model.cfg.d_rot, model.cfg.d_rot // 2
    assert d_rot == model.cfg.d_head // 2
    _, cache = model.run_with_cache(tokens)
    for q, rot in ((cache["q", 1], cache["rot_q", 1]), (cache["k", 1], cache["rot_k", 1])):
        expected = q.clone()
        for pos in range(q.shape[1]):
            for i in range(half):
                angle = pos * 500.0 ** (-2 * i / d_rot)
                c, s = math.cos(angle), math.sin(angle)
                x, y = q[:, pos, :, i], q[:, pos, :, i + half]
                expected[:, pos, :, i] = x * c - y * s
                expected[:, pos, :, i + half] = y * c + x * s
        torch.testing.assert_close(rot, expected, rtol=1e-5, atol=1e-5)
        assert torch.equal(rot[..., d_rot:], q[..., d_rot:])
    scores = torch.einsum("bqhd,bkhd->bhqk", cache["rot_q", 1], cache["rot_k", 1].repeat_interleave(2, dim=2))
    scores = scores * model.cfg.d_head**-0.5
    causal = torch.ones(tokens.shape[1], tokens.shape[1], dtype=torch.bool).tril()
    torch.testing.assert_close(cache["attn_scores", 1][..., causal], scores[..., causal], rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize(
    "family,key",
    [("hunyuan_v1_moe", "model.layers.1.mlp.gate.wg.weight"), ("hunyuan_v1_moe", "model.layers.0.self_attn.query_layernorm.weight"),
     ("solar_open", "model.layers.2.mlp.gate.e_score_correction_bias"), ("solar_open", "model.layers.0.mlp.shared_experts.up_proj.weight")],
)
def test_missing_family_tensor_is_named(copy_checkpoint, family, key):
    folder = copy_checkpoint(family)
    tensors = load_file(folder / "model.safetensors")
    del tensors[key]
    save_file(tensors, folder / "model.safetensors", metadata={"format": "pt"})
    with pytest.raises(CheckpointError, match=key.replace(".", r"\.")):
        HookedTransformer.from_pretrained(folder, progress=False)


@pytest.mark.parametrize("family,field", [("hunyuan_v1_moe", "moe_topk"), ("solar_open", "n_routed_experts"), ("solar_open", "moe_intermediate_size")])
def test_config_without_family_field_is_named(copy_checkpoint, family, field):
    folder = copy_checkpoint(family)
    tiny.edit_config(folder, **{field: None})
    with pytest.raises(CheckpointError, match=f"config.json.*{field}"):
        HookedTransformer.from_pretrained(folder, progress=False)


def test_moe_topk_list_of_wrong_length_is_refused(copy_checkpoint):
    folder = copy_checkpoint("hunyuan_v1_moe")
    tiny.edit_config(folder, moe_topk=[2, 2])
    with pytest.raises(CheckpointError, match="moe_topk has 2 entries"):
        HookedTransformer.from_pretrained(folder, progress=False)
