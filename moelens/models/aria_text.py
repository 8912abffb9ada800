"""HookedAriaText: the text model of Rhymes' Aria (model_type aria_text).

What is special about the family: Llama's attention (biases on q, k, v and o where attention_bias) and a mixture
on every layer: moe_num_experts routed experts (intermediate_size wide, always SiLU-gated), moe_topk of them
chosen by AriaTopKLogitsSoftmax (the top-k of the logits, in the model's dtype, the weights a softmax over the
chosen k in that dtype), then shared experts added ungated: one gated MLP intermediate_size *
moe_num_shared_experts wide whose activation is hidden_act. The routed experts are stored stacked and transposed,
as Aria's checkpoints keep them (mlp.experts.fc1.weight [E, d_model, 2 * intermediate_size], gate columns first;
fc2.weight [E, intermediate_size, d_model]); transformers' module names for them (gate_up_proj, down_proj) are
read as well. A shared expert with biases (mlp_bias) is refused: no Aria checkpoint has them.

Only the text model's own config.json (model_type aria_text) is read; the multimodal Aria checkpoints (model_type
aria) are not loaded.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn.functional as F
from jaxtyping import Float, Int

from moelens.config import HFConfig, MoeConfig, common_fields
from moelens.experts.spec import GLU, ExpertSpec
from moelens.models.base import HookedTransformer
from moelens.models.components import Attention, SharedExpertMoe, TopKRouter
from moelens.models.recipe import Recipe, decoder_recipe
from moelens.models.sites import Entry, attention_projections, decoder_site_map, gated_mlp, router_references
from moelens.sitemap import AS_STORED, ExpertStack, FusedExperts, Reference, SiteMap, Transposed, Weight

# transformers' AriaTextConfig defaults
DEFAULTS = dict(hidden_size=4096, intermediate_size=4096, max_position_embeddings=2048, rms_norm_eps=1e-6,
                moe_num_experts=8, moe_topk=2, moe_num_shared_experts=2)
# present in transformers' config.json, unused by its model
IGNORED_FIELDS = ("attention_dropout", "pretraining_tp")


@dataclass(frozen=True)
class AriaTextConfig(MoeConfig):
    """MoeConfig whose routed experts are SiLU-gated whatever hidden_act says (act_fn is the shared experts')."""

    def expert_spec(self) -> ExpertSpec:
        return ExpertSpec(self.n_experts, self.d_model, self.d_expert, GLU("silu"), storage=self.expert_storage)


class AriaTopKLogitsSoftmax(TopKRouter):
    """Aria's rule: logits in the model's dtype, the top-k taken on them (hook_router_scores holds them as they
    are), the k weights a softmax over the chosen logits, in their dtype."""

    scoring = "top-k logits, softmax over the k"
    scores_form = "top_k_logits"
    probs_form = "softmax_of_logits"

    def logits(self, x: Float[torch.Tensor, "... d_model"]) -> Float[torch.Tensor, "... n_experts"]:
        return F.linear(x, self.weight)

    def scores(self, logits: torch.Tensor) -> Float[torch.Tensor, "... n_experts"]:
        return logits.clone()  # its own tensor: an in-place edit of the scores must not reach the cached logits

    def choose(self, choice_scores: Float[torch.Tensor, "... n_experts"]) -> Int[torch.Tensor, "... top_k"]:
        return torch.topk(choice_scores, self.top_k, dim=-1).indices

    def weights(self, scores: torch.Tensor, indices: torch.Tensor, logits_dtype: torch.dtype) -> torch.Tensor:
        return F.softmax(scores.gather(-1, indices), dim=-1)

    def probabilities(self, scores: Float[torch.Tensor, "... n_experts"]) -> Float[torch.Tensor, "... n_experts"]:
        """The softmax of the logits over all experts, float32 (the weights are a softmax over the chosen k)."""
        return F.softmax(scores, dim=-1, dtype=torch.float32)


class HookedAriaText(HookedTransformer):
    model_type = "aria_text"

    @classmethod
    def recipe(cls, cfg: MoeConfig) -> Recipe:
        return decoder_recipe(cfg, Attention, SharedExpertMoe, AriaTopKLogitsSoftmax)

    @classmethod
    def site_map(cls, cfg: MoeConfig) -> SiteMap:
        return decoder_site_map(cfg, _layer_sites)

    @classmethod
    def config_from_hf(cls, raw: dict) -> AriaTextConfig:
        hf = HFConfig(raw)
        d = DEFAULTS
        fields = common_fields(hf, rms_norm_eps=d["rms_norm_eps"], max_position_embeddings=d["max_position_embeddings"],
                               hidden_size=d["hidden_size"])
        if hf.flag("mlp_bias", False):
            raise ValueError("mlp_bias = true: Aria's shared experts have no biases in any published checkpoint, and "
                             "moelens's gated MLP has none")
        n_layers = fields["n_layers"]
        n_experts = hf.integer("moe_num_experts", d["moe_num_experts"], at_least=1)
        d_expert = hf.integer("intermediate_size", d["intermediate_size"], at_least=1)
        bias = hf.flag("attention_bias", False)
        return AriaTextConfig(
            **fields,
            **_routed(hf, n_layers, n_experts, d_expert),
            family=cls.model_type,
            qkv_bias=bias,
            o_bias=bias,
            d_shared=d_expert * hf.integer("moe_num_shared_experts", d["moe_num_shared_experts"], at_least=1),
            fields_read=tuple(hf.read),
            fields_ignored=tuple(f for f in IGNORED_FIELDS if f in raw),
        )


def _routed(hf: HFConfig, n_layers: int, n_experts: int, d_expert: int) -> dict:
    """routed_fields with Aria's name for the experts per token, moe_topk."""
    top_k = hf.integer("moe_topk", DEFAULTS["moe_topk"], at_least=1, at_most=n_experts)
    return dict(moe_layers=(True,) * n_layers, n_experts=n_experts, top_k_per_layer=(top_k,) * n_layers,
                d_expert=d_expert)


def _layer_sites(cfg: MoeConfig, layer: int, src: str, dst: str) -> list[Entry]:
    mlp = f"{src}.mlp"
    transposed = (Transposed(), Transposed(), AS_STORED, AS_STORED)
    experts = ExpertStack(
        f"{dst}.mlp.experts", cfg.n_experts, cfg.d_expert, (),
        FusedExperts(f"{mlp}.experts.fc1.weight", f"{mlp}.experts.fc2.weight", layouts=transposed), fused_first=True,
        # transformers' module names, which its conversion mapping renames fc1 / fc2 to
        other_fused=(FusedExperts(f"{mlp}.experts.gate_up_proj", f"{mlp}.experts.down_proj", layouts=transposed),),
    )
    return attention_projections(cfg, src, dst) + [
        Weight(f"{dst}.mlp.router.weight", (f"{mlp}.router.weight",)),
        experts,
        *gated_mlp(f"{mlp}.shared_experts", f"{dst}.mlp.shared_expert"),
        Reference(f"{dst}.attn.hook_z", f"{src}.self_attn.o_proj", "in"),
        *router_references(dst, f"{mlp}.router"),
        Reference(f"{dst}.mlp.hook_routed_out", f"{mlp}.experts"),
        Reference(f"{dst}.mlp.shared_expert.hook_out", f"{mlp}.shared_experts"),
    ]
