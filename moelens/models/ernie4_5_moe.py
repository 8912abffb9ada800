"""HookedErnie4_5Moe: ERNIE-4.5-21B-A3B, ERNIE-4.5-300B-A47B (model_type ernie4_5_moe).

What is special about the family:
- the rotary turns each head's dims as interleaved pairs kept in place, in float32 from float32 cos / sin, cast
  back to the model dtype (transformers' ERNIE-4.5 apply_rotary_pos_emb), so hook_rot_q / hook_rot_k keep the
  checkpoint's order of the dims;
- the router (StatisticsBiasedSoftmaxTopK) is float32: a softmax over all experts, the choice on the scores plus
  the per-expert e_score_correction_bias (the checkpoint's moe_statics, stored [1, n_experts]), the weights the
  unbiased scores of the chosen experts divided by max(their sum, moe_norm_min), cast to the model dtype;
- the shared experts (moe_num_shared_experts of moe_intermediate_size, one MLP as wide as all of them) run first
  and are added ungated after the routed experts; none where moe_num_shared_experts is 0;
- the mixture blocks are every moe_layer_interval-th one between moe_layer_start_index and moe_layer_end_index
  (-1: the last), the others dense MLPs of intermediate_size;
- the embeddings are tied unless config.json says otherwise.
The multi-token-prediction layers a checkpoint may store (model.mtp_*) are not part of the model, as in
transformers. use_bias (biases on every projection, the head's included) is refused: no released ERNIE-4.5 MoE
sets it.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass

import torch
import torch.nn.functional as F
from jaxtyping import Float, Int

from moelens.config import HFConfig, MoeConfig, common_fields
from moelens.models.base import HookedTransformer
from moelens.models.components import Attention, SharedFirstMoe, SparseMoe
from moelens.models.components.rotary import Float32Rotary, apply_rotary_adjacent_pairs
from moelens.models.components.router import TopKRouter
from moelens.models.recipe import Recipe, decoder_recipe
from moelens.models.sites import Entry, attention_projections, decoder_site_map, dense_mlp, gated_mlp, router_references, routed_experts
from moelens.models.terms import ParamTerm
from moelens.sitemap import Layout, Reference, SiteMap, Weight

# transformers' Ernie4_5_MoeConfig defaults (ERNIE-4.5-21B-A3B's sizes)
DEFAULTS = dict(
    hidden_size=2560, intermediate_size=12288, num_key_value_heads=4, max_position_embeddings=131072, rms_norm_eps=1e-5,
    rope_theta=500000.0, moe_num_experts=64, moe_k=6, moe_intermediate_size=1536, moe_num_shared_experts=2,
    moe_layer_start_index=1, moe_layer_end_index=-1, moe_layer_interval=1, moe_norm_min=1e-12,
)
# transformers' attribute_map: config.json may spell these fields by the generic names
ALIASES = {"moe_num_experts": "num_experts", "moe_k": "num_experts_per_tok"}
# in ERNIE's config.json, unused by transformers' model (training and serving settings)
IGNORED_FIELDS = ("moe_capacity", "moe_gate", "moe_use_aux_free")


@dataclass(frozen=True)
class Ernie4_5MoeConfig(MoeConfig):
    """MoeConfig plus the floor of the router's renormalising sum (moe_norm_min)."""

    moe_norm_min: float = 1e-12

    def __post_init__(self) -> None:
        super().__post_init__()
        if not self.moe_norm_min >= 0:
            raise ValueError(f"moe_norm_min must be at least 0, got {self.moe_norm_min}")


class StatisticsBiasedSoftmaxTopK(TopKRouter):
    """ERNIE-4.5's router: float32 logits and softmax over all experts; the top-k of the scores plus
    e_score_correction_bias (hook_choice_scores); the weights the chosen experts' unbiased scores divided by
    max(their sum, moe_norm_min), cast to the model dtype."""

    float32_weight = True
    choice_bias = True
    weights_in_stream_dtype = True
    scoring = "softmax"

    @classmethod
    def param_terms(cls, cfg: MoeConfig) -> tuple[ParamTerm, ...]:
        bias = ParamTerm("e_score_correction_bias", (cfg.n_experts,), "routers", cls.float32_weight, buffer=True)
        return (*super().param_terms(cfg), bias)

    def __init__(self, cfg: Ernie4_5MoeConfig, top_k: int) -> None:
        super().__init__(cfg, top_k)
        self.norm_min = cfg.moe_norm_min
        self.register_buffer("e_score_correction_bias", torch.zeros(cfg.n_experts))

    def logits(self, x: Float[torch.Tensor, "... d_model"]) -> Float[torch.Tensor, "... n_experts"]:
        return F.linear(x.float(), self.weight.float())

    def scores(self, logits: torch.Tensor) -> Float[torch.Tensor, "... n_experts"]:
        return F.softmax(logits, dim=-1, dtype=torch.float32)

    def choice_scores(self, scores: torch.Tensor) -> torch.Tensor:
        return scores + self.e_score_correction_bias

    def choose(self, choice_scores: Float[torch.Tensor, "... n_experts"]) -> Int[torch.Tensor, "... top_k"]:
        return torch.topk(choice_scores, self.top_k, dim=-1).indices

    def weights(self, scores: torch.Tensor, indices: torch.Tensor, dtype: torch.dtype) -> Float[torch.Tensor, "... top_k"]:
        w = scores.gather(-1, indices)
        return (w / torch.clamp(w.sum(-1, keepdim=True), min=self.norm_min)).to(dtype)

    def extra_repr(self) -> str:
        return f"n_experts={self.n_experts}, top_k={self.top_k}, norm_min={self.norm_min}"


class AdjacentPairRotaryAttention(Attention):
    """Grouped-query attention whose rotary turns interleaved pairs in place, in float32 (ERNIE-4.5)."""

    def position(self, q, k, cos, sin):
        return apply_rotary_adjacent_pairs(q, cos, sin), apply_rotary_adjacent_pairs(k, cos, sin)


class UnitAxisDropped(Layout):
    """Stored [1, n] (ERNIE's moe_statics bias, one row for its single expert group), moelens's [n]."""

    def load(self, stored: torch.Tensor) -> torch.Tensor:
        return stored.reshape(stored.shape[1:])

    def stored_shape(self, shape: tuple[int, ...]) -> tuple[int, ...]:
        return (1, *shape)


class HookedErnie4_5Moe(HookedTransformer):
    model_type = "ernie4_5_moe"
    rotary_class = Float32Rotary

    @classmethod
    def recipe(cls, cfg: MoeConfig) -> Recipe:
        moe = SharedFirstMoe if cfg.d_shared else SparseMoe
        return decoder_recipe(cfg, AdjacentPairRotaryAttention, moe, StatisticsBiasedSoftmaxTopK)

    @classmethod
    def site_map(cls, cfg: MoeConfig) -> SiteMap:
        return decoder_site_map(cfg, _layer_sites, ignored_prefixes=("model.mtp_",))

    @classmethod
    def config_from_hf(cls, raw: dict) -> Ernie4_5MoeConfig:
        raw = _canonical_names(raw)
        hf = HFConfig(raw)
        d = DEFAULTS
        if hf.flag("use_bias", False):
            raise ValueError(
                "use_bias = true: ERNIE-4.5's biases on every projection (the MLPs' and the head's included) are not "
                "supported; no released ERNIE-4.5 MoE sets it"
            )
        fields = common_fields(
            hf, rms_norm_eps=d["rms_norm_eps"], max_position_embeddings=d["max_position_embeddings"],
            num_key_value_heads=d["num_key_value_heads"], hidden_size=d["hidden_size"], rope_theta=d["rope_theta"],
        )
        rope = fields["rope"]
        if rope.partial_rotary_factor != 1.0:
            raise ValueError(
                f"partial_rotary_factor = {rope.partial_rotary_factor}: transformers' ERNIE-4.5 turns every dim of "
                "a head, so only 1.0 is supported"
            )
        fields["rope"] = dataclasses.replace(rope, interleaved=True)
        fields["tie_word_embeddings"] = hf.flag("tie_word_embeddings", True)
        n_layers = fields["n_layers"]
        moe_layers = mixture_layers(hf, n_layers)
        any_moe = any(moe_layers)
        n_experts = hf.integer("moe_num_experts", d["moe_num_experts"], at_least=1) if any_moe else 0
        top_k = hf.integer("moe_k", d["moe_k"], at_least=1, at_most=n_experts) if any_moe else 0
        d_expert = hf.integer("moe_intermediate_size", d["moe_intermediate_size"], at_least=1) if any_moe else 0
        n_shared = hf.integer("moe_num_shared_experts", d["moe_num_shared_experts"], at_least=0) if any_moe else 0
        return Ernie4_5MoeConfig(
            **fields,
            family=cls.model_type,
            d_mlp=hf.integer("intermediate_size", d["intermediate_size"], at_least=1) if not all(moe_layers) else 0,
            moe_layers=moe_layers,
            n_experts=n_experts,
            top_k_per_layer=tuple(top_k if moe else 0 for moe in moe_layers),
            d_expert=d_expert,
            d_shared=n_shared * d_expert,
            norm_topk_prob=True,
            moe_norm_min=hf.number("moe_norm_min", d["moe_norm_min"], at_least=0) if any_moe else d["moe_norm_min"],
            fields_read=tuple(hf.read),
            fields_ignored=tuple(f for f in IGNORED_FIELDS if f in raw),
        )


def _canonical_names(raw: dict) -> dict:
    """config.json with transformers' attribute_map applied (num_experts -> moe_num_experts, num_experts_per_tok ->
    moe_k); both spellings with different values are refused, since transformers would keep one of them silently."""
    raw = dict(raw)
    for field, alias in ALIASES.items():
        if raw.get(alias) is None:
            raw.pop(alias, None)
            continue
        value = raw.pop(alias)
        if raw.get(field) is not None and raw[field] != value:
            raise ValueError(f"{field} = {raw[field]!r} and {alias} = {value!r} disagree (transformers reads {alias} as {field})")
        raw[field] = value
    return raw


def mixture_layers(hf: HFConfig, n_layers: int) -> tuple[bool, ...]:
    """transformers' rule: block i is a mixture when (i + 1) is a multiple of moe_layer_interval and
    moe_layer_start_index <= i <= moe_layer_end_index (-1: the last block)."""
    interval = hf.integer("moe_layer_interval", DEFAULTS["moe_layer_interval"], at_least=1)
    start = hf.integer("moe_layer_start_index", DEFAULTS["moe_layer_start_index"])
    end = hf.integer("moe_layer_end_index", DEFAULTS["moe_layer_end_index"])
    end = n_layers - 1 if end == -1 else end
    return tuple((i + 1) % interval == 0 and start <= i <= end for i in range(n_layers))


def _layer_sites(cfg: MoeConfig, layer: int, src: str, dst: str) -> list[Entry]:
    if not cfg.moe_layers[layer]:
        return attention_projections(cfg, src, dst) + dense_mlp(src, dst)
    gate = f"{src}.mlp.gate"
    # the Hub's spelling (which transformers' save_pretrained writes too), then transformers' module path
    bias_keys = (f"{src}.mlp.moe_statics.e_score_correction_bias", f"{gate}.moe_statics.e_score_correction_bias")
    entries: list[Entry] = attention_projections(cfg, src, dst) + [
        Weight(f"{dst}.mlp.router.weight", (f"{gate}.weight",)),
        Weight(f"{dst}.mlp.router.e_score_correction_bias", bias_keys, layout=UnitAxisDropped()),
        routed_experts(cfg, (f"{src}.mlp.experts",), dst),
        *router_references(dst, gate),
        Reference(f"{dst}.mlp.hook_choice_scores", f"{gate}.moe_statics"),
        Reference(f"{dst}.mlp.hook_routed_out", f"{src}.mlp.experts"),
    ]
    if cfg.d_shared:
        entries += [
            *gated_mlp(f"{src}.mlp.shared_experts", f"{dst}.mlp.shared_expert"),
            Reference(f"{dst}.mlp.shared_expert.hook_out", f"{src}.mlp.shared_experts"),
        ]
    return entries
