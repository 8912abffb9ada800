"""HookedGptOss: gpt-oss-20b, gpt-oss-120b (model_type gpt_oss).

What is special about the family:
- attention: learned sinks, one logit per head that joins every query's softmax as an extra key and takes
  its share of the mass (so a row of the pattern sums to less than one; `hook_sink_scores` holds the sink
  logits as they enter, `hook_pattern` the keys' probabilities without the sink's); the softmax runs in
  the scores' dtype after subtracting the row's max, as transformers does; sliding (`sliding_window`) and
  full attention per `layer_types`; biases on q, k, v and o; YaRN rotary;
- the router: logits with a bias, the top-k taken on the logits themselves, the weights a softmax over the
  k chosen logits (in the logits' dtype);
- the experts: biases on both projections and a clamped SwiGLU (ExpertSpec with ClampedSwiGLU(alpha, limit)),
  stored fused and transposed with gate and up interleaved (gate_up_proj [E, d_model, 2*d_expert],
  down_proj [E, d_expert, d_model]); no shared expert;
- norms apply their weight to the float32 normed stream, then cast back to the stream's dtype.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import ClassVar

import torch
import torch.nn.functional as F
from jaxtyping import Float
from torch import nn

from moelens.config import HFConfig, MoeConfig, common_fields, routed_fields
from moelens.experts.spec import ClampedSwiGLU, ExpertSpec
from moelens.hooks.sites import site_hook
from moelens.models.base import HookedTransformer
from moelens.models.components import SparseMoe, TopKRouter
from moelens.models.components.norm import CastAfterWeightRMSNorm
from moelens.models.components.sliding_window_attention import SlidingWindowAttention
from moelens.models.recipe import Recipe, decoder_recipe
from moelens.models.sites import Entry, attention_projections, decoder_site_map
from moelens.models.terms import ParamTerm, kept_float32, vector
from moelens.sitemap import (
    AS_STORED,
    ExpertStack,
    FusedExperts,
    Interleaved,
    InterleavedRows,
    PackedWeight,
    Reference,
    SiteMap,
    Transposed,
    TransposedInterleaved,
    Weight,
)

LAYER_TYPES = ("sliding_attention", "full_attention")
DEFAULT_ROPE_THETA = 150000.0  # transformers' GptOssConfig default


@dataclass(frozen=True)
class GptOssConfig(MoeConfig):
    swiglu_alpha: float = 1.702
    swiglu_limit: float = 7.0
    # the routed experts' weights stored as MXFP4 blocks and scales (the published checkpoints), else dense
    mxfp4_experts: bool = False

    def expert_spec(self) -> ExpertSpec:
        return ExpertSpec(
            self.n_experts, self.d_model, self.d_expert, ClampedSwiGLU(self.swiglu_alpha, self.swiglu_limit), bias=True,
            storage=self.expert_storage,
        )


class SinkAttention(SlidingWindowAttention):
    """Attention whose softmax has one more, learned, logit per head (the sink): transformers' GptOssAttention."""

    fusable: ClassVar[bool] = False  # SDPA has no sink

    @classmethod
    def param_terms(cls, cfg: MoeConfig, layer: int) -> tuple[ParamTerm, ...]:
        return super().param_terms(cfg, layer) + vector("sinks", cfg.n_heads, "attention")

    def __init__(self, cfg: MoeConfig, layer: int) -> None:
        super().__init__(cfg, layer)
        self.sinks = nn.Parameter(torch.empty(cfg.n_heads))
        self.hook_sink_scores = site_hook("blocks.L.attn.hook_sink_scores")
        self.hook_pattern = site_hook("blocks.L.attn.hook_pattern", "sink")

    def softmax(self, scores: Float[torch.Tensor, "batch head query key"]) -> Float[torch.Tensor, "batch head query key"]:
        b, _, n_q, _ = scores.shape
        # its own memory (an expanded view cannot be edited in place), one logit per head and query
        sinks = self.hook_sink_scores(self.sinks.reshape(1, -1, 1, 1).expand(b, -1, n_q, 1).contiguous())
        combined = torch.cat([scores, sinks.to(scores.dtype)], dim=-1)
        combined = combined - combined.max(dim=-1, keepdim=True).values
        return F.softmax(combined, dim=-1, dtype=combined.dtype)[..., :-1]


class LogitTopKSoftmax(TopKRouter):
    """Logits with a bias, in the model's dtype; the top-k is taken on the logits (hook_router_scores holds
    them as they are), and the k weights are a softmax over the chosen logits, in their dtype."""

    scoring = "top-k logits, softmax over the k"
    scores_form = "top_k_logits"  # hook_router_scores holds the logits the top-k is taken on
    probs_form = "softmax_of_logits"

    @classmethod
    def param_terms(cls, cfg: MoeConfig) -> tuple[ParamTerm, ...]:
        return super().param_terms(cfg) + kept_float32(vector("bias", cfg.n_experts, "routers"), cls.float32_weight)

    def __init__(self, cfg: MoeConfig, top_k: int) -> None:
        super().__init__(cfg, top_k)
        self.bias = nn.Parameter(torch.zeros(cfg.n_experts))

    def logits(self, x: Float[torch.Tensor, "... d_model"]) -> Float[torch.Tensor, "... n_experts"]:
        return F.linear(x, self.weight, self.bias)

    def scores(self, logits: torch.Tensor) -> Float[torch.Tensor, "... n_experts"]:
        return logits.clone()  # its own tensor: an in-place edit of the scores must not reach the cached logits

    def choose(self, choice_scores: Float[torch.Tensor, "... n_experts"]) -> torch.Tensor:
        return torch.topk(choice_scores, self.top_k, dim=-1).indices

    def weights(self, scores: torch.Tensor, indices: torch.Tensor, logits_dtype: torch.dtype) -> torch.Tensor:
        chosen = scores.gather(-1, indices)
        return F.softmax(chosen, dim=-1, dtype=chosen.dtype).to(logits_dtype)

    def probabilities(self, scores: Float[torch.Tensor, "... n_experts"]) -> Float[torch.Tensor, "... n_experts"]:
        """The softmax of the logits over all experts, float32 (the weights are a softmax over the chosen k)."""
        return F.softmax(scores, dim=-1, dtype=torch.float32)


class HookedGptOss(HookedTransformer):
    model_type = "gpt_oss"

    @classmethod
    def recipe(cls, cfg: MoeConfig) -> Recipe:
        return decoder_recipe(cfg, SinkAttention, SparseMoe, LogitTopKSoftmax, norm=CastAfterWeightRMSNorm)

    @classmethod
    def site_map(cls, cfg: MoeConfig) -> SiteMap:
        return decoder_site_map(cfg, _layer_sites, mlp_read="out.0")  # transformers' MLP returns (out, weights)

    @classmethod
    def config_from_hf(cls, raw: dict) -> GptOssConfig:
        hf = HFConfig(raw)
        # the experts' activation is fixed (ClampedSwiGLU): hidden_act is not read
        fields = common_fields(
            hf, rms_norm_eps=1e-5, max_position_embeddings=131072, rope_theta=DEFAULT_ROPE_THETA, act_fn="silu"
        )
        n_layers = fields["n_layers"]
        n_experts = hf.integer("num_local_experts", at_least=1)
        if "sliding_window" in raw and raw["sliding_window"] is None:  # transformers' default is for an absent field
            raise ValueError(
                "sliding_window = null: gpt-oss's attention needs a window length (transformers' GptOss cannot run this "
                "config either, whatever layer_types says); give an integer, e.g. 128, transformers' default where the "
                "field is absent"
            )
        window = hf.integer("sliding_window", 128, at_least=1)
        layer_types = raw.get("layer_types")
        if layer_types is None:  # absent or null: transformers' default, sliding first, alternating
            layer_types = [LAYER_TYPES[i % 2] for i in range(n_layers)]
        if not isinstance(layer_types, list) or len(layer_types) != n_layers or not set(layer_types) <= set(LAYER_TYPES):
            raise ValueError(
                f"layer_types must list {n_layers} entries, each one of {LAYER_TYPES}; got {layer_types!r}"
            )
        hf.read.append("layer_types")
        bias = hf.flag("attention_bias", True)
        return GptOssConfig(
            **fields,
            **routed_fields(
                hf, (True,) * n_layers, n_experts, hf.integer("intermediate_size", at_least=1), num_experts_per_tok=4
            ),
            family=cls.model_type,
            qkv_bias=bias,
            o_bias=bias,
            attention_windows=tuple(window if kind == "sliding_attention" else None for kind in layer_types),
            swiglu_alpha=hf.number("swiglu_alpha", 1.702),
            swiglu_limit=hf.number("swiglu_limit", 7.0, above=0),
            mxfp4_experts=quant_method(raw) == "mxfp4",
            fields_read=tuple(hf.read),
            fields_ignored=tuple(f for f in ("hidden_act",) if f in raw),
        )


def _layer_sites(cfg: GptOssConfig, layer: int, src: str, dst: str) -> list[Entry]:
    return attention_projections(cfg, src, dst) + [
        Weight(f"{dst}.attn.sinks", (f"{src}.self_attn.sinks",)),
        Reference(f"{dst}.attn.hook_z", f"{src}.self_attn.o_proj", "in"),
        Weight(f"{dst}.mlp.router.weight", (f"{src}.mlp.router.weight",)),
        Weight(f"{dst}.mlp.router.bias", (f"{src}.mlp.router.bias",)),
        *(_mxfp4_experts(cfg, src, dst) if cfg.mxfp4_experts else [_dense_experts(cfg, src, dst)]),
        Reference(f"{dst}.mlp.hook_router_logits", f"{src}.mlp.router", "out.0"),
        Reference(f"{dst}.mlp.hook_expert_weights", f"{src}.mlp.router", "out.1"),
        Reference(f"{dst}.mlp.hook_expert_indices", f"{src}.mlp.router", "out.2"),
        Reference(f"{dst}.mlp.hook_routed_out", f"{src}.mlp.experts"),
    ]


def _dense_experts(cfg: GptOssConfig, src: str, dst: str) -> ExpertStack:
    """transformers' layouts of the fused experts (the Hub's bfloat16 copies use them too)."""
    experts = f"{src}.mlp.experts"
    fused = FusedExperts(
        f"{experts}.gate_up_proj", f"{experts}.down_proj", f"{experts}.gate_up_proj_bias", f"{experts}.down_proj_bias",
        (TransposedInterleaved(), Transposed(), Interleaved(), AS_STORED),
    )
    return ExpertStack(f"{dst}.mlp.experts", cfg.n_experts, cfg.d_expert, (), fused)


def _mxfp4_experts(cfg: GptOssConfig, src: str, dst: str) -> list[Entry]:
    """The published checkpoints' experts: <name>_blocks [E, rows, cols / 32, 16] and <name>_scales [E, rows,
    cols / 32], rows and cols in moelens's orientation once dequantized (gate and up rows interleaved); the
    biases as in transformers' layout."""
    experts, ours = f"{src}.mlp.experts", f"{dst}.mlp.experts"
    packed = {name: (f"{experts}.{name}_blocks", f"{experts}.{name}_scales") for name in ("gate_up_proj", "down_proj")}
    return [
        PackedWeight(f"{ours}.W_gate_up", packed["gate_up_proj"], "mxfp4", InterleavedRows()),
        PackedWeight(f"{ours}.W_down", packed["down_proj"], "mxfp4"),
        Weight(f"{ours}.b_gate_up", (f"{experts}.gate_up_proj_bias",), layout=Interleaved()),
        Weight(f"{ours}.b_down", (f"{experts}.down_proj_bias",)),
    ]


def quant_method(raw: dict) -> str | None:
    qc = raw.get("quantization_config")
    return qc.get("quant_method") if isinstance(qc, dict) else None
