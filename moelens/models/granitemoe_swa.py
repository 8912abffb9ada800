"""HookedGraniteMoeSWA: Granite MoE with sliding-window attention and attention sinks (model_type granitemoe_swa).

What is special about the family: granitemoeshared's layers (the muP multipliers, the router, the stacked experts,
a shared MLP where shared_intermediate_size is not 0, the config class's default 0 leaving none), with an
attention of its own on every layer:
- a learned sink per head (self_attn.sinks), applied after the values: the pattern is the plain float32 softmax
  over the keys (each row sums to 1, as transformers' attention weights), and each head's output pattern @ v is
  multiplied by sigmoid(logsumexp(scores) - sink) (hook_sink_scale), the keys' share once the sink joins the
  softmax; transformers' eager order, so bfloat16 results match bit for bit;
- a sliding window (sliding_window, default 128) on the layers layer_types calls "sliding_attention" (by default
  every layer but each fourth, layer 0 first, full);
- a rotary base per layer (layer_rope_theta, default the global rope_theta on every layer), 0 meaning no rotary
  on that layer (NoPE: hook_rot_q and hook_rot_k hold q and k as projected).
"""

from __future__ import annotations

import dataclasses
import math
from dataclasses import dataclass
from typing import ClassVar

import torch
from jaxtyping import Float
from torch import nn

from moelens.config import HFConfig, RopeConfig
from moelens.hooks.sites import site_hook
from moelens.models.components import SparseMoe
from moelens.models.components.multiplier_attention import MultiplierScaledAttention
from moelens.models.components.rotary import Rotary
from moelens.models.components.router import TopKLogitsSoftmax
from moelens.models.components.sliding_window_attention import SlidingWindowAttention
from moelens.models.granitemoe import granite_fields, granite_recipe, granite_site_map
from moelens.models.granitemoeshared import (
    FusedSharedExpertMoe,
    GraniteMoeSharedConfig,
    HookedGraniteMoeShared,
    shared_layer_sites,
)
from moelens.models.recipe import Recipe, decoder_recipe
from moelens.models.sites import Entry, decoder_site_map
from moelens.models.terms import ParamTerm, vector
from moelens.sitemap import SiteMap, Weight

LAYER_TYPES = ("full_attention", "sliding_attention")


@dataclass(frozen=True)
class GraniteMoeSWAConfig(GraniteMoeSharedConfig):
    """GraniteMoeSharedConfig plus each layer's rotary (None: no rotary on that layer)."""

    layer_ropes: tuple[RopeConfig | None, ...] = ()

    def __post_init__(self) -> None:
        super().__post_init__()
        if len(self.layer_ropes) != self.n_layers:
            raise ValueError(f"layer_ropes ({len(self.layer_ropes)}) needs one entry per layer ({self.n_layers})")


class GraniteSinkAttention(SlidingWindowAttention, MultiplierScaledAttention):
    """Attention scaled by attention_multiplier, windowed where the layer is sliding, with a learned sink per head
    that scales the head's output after the values (transformers' GraniteMoeSWAAttention), and the layer's own
    rotary base (or none)."""

    fusable: ClassVar[bool] = False  # SDPA has no sink

    @classmethod
    def param_terms(cls, cfg: GraniteMoeSWAConfig, layer: int) -> tuple[ParamTerm, ...]:
        return super().param_terms(cfg, layer) + vector("sinks", cfg.n_heads, "attention")

    def __init__(self, cfg: GraniteMoeSWAConfig, layer: int) -> None:
        super().__init__(cfg, layer)
        self.sinks = nn.Parameter(torch.empty(cfg.n_heads))
        self.hook_sink_scale = site_hook("blocks.L.attn.hook_sink_scale")
        rope = cfg.layer_ropes[layer]
        self.nope = rope is None
        # the model's table serves a layer at the global base; another base gets its own
        self.layer_rotary = None if rope is None or rope == cfg.rope else Rotary(dataclasses.replace(cfg, rope=rope))

    def position_at(self, q, k, inputs):
        if self.nope:
            return q, k
        if self.layer_rotary is None:
            return super().position_at(q, k, inputs)
        cos, sin = self.layer_rotary(inputs.positions, q.dtype)
        return self.position(q, k, cos, sin)

    def rescale_heads(
        self, z: Float[torch.Tensor, "batch head query d_v"], scores: Float[torch.Tensor, "batch head query key"]
    ) -> Float[torch.Tensor, "batch head query d_v"]:
        # transformers' order: logsumexp and the difference in the scores' dtype, the sigmoid in float32
        lse = torch.logsumexp(scores, dim=-1)
        scale = self.hook_sink_scale((lse - self.sinks.view(1, -1, 1)).to(torch.float32).sigmoid().unsqueeze(-1))
        return z * scale.to(z.dtype)

    def extra_repr(self) -> str:
        nope = ", nope" if self.nope else ""
        return f"scale={self.scale}, sliding_window={self.sliding_window}{nope}"


class HookedGraniteMoeSWA(HookedGraniteMoeShared):
    model_type = "granitemoe_swa"

    @classmethod
    def recipe(cls, cfg: GraniteMoeSWAConfig) -> Recipe:
        moe = FusedSharedExpertMoe if cfg.d_shared else SparseMoe
        return granite_recipe(cfg, decoder_recipe(cfg, GraniteSinkAttention, moe, TopKLogitsSoftmax))

    @classmethod
    def site_map(cls, cfg: GraniteMoeSWAConfig) -> SiteMap:
        return granite_site_map(cfg, decoder_site_map(cfg, _layer_sites, mlp_module="block_sparse_moe"))

    @classmethod
    def config_from_hf(cls, raw: dict) -> GraniteMoeSWAConfig:
        hf = HFConfig(raw)
        fields = granite_fields(hf)
        n_layers = fields["n_layers"]
        types = hf.opt("layer_types")
        if types is None:  # absent or null: transformers' default, full attention on every fourth layer from 0
            types = [LAYER_TYPES[i % 4 != 0] for i in range(n_layers)]
        if not isinstance(types, list) or len(types) != n_layers or not set(types) <= set(LAYER_TYPES):
            raise ValueError(f"layer_types must list {n_layers} entries (num_hidden_layers), each one of "
                             f"{list(LAYER_TYPES)}; got {types!r}")
        sliding = "sliding_attention" in types
        if "sliding_window" in raw and raw["sliding_window"] is None and sliding:
            raise ValueError("sliding_window = null but layer_types has sliding_attention layers: they need a window")
        window = hf.integer("sliding_window", 128, at_least=1) if sliding else None
        return GraniteMoeSWAConfig(
            **fields,
            d_shared=hf.integer("shared_intermediate_size", 0, at_least=0),
            attention_windows=tuple(window if t == "sliding_attention" else None for t in types),
            layer_ropes=_layer_ropes(hf, fields["rope"], n_layers),
            family=cls.model_type,
            fields_read=tuple(hf.read),
        )


def _layer_ropes(hf: HFConfig, rope: RopeConfig, n_layers: int) -> tuple[RopeConfig | None, ...]:
    """layer_rope_theta: one base per layer, 0 for none (absent or null: the global rope_theta on every layer)."""
    thetas = hf.opt("layer_rope_theta")
    if thetas is None:
        return (rope,) * n_layers
    if not isinstance(thetas, list) or len(thetas) != n_layers or not all(_is_base(t) for t in thetas):
        raise ValueError(f"layer_rope_theta must list {n_layers} entries (num_hidden_layers), each a finite number "
                         f">= 0 (0: no rotary on that layer); got {thetas!r}")
    return tuple(dataclasses.replace(rope, theta=float(t)) if t else None for t in thetas)


def _is_base(t) -> bool:
    return not isinstance(t, bool) and isinstance(t, (int, float)) and math.isfinite(t) and t >= 0


def _layer_sites(cfg: GraniteMoeSWAConfig, layer: int, src: str, dst: str) -> list[Entry]:
    return shared_layer_sites(cfg, layer, src, dst) + [Weight(f"{dst}.attn.sinks", (f"{src}.self_attn.sinks",))]
