"""HookedGraniteMoeHybrid: Granite-4.0-H (model_type granitemoehybrid: granite-4.0-h-small 32B, h-tiny, h-micro).

What is special about the family: Granite MoE with a shared MLP (moelens.models.granitemoeshared: the muP
multipliers, the router, the stacked experts' and the shared MLP's spellings) on hybrid layers:
- each layer's token mixer from layer_types (config.json's "mamba" / "attention", transformers 5's
  "linear_attention" / "full_attention"; every layer Mamba-2 where none is given): a Mamba-2 mixer
  (moelens.models.mixers.mamba2, its sites blocks.L.mixer.*; checkpoint keys layers.L.mamba.*) or attention
  scaled by attention_multiplier, rotary where position_embedding_type is "rope" and without positional
  encoding otherwise ("nope", or none given); either mixer's output times residual_multiplier is hook_attn_out;
- each layer's feed-forward: the mixture plus the shared MLP where num_local_experts > 0, and only the shared MLP,
  as a dense MLP (blocks.L.mlp, gate and up one matrix), where it is 0 (granite-4.0-h-micro);
- the Mamba-2 sizes under config.json's names (mamba_n_heads, mamba_d_head, "auto": mamba_expand * hidden_size /
  mamba_n_heads); the convolution's activation is hidden_act (the MLPs' too), so it must be silu; its gated norm's
  eps is rms_norm_eps; time_step_limit clamps dt in the chunked form (a multi-token forward), and a decode step
  clamps nothing, as transformers 5.24 computes them. transformers writes its infinite bound as
  {"__float__": "Infinity"}; that, a JSON Infinity and a number are read.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

from moelens.config import HFConfig, check_layer_kinds, routed_fields
from moelens.models.components.attention import NoPositionAttention
from moelens.models.components.mlp import FusedGateUpMLP
from moelens.models.components.multiplier_attention import MultiplierScaledAttention
from moelens.models.components.router import TopKLogitsSoftmax
from moelens.models.granitemoe import granite_attention_sites, granite_mixture_sites, granite_recipe, granite_site_map, granite_stream_fields
from moelens.models.granitemoeshared import FusedSharedExpertMoe, GraniteMoeSharedConfig, HookedGraniteMoeShared, shared_mlp_sites
from moelens.models.mixers.mamba2 import Mamba2Mixer
from moelens.models.recipe import Dense, LayerSpec, Mixture, Recipe
from moelens.models.sites import Entry, decoder_site_map
from moelens.sitemap import Reference, SiteMap, Weight

LAYER_TYPES = ("linear_attention", "full_attention")
LEGACY = {"mamba": "linear_attention", "attention": "full_attention"}  # config.json's names (transformers remaps)
POSITION_TYPES = ("rope", "nope")  # transformers applies the rotary only for "rope"
# transformers' tag for a float JSON cannot spell (PreTrainedConfig._encode_special_floats)
FLOAT_TAG = "__float__"
MAMBA_PARAMETERS = ("in_proj.weight", "conv1d.weight", "dt_bias", "A_log", "D", "norm.weight", "out_proj.weight")
# config.json fields that change nothing transformers 5.24 computes
IGNORED_FIELDS = ("normalization_function", "init_method")


@dataclass(frozen=True)
class GraniteMoeHybridConfig(GraniteMoeSharedConfig):
    """GraniteMoeSharedConfig plus each layer's kind (LAYER_TYPES), the attention's positions (POSITION_TYPES)
    and the Mamba-2 sizes (moelens.models.mixers.mamba2.Mamba2Config's names)."""

    layer_types: tuple[str, ...] = ()
    position_embedding: str = "nope"
    mamba_n_heads: int = 0
    mamba_d_head: int = 0
    mamba_n_groups: int = 0
    mamba_d_state: int = 0
    mamba_d_conv: int = 0
    mamba_chunk_size: int = 0
    mamba_conv_bias: bool = True
    mamba_proj_bias: bool = False
    mamba_norm_eps: float = 1e-6
    mamba_time_step_limit: tuple[float, float] = (0.0, math.inf)
    mamba_decode_time_step_limit: tuple[float, float] = (0.0, math.inf)

    def __post_init__(self) -> None:
        super().__post_init__()
        check_layer_kinds(self.layer_types, self.n_layers, LAYER_TYPES)
        if self.position_embedding not in POSITION_TYPES:
            raise ValueError(f"position_embedding = {self.position_embedding!r}; expected one of {POSITION_TYPES}")


class NoPositionMultiplierAttention(NoPositionAttention, MultiplierScaledAttention):
    """Attention scaled by attention_multiplier, without positional encoding (position_embedding_type "nope")."""


class HookedGraniteMoeHybrid(HookedGraniteMoeShared):
    model_type = "granitemoehybrid"

    @classmethod
    def recipe(cls, cfg: GraniteMoeHybridConfig) -> Recipe:
        attention = MultiplierScaledAttention if cfg.position_embedding == "rope" else NoPositionMultiplierAttention
        ffn = Mixture(FusedSharedExpertMoe, TopKLogitsSoftmax) if cfg.n_experts else Dense(FusedGateUpMLP)
        mixers = {"linear_attention": Mamba2Mixer, "full_attention": attention}
        return granite_recipe(cfg, Recipe(tuple(LayerSpec(mixers[kind], ffn) for kind in cfg.layer_types)))

    @classmethod
    def site_map(cls, cfg: GraniteMoeHybridConfig) -> SiteMap:
        return granite_site_map(cfg, decoder_site_map(cfg, _layer_sites, mlp_module="shared_mlp"))

    @classmethod
    def config_from_hf(cls, raw: dict) -> GraniteMoeHybridConfig:
        hf = HFConfig.with_spellings(raw, {"layers_block_type": "layer_types"})
        fields = granite_stream_fields(hf)
        kinds = read_layer_types(hf, fields["n_layers"])
        n_experts = hf.integer("num_local_experts", 8, at_least=0)
        moe = (n_experts > 0,) * fields["n_layers"]
        d_shared = hf.integer("shared_intermediate_size", 1024, at_least=1)
        d_expert = hf.integer("intermediate_size", 11008, at_least=1) if n_experts else 0
        if "linear_attention" in kinds and fields["act_fn"] != "silu":
            raise ValueError(f"hidden_act = {fields['act_fn']!r}: it is also the Mamba-2 convolution's activation "
                             "(transformers' GraniteMoeHybridMambaLayer), which moelens's mixer computes as silu")
        position = hf.text("position_embedding_type", "nope")
        if position not in POSITION_TYPES:
            raise ValueError(f"position_embedding_type = {position!r}; expected \"rope\" (rotary) or \"nope\" / null "
                             "(no positional encoding)")
        return GraniteMoeHybridConfig(
            **fields,
            **routed_fields(hf, moe, n_experts, d_expert, num_experts_per_tok=2),
            **mamba_fields(hf, fields["d_model"], fields["norm_eps"]),
            d_mlp=0 if n_experts else d_shared,
            d_shared=d_shared if n_experts else 0,
            layer_types=kinds,
            position_embedding=position,
            family=cls.model_type,
            fields_read=tuple(hf.read),
            fields_ignored=tuple(f for f in IGNORED_FIELDS if f in raw),
        )


def read_layer_types(hf: HFConfig, n_layers: int) -> tuple[str, ...]:
    """layer_types with config.json's names mapped to transformers 5's; every layer Mamba-2 where absent (as
    transformers' GraniteMoeHybridConfig)."""
    kinds = hf.opt("layer_types")
    if kinds is None:
        return ("linear_attention",) * n_layers
    if not isinstance(kinds, list) or not all(isinstance(k, str) for k in kinds):
        raise ValueError(f"{hf.label('layer_types')} = {kinds!r}; expected a list of \"mamba\" / \"attention\"")
    mapped = tuple(LEGACY.get(k, k) for k in kinds)
    bad = sorted({k for k, m in zip(kinds, mapped) if m not in LAYER_TYPES})
    if bad:
        raise ValueError(f"{hf.label('layer_types')}: unknown layer kinds {bad}; expected \"mamba\" (or "
                         "\"linear_attention\") and \"attention\" (or \"full_attention\")")
    if len(mapped) != n_layers:
        raise ValueError(f"{hf.label('layer_types')} has {len(mapped)} entries, num_hidden_layers is {n_layers}")
    return mapped


def mamba_fields(hf: HFConfig, d_model: int, norm_eps: float) -> dict:
    """The Mamba-2 sizes (transformers' GraniteMoeHybridConfig defaults and checks, read on every config as
    transformers checks them whatever the layers)."""
    n_heads = hf.integer("mamba_n_heads", 128, at_least=1)
    expand = hf.integer("mamba_expand", 2, at_least=1)
    width = expand * d_model
    if width % n_heads:
        raise ValueError(f"mamba_n_heads ({n_heads}) must divide mamba_expand * hidden_size ({width})")
    d_head = hf.opt("mamba_d_head", "auto")
    d_head = width // n_heads if d_head == "auto" else hf.integer("mamba_d_head", at_least=1)
    if d_head * n_heads != width:
        raise ValueError(f"mamba_d_head ({d_head}) * mamba_n_heads ({n_heads}) must be mamba_expand * hidden_size "
                         f"({width}), the Mamba-2 mixer's width")
    n_groups = hf.integer("mamba_n_groups", 1, at_least=1)
    if n_heads % n_groups:
        raise ValueError(f"mamba_n_heads ({n_heads}) must be a multiple of mamba_n_groups ({n_groups}): each group's "
                         "B and C serve mamba_n_heads / mamba_n_groups heads")
    return dict(
        mamba_n_heads=n_heads,
        mamba_d_head=d_head,
        mamba_n_groups=n_groups,
        mamba_d_state=hf.integer("mamba_d_state", 256, at_least=1),
        mamba_d_conv=hf.integer("mamba_d_conv", 4, at_least=1),
        mamba_chunk_size=hf.integer("mamba_chunk_size", 256, at_least=1),
        mamba_conv_bias=hf.flag("mamba_conv_bias", True),
        mamba_proj_bias=hf.flag("mamba_proj_bias", False),
        mamba_norm_eps=norm_eps,
        mamba_time_step_limit=time_step_limit(hf),
        mamba_decode_time_step_limit=(0.0, math.inf),  # transformers' decode step clamps nothing
    )


def time_step_limit(hf: HFConfig) -> tuple[float, float]:
    """config.json's time_step_limit, [min, max] with 0 <= min <= max (max may be infinite: a JSON Infinity or
    transformers' {"__float__": "Infinity"}); (0, inf) where absent. null is refused: transformers clamps to it
    and fails."""
    if "time_step_limit" in hf.raw and hf.raw["time_step_limit"] is None:
        raise ValueError("config.json: time_step_limit is null; transformers clamps dt to it, so a [min, max] pair "
                         "is needed ([0.0, {\"__float__\": \"Infinity\"}] where absent)")
    value = hf.opt("time_step_limit", [0.0, math.inf])
    expected = "a [min, max] pair, 0 <= min <= max, max a number or {\"__float__\": \"Infinity\"}"
    if not isinstance(value, (list, tuple)) or len(value) != 2:
        raise ValueError(f"time_step_limit = {value!r}; expected {expected}")
    bounds = []
    for bound in value:
        if isinstance(bound, dict) and bound == {FLOAT_TAG: "Infinity"}:
            bound = math.inf
        if isinstance(bound, bool) or not isinstance(bound, (int, float)) or math.isnan(bound):
            raise ValueError(f"time_step_limit = {value!r}; expected {expected}")
        bounds.append(float(bound))
    low, high = bounds
    if not (math.isfinite(low) and 0 <= low <= high):
        raise ValueError(f"time_step_limit = {value!r}; expected {expected}")
    return low, high


def _layer_sites(cfg: GraniteMoeHybridConfig, layer: int, src: str, dst: str) -> list[Entry]:
    m = cfg.residual_multiplier
    if cfg.layer_types[layer] == "linear_attention":
        mamba = f"{src}.mamba"
        names = MAMBA_PARAMETERS + (("conv1d.bias",) if cfg.mamba_conv_bias else ())
        names += ("in_proj.bias", "out_proj.bias") if cfg.mamba_proj_bias else ()
        entries: list[Entry] = [Weight(f"{dst}.mixer.{n}", (f"{mamba}.{n}",)) for n in names]
        entries.append(Reference(f"{dst}.hook_attn_out", mamba, multiplier=m))  # the module returns a tensor
    else:
        entries = granite_attention_sites(cfg, src, dst)
    entries.append(Reference(f"{dst}.hook_resid_mid", f"{src}.post_attention_layernorm", "in"))
    if cfg.n_experts:
        return entries + granite_mixture_sites(cfg, src, dst) + shared_mlp_sites(cfg, src, dst)
    shared = f"{src}.shared_mlp"  # the only feed-forward: a dense MLP
    return entries + [
        Weight(f"{dst}.mlp.gate_up_proj.weight", (f"{shared}.input_linear.weight",)),
        Weight(f"{dst}.mlp.down_proj.weight", (f"{shared}.output_linear.weight",)),
        Reference(f"{dst}.mlp.hook_post", f"{shared}.output_linear", "in"),
        Reference(f"{dst}.hook_mlp_out", shared, multiplier=m),
    ]
