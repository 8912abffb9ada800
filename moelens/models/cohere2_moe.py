"""HookedCohere2Moe: Cohere's Command-A MoE (model_type cohere2_moe).

What is special about the family:
- a parallel block: one norm (input_layernorm, blocks.L.ln1) reads the stream, attention and the mixture (or
  dense MLP) both read its output, and both outputs are added to the stream, resid_post = resid_pre + attn_out +
  mlp_out in that order (transformers'). No stream lies between the two sublayers, so the block has no ln2 and
  no hook_resid_mid (as TransformerLens's parallel_attn_mlp blocks): the mixture reads resid_pre through ln1.
  With hook_mlp_in switched on, it holds a copy of resid_pre, which only the feed-forward reads (through ln1
  again); cfg.parallel_attn_mlp is True;
- Cohere's LayerNorm: the input centred and divided by sqrt(var + layer_norm_eps), without a bias, computed in
  float32 with the weight applied in float32 and one cast back (CohereLayerNorm); where config.json sets
  rms_norm_eps, an RMSNorm with that eps instead, as transformers chooses;
- the logits are lm_head's output times logit_scale (0.0625 by default); hook_logits holds the product;
- sliding-window layers and full layers (layer_types; by default each sliding_window_pattern-th layer full): the
  rotary turns q and k on the sliding layers only, on adjacent pairs (x0, x1), (x2, x3), ... in float32 with cos
  and sin in the stream's dtype; the full layers have no positional encoding (NoPE: hook_rot_q / hook_rot_k hold
  q and k as projected), except dense layers while prefix_dense_sliding_window_pattern is 1 (transformers'
  force_rope);
- dense layers where mlp_layer_types says "dense" (or the first first_k_dense_replace layers, where
  mlp_layer_types is absent), prefix_dense_intermediate_size wide (intermediate_size where null);
- the router takes the top-k of its logits in the model's dtype; expert_selection_fn "softmax" weights the k by a
  float32 softmax over them, "sigmoid" by their sigmoids (in the model's dtype), divided by their sum where
  norm_topk_prob; cast to the model's dtype;
- num_shared_experts > 0 adds an MLP num_shared_experts * intermediate_size wide to the routed experts' output
  (shared_expert_combination_strategy "sum"); the "average" strategy, (routed + shared) / 2, is refused.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass
from typing import Literal

import torch
import torch.nn.functional as F
from jaxtyping import Float
from torch import nn

from moelens.config import HFConfig, MoeConfig, common_fields, routed_fields
from moelens.hooks.sites import site_hook
from moelens.models.base import HookedTransformer
from moelens.models.components import SparseMoe
from moelens.models.components.attention import NoPositionAttention
from moelens.models.components.block import Block, Sublayer
from moelens.models.components.layer_norm import BiasFreeLayerNorm
from moelens.models.components.moe import SharedExpertMoe
from moelens.models.components.norm import RMSNorm
from moelens.models.components.rotary import apply_rotary_adjacent_pairs
from moelens.models.components.router import TopKLogitsSoftmax
from moelens.models.components.sliding_window_attention import SlidingWindowAttention
from moelens.models.context import LayerInputs
from moelens.models.llama4_text import SigmoidOfChosenLogits
from moelens.models.mixers.base import StateTensor
from moelens.models.recipe import Dense, LayerSpec, Mixture, Recipe
from moelens.models.sites import (
    Entry, attention_projections, dense_mlp, gated_mlp, own_blocks_site_map, router_references, routed_experts,
)
from moelens.models.terms import ParamTerm, under
from moelens.sitemap import Reference, SiteMap, Weight

LAYER_TYPES = ("full_attention", "sliding_attention")
MLP_LAYER_TYPES = {"dense": False, "sparse": True}
SELECTIONS = ("softmax", "sigmoid")
# transformers' Cohere2MoeConfig defaults
DEFAULTS = dict(hidden_size=8192, intermediate_size=22528, logit_scale=0.0625, head_dim=128,
                max_position_embeddings=8192, layer_norm_eps=1e-5, sliding_window=4096, num_experts_per_tok=2, num_experts=8,
                sliding_window_pattern=4, prefix_dense_sliding_window_pattern=1)
# present in transformers' config.json, unused by its model's forward
IGNORED_FIELDS = ("attention_dropout", "initializer_range", "output_router_logits", "use_cache")


@dataclass(frozen=True)
class Cohere2MoeConfig(MoeConfig):
    """MoeConfig plus the logits' scale, which layers the rotary turns, and the block norm's kind."""

    logit_scale: float = 0.0625
    rotary_layers: tuple[bool, ...] = ()  # per layer: q and k rotated (else no positional encoding)
    norm: Literal["layer_norm", "rms_norm"] = "layer_norm"
    expert_selection_fn: Literal["softmax", "sigmoid"] = "softmax"

    def __post_init__(self) -> None:
        super().__post_init__()
        if len(self.rotary_layers) != self.n_layers:
            raise ValueError(f"rotary_layers ({len(self.rotary_layers)}) needs one entry per layer ({self.n_layers})")

    @property
    def parallel_attn_mlp(self) -> bool:
        return True


class CohereLayerNorm(BiasFreeLayerNorm):
    """transformers' Cohere2MoeLayerNorm: (x - mean) * rsqrt(var + eps) in float32, times the weight in float32,
    cast back once; no bias. BiasFreeLayerNorm's hooks (hook_scale holds sqrt(var + eps))."""

    def unhooked(self, x: Float[torch.Tensor, "... d"]) -> Float[torch.Tensor, "... d"]:
        x32 = x.float()
        centred = x32 - x32.mean(-1, keepdim=True)
        normed = centred * torch.rsqrt(centred.pow(2).mean(-1, keepdim=True) + self.eps)
        return (self.weight.float() * normed).to(x.dtype)


class PairRotaryAttention(SlidingWindowAttention):
    """Attention whose rotary turns adjacent pairs of every head dim (transformers' Cohere2Moe rotate_half, in
    float32), windowed where the layer is sliding."""

    def position(self, q, k, cos, sin):
        return apply_rotary_adjacent_pairs(q, cos, sin), apply_rotary_adjacent_pairs(k, cos, sin)


class TopKLogitsFloat32Softmax(TopKLogitsSoftmax):
    """TopKLogitsSoftmax on the logits in the model's dtype (transformers' Cohere2MoeTopKRouter takes the top-k of
    them as they are, ties included): hook_router_scores holds them so."""

    def logits(self, x: Float[torch.Tensor, "... d_model"]) -> Float[torch.Tensor, "... n_experts"]:
        return F.linear(x.to(self.weight.dtype), self.weight)

    def scores(self, logits: torch.Tensor) -> Float[torch.Tensor, "... n_experts"]:
        return logits.clone()  # its own tensor: an in-place edit of the scores must not reach the cached logits


class SigmoidOfChosenLogitsRenormalised(SigmoidOfChosenLogits):
    """The top-k of the logits in the model's dtype, each chosen one's sigmoid in that dtype, divided by their sum
    where norm_topk_prob (transformers' Cohere2MoeTopKRouter with expert_selection_fn "sigmoid")."""

    scoring = "top-k logits, sigmoid of the chosen, renormalised"

    def weights(self, scores: torch.Tensor, indices: torch.Tensor, logits_dtype: torch.dtype) -> torch.Tensor:
        w = torch.sigmoid(scores.gather(-1, indices))
        if self.norm_topk_prob:
            w = w / w.sum(-1, keepdim=True)
        return w.to(logits_dtype)


class ParallelBlock(Block):
    """ln1 once, then attention and the feed-forward on its output, both added: resid_pre + attn_out + mlp_out.
    No hook_resid_mid and no ln2 (module docstring)."""

    @classmethod
    def param_terms(cls, cfg: MoeConfig, layer: int, spec: LayerSpec) -> tuple[ParamTerm, ...]:
        return (under("ln1", spec.norm.param_terms(cfg.d_model))
                + under(spec.mixer.block_attribute, spec.mixer.param_terms(cfg, layer))
                + under("mlp", spec.ffn.param_terms(cfg, layer)))

    @classmethod
    def state_tensors(cls, cfg: MoeConfig, spec: LayerSpec) -> tuple[StateTensor, ...]:
        return spec.mixer.state_tensors(cfg)

    def __init__(self, cfg: MoeConfig, layer: int, spec: LayerSpec) -> None:
        nn.Module.__init__(self)
        self.is_moe = spec.is_moe
        self.residual_multiplier = 1.0
        self.n_heads, self.n_kv_heads = cfg.n_heads, cfg.n_kv_heads
        self.ln1 = spec.norm(cfg.d_model, cfg.norm_eps, site="blocks.L.ln1")
        mixer = spec.mixer(cfg, layer)
        self.mixer_attribute = mixer.block_attribute
        setattr(self, self.mixer_attribute, mixer)
        self.mlp: nn.Module = spec.ffn.build(cfg, layer)
        self.hook_resid_pre = site_hook("blocks.L.hook_resid_pre")
        self.hook_attn_out = site_hook("blocks.L.hook_attn_out")
        self.hook_mlp_out = site_hook("blocks.L.hook_mlp_out")
        self.hook_resid_post = site_hook("blocks.L.hook_resid_post")

    def sublayers(self) -> list[Sublayer]:
        return [Sublayer("mixer", self.ln1, self.token_mixer, "hook_attn_out"),
                Sublayer("ffn", self.ln1, self.mlp, "hook_mlp_out")]

    def ffn_input_sublayers(self) -> list[Sublayer]:
        return []  # the feed-forward reads ln1(resid_pre), without the attention's output

    def forward(
        self, resid: Float[torch.Tensor, "batch pos d_model"], inputs: LayerInputs
    ) -> Float[torch.Tensor, "batch pos d_model"]:
        resid = self.hook_resid_pre(resid)
        if self.use_split_qkv_input or self.use_attn_in or self.use_hook_mlp_in:
            # each sublayer its own normed input, so an edit of one's (hook_q_input, hook_mlp_in, ...) reaches it alone
            attn_in = self.attn_input(resid)
            mlp_normed = self.ln1(self.hook_mlp_in(resid.clone()) if self.use_hook_mlp_in else resid)
        else:
            attn_in = mlp_normed = self.ln1(resid)
        attn_out = self.hook_attn_out(self.token_mixer(attn_in, inputs))
        mlp_out = self.hook_mlp_out(self.mlp(mlp_normed))
        return self.hook_resid_post(resid + attn_out + mlp_out)


class HookedCohere2Moe(HookedTransformer):
    model_type = "cohere2_moe"

    @classmethod
    def recipe(cls, cfg: Cohere2MoeConfig) -> Recipe:
        norm = CohereLayerNorm if cfg.norm == "layer_norm" else RMSNorm
        router = TopKLogitsFloat32Softmax if cfg.expert_selection_fn == "softmax" else SigmoidOfChosenLogitsRenormalised
        mixture = Mixture(SharedExpertMoe if cfg.d_shared else SparseMoe, router)
        layers = tuple(
            LayerSpec(PairRotaryAttention if rotary else NoPositionAttention, mixture if moe else Dense(), norm,
                      block=ParallelBlock)
            for rotary, moe in zip(cfg.rotary_layers, cfg.moe_layers, strict=True)
        )
        return Recipe(layers, norm, logits_divisor=1.0 / cfg.logit_scale)

    @classmethod
    def site_map(cls, cfg: Cohere2MoeConfig) -> SiteMap:
        site_map = own_blocks_site_map(cfg, _layer_sites)
        # transformers multiplies lm_head's output by logit_scale
        references = tuple(dataclasses.replace(r, multiplier=cfg.logit_scale) if r.hook == "hook_logits" else r
                           for r in site_map.references)
        return dataclasses.replace(site_map, references=references)

    @classmethod
    def config_from_hf(cls, raw: dict) -> Cohere2MoeConfig:
        hf = HFConfig(raw)
        d = DEFAULTS
        n_layers = hf.integer("num_hidden_layers", at_least=1)
        first_dense = hf.integer("first_k_dense_replace", 0, at_least=0, at_most=n_layers)
        types = _layer_types(hf, n_layers, first_dense)
        mlp_types = _listed(hf, "mlp_layer_types", n_layers, tuple(MLP_LAYER_TYPES),
                            ["dense" if i < first_dense else "sparse" for i in range(n_layers)])
        moe_layers = tuple(MLP_LAYER_TYPES[t] for t in mlp_types)
        if not any(moe_layers):
            raise ValueError("mlp_layer_types makes every block a dense MLP, leaving no mixture block")
        force_rope = hf.integer("prefix_dense_sliding_window_pattern", d["prefix_dense_sliding_window_pattern"],
                                at_least=1) == 1
        rotary = tuple(t == "sliding_attention" or (force_rope and not moe) for t, moe in zip(types, moe_layers))
        if "sliding_window" in raw and raw["sliding_window"] is None and "sliding_attention" in types:
            raise ValueError("sliding_window = null but layer_types has sliding_attention layers: they need a window")
        window = hf.integer("sliding_window", d["sliding_window"], at_least=1) if "sliding_attention" in types else None

        fields = common_fields(
            hf, rms_norm_eps=d["layer_norm_eps"], max_position_embeddings=d["max_position_embeddings"],
            hidden_size=d["hidden_size"], d_head=hf.integer("head_dim", d["head_dim"], at_least=1),
        )
        fields["tie_word_embeddings"] = hf.flag("tie_word_embeddings", True)
        if fields["rope"].partial_rotary_factor != 1.0:  # transformers' Cohere2Moe rotary turns the whole head
            raise ValueError(f"partial_rotary_factor = {fields['rope'].partial_rotary_factor}: Cohere2Moe's rotary "
                             "(transformers') turns every dimension of the head, so only 1 is supported")
        # transformers builds an RMSNorm where rms_norm_eps is set, else its LayerNorm with layer_norm_eps
        rms_eps = fields["norm_eps"] if hf.opt("rms_norm_eps") is not None else None
        layer_eps = hf.number("layer_norm_eps", d["layer_norm_eps"], at_least=0)
        fields["norm_eps"] = layer_eps if rms_eps is None else rms_eps
        selection = hf.text("expert_selection_fn", "softmax")
        if selection not in SELECTIONS:
            raise ValueError(f"expert_selection_fn = {selection!r}; transformers' Cohere2Moe router knows only "
                             f"{list(SELECTIONS)}")
        intermediate = hf.integer("intermediate_size", d["intermediate_size"], at_least=1)
        n_shared = hf.integer("num_shared_experts", 0, at_least=0)
        strategy = hf.text("shared_expert_combination_strategy", "average")
        if strategy not in ("sum", "average"):
            raise ValueError(f"shared_expert_combination_strategy = {strategy!r}; transformers' Cohere2Moe knows only "
                             "'sum' and 'average'")
        if n_shared and strategy != "sum":
            raise ValueError(f"shared_expert_combination_strategy = {strategy!r} with num_shared_experts = {n_shared}: "
                             "only 'sum' is supported (transformers also knows 'average', (routed + shared) / 2, "
                             "which moelens does not build)")
        logit_scale = hf.number("logit_scale", d["logit_scale"], above=0)
        dense_width = hf.integer("prefix_dense_intermediate_size", intermediate, at_least=1)
        bias = hf.flag("attention_bias", False)
        return Cohere2MoeConfig(
            **fields,
            **routed_fields(hf, moe_layers, hf.integer("num_experts", d["num_experts"], at_least=1), intermediate,
                            num_experts_per_tok=d["num_experts_per_tok"]),
            family=cls.model_type,
            qkv_bias=bias,
            o_bias=bias,
            d_mlp=dense_width if not all(moe_layers) else 0,
            d_shared=n_shared * intermediate,
            # read by the sigmoid rule only, as transformers
            norm_topk_prob=hf.flag("norm_topk_prob", True) and selection == "sigmoid",
            attention_windows=tuple(window if t == "sliding_attention" else None for t in types),
            logit_scale=logit_scale,
            rotary_layers=rotary,
            norm="rms_norm" if rms_eps is not None else "layer_norm",
            expert_selection_fn=selection,
            fields_read=tuple(hf.read),
            fields_ignored=tuple(f for f in IGNORED_FIELDS if raw.get(f) is not None),
        )


def _listed(hf: HFConfig, name: str, n_layers: int, allowed: tuple[str, ...], default: list[str]) -> list[str]:
    types = hf.opt(name)
    if types is None:
        return default
    if not isinstance(types, list) or len(types) != n_layers or not set(types) <= set(allowed):
        raise ValueError(f"{name} must list {n_layers} entries (num_hidden_layers), each one of {list(allowed)}; "
                         f"got {types!r}")
    return types


def _layer_types(hf: HFConfig, n_layers: int, first_dense: int) -> list[str]:
    """layer_types, else transformers' default: within the first first_k_dense_replace layers each
    prefix_dense_sliding_window_pattern-th full, after them each sliding_window_pattern-th, counted from 1."""
    d = DEFAULTS
    prefix = hf.integer("prefix_dense_sliding_window_pattern", d["prefix_dense_sliding_window_pattern"], at_least=1)
    pattern = hf.integer("sliding_window_pattern", d["sliding_window_pattern"], at_least=1)
    default = ([LAYER_TYPES[(i + 1) % prefix != 0] for i in range(first_dense)]
               + [LAYER_TYPES[(i + 1) % pattern != 0] for i in range(n_layers - first_dense)])
    return _listed(hf, "layer_types", n_layers, LAYER_TYPES, default)


def _layer_sites(cfg: Cohere2MoeConfig, layer: int, src: str, dst: str) -> list[Entry]:
    entries: list[Entry] = [
        Weight(f"{dst}.ln1.weight", (f"{src}.input_layernorm.weight",)),
        Reference(f"{dst}.hook_resid_pre", src, "in"),
        Reference(f"{dst}.ln1.hook_normalized", f"{src}.input_layernorm"),
        *attention_projections(cfg, src, dst),
        Reference(f"{dst}.attn.hook_z", f"{src}.self_attn.o_proj", "in"),
        Reference(f"{dst}.hook_attn_out", f"{src}.self_attn", "out.0"),
        Reference(f"{dst}.hook_mlp_out", f"{src}.mlp"),
        Reference(f"{dst}.hook_resid_post", src),
    ]
    if not cfg.moe_layers[layer]:
        return entries + dense_mlp(src, dst)
    moe = f"{src}.mlp"
    entries += [
        Weight(f"{dst}.mlp.router.weight", (f"{moe}.gate.weight",)),
        routed_experts(cfg, (f"{moe}.experts",), dst),
        *router_references(dst, f"{moe}.gate"),
        Reference(f"{dst}.mlp.hook_routed_out", f"{moe}.experts"),
    ]
    if cfg.d_shared:
        entries += [*gated_mlp(f"{moe}.shared_experts", f"{dst}.mlp.shared_expert"),
                    Reference(f"{dst}.mlp.hook_shared_out", f"{moe}.shared_experts"),
                    Reference(f"{dst}.mlp.shared_expert.hook_out", f"{moe}.shared_experts")]
    return entries

