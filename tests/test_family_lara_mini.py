"""What only Lara Mini has: its config refusals, the fused in_proj read into four projections, and which attention
layers turn positions."""

from __future__ import annotations

import copy

import pytest

from moelens.models.lara_mini import HookedLaraMini, LaraNoRotaryAttention, LaraSlidingAttention
from moelens.sitemap import SplitWeight

RAW = {"hidden_size": 64, "num_attention_heads": 4, "num_hidden_layers": 5, "vocab_size": 96, "head_dim": 16,
       "linear_key_head_dim": 8, "linear_value_head_dim": 12, "linear_num_key_heads": 2, "linear_num_value_heads": 4,
       "num_experts": 8, "num_experts_per_tok": 3, "sliding_window": 5}


def config(**changes):
    raw = copy.deepcopy(RAW) | changes
    return HookedLaraMini.config_from_hf({k: v for k, v in raw.items() if v is not ...})


@pytest.mark.parametrize("changes,named", [
    (dict(sliding_window=None), "sliding_window = null"),
    (dict(rope_parameters={"rope_type": "default", "rope_theta": 1e4, "partial_rotary_factor": 0.5}), "partial_rotary_factor"),
    (dict(layer_types=["linear_attention"] * 4), "layer_types"),
    (dict(layer_types=["linear_attention", "local", "full_attention", "sliding_attention", "linear_attention"]), "layer_types"),
])
def test_bad_configs_are_refused_naming_the_field(changes, named):
    with pytest.raises(ValueError, match=named):
        config(**changes)


def test_default_layer_kinds_and_windows():
    cfg = config()
    assert cfg.layer_types == ("linear_attention", "sliding_attention", "linear_attention", "full_attention",
                               "sliding_attention")
    assert cfg.attention_windows == (None, 5, None, None, 5) and cfg.tie_word_embeddings
    mixers = [spec.mixer for spec in HookedLaraMini.recipe(cfg).layers]
    assert mixers[1] is LaraSlidingAttention and mixers[3] is LaraNoRotaryAttention


def test_fused_in_proj_rows_split_q_k_v_z_b_a():
    cfg = config()
    split = [w for w in HookedLaraMini.site_map(cfg).weights if isinstance(w, SplitWeight)]
    assert [w.keys for w in split] == [("model.layers.0.linear_attn.in_proj.weight",),
                                       ("model.layers.2.linear_attn.in_proj.weight",)]
    # q and k: 2 heads x 8, v and z: 4 heads x 12, b and a: one per value head
    assert [(p.param.rsplit(".", 2)[-2], p.rows) for p in split[0].parts] == [
        ("in_proj_qkv", 2 * 16 + 48), ("in_proj_z", 48), ("in_proj_b", 4), ("in_proj_a", 4)]
