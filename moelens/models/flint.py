"""HookedFlint: Recursive's Flint (model_type flint).

What is special about the family:
- attention with learned sinks on every layer (gpt-oss's SinkAttention: one logit per head joins each query's
  softmax, `hook_sink_scores`), sliding-window and full layers per `layer_types` (by default full on the first
  two layers, every fourth layer from layer 1 and the last one); a per-head q/k RMSNorm first on every layer;
  only the sliding layers turn queries and keys by the rotary, the full layers have none (NoPE);
- the scores and the softmax in float32 whatever the model's dtype (the pattern cast back to the values'), and
  the sinks kept float32, as transformers keeps them;
- the router: float32 logits from a float32 weight, sigmoid scores, the top-k of the scores without a bias, the
  chosen scores renormalised when norm_topk_prob, float32;
- routed experts plus a shared expert (shared_expert_intermediate_size wide) added ungated; the blocks in
  mlp_only_layers (by default the first two) and those decoder_sparse_step skips are dense MLPs;
- every norm applies its weight to the float32 normed input before the cast back (gpt-oss's order).

The checkpoints spell the sinks self_attn.softmax_offset (transformers' conversion mapping renames them to its
module's self_attn.sinks on load and back on save); both spellings are read.
"""

from __future__ import annotations

import dataclasses

import torch
import torch.nn.functional as F
from jaxtyping import Float, Int

from moelens.config import HFConfig, MoeConfig, common_fields, routed_fields
from moelens.models.base import HookedTransformer
from moelens.models.components import SharedExpertMoe, TopKRouter
from moelens.models.components.norm import CastAfterWeightRMSNorm
from moelens.models.gpt_oss import SinkAttention
from moelens.models.qwen2_moe import mixture_layers
from moelens.models.recipe import Recipe, decoder_recipe
from moelens.models.sites import (
    Entry, attention_projections, decoder_site_map, dense_mlp, gated_mlp, router_references, routed_experts,
)
from moelens.models.terms import ParamTerm, under
from moelens.sitemap import Reference, SiteMap, Weight

LAYER_TYPES = ("sliding_attention", "full_attention")
# transformers' FlintConfig defaults (Flint's sizes)
DEFAULTS = dict(
    hidden_size=2048, intermediate_size=6144, num_key_value_heads=4, max_position_embeddings=262144, rms_norm_eps=1e-6, head_dim=128,
    sliding_window=513, moe_intermediate_size=512, shared_expert_intermediate_size=1024, num_experts_per_tok=6,
    num_experts=256, mlp_only_layers=[0, 1],
)
# present in transformers' config.json, unused by its model's forward
IGNORED_FIELDS = ("attention_dropout", "router_aux_loss_coef")


def default_layer_types(n_layers: int) -> list[str]:
    """transformers' default: full on the first two layers, every fourth from layer 1 and the last; sliding elsewhere."""
    return ["full_attention" if i < 2 or i % 4 == 1 or i == n_layers - 1 else "sliding_attention" for i in range(n_layers)]


class FlintAttention(SinkAttention):
    """Sink attention after a per-head q/k RMSNorm (weight applied before the cast back); the rotary only on a
    sliding layer. hook_q / hook_k: the projections before the norm; hook_rot_q / hook_rot_k: what enters the
    scores (normed, and turned on a sliding layer). Scores and softmax float32, the sinks kept float32."""

    float32_scores = True
    float32_params = ("sinks",)

    @classmethod
    def param_terms(cls, cfg: MoeConfig, layer: int) -> tuple[ParamTerm, ...]:
        norm = CastAfterWeightRMSNorm.param_terms(cfg.d_head)
        terms = tuple(dataclasses.replace(t, float32=True) if t.name == "sinks" else t
                      for t in super().param_terms(cfg, layer))
        return terms + under("q_norm", norm) + under("k_norm", norm)

    def __init__(self, cfg: MoeConfig, layer: int) -> None:
        super().__init__(cfg, layer)
        self.rotary = self.sliding_window is not None
        self.q_norm = CastAfterWeightRMSNorm(cfg.d_head, cfg.norm_eps, hooked=False)
        self.k_norm = CastAfterWeightRMSNorm(cfg.d_head, cfg.norm_eps, hooked=False)

    def position(self, q, k, cos, sin):
        q, k = self.q_norm(q), self.k_norm(k)
        return super().position(q, k, cos, sin) if self.rotary else (q, k)

    def extra_repr(self) -> str:
        return f"{super().extra_repr()}, rotary={self.rotary}"


class Float32SigmoidTopK(TopKRouter):
    """Flint's rule: float32 logits from a float32 weight, sigmoid scores, the top-k of the scores (no bias); the
    weights the chosen scores divided by their sum when norm_topk_prob (the plain sum, no epsilon), float32."""

    float32_weight = True
    scoring = "sigmoid"
    scores_form = probs_form = "sigmoid"

    def logits(self, x: Float[torch.Tensor, "... d_model"]) -> Float[torch.Tensor, "... n_experts"]:
        return F.linear(x.float(), self.weight.float())

    def scores(self, logits: torch.Tensor) -> Float[torch.Tensor, "... n_experts"]:
        return logits.float().sigmoid()

    def choose(self, choice_scores: Float[torch.Tensor, "... n_experts"]) -> Int[torch.Tensor, "... top_k"]:
        return torch.topk(choice_scores, self.top_k, dim=-1).indices

    def weights(self, scores: torch.Tensor, indices: torch.Tensor, logits_dtype: torch.dtype) -> torch.Tensor:
        w = scores.gather(-1, indices)
        return w / w.sum(-1, keepdim=True) if self.norm_topk_prob else w


class HookedFlint(HookedTransformer):
    model_type = "flint"

    @classmethod
    def recipe(cls, cfg: MoeConfig) -> Recipe:
        return decoder_recipe(cfg, FlintAttention, SharedExpertMoe, Float32SigmoidTopK, norm=CastAfterWeightRMSNorm)

    @classmethod
    def site_map(cls, cfg: MoeConfig) -> SiteMap:
        return decoder_site_map(cfg, _layer_sites)

    @classmethod
    def config_from_hf(cls, raw: dict) -> MoeConfig:
        d = DEFAULTS
        if raw.get("mlp_only_layers") is None:  # absent or null: transformers' default, the first two layers dense
            raw = {**raw, "mlp_only_layers": d["mlp_only_layers"]}
        hf = HFConfig(raw)
        fields = common_fields(
            hf, rms_norm_eps=d["rms_norm_eps"], max_position_embeddings=d["max_position_embeddings"],
            num_key_value_heads=d["num_key_value_heads"], hidden_size=d["hidden_size"],
            d_head=hf.integer("head_dim", d["head_dim"], at_least=1),
        )
        if fields["rope"].partial_rotary_factor != 1.0:  # transformers' Flint rotary turns every dim of a head
            raise ValueError(f"partial_rotary_factor = {fields['rope'].partial_rotary_factor}: Flint turns every dim "
                             "of a head (transformers does not read it), so only 1.0 is supported")
        n_layers = fields["n_layers"]
        layer_types = hf.opt("layer_types")
        if layer_types is None:
            layer_types = default_layer_types(n_layers)
        if not isinstance(layer_types, list) or len(layer_types) != n_layers or not set(layer_types) <= set(LAYER_TYPES):
            raise ValueError(f"layer_types must list {n_layers} entries (num_hidden_layers), each one of "
                             f"{list(LAYER_TYPES)}; got {layer_types!r}")
        if "sliding_window" in raw and raw["sliding_window"] is None:  # transformers' FlintConfig refuses it too
            raise ValueError("sliding_window = null: transformers' Flint needs an integer window for its sliding "
                             "layers (its default where absent: 513)")
        window = hf.integer("sliding_window", d["sliding_window"], at_least=1)
        n_experts = hf.integer("num_experts", d["num_experts"], at_least=0)
        moe_layers = mixture_layers(hf, n_layers, n_experts)
        any_moe = any(moe_layers)
        d_expert = hf.integer("moe_intermediate_size", d["moe_intermediate_size"], at_least=1) if any_moe else 0
        bias = hf.flag("attention_bias", False)
        return MoeConfig(
            **fields,
            **routed_fields(hf, moe_layers, n_experts, d_expert, num_experts_per_tok=d["num_experts_per_tok"]),
            family=cls.model_type,
            qkv_bias=bias,
            o_bias=bias,
            d_mlp=(hf.integer("intermediate_size", 0, at_least=0) if all(moe_layers)  # no dense block: not needed
                   else hf.integer("intermediate_size", d["intermediate_size"], at_least=1)),
            d_shared=(hf.integer("shared_expert_intermediate_size", d["shared_expert_intermediate_size"], at_least=1)
                      if any_moe else 0),
            norm_topk_prob=hf.flag("norm_topk_prob", True),
            attention_windows=tuple(window if kind == "sliding_attention" else None for kind in layer_types),
            fields_read=tuple(hf.read),
            fields_ignored=tuple(f for f in IGNORED_FIELDS if f in raw),
        )


def _layer_sites(cfg: MoeConfig, layer: int, src: str, dst: str) -> list[Entry]:
    attn, mlp = f"{src}.self_attn", f"{src}.mlp"
    # q_norm / k_norm's outputs have no moelens hook (hook_q / hook_k are the projections, as q_proj / k_proj's)
    entries = attention_projections(cfg, src, dst) + [
        Weight(f"{dst}.attn.q_norm.weight", (f"{attn}.q_norm.weight",)),
        Weight(f"{dst}.attn.k_norm.weight", (f"{attn}.k_norm.weight",)),
        # the checkpoints' name (transformers saves it too), then that of transformers' module, which its conversion
        # mapping renames it to
        Weight(f"{dst}.attn.sinks", (f"{attn}.softmax_offset", f"{attn}.sinks")),
        Reference(f"{dst}.attn.hook_z", f"{attn}.o_proj", "in"),
    ]
    if not cfg.moe_layers[layer]:
        return entries + dense_mlp(src, dst)
    return entries + [
        Weight(f"{dst}.mlp.router.weight", (f"{mlp}.gate.weight",)),
        routed_experts(cfg, (f"{mlp}.experts",), dst),
        *gated_mlp(f"{mlp}.shared_expert", f"{dst}.mlp.shared_expert"),
        *router_references(dst, f"{mlp}.gate"),
        Reference(f"{dst}.mlp.hook_routed_out", f"{mlp}.experts"),
        Reference(f"{dst}.mlp.shared_expert.hook_out", f"{mlp}.shared_expert"),
    ]
