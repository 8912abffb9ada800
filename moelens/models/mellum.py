"""HookedMellum: JetBrains' Mellum 2 (model_type mellum).

What is special about the family: Qwen3-MoE's blocks (per-head q/k RMSNorm before the rotary, a softmax router
renormalised where norm_topk_prob, no shared expert) on sliding-window and full layers (layer_types; default all
full), each layer type with rotary settings of its own: rope_parameters is keyed by layer type
({"full_attention": {...}, "sliding_attention": {...}}, by default rope_theta 500000 and 10000), so each attention
turns positions with its own type's tables (LayerTypeRotaryAttention). Dense blocks (intermediate_size wide)
where mlp_layer_types says "dense" (default all mixtures). A per-type partial_rotary_factor other than 1 is
refused: transformers' Mellum rotates the whole head with the narrower tables and cannot run it. The checkpoints'
multi-token-prediction layer (mtp.*) is not part of the model, as in transformers.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass

from moelens.config import HFConfig, MoeConfig, RopeConfig, common_fields, routed_fields
from moelens.models.base import HookedTransformer
from moelens.models.components import SoftmaxTopK, SparseMoe
from moelens.models.components.qk_norm_attention import QKNormSlidingWindowAttention
from moelens.models.components.rotary import Rotary
from moelens.models.recipe import Recipe, decoder_recipe
from moelens.models.qwen3_moe import qk_norm_layer_sites
from moelens.models.sites import decoder_site_map
from moelens.sitemap import SiteMap

LAYER_TYPES = ("full_attention", "sliding_attention")
MLP_LAYER_TYPES = {"dense": False, "sparse": True}
# transformers' MellumConfig defaults (Mellum2-12B-A2.5B's sizes)
DEFAULTS = dict(hidden_size=2304, intermediate_size=7168, num_key_value_heads=4, max_position_embeddings=131072,
                rms_norm_eps=1e-6, head_dim=128, sliding_window=1024, moe_intermediate_size=896, num_experts_per_tok=8,
                num_experts=64)
DEFAULT_THETA = {"full_attention": 500000.0, "sliding_attention": 10000.0}
# present in transformers' config.json, unused by its model
IGNORED_FIELDS = ("attention_dropout", "router_aux_loss_coef", "num_nextn_predict_layers", "num_mtp_layers",
                  "mtp_layer_types", "mtp_mlp_layer_types")


@dataclass(frozen=True)
class MellumConfig(MoeConfig):
    """MoeConfig plus each layer's rotary (its layer type's); cfg.rope is the first layer's."""

    layer_ropes: tuple[RopeConfig, ...] = ()

    def __post_init__(self) -> None:
        super().__post_init__()
        if len(self.layer_ropes) != self.n_layers:
            raise ValueError(f"layer_ropes ({len(self.layer_ropes)}) needs one entry per layer ({self.n_layers})")


class LayerTypeRotaryAttention(QKNormSlidingWindowAttention):
    """QKNormSlidingWindowAttention whose rotary is its layer's own (cfg.layer_ropes[layer]), computed from the
    positions of its inputs rather than the model's one table."""

    def __init__(self, cfg: MellumConfig, layer: int) -> None:
        super().__init__(cfg, layer)
        self.layer_rotary = Rotary(dataclasses.replace(cfg, rope=cfg.layer_ropes[layer]))

    def position_at(self, q, k, inputs):
        cos, sin = self.layer_rotary(inputs.positions, q.dtype)
        return self.position(q, k, cos, sin)


class HookedMellum(HookedTransformer):
    model_type = "mellum"

    @classmethod
    def recipe(cls, cfg: MoeConfig) -> Recipe:
        return decoder_recipe(cfg, LayerTypeRotaryAttention, SparseMoe, SoftmaxTopK)

    @classmethod
    def site_map(cls, cfg: MoeConfig) -> SiteMap:
        return decoder_site_map(cfg, qk_norm_layer_sites, ignored_prefixes=("mtp.",))

    @classmethod
    def config_from_hf(cls, raw: dict) -> MellumConfig:
        hf = HFConfig.with_spellings(raw, {"num_experts": "num_local_experts"})
        d = DEFAULTS
        n_layers = hf.integer("num_hidden_layers", at_least=1)
        types = _layer_types(hf, "layer_types", n_layers, LAYER_TYPES, ["full_attention"] * n_layers)
        ropes = _type_ropes(hf, sorted(set(types)))
        fields = common_fields(
            hf, rms_norm_eps=d["rms_norm_eps"], max_position_embeddings=d["max_position_embeddings"],
            num_key_value_heads=d["num_key_value_heads"], hidden_size=d["hidden_size"],
            d_head=hf.integer("head_dim", d["head_dim"], at_least=1), rope=ropes[types[0]],
        )
        if "sliding_window" in raw and raw["sliding_window"] is None and "sliding_attention" in types:
            raise ValueError("sliding_window = null but layer_types has sliding_attention layers: they need a window")
        window = hf.integer("sliding_window", d["sliding_window"], at_least=1) if "sliding_attention" in types else None
        mlp_types = _layer_types(hf, "mlp_layer_types", n_layers, tuple(MLP_LAYER_TYPES), ["sparse"] * n_layers)
        moe_layers = tuple(MLP_LAYER_TYPES[t] for t in mlp_types)
        if not any(moe_layers):
            raise ValueError("mlp_layer_types makes every block a dense MLP, leaving no mixture block")
        n_experts = hf.integer("num_local_experts", d["num_experts"], at_least=1)
        bias = hf.flag("attention_bias", False)
        return MellumConfig(
            **fields,
            **routed_fields(hf, moe_layers, n_experts, hf.integer("moe_intermediate_size", d["moe_intermediate_size"],
                            at_least=1), num_experts_per_tok=d["num_experts_per_tok"]),
            family=cls.model_type,
            qkv_bias=bias,
            o_bias=bias,
            d_mlp=hf.integer("intermediate_size", d["intermediate_size"], at_least=1) if not all(moe_layers) else 0,
            norm_topk_prob=hf.flag("norm_topk_prob", True),
            attention_windows=tuple(window if t == "sliding_attention" else None for t in types),
            layer_ropes=tuple(ropes[t] for t in types),
            fields_read=tuple(hf.label(f) for f in hf.read),
            fields_ignored=tuple(f for f in IGNORED_FIELDS if raw.get(f) is not None),
        )


def _layer_types(hf: HFConfig, name: str, n_layers: int, allowed: tuple[str, ...], default: list[str]) -> list[str]:
    types = hf.opt(name)
    if types is None:
        return default
    if not isinstance(types, list) or len(types) != n_layers or not set(types) <= set(allowed):
        raise ValueError(f"{name} must list {n_layers} entries (num_hidden_layers), each one of {list(allowed)}; "
                         f"got {types!r}")
    return types


def _type_ropes(hf: HFConfig, types: list[str]) -> dict[str, RopeConfig]:
    """Each layer type's rotary from rope_parameters[type] (transformers' defaults where rope_parameters is absent)."""
    params = hf.opt("rope_parameters")
    if params is None:
        params = {t: {"rope_type": "default", "rope_theta": theta} for t, theta in DEFAULT_THETA.items()}
    if not isinstance(params, dict) or not set(types) <= set(params) or not all(isinstance(params[t], dict) for t in types):
        raise ValueError(f"rope_parameters must hold an object per layer type ({types}), as {{\"full_attention\": "
                         f"{{...}}, \"sliding_attention\": {{...}}}}; got {_shape(params)}")
    ropes = {}
    for t in types:
        rope = HFConfig({"rope_parameters": params[t], "max_position_embeddings": hf.opt("max_position_embeddings")}
                        ).rope(theta=DEFAULT_THETA[t])
        if rope.partial_rotary_factor != 1.0:
            raise ValueError(f"rope_parameters.{t}.partial_rotary_factor = {rope.partial_rotary_factor}: transformers' "
                             "Mellum rotates every dim of a head with tables that narrow, and cannot run it; only 1.0")
        ropes[t] = rope
    return ropes


def _shape(value) -> str:
    """What a rope_parameters value is, briefly (its keys, not a whole nested config)."""
    return f"an object with keys {sorted(value)[:6]}" if isinstance(value, dict) else type(value).__name__
