"""HookedDeepseekV2: DeepSeek-V2, DeepSeek-V2-Lite, DeepSeek-V2.5 (model_type deepseek_v2).

What is special about the family, beside DeepSeek-V3's (moelens.models.deepseek_v3: multi-head latent attention,
dense first blocks, a shared expert added ungated after the routed experts):
- the rotary turns the qk_rope_head_dim dims of each head as interleaved pairs kept in place (transformers'
  DeepseekV2 apply_rotary_emb: complex products of torch.polar's turns, in float32), so hook_rot_q / hook_rot_k
  keep the checkpoint's order (DeepSeek-V3 de-interleaves them);
- the router (SoftmaxGroupLimitedTopK) softmaxes float32 logits over all experts and takes the top
  num_experts_per_tok scores, with topk_method "greedy" among all experts, with "group_limited_greedy" among the
  topk_group of n_group groups whose best score is highest; the weights are the chosen scores times
  routed_scaling_factor, float32, never renormalised (transformers does not read norm_topk_prob, and a config
  asking for it is refused rather than run otherwise than it says).
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from jaxtyping import Float, Int

from moelens.config import REQUIRED, HFConfig, MoeConfig
from moelens.models.components import SharedExpertMoe
from moelens.models.components.latent_attention import MultiHeadLatentAttention
from moelens.models.components.rotary import PolarRotary, apply_rotary_pairs
from moelens.models.components.router import TopKRouter
from moelens.models.deepseek_v3 import DeepseekV3Config, HookedDeepseekV3, _attention_sites, latent_decoder_fields
from moelens.models.recipe import Recipe, decoder_recipe
from moelens.models.sites import Entry, decoder_site_map, dense_mlp, gated_mlp, router_references, routed_experts
from moelens.sitemap import Reference, SiteMap, Weight

TOPK_METHODS = ("greedy", "group_limited_greedy")
# in DeepSeek's config.json, unused by transformers' model (training settings, the scoring rule's name: always
# softmax there; head_dim, which it sets itself)
IGNORED_FIELDS = ("aux_loss_alpha", "seq_aux", "scoring_func", "moe_layer_freq", "ep_size", "head_dim", "pretraining_tp")

# transformers' DeepseekV2Config defaults, for the fields latent_decoder_fields reads
DEEPSEEK_V2_DEFAULTS = dict(
    rms_norm_eps=1e-6, max_position_embeddings=2048, hidden_size=4096, qk_nope_head_dim=128, qk_rope_head_dim=64,
    v_head_dim=128, q_lora_rank=1536, kv_lora_rank=512, first_k_dense_replace=0, n_routed_experts=64,
    num_experts_per_tok=REQUIRED, moe_intermediate_size=1407,
    intermediate_size=11008, n_group=1, topk_group=1, routed_scaling_factor=1.0,
)


class SoftmaxGroupLimitedTopK(TopKRouter):
    """DeepSeek-V2's router: float32 logits and softmax; the top-k scores among all experts (n_group 1: "greedy")
    or among the topk_group groups whose best expert scores highest ("group_limited_greedy", the others' scores
    set to 0 for the choice); weights the chosen scores times routed_scaling_factor, float32."""

    float32_weight = True
    scoring = "softmax"

    def __init__(self, cfg: MoeConfig, top_k: int) -> None:
        super().__init__(cfg, top_k)
        self.routed_scaling_factor = cfg.routed_scaling_factor
        self.n_group, self.topk_group = cfg.n_group, cfg.topk_group

    def logits(self, x: Float[torch.Tensor, "... d_model"]) -> Float[torch.Tensor, "... n_experts"]:
        return F.linear(x.float(), self.weight.float())

    def scores(self, logits: torch.Tensor) -> Float[torch.Tensor, "... n_experts"]:
        return logits.softmax(dim=-1, dtype=torch.float32)

    def choose(self, choice_scores: Float[torch.Tensor, "... n_experts"]) -> Int[torch.Tensor, "... top_k"]:
        if self.n_group > 1:
            grouped = choice_scores.unflatten(-1, (self.n_group, self.n_experts // self.n_group))
            best = torch.topk(grouped.max(dim=-1).values, self.topk_group, dim=-1, sorted=False).indices
            keep = torch.zeros(grouped.shape[:-1], dtype=torch.bool, device=grouped.device).scatter_(-1, best, True)
            choice_scores = grouped.masked_fill(~keep.unsqueeze(-1), 0.0).flatten(-2)
        # sorted=False as the reference: slot order then follows the kernel, as it does there
        return torch.topk(choice_scores, self.top_k, dim=-1, sorted=False).indices

    def weights(
        self, scores: torch.Tensor, indices: torch.Tensor, logits_dtype: torch.dtype
    ) -> Float[torch.Tensor, "... top_k"]:
        return (scores.gather(-1, indices) * self.routed_scaling_factor).to(logits_dtype)

    def extra_repr(self) -> str:
        return (
            f"n_experts={self.n_experts}, top_k={self.top_k}, n_group={self.n_group}, topk_group={self.topk_group}, "
            f"routed_scaling_factor={self.routed_scaling_factor}"
        )


class PairRotaryLatentAttention(MultiHeadLatentAttention):
    """Latent attention whose rotary turns interleaved pairs in place (DeepSeek-V2): hook_rot_q / hook_rot_k and the
    cached keys keep the checkpoint's order of the rotated dims."""

    def __init__(self, cfg, layer: int) -> None:
        super().__init__(cfg, layer)
        self.rotate = apply_rotary_pairs


class HookedDeepseekV2(HookedDeepseekV3):
    model_type = "deepseek_v2"
    rotary_class = PolarRotary  # transformers turns by torch.polar's cos / sin (an ulp from torch.cos's)

    @classmethod
    def recipe(cls, cfg: MoeConfig) -> Recipe:
        return decoder_recipe(cfg, PairRotaryLatentAttention, SharedExpertMoe, SoftmaxGroupLimitedTopK)

    @classmethod
    def site_map(cls, cfg: MoeConfig) -> SiteMap:
        return decoder_site_map(cfg, _layer_sites)

    @classmethod
    def config_from_hf(cls, raw: dict) -> DeepseekV3Config:
        method = HFConfig(raw).text("topk_method", "greedy")
        if method not in TOPK_METHODS:
            raise ValueError(f"topk_method {method!r}: DeepSeek-V2's router is one of {TOPK_METHODS}")
        ignored = [f for f in IGNORED_FIELDS if f in raw]
        groups = ("n_group", "topk_group")
        if method == "greedy":  # transformers reads no groups then: one group of every expert is the same rule
            ignored += [f for f in groups if raw.get(f) is not None]
            raw = {k: v for k, v in raw.items() if k not in groups}
        else:
            missing = [f for f in groups if raw.get(f) is None]
            if missing:
                raise ValueError(f"topk_method 'group_limited_greedy' needs {' and '.join(missing)} (absent or null)")
        hf = HFConfig(raw)
        hf.text("topk_method", "greedy")  # read above; listed among the fields read
        if hf.flag("norm_topk_prob", False):
            raise ValueError(
                "norm_topk_prob = true: transformers' DeepSeek-V2 never renormalises the top-k weights (it does not read "
                "the field), DeepSeek's own code would; no published DeepSeek-V2 sets it, so moelens refuses to choose"
            )
        if hf.flag("mlp_bias", False):
            raise ValueError("mlp_bias = true: DeepSeek-V2's dense and shared-expert MLPs have no biases in moelens")
        fields = latent_decoder_fields(hf, raw, DEEPSEEK_V2_DEFAULTS, rope_interleave=True)
        if method == "greedy":  # looked up for the single group, not read from config.json
            hf.read = [f for f in hf.read if f not in groups]
        if "n_shared_experts" not in raw or raw["n_shared_experts"] is None:  # transformers' default is 2
            fields["d_shared"] = 2 * fields["d_expert"]
        fields["norm_topk_prob"] = False
        return DeepseekV3Config(
            **fields, family=cls.model_type, fields_read=tuple(hf.read), fields_ignored=tuple(ignored),
        )


def _layer_sites(cfg: DeepseekV3Config, layer: int, src: str, dst: str) -> list[Entry]:
    if not cfg.moe_layers[layer]:
        return _attention_sites(cfg, src, dst) + dense_mlp(src, dst)
    return _attention_sites(cfg, src, dst) + [
        Weight(f"{dst}.mlp.router.weight", (f"{src}.mlp.gate.weight",)),
        routed_experts(cfg, (f"{src}.mlp.experts",), dst),
        *gated_mlp(f"{src}.mlp.shared_experts", f"{dst}.mlp.shared_expert"),
        *router_references(dst, f"{src}.mlp.gate"),
        Reference(f"{dst}.mlp.hook_routed_out", f"{src}.mlp.experts"),
        Reference(f"{dst}.mlp.shared_expert.hook_out", f"{src}.mlp.shared_experts"),
    ]
