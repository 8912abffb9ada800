"""HookedExaoneMoe: LG's K-EXAONE (K-EXAONE-236B-A23B; model_type exaone_moe).

What is special about the family: dots.llm1's blocks (moelens.models.dots1: q/k-normed attention, sliding layers,
DeepSeek-V3's float32 sigmoid grouped router with correction bias, an ungated shared expert, dense first blocks)
with global layers that have no rotary at all: the sliding_attention layers turn queries and keys by the rotary
and attend within the last sliding_window positions, the full_attention layers attend everywhere without
positions (NoPE; QKNormNoRotaryAttention). layer_types absent: a layer is full where (index + 1) is a multiple of
sliding_window_pattern (4), else sliding. transformers' config needs an integer sliding_window (null is refused). Dense and mixture
blocks by mlp_layer_types, else the first first_k_dense_replace blocks dense. No attention biases.

The Hub's names (num_experts, num_shared_experts) are read; their DeepSeek spellings, which transformers'
ExaoneMoeConfig does not read, are refused. The correction bias is stored as the mixture block's
(mlp.e_score_correction_bias); transformers' module spelling (mlp.gate.e_score_correction_bias) loads too. Like
transformers, the model is the num_hidden_layers blocks: the checkpoint's multi-token-prediction module (mtp.*)
is not part of it, and loading passes over its keys.
"""

from __future__ import annotations

from moelens.config import HFConfig, common_fields, refuse_unread_fields
from moelens.models.components import SharedExpertMoe, SigmoidGroupedTopK
from moelens.models.components.qk_norm_attention import QKNormNoRotaryAttention, QKNormSlidingWindowAttention
from moelens.models.deepseek_v3 import deepseek_mixture_fields
from moelens.models.dots1 import HookedDots1, attention_windows, full_rotary
from moelens.models.glm4_moe import Glm4MoeConfig, attention_sites
from moelens.models.glm4_moe_lite import mlp_layer_types
from moelens.models.recipe import Dense, LayerSpec, Mixture, Recipe
from moelens.models.sites import Entry, decoder_site_map, dense_mlp, gated_mlp, router_references, routed_experts
from moelens.sitemap import Reference, SiteMap, Weight

SPELLINGS = {"num_experts": "n_routed_experts", "num_shared_experts": "n_shared_experts"}
# Present in K-EXAONE's config.json, unused by transformers' model: the routing rule's names (always sigmoid with
# the correction bias), attention_bias (its projections have none)
IGNORED_FIELDS = ("scoring_func", "topk_method", "attention_bias")


class HookedExaoneMoe(HookedDots1):
    model_type = "exaone_moe"

    @classmethod
    def recipe(cls, cfg: Glm4MoeConfig) -> Recipe:
        mixture, dense = Mixture(SharedExpertMoe, SigmoidGroupedTopK), Dense()
        layers = []
        for layer, is_moe in enumerate(cfg.moe_layers):
            # a sliding layer turns queries and keys by the rotary, a full one has no positions
            attention = QKNormSlidingWindowAttention if cfg.window(layer) is not None else QKNormNoRotaryAttention
            layers.append(LayerSpec(attention, mixture if is_moe else dense))
        return Recipe(tuple(layers))

    @classmethod
    def site_map(cls, cfg: Glm4MoeConfig) -> SiteMap:
        return decoder_site_map(cfg, _layer_sites, ("mtp.",))  # transformers skips the MTP module too

    # transformers' ExaoneMoeConfig defaults, for the fields config.json leaves out
    defaults = dict(
        hidden_size=4096, rms_norm_eps=1e-5, max_position_embeddings=2048, num_key_value_heads=32, rope_theta=10000.0,
        sliding_window=4096, sliding_window_pattern=4, first_k_dense_replace=1, n_routed_experts=64,
        num_experts_per_tok=8, n_shared_experts=1, moe_intermediate_size=1024, intermediate_size=16384, n_group=1,
        topk_group=1, routed_scaling_factor=2.5, norm_topk_prob=True,
    )

    @classmethod
    def config_from_hf(cls, raw: dict) -> Glm4MoeConfig:
        refuse_unread_fields(raw, SPELLINGS, "ExaoneMoeConfig")
        hf = HFConfig.with_spellings(raw, SPELLINGS)
        d = cls.defaults
        fields = common_fields(
            hf, rms_norm_eps=d["rms_norm_eps"], max_position_embeddings=d["max_position_embeddings"],
            num_key_value_heads=d["num_key_value_heads"], rope_theta=d["rope_theta"], hidden_size=d["hidden_size"],
        )
        full_rotary(fields)
        n_layers = fields["n_layers"]
        if "sliding_window" in raw and raw["sliding_window"] is None:
            raise ValueError("sliding_window = null: transformers' ExaoneMoeConfig needs the window's length (an "
                             "integer; 4096 where the field is absent)")
        windows = attention_windows(hf, raw, n_layers, d["sliding_window"], lambda window: _default_types(
            hf, n_layers, window, d["sliding_window_pattern"]))
        ignored = [f for f in IGNORED_FIELDS if f in raw]
        if "mlp_layer_types" in raw and raw["mlp_layer_types"] is not None:
            # transformers reads mlp_layer_types over first_k_dense_replace
            moe_layers = mlp_layer_types(hf, {k: v for k, v in raw.items() if k != "first_k_dense_replace"}, n_layers)
            ignored += [f for f in ("first_k_dense_replace",) if f in raw]
            first_dense = 0
        else:
            moe_layers, first_dense = None, hf.integer("first_k_dense_replace", d["first_k_dense_replace"], at_least=0)
        if "layer_types" in raw and raw["layer_types"] is not None and "sliding_window_pattern" in raw:
            ignored.append("sliding_window_pattern")
        mixture = {k: d[k] for k in (
            "n_routed_experts", "num_experts_per_tok", "n_shared_experts", "moe_intermediate_size",
            "intermediate_size", "n_group", "topk_group", "routed_scaling_factor", "norm_topk_prob",
        )}
        return Glm4MoeConfig(
            **fields,
            **deepseek_mixture_fields(hf, n_layers, first_dense, moe_layers=moe_layers, **mixture),
            family=cls.model_type,
            attention_windows=windows,
            qk_norm=True,
            fields_read=tuple(hf.label(f) for f in hf.read),
            fields_ignored=tuple(ignored),
        )


def _default_types(hf: HFConfig, n_layers: int, window: int | None, pattern_default: int) -> list[str]:
    """transformers' layer_types where config.json has none: full where (i + 1) % sliding_window_pattern == 0
    (transformers cannot derive them from a pattern string such as "LLLG": an integer is required here)."""
    pattern = hf.integer("sliding_window_pattern", pattern_default, at_least=1)
    return ["full_attention" if (i + 1) % pattern == 0 else "sliding_attention" for i in range(n_layers)]


def _layer_sites(cfg: Glm4MoeConfig, layer: int, src: str, dst: str) -> list[Entry]:
    entries = attention_sites(cfg, src, dst)
    if not cfg.moe_layers[layer]:
        return entries + dense_mlp(src, dst)
    mlp = f"{src}.mlp"
    return entries + [
        Weight(f"{dst}.mlp.router.weight", (f"{mlp}.gate.weight",)),
        # the Hub's spelling first (what save_pretrained writes), then transformers' module's
        Weight(f"{dst}.mlp.router.e_score_correction_bias",
               (f"{mlp}.e_score_correction_bias", f"{mlp}.gate.e_score_correction_bias")),
        routed_experts(cfg, (f"{mlp}.experts",), dst),
        *gated_mlp(f"{mlp}.shared_experts", f"{dst}.mlp.shared_expert"),
        *router_references(dst, f"{mlp}.gate"),
        Reference(f"{dst}.mlp.hook_routed_out", f"{mlp}.experts"),
        Reference(f"{dst}.mlp.shared_expert.hook_out", f"{mlp}.shared_experts"),
    ]
