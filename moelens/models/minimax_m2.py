"""HookedMiniMaxM2: MiniMax-M2 (model_type minimax_m2).

What is special about the family: an RMSNorm over each token's whole query projection and one over its whole
key projection (all heads together, qk_norm_type "per_layer", as OLMoE) before the split into heads; the rotary
on the first rotary_dim dims of each head only (64 of 128 in MiniMax-M2; transformers' spelling is
rope_parameters.partial_rotary_factor, which wins where both are given); a sigmoid router whose logits stay in
the model's dtype (SigmoidTopKFloat32Weights): the choice is taken on sigmoid + e_score_correction_bias over all
experts (no groups), the weights are the unbiased sigmoids of the chosen experts divided by their sum, kept
float32; routed experts only, in every block. The Hub spells the mixture `block_sparse_moe` (gate,
e_score_correction_bias, experts w1 gate / w3 up / w2 down); transformers 5 calls it `mlp`, with fused experts.

transformers' MiniMaxM2 reads none of MiniMax's own switches: it always builds the model that use_qk_norm true,
qk_norm_type "per_layer", scoring_func "sigmoid", use_routing_bias true, shared_intermediate_size 0 and an
attn_type_list of 1s (full attention) describe, so any other value is refused here rather than run as that
model. The multi-token-prediction modules are not part of the model, as in transformers: num_mtp_modules
layers stored after the last block (model.layers.N, N+1, ...) are skipped, any other extra tensor refused.

The published checkpoint is block-scaled fp8 (quantization_config quant_method "fp8", weight_block_size
[128, 128]): self_attn.{q,k,v,o}_proj.weight and every block_sparse_moe.experts.E.{w1,w2,w3}.weight are
float8_e4m3fn, each with a float32 `.weight_scale_inv` beside it (one scale per 128 x 128 block); the gate,
e_score_correction_bias, the norms, the embeddings and lm_head are stored unquantised.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass

import torch
import torch.nn.functional as F
from jaxtyping import Float, Int

from moelens.config import HFConfig, MoeConfig, common_fields, routed_fields
from moelens.models.base import HookedTransformer
from moelens.models.components import SparseMoe, TopKRouter
from moelens.models.components.projection_norm_attention import ClipQKVConfig, ProjectionQKNormAttention
from moelens.models.mixtral import W1_W3_W2
from moelens.models.recipe import Recipe, decoder_recipe
from moelens.models.terms import ParamTerm
from moelens.models.sites import Entry, attention_projections, decoder_site_map, router_references, routed_experts
from moelens.sitemap import ExpertStack, Reference, SiteMap, Weight

DEFAULT_ROPE_THETA = 5e6  # transformers' MiniMaxM2Config.default_theta
# MiniMax's own config fields that transformers' model does not read, with the only value it builds
FIXED_FIELDS = {
    "use_qk_norm": True, "qk_norm_type": "per_layer", "scoring_func": "sigmoid", "use_routing_bias": True,
    "shared_intermediate_size": 0, "attention_bias": False,
}
# present in MiniMax-M2's config.json, unused by transformers' model (training settings, the MTP modules, a
# width no module has)
IGNORED_FIELDS = (
    "mlp_intermediate_size", "use_mtp", "mtp_transformer_layers", "sliding_window", "router_aux_loss_coef",
    "router_jitter_noise", "shared_moe_mode", "attention_dropout",
)


@dataclass(frozen=True)
class MiniMaxM2Config(ClipQKVConfig):
    """MoeConfig plus the multi-token-prediction layers stored after the last block (not run). clip_qkv stays
    None: MiniMax-M2 clamps nothing."""

    mtp_layers: int = 0


class SigmoidTopKFloat32Weights(TopKRouter):
    """MiniMax-M2's rule: logits in the weight's dtype (the model's), sigmoid scores in float32; the choice is
    the top-k of scores + e_score_correction_bias (a buffer in the model's dtype) over all experts; the weights
    are the chosen experts' unbiased scores divided by their sum (the plain sum, no epsilon), kept float32, so
    that in a bfloat16 model the expert outputs are scaled by float32 weights, as in transformers."""

    choice_bias = True
    scoring = "sigmoid"
    scores_form = probs_form = "sigmoid"

    @classmethod
    def param_terms(cls, cfg: MoeConfig) -> tuple[ParamTerm, ...]:
        bias = ParamTerm("e_score_correction_bias", (cfg.n_experts,), "routers", cls.float32_weight, buffer=True)
        return (*super().param_terms(cfg), bias)

    def __init__(self, cfg: MoeConfig, top_k: int) -> None:
        super().__init__(cfg, top_k)
        self.register_buffer("e_score_correction_bias", torch.zeros(cfg.n_experts))

    def logits(self, x: Float[torch.Tensor, "... d_model"]) -> Float[torch.Tensor, "... n_experts"]:
        return F.linear(x.to(self.weight.dtype), self.weight)

    def scores(self, logits: torch.Tensor) -> Float[torch.Tensor, "... n_experts"]:
        return logits.float().sigmoid()

    def choice_scores(self, scores: torch.Tensor) -> torch.Tensor:
        return scores + self.e_score_correction_bias

    def choose(self, choice_scores: Float[torch.Tensor, "... n_experts"]) -> Int[torch.Tensor, "... top_k"]:
        # sorted=False as the reference: slot order then follows the kernel, as it does there
        return torch.topk(choice_scores, self.top_k, dim=-1, sorted=False).indices

    def weights(
        self, scores: torch.Tensor, indices: torch.Tensor, logits_dtype: torch.dtype
    ) -> Float[torch.Tensor, "... top_k"]:
        w = scores.gather(-1, indices)
        return w / w.sum(-1, keepdim=True)


class HookedMiniMaxM2(HookedTransformer):
    model_type = "minimax_m2"

    @classmethod
    def recipe(cls, cfg: MoeConfig) -> Recipe:
        return decoder_recipe(cfg, ProjectionQKNormAttention, SparseMoe, SigmoidTopKFloat32Weights)

    @classmethod
    def site_map(cls, cfg: MiniMaxM2Config) -> SiteMap:
        # the multi-token-prediction modules follow the last block; transformers skips them too
        mtp = tuple(f"model.layers.{i}." for i in range(cfg.n_layers, cfg.n_layers + cfg.mtp_layers))
        return decoder_site_map(cfg, _layer_sites, mtp)

    @classmethod
    def config_from_hf(cls, raw: dict) -> MiniMaxM2Config:
        hf = HFConfig(raw)
        _check_fixed_fields(hf)
        full_attention = hf.integers("attn_type_list", None, at_least=0, at_most=1)
        if full_attention is not None and 0 in full_attention:
            raise ValueError(
                f"attn_type_list has linear-attention layers (0) at {[i for i, t in enumerate(full_attention) if t == 0]}: "
                "MiniMax-M2 (and transformers' MiniMaxM2) has full attention (1) in every layer"
            )
        d_head = hf.integer("head_dim", 128, at_least=1)  # transformers' default, not hidden_size / heads
        # the Hub's rotary_dim: the rotated share of the head where neither spelling gives partial_rotary_factor;
        # where one does, it wins and rotary_dim is not used (transformers' reading), so its value is not checked
        factor_given = any(
            section.get("partial_rotary_factor") is not None for section in (raw, hf.rope_section().raw)
        )
        if factor_given:
            rotary_dim = hf.number("rotary_dim", None)
        else:
            rotary_dim = hf.integer("rotary_dim", None, at_least=2, at_most=d_head)
        fields = common_fields(
            hf, rms_norm_eps=1e-6, max_position_embeddings=196608, num_key_value_heads=8, d_head=d_head,
            rope_theta=DEFAULT_ROPE_THETA,
            partial_rotary_factor=rotary_dim / d_head if rotary_dim and not factor_given else 1.0,
        )
        n_layers = fields["n_layers"]
        _check_layer_types(hf, n_layers)
        overridden = factor_given and rotary_dim is not None and rotary_dim != d_head * fields["rope"].partial_rotary_factor
        n_experts = hf.integer("num_local_experts", 256, at_least=1)
        return MiniMaxM2Config(
            **fields,
            **routed_fields(
                hf, (True,) * n_layers, n_experts, hf.integer("intermediate_size", at_least=1), num_experts_per_tok=8
            ),
            family=cls.model_type,
            norm_topk_prob=True,  # always, as transformers
            mtp_layers=hf.integer("num_mtp_modules", 0, at_least=0),
            fields_read=tuple(hf.read),
            fields_ignored=tuple(f for f in IGNORED_FIELDS if raw.get(f) is not None) + (("rotary_dim",) if overridden else ()),
        )


def _check_fixed_fields(hf: HFConfig) -> None:
    for name, built in FIXED_FIELDS.items():
        value = hf.opt(name)
        if value is not None and (value != built or type(value) is not type(built)):
            raise ValueError(
                f"{name} = {value!r}: transformers' MiniMaxM2 (and so moelens) builds only the model with "
                f"{name} = {built!r}"
            )


def _check_layer_types(hf: HFConfig, n_layers: int) -> None:
    """layer_types, where given: transformers' MiniMaxM2 runs full attention in every layer whatever it says
    (a sliding_attention layer runs as full attention, or fails without sliding_window), so only that is taken."""
    layer_types = hf.opt("layer_types")
    if layer_types is None:
        return
    if not isinstance(layer_types, list) or len(layer_types) != n_layers:
        raise ValueError(f"layer_types = {layer_types!r}: expected a list of {n_layers} entries (num_hidden_layers)")
    other = {i: t for i, t in enumerate(layer_types) if t != "full_attention"}
    if other:
        raise ValueError(
            f"layer_types lists {', '.join(sorted({repr(t) for t in other.values()}))} at layers {list(other)}: transformers' MiniMaxM2 "
            "(and so moelens) has full attention in every layer (it would run those layers as full attention); "
            "expected 'full_attention' in every entry, or no layer_types"
        )


def _layer_sites(cfg: MiniMaxM2Config, layer: int, src: str, dst: str) -> list[Entry]:
    attn = f"{src}.self_attn"
    hub, ours = f"{src}.block_sparse_moe", f"{src}.mlp"  # the Hub's spelling, transformers 5's
    # hook_q / hook_k are the norms' outputs; q_proj's and k_proj's raw outputs have no moelens hook
    entries = [
        e for e in attention_projections(cfg, src, dst) if not isinstance(e, Reference) or e.hook.endswith("hook_v")
    ]
    return entries + [
        Weight(f"{dst}.attn.q_norm.weight", (f"{attn}.q_norm.weight",)),
        Weight(f"{dst}.attn.k_norm.weight", (f"{attn}.k_norm.weight",)),
        Reference(f"{dst}.attn.hook_q", f"{attn}.q_norm"),
        Reference(f"{dst}.attn.hook_k", f"{attn}.k_norm"),
        Reference(f"{dst}.attn.hook_z", f"{attn}.o_proj", "in"),
        Weight(f"{dst}.mlp.router.weight", (f"{hub}.gate.weight", f"{ours}.gate.weight")),
        Weight(
            f"{dst}.mlp.router.e_score_correction_bias",
            (f"{hub}.e_score_correction_bias", f"{ours}.e_score_correction_bias"),
        ),
        _experts(cfg, hub, ours, dst),
        *router_references(dst, f"{ours}.gate"),
        Reference(f"{dst}.mlp.hook_routed_out", f"{ours}.experts"),
    ]


def _experts(cfg: MoeConfig, hub: str, ours: str, dst: str) -> ExpertStack:
    """Per-expert w1/w3/w2 under either prefix, the Hub's first (what a new checkpoint is written in);
    transformers 5's fused pair under mlp.experts."""
    stack = routed_experts(cfg, (f"{ours}.experts", f"{hub}.experts"), dst, (W1_W3_W2,))
    return dataclasses.replace(stack, per_expert=stack.per_expert[::-1])
