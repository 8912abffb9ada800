"""HookedMiniMax: MiniMax-Text-01, MiniMax-M1 (model_type minimax).

What is special about the family:
- hybrid layers (`layer_types`, by default softmax attention on the even layers and lightning attention on the
  odd ones; the published checkpoints have seven lightning layers to one softmax layer): the lightning layers'
  mixer is moelens.models.mixers.lightning (linear attention with a fixed decay per head and layer, computed
  block by block for a prompt and token by token after a cached state; its sites blocks.L.mixer.*, its state
  the [d_head d_head] matrix per head); the softmax layers are plain GQA attention with a rotary over the whole
  head (transformers' rotary ignores partial_rotary_factor) and the optional `sliding_window`;
- the block keeps the *normed* stream as its residual, scaled: with x = ln1(resid_pre),
  resid_mid = alpha_attn * x + beta_attn * mixer(x) and, with y = ln2(resid_mid), resid_post = alpha_mlp * y +
  beta_mlp * mlp(y) (full_attn_* / linear_attn_* by the layer's kind, mlp_* for the mixture; all 1 by
  default). hook_attn_out and hook_mlp_out hold beta times the sublayer's output (what the stream receives);
  the stream is therefore not resid_pre plus the sublayers' outputs, and the analyses that decompose it into
  them refuse the model (MiniMaxBlock.stream_is_sum);
- Mixtral's mixture: softmax over all experts in float32, top-k, renormalised, the weights kept float32; the
  Hub spells it `block_sparse_moe` with experts w1 / w3 / w2.

transformers stores the lightning layers' decay tables as buffers (self_attn.slope_rate, query_decay,
key_decay, diagonal_decay); they are functions of the config, computed here (moelens.models.mixers.lightning),
and the stored copies are not read. Like transformers, it reads no router_jitter_noise (training only).
"""

from __future__ import annotations

import dataclasses
import math
from dataclasses import dataclass
from typing import TYPE_CHECKING

import torch
from jaxtyping import Float

from moelens.config import HFConfig, check_layer_kinds, common_fields, routed_fields
from moelens.models.components import SparseMoe
from moelens.models.components.block import Block
from moelens.models.components.norm import RMSNorm
from moelens.models.components.sliding_window_attention import SlidingWindowAttention
from moelens.models.context import LayerInputs
from moelens.models.mixers.lightning import LightningAttention
from moelens.models.mixtral import DEFAULT_ROPE_THETA, HookedMixtral, MixtralConfig, SoftmaxTopKFloat32Weights, _layer_sites
from moelens.models.recipe import LayerSpec, Mixture, Recipe
from moelens.models.sites import Entry, decoder_site_map
from moelens.models.terms import ParamTerm, under
from moelens.sitemap import Reference, SiteMap, Weight

if TYPE_CHECKING:
    from moelens.config import MoeConfig

LAYER_TYPES = ("full_attention", "linear_attention")
# the lightning layers' decay tables, stored by transformers as buffers: derived from the config, not read
DECAY_BUFFERS = ("slope_rate", "query_decay", "key_decay", "diagonal_decay")
LIGHTNING_PARAMETERS = ("qkv_proj.weight", "output_gate.weight", "norm.weight", "out_proj.weight")
FACTORS = ("full_attn_alpha_factor", "full_attn_beta_factor", "linear_attn_alpha_factor", "linear_attn_beta_factor",
           "mlp_alpha_factor", "mlp_beta_factor")


@dataclass(frozen=True)
class MiniMaxConfig(MixtralConfig):
    """MixtralConfig plus each layer's kind, the lightning block size and the six residual factors."""

    layer_types: tuple[str, ...] = ()
    lightning_block_size: int = 256
    full_attn_alpha_factor: float = 1.0
    full_attn_beta_factor: float = 1.0
    linear_attn_alpha_factor: float = 1.0
    linear_attn_beta_factor: float = 1.0
    mlp_alpha_factor: float = 1.0
    mlp_beta_factor: float = 1.0

    def __post_init__(self) -> None:
        super().__post_init__()
        check_layer_kinds(self.layer_types, self.n_layers, LAYER_TYPES)
        if "linear_attention" in self.layer_types and self.act_fn != "silu":
            raise ValueError(f"hidden_act {self.act_fn!r}: the lightning layers' activation of q, k and v is implemented "
                             "for 'silu' only")
        for name in FACTORS:
            value = getattr(self, name)
            if isinstance(value, bool) or not isinstance(value, (int, float)) or not math.isfinite(value):
                raise ValueError(f"{name} must be a finite number, got {value!r}")

    def attn_factors(self, layer: int) -> tuple[float, float]:
        """(alpha, beta) of the layer's token mixer, by its kind."""
        if self.layer_types[layer] == "linear_attention":
            return self.linear_attn_alpha_factor, self.linear_attn_beta_factor
        return self.full_attn_alpha_factor, self.full_attn_beta_factor


class MiniMaxBlock(Block):
    """x = ln1(resid_pre); resid_mid = alpha * x + beta * mixer(x); y = ln2(resid_mid); resid_post = alpha_mlp *
    y + beta_mlp * mlp(y) (transformers' MiniMaxDecoderLayer; the products in the stream's dtype, as there).
    hook_attn_out / hook_mlp_out hold beta times the sublayer's output. With hook_mlp_in on, an edit of it
    reaches ln2 and so both the MLP and the residual it keeps."""

    keeps_normed_stream = True
    stream_is_sum = False  # resid_post is not resid_pre plus the sublayers' outputs

    @classmethod
    def param_terms(cls, cfg: MoeConfig, layer: int, spec: LayerSpec) -> tuple[ParamTerm, ...]:
        norm = spec.norm.param_terms(cfg.d_model)
        return (under("ln1", norm) + under(spec.mixer.block_attribute, spec.mixer.param_terms(cfg, layer))
                + under("ln2", norm) + under("mlp", spec.ffn.param_terms(cfg, layer)))

    @classmethod
    def state_tensors(cls, cfg: MoeConfig, spec: LayerSpec):
        return spec.mixer.state_tensors(cfg)

    def __init__(self, cfg: MiniMaxConfig, layer: int, spec: LayerSpec) -> None:
        if spec.mixer is None or spec.ffn is None:
            raise ValueError("MiniMaxBlock needs a token mixer and a feed-forward (LayerSpec with both)")
        super().__init__(cfg, layer, spec)
        self.attn_alpha, self.attn_beta = cfg.attn_factors(layer)
        self.mlp_alpha, self.mlp_beta = cfg.mlp_alpha_factor, cfg.mlp_beta_factor

    def output_multiplier(self, kind: str) -> float:
        return self.attn_beta if kind == "mixer" else self.mlp_beta

    def forward(
        self, resid: Float[torch.Tensor, "batch pos d_model"], inputs: LayerInputs
    ) -> Float[torch.Tensor, "batch pos d_model"]:
        resid = self.hook_resid_pre(resid)
        kept = self.ln1(resid)
        mixer_in = self.attn_input(resid) if self.use_split_qkv_input or self.use_attn_in else kept
        attn_out = self.hook_attn_out(self.token_mixer(mixer_in, inputs) * self.attn_beta)
        resid = self.hook_resid_mid(kept * self.attn_alpha + attn_out)
        mlp_in = self.hook_mlp_in(resid.clone()) if self.use_hook_mlp_in else resid
        kept = self.ln2(mlp_in)
        mlp_out = self.hook_mlp_out(self.mlp(kept) * self.mlp_beta)
        return self.hook_resid_post(kept * self.mlp_alpha + mlp_out)

    def extra_repr(self) -> str:
        return (f"attn: {self.attn_alpha} * ln1 + {self.attn_beta} * mixer, "
                f"mlp: {self.mlp_alpha} * ln2 + {self.mlp_beta} * mlp")


class HookedMiniMax(HookedMixtral):
    model_type = "minimax"

    @classmethod
    def recipe(cls, cfg: MiniMaxConfig) -> Recipe:
        mixture = Mixture(SparseMoe, SoftmaxTopKFloat32Weights)
        layers = tuple(
            LayerSpec(LightningAttention if kind == "linear_attention" else SlidingWindowAttention, mixture, RMSNorm,
                      block=MiniMaxBlock)
            for kind in cfg.layer_types
        )
        return Recipe(layers, RMSNorm)

    @classmethod
    def site_map(cls, cfg: MiniMaxConfig) -> SiteMap:
        ignored = tuple(f"model.layers.{layer}.self_attn.{name}" for layer, kind in enumerate(cfg.layer_types)
                        if kind == "linear_attention" for name in DECAY_BUFFERS)
        return decoder_site_map(cfg, _minimax_layer_sites, ignored_prefixes=ignored)

    @classmethod
    def config_from_hf(cls, raw: dict) -> MiniMaxConfig:
        hf = HFConfig(raw)
        rope = hf.rope(1.0, DEFAULT_ROPE_THETA)
        if rope.kind != "default":
            raise ValueError(f"rope type {rope.kind!r}: transformers' MiniMax rotary applies a default rotary's "
                             "tables to the whole head, which only the default type gives; only 'default' is supported")
        ignored = []
        if rope.partial_rotary_factor != 1.0:  # transformers' default rotary turns the whole head whatever it says
            ignored.append("partial_rotary_factor")
            rope = dataclasses.replace(rope, partial_rotary_factor=1.0)
        fields = common_fields(hf, rms_norm_eps=1e-5, max_position_embeddings=4096 * 32, hidden_size=4096, rope=rope)
        n_layers = fields["n_layers"]
        n_experts = hf.integer("num_local_experts", 8, at_least=1)
        window = hf.integer("sliding_window", None, at_least=1)
        kinds = read_layer_types(hf, n_layers)
        return MiniMaxConfig(
            **fields,
            **routed_fields(hf, (True,) * n_layers, n_experts, hf.integer("intermediate_size", 14336, at_least=1),
                            num_experts_per_tok=2),
            family=cls.model_type,
            norm_topk_prob=True,
            sliding_window=window,
            attention_windows=tuple(window if kind == "full_attention" else None for kind in kinds),
            layer_types=kinds,
            lightning_block_size=hf.integer("block_size", 256, at_least=1),
            **{name: hf.number(name, 1.0) for name in FACTORS},
            fields_read=tuple(hf.read),
            fields_ignored=tuple(ignored),
        )


def read_layer_types(hf: HFConfig, n_layers: int) -> tuple[str, ...]:
    """layer_types as transformers reads it: the list given, else softmax attention on the even layers and
    lightning attention on the odd ones."""
    kinds = hf.opt("layer_types")
    if kinds is None:
        return tuple("full_attention" if (i + 1) % 2 else "linear_attention" for i in range(n_layers))
    if not isinstance(kinds, list) or not all(isinstance(k, str) for k in kinds):
        raise ValueError(f"layer_types = {kinds!r}; expected a list of layer kinds ({', '.join(LAYER_TYPES)})")
    if len(kinds) != n_layers:
        raise ValueError(f"layer_types has {len(kinds)} entries, expected one per layer ({n_layers})")
    return tuple(kinds)


def _minimax_layer_sites(cfg: MiniMaxConfig, layer: int, src: str, dst: str) -> list[Entry]:
    """Mixtral's attention and mixture entries, or the lightning mixer's; the residual references scaled by the
    layer's betas (transformers' modules return the sublayers' outputs before them)."""
    attn, mlp = f"{src}.self_attn", f"{src}.mlp"
    entries = _layer_sites(cfg, layer, src, dst)
    if cfg.layer_types[layer] == "linear_attention":
        entries = [e for e in entries if not _attention_entry(e, dst)]
        entries += [Weight(f"{dst}.mixer.{name}", (f"{attn}.{name}",)) for name in LIGHTNING_PARAMETERS]
        entries += [
            Reference(f"{dst}.mixer.hook_core_out", f"{attn}.norm", "in"),
            Reference(f"{dst}.mixer.hook_gate", f"{attn}.output_gate"),
            Reference(f"{dst}.mixer.hook_z", f"{attn}.out_proj", "in"),
        ]
    beta = cfg.attn_factors(layer)[1]
    return entries + [
        Reference(f"{dst}.hook_attn_out", attn, "out.0", multiplier=beta),
        Reference(f"{dst}.hook_resid_mid", f"{src}.post_attention_layernorm", "in"),
        Reference(f"{dst}.hook_mlp_out", mlp, multiplier=cfg.mlp_beta_factor),
    ]


def _attention_entry(entry: Entry, dst: str) -> bool:
    """A softmax-attention entry of Mixtral's layer sites (under blocks.L.attn)."""
    name = entry.hook if isinstance(entry, Reference) else getattr(entry, "param", "")
    return name.startswith(f"{dst}.attn.")
