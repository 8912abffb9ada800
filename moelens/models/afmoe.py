"""HookedAfmoe: Arcee's Trinity models, Trinity-Mini and Trinity-Nano (model_type afmoe).

What is special about the family:
- sandwich-norm blocks (moelens.models.components.sandwich_block): each sublayer between two RMSNorms,
  input_layernorm / post_attention_layernorm around attention (blocks.L.ln1 / ln1_post) and pre_mlp_layernorm /
  post_mlp_layernorm around the mixture (blocks.L.ln2 / ln2_post); every norm applies its weight to the float32
  normed input before the cast back;
- attention per layer_types: sliding layers attend within sliding_window and turn q and k by the rotary, full
  layers attend to every earlier position without any rotary (NoPE); on every layer a per-head RMSNorm of queries
  and keys first, and an output gate: the heads' outputs times sigmoid(gate_proj(x)) (hook_attn_gate, per head)
  before o_proj;
- muP's embedding scale where mup_enabled: the looked-up rows times sqrt(hidden_size) (hook_embed holds them);
- the first num_dense_layers blocks dense MLPs (intermediate_size), the rest mixtures: a sigmoid router whose
  logits are taken in the model's dtype and then cast to float32, experts chosen on scores + expert_bias (a
  float32 buffer, hook_choice_scores) in sorted top-k order, the chosen experts' unbiased scores renormalised
  and times route_scale, float32; shared experts (moe_intermediate_size * num_shared_experts wide) added ungated.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn.functional as F
from jaxtyping import Float, Int
from torch import nn

from moelens.config import HFConfig, MoeConfig, common_fields, routed_fields
from moelens.hooks.sites import site_hook
from moelens.models.base import HookedTransformer
from moelens.models.components import SharedExpertMoe, SigmoidGroupedTopK, SparseMoe
from moelens.models.components.attention import SplitInputs, linear_per_head, project_out, split_inputs
from moelens.models.components.norm import CastAfterWeightRMSNorm
from moelens.models.components.sandwich_block import SandwichBlock
from moelens.models.components.sliding_window_attention import SlidingWindowAttention
from moelens.models.context import LayerInputs
from moelens.models.recipe import Dense, LayerSpec, Mixture, Recipe
from moelens.models.sites import (
    Entry, attention_projections, dense_mlp, gated_mlp, own_blocks_site_map, router_references, routed_experts,
)
from moelens.models.terms import ParamTerm, linear, under
from moelens.sitemap import Reference, SiteMap, Weight

LAYER_TYPES = ("sliding_attention", "full_attention")


@dataclass(frozen=True)
class AfmoeConfig(MoeConfig):
    """MoeConfig plus which layers turn queries and keys by the rotary (the sliding ones; the full ones are NoPE)
    and muP's embedding scale (sqrt(hidden_size) where mup_enabled, else 1)."""

    rotary_layers: tuple[bool, ...] = ()  # empty: the layers with a sliding window
    embedding_multiplier: float = 1.0

    def __post_init__(self) -> None:
        super().__post_init__()
        if self.rotary_layers and len(self.rotary_layers) != self.n_layers:
            raise ValueError(f"rotary_layers ({len(self.rotary_layers)}) needs one entry per layer ({self.n_layers})")

    def rotary(self, layer: int) -> bool:
        """Whether `layer` turns queries and keys by the rotary."""
        return self.rotary_layers[layer] if self.rotary_layers else self.window(layer) is not None


class AfmoeAttention(SlidingWindowAttention):
    """hook_q / hook_k: the projections before the per-head norm; hook_rot_q / hook_rot_k: what enters the
    scores (normed, and turned by the rotary on a sliding layer); hook_attn_gate: gate_proj's output per head,
    before the sigmoid; hook_z: the heads' outputs after the gate (what o_proj reads)."""

    @classmethod
    def param_terms(cls, cfg: AfmoeConfig, layer: int) -> tuple[ParamTerm, ...]:
        norm = CastAfterWeightRMSNorm.param_terms(cfg.d_head)
        return (super().param_terms(cfg, layer) + under("q_norm", norm) + under("k_norm", norm)
                + linear("gate_proj", cfg.d_model, cfg.n_heads * cfg.d_head, False, "attention"))

    def __init__(self, cfg: AfmoeConfig, layer: int) -> None:
        super().__init__(cfg, layer)
        self.rotary = cfg.rotary(layer)
        self.q_norm = CastAfterWeightRMSNorm(cfg.d_head, cfg.norm_eps, hooked=False)
        self.k_norm = CastAfterWeightRMSNorm(cfg.d_head, cfg.norm_eps, hooked=False)
        self.gate_proj = nn.Linear(cfg.d_model, cfg.n_heads * cfg.d_head, bias=False)
        self.hook_attn_gate = site_hook("blocks.L.attn.hook_attn_gate")
        self.hook_z = site_hook("blocks.L.attn.hook_z", "gated")

    def forward(
        self, x: Float[torch.Tensor, "batch pos d_model"] | SplitInputs, inputs: LayerInputs
    ) -> Float[torch.Tensor, "batch pos d_model"]:
        q, k, v = self.project(x)
        xq = split_inputs(x)[0]
        b, p = xq.shape[:2]
        # each head's gate reads that head's query input (the one stream, or its own copy with split inputs)
        gate = self.hook_attn_gate(linear_per_head(self.gate_proj, xq).view(b, p, self.n_heads, self.d_head))
        z = self.heads(q, k, v, inputs)
        return project_out(self, self.hook_z(z * torch.sigmoid(gate)))

    def position(self, q, k, cos, sin):
        q, k = self.q_norm(q), self.k_norm(k)
        return super().position(q, k, cos, sin) if self.rotary else (q, k)

    def input_projections(self) -> list[nn.Linear]:
        """q, k, v and the gate read the normed stream (what fold_ln scales)."""
        return [*super().input_projections(), self.gate_proj]

    @property
    def W_attn_gate(self) -> Float[torch.Tensor, "n_heads d_model d_head"]:
        """Each head's gate projection (hook_attn_gate = normed stream @ W_attn_gate)."""
        return self.gate_proj.weight.view(self.n_heads, self.d_head, -1).transpose(-2, -1)

    def extra_repr(self) -> str:
        return f"{super().extra_repr()}, rotary={self.rotary}"


class AfmoeRouter(SigmoidGroupedTopK):
    """Sigmoid of logits taken in the model's dtype and cast to float32; the choice on scores + the float32
    e_score_correction_bias (the checkpoint's expert_bias), in sorted top-k order over all experts; the weights
    the chosen experts' unbiased scores over their sum (+ 1e-20), times routed_scaling_factor (route_scale)."""

    float32_weight = False
    float32_buffers = ("e_score_correction_bias",)

    @classmethod
    def param_terms(cls, cfg: MoeConfig) -> tuple[ParamTerm, ...]:
        weight = ParamTerm("weight", (cfg.n_experts, cfg.d_model), "routers", False, flops=2 * cfg.n_experts * cfg.d_model)
        return (weight, ParamTerm("e_score_correction_bias", (cfg.n_experts,), "routers", True, buffer=True))

    def logits(self, x: Float[torch.Tensor, "... d_model"]) -> Float[torch.Tensor, "... n_experts"]:
        return F.linear(x, self.weight).float()

    def choose(self, choice_scores: Float[torch.Tensor, "... n_experts"]) -> Int[torch.Tensor, "... top_k"]:
        return torch.topk(choice_scores, self.top_k, dim=-1).indices


class HookedAfmoe(HookedTransformer):
    model_type = "afmoe"

    @classmethod
    def recipe(cls, cfg: AfmoeConfig) -> Recipe:
        norm = CastAfterWeightRMSNorm
        mixture = Mixture(SharedExpertMoe if cfg.d_shared else SparseMoe, AfmoeRouter)
        layers = tuple(LayerSpec(AfmoeAttention, mixture if moe else Dense(), norm, block=SandwichBlock)
                       for moe in cfg.moe_layers)
        return Recipe(layers, norm, embedding_multiplier=cfg.embedding_multiplier)

    @classmethod
    def site_map(cls, cfg: AfmoeConfig) -> SiteMap:
        return own_blocks_site_map(cfg, _layer_sites)

    # transformers' AfmoeConfig defaults (Trinity-Mini's sizes), for the fields config.json leaves out
    defaults = dict(
        hidden_size=2048, intermediate_size=6144, moe_intermediate_size=1408, num_dense_layers=1, head_dim=128,
        max_position_embeddings=16384, rms_norm_eps=1e-5, num_experts=64, num_experts_per_tok=6,
        num_shared_experts=2, route_scale=1.0, global_attn_every_n_layers=4, sliding_window=1024,
        rope_theta=10000.0,
    )

    @classmethod
    def config_from_hf(cls, raw: dict) -> AfmoeConfig:
        hf = HFConfig(raw)
        d = cls.defaults
        fields = common_fields(hf, rms_norm_eps=d["rms_norm_eps"], max_position_embeddings=d["max_position_embeddings"],
                               hidden_size=d["hidden_size"], rope_theta=d["rope_theta"],
                               d_head=hf.integer("head_dim", d["head_dim"], at_least=1))
        n_layers = fields["n_layers"]
        layer_types = _layer_types(hf, raw, n_layers, d["global_attn_every_n_layers"])
        window = hf.integer("sliding_window", d["sliding_window"], at_least=1)
        n_dense = hf.integer("num_dense_layers", d["num_dense_layers"], at_least=0)
        moe_layers = tuple(layer >= n_dense for layer in range(n_layers))
        n_experts = hf.integer("num_experts", d["num_experts"], at_least=1)
        d_expert = hf.integer("moe_intermediate_size", d["moe_intermediate_size"], at_least=1)
        n_shared = hf.integer("num_shared_experts", d["num_shared_experts"], at_least=0)
        bias = hf.flag("attention_bias", False)
        scale = fields["d_model"] ** 0.5 if hf.flag("mup_enabled", False) else 1.0
        return AfmoeConfig(
            **fields,
            **routed_fields(hf, moe_layers, n_experts, d_expert, num_experts_per_tok=d["num_experts_per_tok"]),
            family=cls.model_type,
            qkv_bias=bias,
            o_bias=bias,
            d_mlp=hf.integer("intermediate_size", d["intermediate_size"], at_least=1) if not all(moe_layers) else 0,
            d_shared=d_expert * n_shared,
            norm_topk_prob=True,
            routed_scaling_factor=hf.number("route_scale", d["route_scale"]),
            embedding_multiplier=scale,
            attention_windows=tuple(window if kind == "sliding_attention" else None for kind in layer_types),
            rotary_layers=tuple(kind == "sliding_attention" for kind in layer_types),
            fields_read=tuple(hf.read),
            # transformers derives layer_types from it only where config.json lists none
            fields_ignored=("global_attn_every_n_layers",) if "global_attn_every_n_layers" in raw
            and "global_attn_every_n_layers" not in hf.read else (),
        )


def _layer_types(hf: HFConfig, raw: dict, n_layers: int, every: int) -> list[str]:
    """layer_types as config.json lists them; absent or null, transformers' default: every
    global_attn_every_n_layers-th layer full attention, the others sliding."""
    layer_types = raw.get("layer_types")
    if layer_types is None:
        every = hf.integer("global_attn_every_n_layers", every, at_least=1)
        return ["sliding_attention" if (i + 1) % every else "full_attention" for i in range(n_layers)]
    if not isinstance(layer_types, list) or len(layer_types) != n_layers or not set(layer_types) <= set(LAYER_TYPES):
        raise ValueError(f"layer_types must list {n_layers} entries (num_hidden_layers), each one of {LAYER_TYPES}; "
                         f"got {layer_types!r}")
    hf.read.append("layer_types")
    return layer_types


def _layer_sites(cfg: AfmoeConfig, layer: int, src: str, dst: str) -> list[Entry]:
    attn = f"{src}.self_attn"
    entries = attention_projections(cfg, src, dst) + [
        Weight(f"{dst}.attn.q_norm.weight", (f"{attn}.q_norm.weight",)),
        Weight(f"{dst}.attn.k_norm.weight", (f"{attn}.k_norm.weight",)),
        Weight(f"{dst}.attn.gate_proj.weight", (f"{attn}.gate_proj.weight",)),
        Weight(f"{dst}.ln1.weight", (f"{src}.input_layernorm.weight",)),
        Weight(f"{dst}.ln1_post.weight", (f"{src}.post_attention_layernorm.weight",)),
        Weight(f"{dst}.ln2.weight", (f"{src}.pre_mlp_layernorm.weight",)),
        Weight(f"{dst}.ln2_post.weight", (f"{src}.post_mlp_layernorm.weight",)),
        Reference(f"{dst}.hook_resid_pre", src, "in"),
        Reference(f"{dst}.ln1.hook_normalized", f"{src}.input_layernorm"),
        Reference(f"{dst}.attn.hook_attn_gate", f"{attn}.gate_proj"),
        Reference(f"{dst}.attn.hook_z", f"{attn}.o_proj", "in"),
        Reference(f"{dst}.ln1_post.hook_normalized", f"{src}.post_attention_layernorm"),
        Reference(f"{dst}.hook_attn_out", f"{src}.post_attention_layernorm"),
        Reference(f"{dst}.ln2.hook_normalized", f"{src}.pre_mlp_layernorm"),
        Reference(f"{dst}.ln2_post.hook_normalized", f"{src}.post_mlp_layernorm"),
        Reference(f"{dst}.hook_mlp_out", f"{src}.post_mlp_layernorm"),
        Reference(f"{dst}.hook_resid_post", src),
    ]
    if not cfg.moe_layers[layer]:
        return entries + dense_mlp(src, dst)
    entries += [
        Weight(f"{dst}.mlp.router.weight", (f"{src}.mlp.router.gate.weight",)),
        Weight(f"{dst}.mlp.router.e_score_correction_bias", (f"{src}.mlp.expert_bias",)),
        routed_experts(cfg, (f"{src}.mlp.experts",), dst),
        *router_references(dst, f"{src}.mlp.router"),
        Reference(f"{dst}.mlp.hook_routed_out", f"{src}.mlp.experts"),
    ]
    if cfg.d_shared:
        entries += [*gated_mlp(f"{src}.mlp.shared_experts", f"{dst}.mlp.shared_expert"),
                    Reference(f"{dst}.mlp.shared_expert.hook_out", f"{src}.mlp.shared_experts")]
    return entries
