"""HookedKolibri1: Aleph Alpha's Kolibri 1 (model_type kolibri1).

What is special about the family:
- attention with per-head q/k RMSNorm before the rotary, on sliding-window and full layers (layer_types; by
  default every fifth layer full); only the sliding layers turn positions, the full layers have no rotary
  (QKNormNoRotaryAttention). A null sliding_window is refused: transformers' model cannot run it;
- sandwich norms (SandwichBlock): each sublayer's output is RMS-normed before the add, post_self_attn_layernorm
  (blocks.L.ln1_post) and post_mlp_layernorm (blocks.L.ln2_post), beside the usual pre-norms;
- a mixture on every layer: routed experts, then a shared expert (shared_expert_intermediate_size wide) added
  ungated; the router (BiasedLogitsSigmoidTopK) chooses on float32 logits + e_score_correction_bias (the bias added
  to the logits, not to sigmoid scores) and weighs each chosen expert by the sigmoid of its logit, renormalised
  when norm_topk_prob, float32.

The checkpoints spell three tensors otherwise than transformers' modules (its conversion mapping renames them on
load and back on save): moe.router.expert_bias (the correction bias), post_attn_norm and post_ffn_norm; both
spellings are read.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from jaxtyping import Float, Int

from moelens.config import HFConfig, MoeConfig, common_fields, routed_fields
from moelens.models.base import HookedTransformer
from moelens.models.components import SharedExpertMoe
from moelens.models.components.qk_norm_attention import QKNormNoRotaryAttention, QKNormSlidingWindowAttention
from moelens.models.components.router import TopKRouter
from moelens.models.components.sandwich_block import SandwichBlock
from moelens.models.recipe import LayerSpec, Mixture, Recipe
from moelens.models.sites import Entry, attention_projections, decoder_site_map, gated_mlp, router_references, routed_experts
from moelens.models.terms import ParamTerm
from moelens.sitemap import Reference, SiteMap, Weight

LAYER_TYPES = ("sliding_attention", "full_attention")
# transformers' Kolibri1Config defaults (Kolibri 1's sizes)
DEFAULTS = dict(
    hidden_size=2560, num_key_value_heads=4, max_position_embeddings=262144, rms_norm_eps=1e-6, head_dim=128,
    sliding_window=513, moe_intermediate_size=512, num_experts_per_tok=6, num_experts=384,
    shared_expert_intermediate_size=512,
)
# present in transformers' config.json, unused by its model
IGNORED_FIELDS = ("attention_dropout", "router_aux_loss_coef")


class BiasedLogitsSigmoidTopK(TopKRouter):
    """Kolibri 1's rule: float32 logits (from the weight in the model's dtype); the choice is the top-k of logits +
    e_score_correction_bias (a buffer kept float32) over all experts; each chosen expert's weight is the sigmoid of its (unbiased) logit, divided by the
    chosen ones' sum when norm_topk_prob (the plain sum, no epsilon), kept float32, so that in a bfloat16 model the
    expert outputs are scaled by float32 weights, as in transformers."""

    choice_bias = True
    float32_buffers = ("e_score_correction_bias",)
    scoring = "top-k of biased logits, sigmoid of the chosen"
    scores_form = "top_k_logits_sigmoid"
    probs_form = "sigmoid"

    @classmethod
    def param_terms(cls, cfg: MoeConfig) -> tuple[ParamTerm, ...]:
        bias = ParamTerm("e_score_correction_bias", (cfg.n_experts,), "routers", True, buffer=True)
        return (*super().param_terms(cfg), bias)

    def __init__(self, cfg: MoeConfig, top_k: int) -> None:
        super().__init__(cfg, top_k)
        self.register_buffer("e_score_correction_bias", torch.zeros(cfg.n_experts))

    def logits(self, x: Float[torch.Tensor, "... d_model"]) -> Float[torch.Tensor, "... n_experts"]:
        return F.linear(x.float(), self.weight.float())

    def scores(self, logits: torch.Tensor) -> Float[torch.Tensor, "... n_experts"]:
        return logits.clone()  # its own tensor: an in-place edit of the scores must not reach the cached logits

    def choice_scores(self, scores: torch.Tensor) -> torch.Tensor:
        return scores + self.e_score_correction_bias

    def choose(self, choice_scores: Float[torch.Tensor, "... n_experts"]) -> Int[torch.Tensor, "... top_k"]:
        return torch.topk(choice_scores, self.top_k, dim=-1).indices

    def weights(self, scores: torch.Tensor, indices: torch.Tensor, logits_dtype: torch.dtype) -> torch.Tensor:
        w = scores.gather(-1, indices).sigmoid()
        return w / w.sum(-1, keepdim=True) if self.norm_topk_prob else w

    def probabilities(self, scores: Float[torch.Tensor, "... n_experts"]) -> Float[torch.Tensor, "... n_experts"]:
        """Every expert's sigmoid, float32, rescaled to sum to one (for the analyses' entropy and usage)."""
        s = torch.sigmoid(scores.float())
        return s / s.sum(-1, keepdim=True)


class HookedKolibri1(HookedTransformer):
    model_type = "kolibri1"

    @classmethod
    def recipe(cls, cfg: MoeConfig) -> Recipe:
        mixture = Mixture(SharedExpertMoe, BiasedLogitsSigmoidTopK)
        # only the sliding layers turn positions (transformers' Kolibri1Attention, sliding_window being set)
        return Recipe(tuple(
            LayerSpec(QKNormSlidingWindowAttention if cfg.window(layer) else QKNormNoRotaryAttention, mixture,
                      block=SandwichBlock)
            for layer in range(cfg.n_layers)
        ))

    @classmethod
    def site_map(cls, cfg: MoeConfig) -> SiteMap:
        return decoder_site_map(cfg, _layer_sites)

    @classmethod
    def config_from_hf(cls, raw: dict) -> MoeConfig:
        hf = HFConfig.with_spellings(raw, {"num_experts": "num_local_experts"})
        d = DEFAULTS
        fields = common_fields(
            hf, rms_norm_eps=d["rms_norm_eps"], max_position_embeddings=d["max_position_embeddings"],
            num_key_value_heads=d["num_key_value_heads"], hidden_size=d["hidden_size"],
            d_head=hf.integer("head_dim", d["head_dim"], at_least=1),
        )
        if fields["rope"].partial_rotary_factor != 1.0:  # transformers' Kolibri 1 rotary turns every dim of a head
            raise ValueError(f"partial_rotary_factor = {fields['rope'].partial_rotary_factor}: Kolibri 1 turns every "
                             "dim of a head (transformers does not read it), so only 1.0 is supported")
        n_layers = fields["n_layers"]
        layer_types = hf.opt("layer_types")
        if layer_types is None:  # transformers' default: every fifth layer full
            layer_types = ["full_attention" if (i + 1) % 5 == 0 else "sliding_attention" for i in range(n_layers)]
        if not isinstance(layer_types, list) or len(layer_types) != n_layers or not set(layer_types) <= set(LAYER_TYPES):
            raise ValueError(f"layer_types must list {n_layers} entries (num_hidden_layers), each one of "
                             f"{list(LAYER_TYPES)}; got {layer_types!r}")
        if "sliding_window" in raw and raw["sliding_window"] is None:  # transformers' default is for an absent field
            raise ValueError("sliding_window = null: transformers' Kolibri 1 always builds its sliding-window mask and "
                             "cannot run this config; give an integer (transformers' default where absent: 513)")
        window = hf.integer("sliding_window", d["sliding_window"], at_least=1)
        n_experts = hf.integer("num_local_experts", d["num_experts"], at_least=1)
        d_expert = hf.integer("moe_intermediate_size", d["moe_intermediate_size"], at_least=1)
        return MoeConfig(
            **fields,
            **routed_fields(hf, (True,) * n_layers, n_experts, d_expert, num_experts_per_tok=d["num_experts_per_tok"]),
            family=cls.model_type,
            d_shared=hf.integer("shared_expert_intermediate_size", d["shared_expert_intermediate_size"], at_least=1),
            norm_topk_prob=hf.flag("norm_topk_prob", False),
            attention_windows=tuple(window if kind == "sliding_attention" else None for kind in layer_types),
            fields_read=tuple(hf.label(f) for f in hf.read),
            fields_ignored=tuple(f for f in IGNORED_FIELDS if f in raw),
        )


def _layer_sites(cfg: MoeConfig, layer: int, src: str, dst: str) -> list[Entry]:
    attn, mlp = f"{src}.self_attn", f"{src}.mlp"
    # q_norm / k_norm's outputs have no moelens hook (hook_q / hook_k are the projections, as q_proj / k_proj's)
    return attention_projections(cfg, src, dst) + [
        Weight(f"{dst}.attn.q_norm.weight", (f"{attn}.q_norm.weight",)),
        Weight(f"{dst}.attn.k_norm.weight", (f"{attn}.k_norm.weight",)),
        # the checkpoints' names (transformers saves them too), then those of transformers' modules, which its
        # conversion mapping renames them to
        Weight(f"{dst}.ln1_post.weight", (f"{src}.post_attn_norm.weight", f"{src}.post_self_attn_layernorm.weight")),
        Weight(f"{dst}.ln2_post.weight", (f"{src}.post_ffn_norm.weight", f"{src}.post_mlp_layernorm.weight")),
        Weight(f"{dst}.mlp.router.weight", (f"{mlp}.gate.weight",)),
        Weight(f"{dst}.mlp.router.e_score_correction_bias", (f"{src}.moe.router.expert_bias",
                                                             f"{mlp}.gate.e_score_correction_bias")),
        routed_experts(cfg, (f"{mlp}.experts",), dst),
        *gated_mlp(f"{mlp}.shared_experts", f"{dst}.mlp.shared_expert"),
        Reference(f"{dst}.attn.hook_z", f"{attn}.o_proj", "in"),
        Reference(f"{dst}.ln1_post.hook_normalized", f"{src}.post_self_attn_layernorm"),
        Reference(f"{dst}.hook_attn_out", f"{src}.post_self_attn_layernorm"),
        *router_references(dst, f"{mlp}.gate"),
        Reference(f"{dst}.mlp.hook_routed_out", f"{mlp}.experts"),
        Reference(f"{dst}.mlp.shared_expert.hook_out", f"{mlp}.shared_experts"),
        Reference(f"{dst}.ln2_post.hook_normalized", f"{src}.post_mlp_layernorm"),
        Reference(f"{dst}.hook_mlp_out", f"{src}.post_mlp_layernorm"),
    ]
