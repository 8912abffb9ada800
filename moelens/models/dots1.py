"""HookedDots1: rednote's dots.llm1 (dots.llm1.base, dots.llm1.inst; model_type dots1).

What is special about the family: GLM-4.5's blocks (moelens.models.glm4_moe) with Qwen3's attention: a per-head
RMSNorm of queries and keys before the rotary, always, over the whole head (no partial rotary); q, k, v and o
biased where attention_bias; the first first_k_dense_replace blocks dense MLPs (intermediate_size wide), the rest
mixtures: DeepSeek-V3's float32 sigmoid router (SigmoidGroupedTopK: e_score_correction_bias added only to choose,
among the topk_group best of n_group groups, weights renormalised when norm_topk_prob, times
routed_scaling_factor) and an ungated shared expert moe_intermediate_size * n_shared_experts wide. Layers that
layer_types marks sliding_attention (by default those from max_window_layers on, where sliding_window is set;
none in the published checkpoints) attend within the last sliding_window positions.

transformers' defaults leave n_routed_experts, n_shared_experts and num_experts_per_tok unset (its model cannot be
built without them): config.json must give them.
"""

from __future__ import annotations

from collections.abc import Callable

from moelens.config import REQUIRED, HFConfig, common_fields
from moelens.models.components import SharedExpertMoe, SigmoidGroupedTopK
from moelens.models.components.qk_norm_attention import QKNormSlidingWindowAttention
from moelens.models.deepseek_v3 import deepseek_mixture_fields
from moelens.models.glm4_moe import Glm4MoeConfig, HookedGlm4Moe
from moelens.models.recipe import Recipe, decoder_recipe

LAYER_TYPES = ("full_attention", "sliding_attention")
# Present in dots.llm1's config.json, unused by transformers' Dots1 model: the routing rule's name (always sigmoid
# with the correction bias), the mixture's layer frequency (every block after the dense ones), training settings;
# use_sliding_window is not read (layer_types decides, from sliding_window and max_window_layers)
IGNORED_FIELDS = ("scoring_func", "topk_method", "moe_layer_freq", "aux_loss_alpha", "seq_aux", "use_sliding_window")


class HookedDots1(HookedGlm4Moe):
    model_type = "dots1"

    @classmethod
    def recipe(cls, cfg: Glm4MoeConfig) -> Recipe:
        return decoder_recipe(cfg, QKNormSlidingWindowAttention, SharedExpertMoe, SigmoidGroupedTopK)

    # transformers' Dots1Config defaults, for the fields config.json leaves out (REQUIRED ones: none there)
    defaults = dict(
        hidden_size=4608, rms_norm_eps=1e-6, max_position_embeddings=2048, num_key_value_heads=32, rope_theta=10000.0,
        intermediate_size=10944, moe_intermediate_size=1408, n_group=1, topk_group=1, routed_scaling_factor=1.0,
        first_k_dense_replace=0, norm_topk_prob=False, sliding_window=4096, max_window_layers=62,
    )
    spellings: dict[str, str] = {"num_local_experts": "n_routed_experts"}

    @classmethod
    def config_from_hf(cls, raw: dict) -> Glm4MoeConfig:
        hf = HFConfig.with_spellings(raw, cls.spellings)
        d = cls.defaults
        fields = common_fields(
            hf, rms_norm_eps=d["rms_norm_eps"], max_position_embeddings=d["max_position_embeddings"],
            num_key_value_heads=d["num_key_value_heads"], rope_theta=d["rope_theta"], hidden_size=d["hidden_size"],
        )
        full_rotary(fields)
        n_layers = fields["n_layers"]
        windows = attention_windows(hf, raw, n_layers, d["sliding_window"], lambda window: [
            "sliding_attention" if window is not None and i >= hf.integer("max_window_layers", d["max_window_layers"])
            else "full_attention" for i in range(n_layers)
        ])
        mixture = {k: d[k] for k in (
            "moe_intermediate_size", "intermediate_size", "n_group", "topk_group", "routed_scaling_factor",
            "norm_topk_prob",
        )}
        first_dense = hf.integer("first_k_dense_replace", d["first_k_dense_replace"], at_least=0)
        attention_bias = hf.flag("attention_bias", False)
        ignored = [f for f in IGNORED_FIELDS if f in raw]
        if "max_window_layers" in raw and "max_window_layers" not in hf.read:  # layer_types given: not read
            ignored.append("max_window_layers")
        return Glm4MoeConfig(
            **fields,
            **deepseek_mixture_fields(hf, n_layers, first_dense, n_shared_experts=REQUIRED, **mixture),
            family=cls.model_type,
            qkv_bias=attention_bias,
            o_bias=attention_bias,  # Qwen3's attention: o_proj biased with q, k, v
            attention_windows=windows,
            qk_norm=True,
            fields_read=tuple(hf.label(f) for f in hf.read),
            fields_ignored=tuple(ignored),
        )


def full_rotary(fields: dict) -> None:
    """Refuse a partial rotary: transformers' rotary here turns every dim of the head whatever
    partial_rotary_factor says, so a config asking for less describes another model."""
    rope = fields["rope"]
    if rope.partial_rotary_factor != 1.0:
        raise ValueError(
            f"partial_rotary_factor {rope.partial_rotary_factor}: this family's rotary turns the whole head "
            "(transformers does not read the field); expected 1 or none"
        )


def attention_windows(
    hf: HFConfig, raw: dict, n_layers: int, window_default: int | None,
    default_types: Callable[[int | None], list[str]],
) -> tuple[int | None, ...]:
    """Per layer, the sliding window its attention keeps (None: full attention): sliding_window on the layers
    layer_types marks sliding_attention; layer_types absent or null is the family's default,
    default_types(sliding_window), sliding_window null meaning none (not the default). A sliding layer without a window length is refused (transformers cannot build
    its mask)."""
    # null is no window (transformers keeps an explicit None); the default is for an absent field only
    null = "sliding_window" in raw and raw["sliding_window"] is None
    window = hf.integer("sliding_window", None if null else window_default, at_least=1)
    types = hf.opt("layer_types")
    if types is None:
        types = default_types(window)
    elif not isinstance(types, list) or len(types) != n_layers or not set(types) <= set(LAYER_TYPES):
        raise ValueError(
            f"layer_types must list {n_layers} entries (num_hidden_layers), each one of {list(LAYER_TYPES)}; "
            f"got {types!r}"
        )
    sliding = [kind == "sliding_attention" for kind in types]
    if any(sliding) and window is None:
        raise ValueError(
            f"layer_types marks layers {[i for i, s in enumerate(sliding) if s]} sliding_attention but sliding_window "
            "is null: give the window's length"
        )
    return tuple(window if s else None for s in sliding)
