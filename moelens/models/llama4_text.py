"""HookedLlama4: the text model of Llama 4, Llama-4-Scout-17B-16E and Llama-4-Maverick-17B-128E (model_type
llama4_text; the Hub's multimodal checkpoints, model_type llama4, nest it as text_config and prefix its keys
`language_model.`, and load the same; their vision tower and projector are not loaded).

What is special about the family (transformers' modeling_llama4):
- the router: the top-k on the logits themselves; each chosen expert's weight is the sigmoid of its logit
  (float32, cast back to the model's dtype), and it scales the expert's *input* (routed_in = x * weight), not
  its output (ExpertSpec.weight_at "input": hook_expert_outputs then holds expert(weight * x)); a shared expert
  of the experts' width is added to the routed sum;
- mixture and dense layers interleaved (moe_layers, else every interleave_moe_layer_step-th layer), the dense
  ones intermediate_size_mlp wide, the experts intermediate_size;
- attention: RoPE layers and NoPE layers (no_rope_layers: 1 rotary, 0 none; default every
  no_rope_layer_interval-th layer has none); the rotary turns each head's dims as interleaved pairs kept in
  place, as complex products in float32 (rope_type llama3 in the published checkpoints); on RoPE layers a
  weightless L2 norm of each query and key head after the rotary (use_qk_norm); on NoPE layers the queries
  are scaled by log1p(floor((i + 1) / floor_scale)) * attn_scale + 1, i the query's index in the input and
  cache (attn_temperature_tuning: transformers counts padding there too); chunked attention on the layers
  layer_types marks chunked_attention (by default the RoPE layers): a query sees only the keys of its own
  chunk of attention_chunk_size positions, chunks counted from each row's first real token; the softmax in the
  scores' dtype (no float32 upcast).

transformers' Llama 4 is not invariant to left padding: the NoPE layers' temperature counts the padding
positions, so a padded row differs from the same row alone; moelens computes what transformers' padded run does.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass
from typing import ClassVar

import torch
import torch.nn.functional as F
from jaxtyping import Bool, Float, Int

from moelens.config import HFConfig, MoeConfig, common_fields, routed_fields
from moelens.experts.spec import GLU, ExpertSpec
from moelens.hooks.sites import site_hook
from moelens.models.base import HookedTransformer
from moelens.models.components import SharedExpertMoe, TopKRouter
from moelens.models.components.attention import Attention
from moelens.models.components.rotary import PolarRotary, apply_rotary_pairs
from moelens.models.context import LayerInputs
from moelens.models.recipe import Dense, LayerSpec, Mixture, Recipe
from moelens.models.sites import GATE_UP_DOWN, Entry, decoder_site_map
from moelens.sitemap import ExpertStack, FusedExperts, PerExpertKeys, Reference, SiteMap, Transposed, Weight

DEFAULT_ROPE_THETA = 500000.0  # transformers' Llama4TextConfig.default_theta
LAYER_TYPES = ("chunked_attention", "full_attention")
HUB_PREFIX = "language_model."  # the multimodal checkpoints' text model
# the multimodal checkpoints' other parts, not part of the text model
MULTIMODAL_PREFIXES = ("vision_model.", "multi_modal_projector.")
# read by transformers for training or generation only
IGNORED_FIELDS = ("router_aux_loss_coef", "router_jitter_noise", "attention_dropout", "output_router_logits")


@dataclass(frozen=True)
class Llama4Config(MoeConfig):
    """MoeConfig plus, per layer, whether the layer turns q and k by the rotary (rope_layers) and the chunk its
    attention is confined to (attention_chunks, None: every earlier position); the attention temperature of the
    NoPE layers; and the prefix of the checkpoint's keys ("language_model." for the Hub's nested checkpoints)."""

    rope_layers: tuple[bool, ...] = ()
    attention_chunks: tuple[int | None, ...] = ()
    use_qk_norm: bool = True
    attn_temperature_tuning: bool = True
    floor_scale: float = 8192.0
    attn_scale: float = 0.1
    key_prefix: str = ""

    def __post_init__(self) -> None:
        super().__post_init__()
        for name in ("rope_layers", "attention_chunks"):
            if len(getattr(self, name)) != self.n_layers:
                raise ValueError(f"{name} ({len(getattr(self, name))}) needs one entry per layer ({self.n_layers})")

    def expert_spec(self) -> ExpertSpec:
        return ExpertSpec(
            self.n_experts, self.d_model, self.d_expert, GLU(self.act_fn), storage=self.expert_storage,
            weight_at="input", slot_order="stable",  # its reference runs each expert's tokens in token order
        )


# ---- attention ----------------------------------------------------------------------------------------------


def same_chunk(inputs: LayerInputs, chunk: int) -> Bool[torch.Tensor, "batch 1 query key"]:
    """Keys in the query's chunk of `chunk` positions, chunks counted from each row's first real token as
    transformers' chunked mask does ((key - left_padding) // chunk == (query - left_padding) // chunk): with
    the query's position p (its count of real tokens before it), the keys at most p % chunk indices back."""
    query, key = inputs.key_offsets()  # [query 1], [1 key]
    back = (inputs.positions % chunk)[:, None, :, None]  # [batch 1 query 1]
    return (query - key)[None, None] <= back


class Llama4Attention(Attention):
    """Llama 4's attention without a position step of its own (a NoPE layer): chunked where
    cfg.attention_chunks says, the softmax in the scores' dtype (transformers' Llama 4 eager attention does not
    upcast it)."""

    def __init__(self, cfg: Llama4Config, layer: int) -> None:
        super().__init__(cfg, layer)
        self.chunk: int | None = cfg.attention_chunks[layer]

    def allowed(self, inputs: LayerInputs) -> Bool[torch.Tensor, "batch 1 query key"]:
        return inputs.allowed if self.chunk is None else inputs.allowed & same_chunk(inputs, self.chunk)

    def softmax(self, scores: Float[torch.Tensor, "batch head query key"]) -> Float[torch.Tensor, "batch head query key"]:
        return F.softmax(scores, dim=-1)

    def position(self, q, k, cos, sin):
        # no rotary; copies, so that an in-place edit of hook_rot_q / hook_rot_k leaves hook_q / hook_k's tensors
        return q.clone(), k.clone()

    def extra_repr(self) -> str:
        return f"attention_chunk_size={self.chunk}"


class TemperatureNoRopeAttention(Llama4Attention):
    """A NoPE layer with attention temperature tuning: each query times log1p(floor((i + 1) / floor_scale)) *
    attn_scale + 1 (float32, cast back), i its index among the input's and the cache's positions (padding
    counted, as transformers counts it); hook_rot_q holds the scaled queries."""

    def __init__(self, cfg: Llama4Config, layer: int) -> None:
        super().__init__(cfg, layer)
        self.floor_scale, self.attn_scale = cfg.floor_scale, cfg.attn_scale
        self.hook_rot_q = site_hook("blocks.L.attn.hook_rot_q", "nope_temperature")

    def temperature(self, inputs: LayerInputs) -> Float[torch.Tensor, "query"]:
        query = inputs.key_offsets()[0][:, 0]
        return torch.log1p(torch.floor((query.float() + 1.0) / self.floor_scale)) * self.attn_scale + 1.0

    def position_at(self, q, k, inputs):
        return (q * self.temperature(inputs)[None, :, None, None]).to(q.dtype), k.clone()

    def extra_repr(self) -> str:
        return f"{super().extra_repr()}, floor_scale={self.floor_scale}, attn_scale={self.attn_scale}"


class PairRotaryAttention(Llama4Attention):
    """A RoPE layer: each head's dims turned as interleaved pairs (apply_rotary_pairs)."""

    def position(self, q, k, cos, sin):
        return apply_rotary_pairs(q, cos, sin), apply_rotary_pairs(k, cos, sin)


def l2_norm(x: Float[torch.Tensor, "... d"], eps: float) -> Float[torch.Tensor, "... d"]:
    """x / sqrt(mean(x^2) + eps) over the last axis, in float32, cast back (transformers' Llama4TextL2Norm)."""
    x32 = x.float()
    return (x32 * torch.rsqrt(x32.pow(2).mean(-1, keepdim=True) + eps)).type_as(x)


class PairRotaryL2NormAttention(PairRotaryAttention):
    """A RoPE layer with use_qk_norm: after the rotary, each query and key head divided by its RMS (no weight)."""

    def __init__(self, cfg: Llama4Config, layer: int) -> None:
        super().__init__(cfg, layer)
        self.eps = cfg.norm_eps

    def position(self, q, k, cos, sin):
        q, k = super().position(q, k, cos, sin)
        return l2_norm(q, self.eps), l2_norm(k, self.eps)


# ---- the router ---------------------------------------------------------------------------------------------


class SigmoidOfChosenLogits(TopKRouter):
    """Llama 4's rule: logits in the model's dtype, the top-k taken on them (hook_router_scores holds them as
    they are), each chosen expert's weight the sigmoid of its logit, computed in float32 and cast to the
    logits' dtype. The weight scales the expert's input (Llama4Config.expert_spec)."""

    scoring = "top-k logits, sigmoid of the chosen"
    scores_form = "top_k_logits_sigmoid"

    def logits(self, x: Float[torch.Tensor, "... d_model"]) -> Float[torch.Tensor, "... n_experts"]:
        return F.linear(x, self.weight)

    def scores(self, logits: torch.Tensor) -> Float[torch.Tensor, "... n_experts"]:
        return logits.clone()  # its own tensor: an in-place edit of the scores must not reach the cached logits

    def choose(self, choice_scores: Float[torch.Tensor, "... n_experts"]) -> Int[torch.Tensor, "... top_k"]:
        return torch.topk(choice_scores, self.top_k, dim=-1).indices

    def weights(self, scores: torch.Tensor, indices: torch.Tensor, logits_dtype: torch.dtype) -> torch.Tensor:
        return torch.sigmoid(scores.gather(-1, indices).float()).to(logits_dtype)

    def probabilities(self, scores: Float[torch.Tensor, "... n_experts"]) -> Float[torch.Tensor, "... n_experts"]:
        """Every expert's sigmoid, float32, rescaled to sum to one (for the analyses' entropy and usage)."""
        s = torch.sigmoid(scores.float())
        return s / s.sum(-1, keepdim=True)


# ---- the family ---------------------------------------------------------------------------------------------


class HookedLlama4(HookedTransformer):
    model_type = "llama4_text"
    model_type_aliases: ClassVar[tuple[str, ...]] = ("llama4",)  # the Hub's multimodal config, text_config nested
    rotary_class = PolarRotary

    @classmethod
    def recipe(cls, cfg: Llama4Config) -> Recipe:
        mixture, dense = Mixture(SharedExpertMoe, SigmoidOfChosenLogits), Dense()
        layers = tuple(
            LayerSpec(attention_class(cfg, layer), mixture if is_moe else dense)
            for layer, is_moe in enumerate(cfg.moe_layers)
        )
        return Recipe(layers)

    @classmethod
    def site_map(cls, cfg: Llama4Config) -> SiteMap:
        ignored = MULTIMODAL_PREFIXES if cfg.key_prefix else ()
        # transformers' mixture returns (out, router logits), its dense MLP the output alone
        site_map = decoder_site_map(
            cfg, _layer_sites, ignored, mlp_read="out.0", key_prefix=cfg.key_prefix, mlp_module="feed_forward"
        )
        dense_outputs = {f"blocks.{layer}.hook_mlp_out" for layer in cfg.dense_layer_indices}
        references = tuple(
            dataclasses.replace(r, read="out") if r.hook in dense_outputs else r for r in site_map.references
        )
        return dataclasses.replace(site_map, references=references)

    @classmethod
    def config_from_hf(cls, raw: dict) -> Llama4Config:
        outer = HFConfig(raw)
        nested = raw.get("model_type") == "llama4"
        if nested and not isinstance(raw.get("text_config"), dict):
            raise ValueError("model_type 'llama4' (the multimodal checkpoint) needs its text model's text_config object")
        hf = outer.section("text_config") if nested else outer
        cfg = _read_text_config(hf, cls.model_type)
        read = tuple(hf.label(f) for f in hf.read)
        ignored = tuple(hf.label(f) for f in IGNORED_FIELDS if hf.raw.get(f) is not None)
        if nested:
            ignored += tuple(f for f in ("vision_config", "boi_token_index", "eoi_token_index", "image_token_index") if f in raw)
        return dataclasses.replace(
            cfg, key_prefix=HUB_PREFIX if nested else "", fields_read=read, fields_ignored=ignored
        )


def attention_class(cfg: Llama4Config, layer: int) -> type[Attention]:
    if cfg.rope_layers[layer]:
        return PairRotaryL2NormAttention if cfg.use_qk_norm else PairRotaryAttention
    return TemperatureNoRopeAttention if cfg.attn_temperature_tuning else Llama4Attention


def _read_text_config(hf: HFConfig, family: str) -> Llama4Config:
    fields = common_fields(
        hf, rms_norm_eps=1e-5, max_position_embeddings=131072, num_key_value_heads=8, rope_theta=DEFAULT_ROPE_THETA,
        d_head=hf.integer("head_dim", 128, at_least=1),  # transformers' default, not hidden_size / heads
    )
    n = fields["n_layers"]
    moe = hf.integers("moe_layers", None, at_least=0, at_most=n - 1)
    if moe is None:  # transformers: every interleave_moe_layer_step-th layer, the last of each step
        step = hf.integer("interleave_moe_layer_step", 1, at_least=1)
        moe = list(range(step - 1, n, step))
    moe_layers = tuple(layer in set(moe) for layer in range(n))
    n_experts = hf.integer("num_local_experts", 16, at_least=1)
    d_expert = hf.integer("intermediate_size", 8192, at_least=1)
    rope_layers = _rope_layers(hf, n)
    bias = hf.flag("attention_bias", False)  # on q, k, v and o alike
    return Llama4Config(
        **fields,
        **routed_fields(hf, moe_layers, n_experts, d_expert, num_experts_per_tok=1),
        family=family,
        d_mlp=hf.integer("intermediate_size_mlp", 16384, at_least=1) if not all(moe_layers) else 0,
        d_shared=d_expert,
        qkv_bias=bias,
        o_bias=bias,
        rope_layers=rope_layers,
        attention_chunks=_attention_chunks(hf, rope_layers),
        use_qk_norm=hf.flag("use_qk_norm", True),
        attn_temperature_tuning=_temperature_tuning(hf),
        floor_scale=hf.number("floor_scale", 8192, above=0),
        attn_scale=hf.number("attn_scale", 0.1),
    )


def _rope_layers(hf: HFConfig, n: int) -> tuple[bool, ...]:
    """no_rope_layers: per layer 1 (rotary) or 0 (NoPE); absent or empty, transformers' default: NoPE on every
    no_rope_layer_interval-th layer."""
    listed = hf.integers("no_rope_layers", None, at_least=0, at_most=1)
    if not listed:
        interval = hf.integer("no_rope_layer_interval", 4, at_least=1)
        return tuple((layer + 1) % interval != 0 for layer in range(n))
    if len(listed) != n:
        raise ValueError(f"{hf.label('no_rope_layers')} has {len(listed)} entries, expected one per layer ({n})")
    return tuple(bool(v) for v in listed)


def _attention_chunks(hf: HFConfig, rope_layers: tuple[bool, ...]) -> tuple[int | None, ...]:
    """The chunk of each layer's attention: attention_chunk_size (8192 where absent, none where null, as
    transformers) on the layers layer_types marks chunked_attention (by default the RoPE layers)."""
    chunk = hf.integer("attention_chunk_size", None, at_least=1)
    if chunk is None and "attention_chunk_size" not in hf:
        chunk = 8192  # transformers' default; an explicit null turns chunking off
    types = hf.opt("layer_types")
    if types is None:
        types = ["chunked_attention" if rope and chunk is not None else "full_attention" for rope in rope_layers]
    if not isinstance(types, list) or len(types) != len(rope_layers) or not set(types) <= set(LAYER_TYPES):
        raise ValueError(
            f"{hf.label('layer_types')} must list {len(rope_layers)} entries, each one of {LAYER_TYPES}; got {types!r}"
        )
    if "chunked_attention" in types and chunk is None:
        raise ValueError(
            f"{hf.label('layer_types')} has chunked_attention layers but {hf.label('attention_chunk_size')} is null"
        )
    return tuple(chunk if kind == "chunked_attention" else None for kind in types)


def _temperature_tuning(hf: HFConfig) -> bool:
    """attn_temperature_tuning: true / false (transformers' type), or an integer, read as transformers' `if`
    reads it (nonzero: on); the Hub's configs have written 4."""
    value = hf.opt("attn_temperature_tuning", True)
    if isinstance(value, bool):
        return value
    if isinstance(value, int) and value >= 0:
        return value != 0
    raise ValueError(
        f"{hf.label('attn_temperature_tuning')} = {value!r} ({type(value).__name__}); expected true / false or a "
        "non-negative integer"
    )


def _layer_sites(cfg: Llama4Config, layer: int, src: str, dst: str) -> list[Entry]:
    key = f"{cfg.key_prefix}{src}"  # checkpoint keys; references name transformers' modules (src)
    attn, ff = f"{src}.self_attn", f"{src}.feed_forward"
    entries: list[Entry] = []
    for proj in "qkvo":
        entries.append(Weight(f"{dst}.attn.{proj}_proj.weight", (f"{key}.self_attn.{proj}_proj.weight",)))
        if cfg.qkv_bias:
            entries.append(Weight(f"{dst}.attn.{proj}_proj.bias", (f"{key}.self_attn.{proj}_proj.bias",)))
        if proj != "o":
            entries.append(Reference(f"{dst}.attn.hook_{proj}", f"{attn}.{proj}_proj"))
    entries.append(Reference(f"{dst}.attn.hook_z", f"{attn}.o_proj", "in"))
    if not cfg.moe_layers[layer]:
        return entries + _gated(f"{key}.feed_forward", f"{dst}.mlp") + [
            Reference(f"{dst}.mlp.hook_post", f"{ff}.down_proj", "in"),
        ]
    return entries + [
        Weight(f"{dst}.mlp.router.weight", (f"{key}.feed_forward.router.weight",)),
        _experts(cfg, f"{key}.feed_forward.experts", dst),
        *_gated(f"{key}.feed_forward.shared_expert", f"{dst}.mlp.shared_expert"),
        # transformers' router returns (dense sigmoid scores [tokens, experts], zero where not chosen; logits),
        # its experts every expert's output on every (scaled) token, [experts * tokens, d_model]
        Reference(f"{dst}.mlp.hook_router_logits", f"{ff}.router", "out.1"),
        Reference(f"{dst}.mlp.hook_expert_indices", f"{ff}.router", f"out.0.topk_indices.{cfg.top_k_per_layer[layer]}"),
        Reference(f"{dst}.mlp.hook_expert_weights", f"{ff}.router", f"out.0.topk_values.{cfg.top_k_per_layer[layer]}"),
        Reference(f"{dst}.mlp.hook_routed_out", f"{ff}.experts", f"out.expert_sum.{cfg.n_experts}"),
        Reference(f"{dst}.mlp.shared_expert.hook_post", f"{ff}.shared_expert.down_proj", "in"),
        Reference(f"{dst}.mlp.shared_expert.hook_out", f"{ff}.shared_expert", "out.copy"),
        Reference(f"{dst}.mlp.hook_shared_out", f"{ff}.shared_expert", "out.copy"),
    ]


def _gated(key: str, ours: str) -> list[Weight]:
    return [Weight(f"{ours}.{p}.weight", (f"{key}.{p}.weight",)) for p in ("gate_proj", "up_proj", "down_proj")]


def _experts(cfg: Llama4Config, key: str, dst: str) -> ExpertStack:
    """transformers' fused layout, gate_up_proj [E, d_model, 2*d_expert] (gate columns first) and down_proj [E,
    d_expert, d_model], both x @ W (the Hub's bfloat16 checkpoints); or per-expert gate_proj / up_proj /
    down_proj [out, in] (Meta's fp8 Maverick spells its experts so)."""
    per_expert = PerExpertKeys(*(f"{key}.{k}" for k in (GATE_UP_DOWN.gate, GATE_UP_DOWN.up, GATE_UP_DOWN.down)))
    fused = FusedExperts(f"{key}.gate_up_proj", f"{key}.down_proj", layouts=(Transposed(), Transposed(), Transposed(), Transposed()))
    return ExpertStack(f"{dst}.mlp.experts", cfg.n_experts, cfg.d_expert, (per_expert,), fused, fused_first=True)

