"""HookedBeam: Reflection AI's Beam (model_type beam).

What is special about the family:
- sandwich-norm blocks whose adds are depth-scaled: each sublayer output o (after its post-norm) enters the
  stream as o / sqrt(i) + resid * sqrt((i - 1) / i), i = 2 (layer + 1) for the attention and one more for the
  feed-forward (hook_attn_out / hook_mlp_out hold o / sqrt(i)); the stream is then no sum of sublayer outputs,
  so the decompositions into them are refused;
- attention per layer_types: sliding layers attend within sliding_window, full ones to every earlier position;
  each layer type has its own rotary in rope_parameters (null: NoPE), tables kept float32; on a NoPE layer each
  q-normed query is multiplied by (1 + (position + 1) / 2048) ** 0.1 in float32 (scalable softmax); a per-head
  RMSNorm of queries and keys on every layer, and an output gate sigmoid(gate_proj(x) + gate_bias[head]);
- the first three blocks (mlp_layer_types) dense SwiGLU MLPs, the rest mixtures without a shared expert: a float32
  sigmoid router choosing on scores + e_score_correction_bias among the topk_group best of n_group groups, in
  sorted top-k order, the weights renormalised (+ 1e-20), float32; the experts' weighted sum times
  routed_scaling_factor in the stream's dtype (hook_routed_out holds the product; ScaledSumMoe); every SwiGLU's
  activation and product in float32;
- the logits softcapped in float32, cap * tanh(logits / cap) (final_logit_softcapping; null: none).
"""

from __future__ import annotations

import dataclasses
import math
from dataclasses import dataclass

import torch
from jaxtyping import Float, Int
from torch import nn

from moelens.config import HFConfig, MoeConfig, RopeConfig, common_fields, routed_fields
from moelens.experts.spec import GLU, ExpertSpec
from moelens.hooks.sites import site_hook
from moelens.models.afmoe import AfmoeAttention
from moelens.models.base import HookedTransformer
from moelens.models.components import SigmoidGroupedTopK
from moelens.models.components.attention import SplitInputs, linear_per_head, project_out, split_inputs
from moelens.models.components.mlp import GatedMLP
from moelens.models.components.moe import ScaledSumMoe
from moelens.models.components.norm import CastAfterWeightRMSNorm
from moelens.models.components.rotary import Float32Rotary, apply_rotary
from moelens.models.components.sandwich_block import SandwichBlock
from moelens.models.components.softcap import check_cap
from moelens.models.context import LayerInputs
from moelens.models.recipe import Dense, LayerSpec, Mixture, Recipe
from moelens.models.sites import Entry, attention_projections, gated_mlp, own_blocks_site_map, routed_experts
from moelens.models.terms import ParamTerm, vector
from moelens.sitemap import Reference, SiteMap, Weight

LAYER_TYPES = ("sliding_attention", "full_attention")
MLP_LAYER_TYPES = {"dense": False, "sparse": True}
# transformers' BeamConfig defaults (Beam-1.0-501B-A23B's sizes)
DEFAULTS = dict(hidden_size=5120, intermediate_size=20480, num_key_value_heads=8, max_position_embeddings=8192,
                rms_norm_eps=1e-6, head_dim=128, sliding_window=512, moe_intermediate_size=2560, num_experts_per_tok=8,
                num_experts=256, n_group=8, topk_group=4, routed_scaling_factor=2.5, final_logit_softcapping=30.0,
                rope_theta=10000.0)
# present in transformers' config.json, unused by its model
IGNORED_FIELDS = ("attention_dropout", "initializer_range", "output_router_logits", "use_cache")


@dataclass(frozen=True)
class BeamConfig(MoeConfig):
    """MoeConfig plus each layer's rotary (None: NoPE with the scalable-softmax query scale) and the logits' cap."""

    layer_ropes: tuple[RopeConfig | None, ...] = ()
    final_logit_softcapping: float | None = None

    def __post_init__(self) -> None:
        super().__post_init__()
        if len(self.layer_ropes) != self.n_layers:
            raise ValueError(f"layer_ropes ({len(self.layer_ropes)}) needs one entry per layer ({self.n_layers})")

    def rotary(self, layer: int) -> bool:
        """Whether `layer` turns queries and keys by a rotary (else NoPE, with the scalable-softmax scale)."""
        return self.layer_ropes[layer] is not None

    def expert_spec(self) -> ExpertSpec:
        return dataclasses.replace(super().expert_spec(), activation=Float32GLU(self.act_fn))


@dataclass(frozen=True)
class Float32GLU(GLU):
    """act(gate) * up computed in float32 and cast back to the experts' dtype (transformers' BeamExperts)."""

    def __call__(self, gate: torch.Tensor, up: torch.Tensor) -> torch.Tensor:
        return super().__call__(gate.float(), up.float()).to(gate.dtype)


class Float32GatedMLP(GatedMLP):
    """A SwiGLU MLP whose activation and product are float32, cast back (hook_post holds the cast product)."""

    def forward(self, x: Float[torch.Tensor, "batch pos d_model"]) -> Float[torch.Tensor, "batch pos d_model"]:
        pre = self.hook_pre(self.gate_proj(x))
        pre_linear = self.hook_pre_linear(self.up_proj(x))
        post = (self.act(pre.float()) * pre_linear.float()).to(pre.dtype)
        out = self.down_proj(self.hook_post(post))
        return self.hook_out(out) if self.has_hook_out else out


def scalable_softmax_scale(positions: Int[torch.Tensor, "batch pos"]) -> Float[torch.Tensor, "batch pos"]:
    """(1 + (position + 1) / 2048) ** 0.1, float32, in transformers' ops (exp of 0.1 * log1p)."""
    return torch.exp(0.1 * torch.log1p((positions.float() + 1) / 2048))


class BeamAttention(AfmoeAttention):
    """AFMoE's attention (per-head q/k norm, sigmoid output gate, windows per layer) with a bias per head on the
    gate (hook_attn_gate holds gate_proj(x) + gate_bias, before the sigmoid), the layer's own rotary, and on a
    NoPE layer the scalable-softmax query scale (hook_rot_q holds the scaled queries)."""

    @classmethod
    def param_terms(cls, cfg: BeamConfig, layer: int) -> tuple[ParamTerm, ...]:
        return super().param_terms(cfg, layer) + vector("gate_bias", cfg.n_heads, "attention")

    def __init__(self, cfg: BeamConfig, layer: int) -> None:
        super().__init__(cfg, layer)
        self.gate_bias = nn.Parameter(torch.empty(cfg.n_heads))
        self.hook_attn_gate = site_hook("blocks.L.attn.hook_attn_gate", "biased")
        rope = cfg.layer_ropes[layer]
        if not self.rotary:
            self.hook_rot_q = site_hook("blocks.L.attn.hook_rot_q", "nope_scalable_softmax")
        # the model's table serves a layer at the model's rotary; another gets its own
        self.layer_rotary = None if rope is None or rope == cfg.rope else Float32Rotary(dataclasses.replace(cfg, rope=rope))

    def forward(
        self, x: Float[torch.Tensor, "batch pos d_model"] | SplitInputs, inputs: LayerInputs
    ) -> Float[torch.Tensor, "batch pos d_model"]:
        q, k, v = self.project(x)
        xq = split_inputs(x)[0]
        b, p = xq.shape[:2]
        gate = linear_per_head(self.gate_proj, xq).view(b, p, self.n_heads, self.d_head) + self.gate_bias[:, None]
        gate = self.hook_attn_gate(gate)
        z = self.heads(q, k, v, inputs)
        return project_out(self, self.hook_z(z * torch.sigmoid(gate)))

    def position_at(self, q, k, inputs):
        if not self.rotary:
            q, k = self.q_norm(q), self.k_norm(k)
            scale = scalable_softmax_scale(inputs.positions)[:, :, None, None]
            return (q.float() * scale).to(q.dtype), k
        if self.layer_rotary is None:
            return super().position_at(q, k, inputs)
        cos, sin = self.layer_rotary(inputs.positions, q.dtype)
        return self.position(q, k, cos, sin)

    def position(self, q, k, cos, sin):
        # float32 tables: the turn is computed in float32 and cast back, as transformers' Beam
        q, k = self.q_norm(q), self.k_norm(k)
        return apply_rotary(q, cos, sin).to(q.dtype), apply_rotary(k, cos, sin).to(k.dtype)


class BeamRouter(SigmoidGroupedTopK):
    """DeepSeek-V3's grouped sigmoid rule, the experts taken in sorted top-k order, the weights renormalised without
    routed_scaling_factor (the mixture scales the experts' sum: transformers' BeamTopKRouter and BeamMoE)."""

    def weights(
        self, scores: torch.Tensor, indices: torch.Tensor, logits_dtype: torch.dtype
    ) -> Float[torch.Tensor, "... top_k"]:
        w = scores.gather(-1, indices)
        if self.norm_topk_prob:
            w = w / (w.sum(-1, keepdim=True) + 1e-20)
        return w.to(logits_dtype)

    def choose(self, choice_scores: Float[torch.Tensor, "... n_experts"]) -> Int[torch.Tensor, "... top_k"]:
        if self.n_group > 1:
            choice_scores = self._mask_groups(choice_scores)
        return torch.topk(choice_scores, self.top_k, dim=-1).indices


class DepthScaledSandwichBlock(SandwichBlock):
    """SandwichBlock whose adds are depth-scaled: resid * sqrt((i - 1) / i) + out / sqrt(i), i = 2 (layer + 1) for
    the token mixer and one more for the feed-forward; hook_attn_out / hook_mlp_out hold out / sqrt(i)."""

    stream_is_sum = False

    def __init__(self, cfg: MoeConfig, layer: int, spec: LayerSpec) -> None:
        super().__init__(cfg, layer, spec)
        self.adds = tuple(_depth_scales(2 * (layer + 1) + i) for i in range(2))

    def output_multiplier(self, kind: str) -> float:
        return self.adds[kind == "ffn"][0]

    def forward(
        self, resid: Float[torch.Tensor, "batch pos d_model"], inputs: LayerInputs
    ) -> Float[torch.Tensor, "batch pos d_model"]:
        (out_1, keep_1), (out_2, keep_2) = self.adds
        resid = self.hook_resid_pre(resid)
        attn_out = self.hook_attn_out(self.ln1_post(self.token_mixer(self.attn_input(resid), inputs)) * out_1)
        resid = self.hook_resid_mid(attn_out + resid * keep_1)
        mlp_in = self.hook_mlp_in(resid.clone()) if self.use_hook_mlp_in else resid
        mlp_out = self.hook_mlp_out(self.ln2_post(self.mlp(self.ln2(mlp_in))) * out_2)
        return self.hook_resid_post(mlp_out + resid * keep_2)

    def extra_repr(self) -> str:
        return f"adds={self.adds}"


def _depth_scales(i: int) -> tuple[float, float]:
    """(the output's factor, the residual's) of the i-th add, as transformers computes them."""
    return 1.0 / math.sqrt(i), math.sqrt((i - 1) / i)


class HookedBeam(HookedTransformer):
    model_type = "beam"
    rotary_class = Float32Rotary

    @classmethod
    def recipe(cls, cfg: BeamConfig) -> Recipe:
        norm = CastAfterWeightRMSNorm
        mixture, dense = Mixture(ScaledSumMoe, BeamRouter), Dense(Float32GatedMLP)
        layers = tuple(LayerSpec(BeamAttention, mixture if moe else dense, norm, block=DepthScaledSandwichBlock)
                       for moe in cfg.moe_layers)
        return Recipe(layers, norm, logits_softcap=cfg.final_logit_softcapping)

    @classmethod
    def site_map(cls, cfg: BeamConfig) -> SiteMap:
        site_map = own_blocks_site_map(cfg, _layer_sites)
        if cfg.final_logit_softcapping is None:
            return site_map
        references = tuple(dataclasses.replace(r, softcap=cfg.final_logit_softcapping) if r.hook == "hook_logits" else r
                           for r in site_map.references)
        return dataclasses.replace(site_map, references=references)

    @classmethod
    def config_from_hf(cls, raw: dict) -> BeamConfig:
        hf = HFConfig(raw)
        d = DEFAULTS
        n_layers = hf.integer("num_hidden_layers", at_least=1)
        types = _layer_types(hf, "layer_types", n_layers, LAYER_TYPES, _default_layer_types(n_layers))
        ropes = _type_ropes(hf, sorted(set(types)))
        layer_ropes = tuple(ropes[t] for t in types)
        rope = next((r for r in layer_ropes if r is not None), RopeConfig(theta=d["rope_theta"]))
        fields = common_fields(
            hf, rms_norm_eps=d["rms_norm_eps"], max_position_embeddings=d["max_position_embeddings"],
            num_key_value_heads=d["num_key_value_heads"], hidden_size=d["hidden_size"],
            d_head=hf.integer("head_dim", d["head_dim"], at_least=1), rope=rope,
        )
        if "sliding_window" in raw and raw["sliding_window"] is None and "sliding_attention" in types:
            raise ValueError("sliding_window = null but layer_types has sliding_attention layers: they need a window")
        window = hf.integer("sliding_window", d["sliding_window"], at_least=1) if "sliding_attention" in types else None
        n_dense = min(3, n_layers)
        mlp_types = _layer_types(hf, "mlp_layer_types", n_layers, tuple(MLP_LAYER_TYPES),
                                 ["dense"] * n_dense + ["sparse"] * (n_layers - n_dense))
        moe_layers = tuple(MLP_LAYER_TYPES[t] for t in mlp_types)
        if not any(moe_layers):
            raise ValueError("mlp_layer_types makes every block a dense MLP, leaving no mixture block")
        n_experts = hf.integer("num_experts", d["num_experts"], at_least=1)
        routed = routed_fields(hf, moe_layers, n_experts, hf.integer("moe_intermediate_size", d["moe_intermediate_size"],
                               at_least=1), num_experts_per_tok=d["num_experts_per_tok"])
        n_group = hf.integer("n_group", d["n_group"], at_least=1)
        topk_group = hf.integer("topk_group", d["topk_group"], at_least=1)
        SigmoidGroupedTopK.check_groups(n_experts, max(routed["top_k_per_layer"]), n_group, topk_group)
        cap = hf.opt("final_logit_softcapping") if "final_logit_softcapping" in raw else d["final_logit_softcapping"]
        bias = hf.flag("attention_bias", False)
        return BeamConfig(
            **fields,
            **routed,
            family=cls.model_type,
            qkv_bias=bias,
            o_bias=bias,
            d_mlp=hf.integer("intermediate_size", d["intermediate_size"], at_least=1) if not all(moe_layers) else 0,
            norm_topk_prob=hf.flag("norm_topk_prob", True),
            routed_scaling_factor=hf.number("routed_scaling_factor", d["routed_scaling_factor"]),
            n_group=n_group,
            topk_group=topk_group,
            attention_windows=tuple(window if t == "sliding_attention" else None for t in types),
            layer_ropes=layer_ropes,
            final_logit_softcapping=None if cap is None else check_cap("final_logit_softcapping", cap),
            fields_read=tuple(hf.label(f) for f in hf.read),
            fields_ignored=tuple(f for f in IGNORED_FIELDS if raw.get(f) is not None),
        )


def _default_layer_types(n_layers: int) -> list[str]:
    """transformers' default: every sixth layer full attention, and the last one; the others sliding."""
    types = ["sliding_attention" if (i + 1) % 6 else "full_attention" for i in range(n_layers)]
    types[-1] = "full_attention"
    return types


def _layer_types(hf: HFConfig, name: str, n_layers: int, allowed: tuple[str, ...], default: list[str]) -> list[str]:
    types = hf.opt(name)
    if types is None:
        return default
    if not isinstance(types, list) or len(types) != n_layers or not set(types) <= set(allowed):
        raise ValueError(f"{name} must list {n_layers} entries (num_hidden_layers), each one of {list(allowed)}; "
                         f"got {types!r}")
    return types


def _type_ropes(hf: HFConfig, types: list[str]) -> dict[str, RopeConfig | None]:
    """Each layer type's rotary from rope_parameters[type], null for none (transformers' default where
    rope_parameters is absent: the sliding layers' rope_theta 10000, the full layers NoPE)."""
    params = hf.opt("rope_parameters")
    if params is None:
        params = {"sliding_attention": {"rope_type": "default", "rope_theta": DEFAULTS["rope_theta"]},
                  "full_attention": None}
    if not isinstance(params, dict) or not set(types) <= set(params) or not all(
            params[t] is None or isinstance(params[t], dict) for t in types):
        raise ValueError(f"rope_parameters must hold an object (or null: no rotary) per layer type ({types}), as "
                         f"{{\"sliding_attention\": {{...}}, \"full_attention\": null}}; got {params!r:.200}")
    ropes: dict[str, RopeConfig | None] = {}
    for t in types:
        if params[t] is None:
            ropes[t] = None
            continue
        section = {"rope_parameters": params[t], "max_position_embeddings": hf.opt("max_position_embeddings")}
        rope = HFConfig(section).rope(theta=DEFAULTS["rope_theta"])
        if rope.partial_rotary_factor != 1.0:
            raise ValueError(f"rope_parameters.{t}.partial_rotary_factor = {rope.partial_rotary_factor}: transformers' "
                             "Beam turns every dim of a head and does not read it; only 1.0")
        ropes[t] = rope
    return ropes


def _layer_sites(cfg: BeamConfig, layer: int, src: str, dst: str) -> list[Entry]:
    attn = f"{src}.self_attn"
    out_1, out_2 = _depth_scales(2 * (layer + 1)), _depth_scales(2 * (layer + 1) + 1)
    entries = attention_projections(cfg, src, dst) + [
        Weight(f"{dst}.attn.q_norm.weight", (f"{attn}.q_norm.weight",)),
        Weight(f"{dst}.attn.k_norm.weight", (f"{attn}.k_norm.weight",)),
        Weight(f"{dst}.attn.gate_proj.weight", (f"{attn}.gate_proj.weight",)),
        Weight(f"{dst}.attn.gate_bias", (f"{attn}.gate_bias",)),
        Weight(f"{dst}.ln1.weight", (f"{src}.input_layernorm.weight",)),
        Weight(f"{dst}.ln1_post.weight", (f"{src}.post_attention_layernorm.weight",)),
        Weight(f"{dst}.ln2.weight", (f"{src}.pre_feedforward_layernorm.weight",)),
        Weight(f"{dst}.ln2_post.weight", (f"{src}.post_feedforward_layernorm.weight",)),
        Reference(f"{dst}.hook_resid_pre", src, "in"),
        Reference(f"{dst}.ln1.hook_normalized", f"{src}.input_layernorm"),
        Reference(f"{dst}.attn.hook_z", f"{attn}.o_proj", "in"),
        Reference(f"{dst}.ln1_post.hook_normalized", f"{src}.post_attention_layernorm"),
        Reference(f"{dst}.hook_attn_out", f"{src}.post_attention_layernorm", multiplier=out_1[0]),
        Reference(f"{dst}.ln2.hook_normalized", f"{src}.pre_feedforward_layernorm"),
        Reference(f"{dst}.ln2_post.hook_normalized", f"{src}.post_feedforward_layernorm"),
        Reference(f"{dst}.hook_mlp_out", f"{src}.post_feedforward_layernorm", multiplier=out_2[0]),
        Reference(f"{dst}.hook_resid_post", src),
    ]
    if not cfg.moe_layers[layer]:
        return entries + [*gated_mlp(f"{src}.mlp", f"{dst}.mlp"),
                          Reference(f"{dst}.mlp.hook_post", f"{src}.mlp.down_proj", "in")]
    gate = f"{src}.mlp.gate"
    scale = cfg.routed_scaling_factor
    return entries + [
        Weight(f"{dst}.mlp.router.weight", (f"{gate}.weight",)),
        Weight(f"{dst}.mlp.router.e_score_correction_bias", (f"{gate}.e_score_correction_bias",)),
        routed_experts(cfg, (f"{src}.mlp.experts",), dst),
        Reference(f"{dst}.mlp.hook_router_logits", gate, "out.0"),
        Reference(f"{dst}.mlp.hook_expert_weights", gate, "out.1"),
        Reference(f"{dst}.mlp.hook_expert_indices", gate, "out.2"),
        Reference(f"{dst}.mlp.hook_routed_out", f"{src}.mlp.experts", multiplier=scale),
    ]
