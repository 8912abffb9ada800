"""HookedJamba: AI21's Jamba (model_type jamba: Jamba-v0.1, Jamba-1.5-Mini, Jamba-1.5-Large).

What is special about the family:
- each layer's token mixer by period and offset: attention where layer % attn_layer_period ==
  attn_layer_offset, else a Mamba (v1) mixer with RMSNorms on its time step, B and C
  (moelens.models.mixers.mamba1, its sites blocks.L.mixer.*; checkpoint keys layers.L.mamba.*);
- each layer's feed-forward by period and offset too: a mixture of num_experts experts where layer %
  expert_layer_period == expert_layer_offset and num_experts > 1, else a dense SwiGLU MLP of the same
  intermediate_size;
- attention without positional encoding (no rotary: the Mamba layers carry the order), no biases;
- the router: softmax in float32 over all experts, top-k, the k weights not renormalised, cast to the stream's
  dtype (SoftmaxTopK without norm_topk_prob);
- the checkpoint's names: feed_forward (router, experts per expert or transformers 5's stacked pair, or the dense
  MLP), pre_ff_layernorm, final_layernorm;
- hidden_act is also the Mamba convolution's activation, which the mixer computes as SiLU: any other is refused
  where a Mamba layer exists.
"""

from __future__ import annotations

from dataclasses import dataclass

from moelens.config import HFConfig, MoeConfig, RopeConfig, check_layer_kinds, common_fields, routed_fields
from moelens.models.base import HookedTransformer
from moelens.models.components import SoftmaxTopK, SparseMoe
from moelens.models.components.attention import NoPositionAttention
from moelens.models.mixers.mamba1 import Mamba1Mixer
from moelens.models.recipe import Dense, LayerSpec, Mixture, Recipe
from moelens.models.sites import Entry, attention_projections, gated_mlp, router_references, routed_experts
from moelens.sitemap import Reference, SiteMap, Weight

LAYER_TYPES = ("linear_attention", "full_attention")  # Mamba, attention (transformers' layer_types)
MAMBA_PARAMETERS = ("in_proj.weight", "conv1d.weight", "x_proj.weight", "dt_proj.weight", "dt_proj.bias", "A_log", "D",
                    "dt_layernorm.weight", "b_layernorm.weight", "c_layernorm.weight", "out_proj.weight")
# config.json fields that change nothing transformers 5.24 computes in inference: kernel choices (its torch
# path is the sequential scan; mambapy is not installed with it and its scan is a training fallback), training
# settings, and fields its JambaConfig does not have (sliding_window: its attention never reads one)
IGNORED_FIELDS = ("use_mamba_kernels", "use_mambapy", "use_associative_scan", "output_router_logits",
                  "router_aux_loss_coef", "initializer_range", "attention_dropout", "num_logits_to_keep",
                  "calc_logits_for_entire_prompt", "sliding_window", "use_cache")


@dataclass(frozen=True)
class JambaConfig(MoeConfig):
    """MoeConfig plus each layer's token mixer (LAYER_TYPES) and the Mamba sizes (moelens.models.mixers.mamba1.
    Mamba1Config's names: mamba_d_inner = mamba_expand * hidden_size)."""

    layer_types: tuple[str, ...] = ()
    mamba_d_inner: int = 0
    mamba_d_state: int = 0
    mamba_d_conv: int = 0
    mamba_dt_rank: int = 0
    mamba_conv_bias: bool = True
    mamba_proj_bias: bool = False
    mamba_norm_eps: float = 1e-6

    def __post_init__(self) -> None:
        super().__post_init__()
        check_layer_kinds(self.layer_types, self.n_layers, LAYER_TYPES)


class HookedJamba(HookedTransformer):
    model_type = "jamba"

    @classmethod
    def recipe(cls, cfg: JambaConfig) -> Recipe:
        mixers = {"linear_attention": Mamba1Mixer, "full_attention": NoPositionAttention}
        mixture, dense = Mixture(SparseMoe, SoftmaxTopK), Dense()
        return Recipe(tuple(LayerSpec(mixers[kind], mixture if moe else dense)
                            for kind, moe in zip(cfg.layer_types, cfg.moe_layers)))

    @classmethod
    def site_map(cls, cfg: JambaConfig) -> SiteMap:
        entries: list[Entry] = [
            Weight("embed.weight", ("model.embed_tokens.weight",)),
            Weight("ln_final.weight", ("model.final_layernorm.weight",)),
            Weight("unembed.weight", ("lm_head.weight",), required=not cfg.tie_word_embeddings),
            Reference("ln_final.hook_normalized", "model.final_layernorm"),
            Reference("hook_logits", "lm_head"),
        ]
        for layer in range(cfg.n_layers):
            entries += _layer_sites(cfg, layer, f"model.layers.{layer}", f"blocks.{layer}")
        return SiteMap(tuple(e for e in entries if not isinstance(e, Reference)),
                       tuple(e for e in entries if isinstance(e, Reference)))

    @classmethod
    def config_from_hf(cls, raw: dict) -> JambaConfig:
        hf = HFConfig.with_spellings(raw, {"num_local_experts": "num_experts"})
        # no rotary: the RopeConfig is built by the model, never applied
        fields = common_fields(hf, rms_norm_eps=1e-6, max_position_embeddings=262144, num_key_value_heads=8,
                               rope=RopeConfig(theta=10000.0))
        n_layers, d_model = fields["n_layers"], fields["d_model"]
        attn_period, attn_offset = period_offset(hf, "attn_layer", 8, 4)
        expert_period, expert_offset = period_offset(hf, "expert_layer", 2, 1)
        kinds = tuple("full_attention" if i % attn_period == attn_offset else "linear_attention" for i in range(n_layers))
        n_experts = hf.integer("num_experts", 16, at_least=1)
        # transformers builds a mixture only where a layer has more than one expert
        moe = tuple(i % expert_period == expert_offset and n_experts > 1 for i in range(n_layers))
        d_ff = hf.integer("intermediate_size", 14336, at_least=1)
        if "linear_attention" in kinds and fields["act_fn"] != "silu":
            raise ValueError(f"hidden_act = {fields['act_fn']!r}: it is also the Mamba convolution's activation "
                             "(transformers' JambaMambaMixer), which moelens's mixer computes as silu")
        expand = hf.integer("mamba_expand", 2, at_least=1)
        dt_rank = hf.opt("mamba_dt_rank", "auto")
        dt_rank = -(-d_model // 16) if dt_rank == "auto" else hf.integer("mamba_dt_rank", at_least=1)
        return JambaConfig(
            **fields,
            **routed_fields(hf, moe, n_experts if any(moe) else 0, d_ff if any(moe) else 0, num_experts_per_tok=2),
            d_mlp=d_ff if not all(moe) else 0,
            norm_topk_prob=False,
            layer_types=kinds,
            mamba_d_inner=expand * d_model,
            mamba_d_state=hf.integer("mamba_d_state", 16, at_least=1),
            mamba_d_conv=hf.integer("mamba_d_conv", 4, at_least=1),
            mamba_dt_rank=dt_rank,
            mamba_conv_bias=hf.flag("mamba_conv_bias", True),
            mamba_proj_bias=hf.flag("mamba_proj_bias", False),
            mamba_norm_eps=fields["norm_eps"],
            family=cls.model_type,
            fields_read=tuple(hf.read),
            fields_ignored=tuple(f for f in IGNORED_FIELDS if f in raw),
        )


def period_offset(hf: HFConfig, name: str, period: int, offset: int) -> tuple[int, int]:
    """{name}_period and {name}_offset, the offset below the period (transformers' JambaConfig check)."""
    p = hf.integer(f"{name}_period", period, at_least=1)
    o = hf.integer(f"{name}_offset", offset, at_least=0)
    if o >= p:
        raise ValueError(f"{name}_offset ({o}) must be smaller than {name}_period ({p})")
    return p, o


def _layer_sites(cfg: JambaConfig, layer: int, src: str, dst: str) -> list[Entry]:
    ffn = f"{src}.feed_forward"
    entries: list[Entry] = [
        Weight(f"{dst}.ln1.weight", (f"{src}.input_layernorm.weight",)),
        Weight(f"{dst}.ln2.weight", (f"{src}.pre_ff_layernorm.weight",)),
        Reference(f"{dst}.hook_resid_pre", src, "in"),
        Reference(f"{dst}.ln1.hook_normalized", f"{src}.input_layernorm"),
        Reference(f"{dst}.hook_resid_mid", f"{src}.pre_ff_layernorm", "in"),
        Reference(f"{dst}.ln2.hook_normalized", f"{src}.pre_ff_layernorm"),
        Reference(f"{dst}.hook_mlp_out", ffn),
        Reference(f"{dst}.hook_resid_post", src),
    ]
    if cfg.layer_types[layer] == "full_attention":
        entries += attention_projections(cfg, src, dst) + [
            Reference(f"{dst}.attn.hook_z", f"{src}.self_attn.o_proj", "in"),
            Reference(f"{dst}.hook_attn_out", f"{src}.self_attn", "out.0"),
        ]
    else:
        entries += mamba_sites(cfg, f"{src}.mamba", dst)
    if not cfg.moe_layers[layer]:
        return entries + [*gated_mlp(ffn, f"{dst}.mlp"), Reference(f"{dst}.mlp.hook_post", f"{ffn}.down_proj", "in")]
    return entries + [
        Weight(f"{dst}.mlp.router.weight", (f"{ffn}.router.weight",)),
        routed_experts(cfg, (f"{ffn}.experts",), dst),
        *router_references(dst, f"{ffn}.router"),
        Reference(f"{dst}.mlp.hook_routed_out", f"{ffn}.experts"),
    ]


def mamba_sites(cfg: JambaConfig, mamba: str, dst: str) -> list[Entry]:
    names = MAMBA_PARAMETERS + (("conv1d.bias",) if cfg.mamba_conv_bias else ())
    names += ("in_proj.bias", "out_proj.bias") if cfg.mamba_proj_bias else ()
    return [Weight(f"{dst}.mixer.{n}", (f"{mamba}.{n}",)) for n in names] + [
        Reference(f"{dst}.mixer.hook_x", f"{mamba}.x_proj", "in"),
        Reference(f"{dst}.mixer.hook_dt_low_rank", f"{mamba}.dt_layernorm"),
        Reference(f"{dst}.mixer.hook_B", f"{mamba}.b_layernorm"),
        Reference(f"{dst}.mixer.hook_C", f"{mamba}.c_layernorm"),
        Reference(f"{dst}.mixer.hook_z", f"{mamba}.out_proj", "in"),
        Reference(f"{dst}.hook_attn_out", mamba),
    ]
