"""HookedNemotronH: Nemotron-H (model_type nemotron_h: Nemotron-3 Nano 30B-A3B, Super 120B).

What is special about the family:
- every layer is ONE sublayer, its kind from layers_block_type (or the Hub's hybrid_override_pattern, one
  character a layer: M Mamba-2, * attention, E mixture, - MLP): a Mamba-2 mixer (moelens.models.mixers.mamba2)
  or softmax attention without positional encoding as the token mixer (blocks.L.hook_attn_out), or a mixture
  or a dense MLP as the feed-forward (blocks.L.hook_mlp_out); one norm per block, the weight applied in float32
  before the cast back;
- the mixture: DeepSeek-V3's grouped sigmoid router (correction bias, n_group / topk_group, routed_scaling_factor),
  ungated experts down(relu2(up(x))) (moelens.experts.spec.Ungated), optionally read and written through latent
  projections (moe_latent_size: fc1_latent_proj before the experts, fc2_latent_proj after; the router reads the
  block's input), then an ungated shared expert added;
- checkpoint keys under backbone. (embeddings, layers.L.norm, layers.L.mixer.*, norm_f); transformers' own
  spelling, model., is read too, and the experts per expert or stacked (up_proj [E, I, H], down_proj [E, H, I]).

Padding: transformers zeroes a padded position's input to the Mamba-2 mixer and its convolved channels (the
mixer does the same with the block's mask); attention masks padded keys.
"""

from __future__ import annotations

import dataclasses
import math
from dataclasses import dataclass

import torch
from jaxtyping import Float
from torch import nn

from moelens.config import HFConfig, MoeConfig, RopeConfig, routed_fields
from moelens.experts.spec import ExpertSpec, Ungated
from moelens.hooks.sites import site_hook
from moelens.models.base import HookedTransformer
from moelens.models.components.attention import NoPositionAttention
from moelens.models.components.mlp import UngatedMLP
from moelens.models.components.moe import SparseMoe
from moelens.models.components.norm import CastAfterWeightRMSNorm
from moelens.models.components.parts import GatedMlpPart, MlpPart, RoutedPart
from moelens.models.components.router import SigmoidGroupedTopK, TopKRouter
from moelens.models.mixers.mamba2 import Mamba2Mixer
from moelens.models.recipe import Dense, LayerSpec, Mixture, Recipe
from moelens.models.terms import ParamTerm, linear, under
from moelens.models.sites import Entry, router_references, routed_experts
from moelens.sitemap import PerExpertKeys, Reference, SiteMap, Weight

LAYER_KINDS = ("linear_attention", "full_attention", "moe", "mlp")
PATTERN = {"M": "linear_attention", "*": "full_attention", "E": "moe", "-": "mlp"}  # hybrid_override_pattern
LEGACY = {"mamba": "linear_attention", "attention": "full_attention"}  # older layers_block_type names
MIXERS = ("linear_attention", "full_attention")
# the Hub's spelling first (backbone.), then transformers' (model.)
PREFIXES = ("backbone.", "model.")
UP_DOWN = PerExpertKeys(None, "{e}.up_proj.weight", "{e}.down_proj.weight")
# config.json fields that change nothing transformers 5.24 computes (its attention has no biases and no
# positions, the Mamba-2 width is mamba_num_heads * mamba_head_dim, the multi-token-prediction layers are not run)
IGNORED_FIELDS = ("residual_in_fp32", "n_shared_experts", "moe_shared_expert_overlap", "num_logits_to_keep",
                  "use_mamba_kernels", "mamba_ssm_cache_dtype", "rescale_prenorm_residual", "time_step_max",
                  "time_step_floor", "time_step_limit", "sliding_window", "attention_bias", "expand",
                  "mamba_proj_bias", "norm_eps", "rope_theta", "partial_rotary_factor", "num_nextn_predict_layers",
                  "mtp_hybrid_override_pattern", "mtp_layers_block_type")


@dataclass(frozen=True)
class NemotronHConfig(MoeConfig):
    """MoeConfig plus each layer's kind (LAYER_KINDS), the Mamba-2 sizes (Mamba2Config's names) and the
    mixture's latent width (0: none)."""

    layer_types: tuple[str, ...] = ()
    moe_latent_size: int = 0
    mamba_n_heads: int = 0
    mamba_d_head: int = 0
    mamba_n_groups: int = 0
    mamba_d_state: int = 0
    mamba_d_conv: int = 0
    mamba_chunk_size: int = 0
    mamba_conv_bias: bool = True
    mamba_proj_bias: bool = False
    mamba_norm_eps: float = 1e-5
    mamba_time_step_limit: tuple[float, float] = (0.0, math.inf)
    mamba_decode_time_step_limit: tuple[float, float] = (0.0, math.inf)

    def __post_init__(self) -> None:
        super().__post_init__()
        if len(self.layer_types) != self.n_layers:
            raise ValueError(f"layers_block_type has {len(self.layer_types)} entries, expected one per layer ({self.n_layers})")
        unknown = sorted({kind for kind in self.layer_types if kind not in LAYER_KINDS})
        if unknown:
            raise ValueError(f"layers_block_type: unknown layer kinds {unknown}; expected {', '.join(LAYER_KINDS)}")
        if tuple(kind == "moe" for kind in self.layer_types) != self.moe_layers:
            raise ValueError("moe_layers must be True exactly on the layers_block_type 'moe' layers")

    def expert_spec(self) -> ExpertSpec:
        """Ungated experts (act(up), no gate), reading the latent width where moe_latent_size says."""
        width = self.moe_latent_size or self.d_model
        return ExpertSpec(self.n_experts, width, self.d_expert, Ungated(self.act_fn), storage=self.expert_storage)


def read_layer_types(hf: HFConfig) -> tuple[str, ...]:
    """Each layer's kind as transformers reads it: layers_block_type (older names mapped), else
    hybrid_override_pattern; transformers' default where neither is given."""
    kinds = hf.opt("layers_block_type")
    if kinds is not None:
        if not isinstance(kinds, list) or not all(isinstance(k, str) for k in kinds):
            raise ValueError(f"layers_block_type = {kinds!r}; expected a list of layer kinds ({', '.join(LAYER_KINDS)})")
        return tuple(LEGACY.get(k, k) for k in kinds)
    pattern = hf.opt("hybrid_override_pattern")
    if pattern is None:
        return ("linear_attention", "moe", "full_attention", "mlp")
    if not isinstance(pattern, str) or not pattern:
        raise ValueError(f"hybrid_override_pattern = {pattern!r}; expected a string of {''.join(PATTERN)}, one a layer")
    bad = sorted(set(pattern) - set(PATTERN))
    if bad:
        raise ValueError(f"hybrid_override_pattern = {pattern!r}: unknown layer characters {bad}; expected "
                         + ", ".join(f"{c} ({k})" for c, k in PATTERN.items()))
    return tuple(PATTERN[c] for c in pattern)


def aliased(hf: HFConfig, read, name: str, old: str, default, **bounds):
    """A field transformers reads under two names; the older one (config.json of NVIDIA's remote code) wins
    where both are there, as in transformers' NemotronHConfig."""
    return read(old, **bounds) if old in hf else read(name, default, **bounds)


class NemotronHMoe(SparseMoe):
    """Routed ungated experts, through the latent projections where the config has them, then the ungated
    shared expert added (transformers' NemotronHMoE). The router reads the block's input."""

    @classmethod
    def param_terms(cls, cfg: NemotronHConfig, layer: int, router: type[TopKRouter]) -> tuple[ParamTerm, ...]:
        # the latent projections serve the routed experts only (every token multiplies both)
        latent = (linear("fc1_latent_proj", cfg.d_model, cfg.moe_latent_size, False, "routed_experts")
                  + linear("fc2_latent_proj", cfg.moe_latent_size, cfg.d_model, False, "routed_experts")
                  if cfg.moe_latent_size else ())
        shared = under("shared_expert", UngatedMLP.param_terms(cfg.d_model, cfg.d_shared, "shared_experts"))
        return super().param_terms(cfg, layer, router) + latent + shared

    def __init__(self, cfg: NemotronHConfig, layer: int, router: type[TopKRouter]) -> None:
        super().__init__(cfg, layer, router)
        if cfg.moe_latent_size:
            self.fc1_latent_proj = nn.Linear(cfg.d_model, cfg.moe_latent_size, bias=False)
            self.fc2_latent_proj = nn.Linear(cfg.moe_latent_size, cfg.d_model, bias=False)
        self.shared_expert = UngatedMLP(cfg.d_model, cfg.d_shared, cfg.act_fn, "d_shared", hook_out=True)
        self.hook_shared_out = site_hook("blocks.L.mlp.hook_shared_out")

    def expert_input(self, x: Float[torch.Tensor, "batch pos d_model"]) -> torch.Tensor:
        return self.fc1_latent_proj(x) if hasattr(self, "fc1_latent_proj") else x

    def expert_output(self, routed: torch.Tensor) -> Float[torch.Tensor, "batch pos d_model"]:
        return self.fc2_latent_proj(routed) if hasattr(self, "fc2_latent_proj") else routed

    def forward(self, x: Float[torch.Tensor, "batch pos d_model"]) -> Float[torch.Tensor, "batch pos d_model"]:
        routed = self._routed(x)
        return routed + self.hook_shared_out(self.shared_expert(x))

    def parts(self) -> tuple[MlpPart, ...]:
        return (GatedMlpPart("shared", self.shared_expert, out=self.hook_shared_out), self._routed_part())

    def _routed_part(self) -> RoutedPart:
        part = super()._routed_part()
        if not hasattr(self, "fc1_latent_proj"):
            return part
        fields = {f.name: getattr(part, f.name) for f in dataclasses.fields(part)}
        return LatentRoutedPart(**fields, latent=self.fc1_latent_proj)


@dataclass(frozen=True)
class LatentRoutedPart(RoutedPart):
    """The routed part of a latent mixture: what reads the MLP's input is the router and fc1_latent_proj (the
    experts read its output). Its neurons write through fc2_latent_proj, which the neuron decompositions do not
    apply yet."""

    latent: nn.Linear | None = None

    def input_weights(self) -> tuple[torch.Tensor, ...]:
        return (self.router.weight, self.latent.weight)


class HookedNemotronH(HookedTransformer):
    model_type = "nemotron_h"

    @classmethod
    def recipe(cls, cfg: NemotronHConfig) -> Recipe:
        mixture, dense = Mixture(NemotronHMoe, SigmoidGroupedTopK), Dense(UngatedMLP)
        pieces = {
            "linear_attention": (Mamba2Mixer, None), "full_attention": (NoPositionAttention, None),
            "moe": (None, mixture), "mlp": (None, dense),
        }
        return Recipe(tuple(LayerSpec(*pieces[k], CastAfterWeightRMSNorm) for k in cfg.layer_types), CastAfterWeightRMSNorm)

    @classmethod
    def config_from_hf(cls, raw: dict) -> NemotronHConfig:
        hf = HFConfig(raw)
        kinds = read_layer_types(hf)
        n_layers = len(kinds)
        stated = hf.integer("num_hidden_layers", None, at_least=1)
        if stated is not None and stated != n_layers:
            where = "layers_block_type" if "layers_block_type" in raw else "hybrid_override_pattern"
            raise ValueError(f"num_hidden_layers = {stated}, but {where} gives {n_layers} layers")
        for flag in ("mlp_bias",):
            if hf.flag(flag, False):
                raise ValueError(f"{flag} = true: moelens's Nemotron-H reads MLPs, shared experts and latent projections "
                                 "without biases (as every published checkpoint has them)")
        if hf.text("mamba_hidden_act", "silu") != "silu":
            raise ValueError(f"mamba_hidden_act = {raw['mamba_hidden_act']!r}: the Mamba-2 mixer computes SiLU")
        moe_layers = tuple(k == "moe" for k in kinds)
        any_moe = any(moe_layers)
        n_experts = hf.integer("n_routed_experts", 8, at_least=1) if any_moe else 0
        d_expert = hf.integer("moe_intermediate_size", 7688, at_least=1) if any_moe else 0
        routed = routed_fields(hf, moe_layers, n_experts, d_expert, num_experts_per_tok=2)
        n_group = hf.integer("n_group", 1, at_least=1) if any_moe else 1
        topk_group = hf.integer("topk_group", 1, at_least=1) if any_moe else 1
        if any_moe:
            SigmoidGroupedTopK.check_groups(n_experts, max(routed["top_k_per_layer"]), n_group, topk_group)
        n_heads = hf.integer("num_attention_heads", 32, at_least=1)
        time_step_min = aliased(hf, hf.number, "time_step_min", "mamba_dt_min", 0.001, at_least=0)
        mamba_heads = hf.integer("mamba_num_heads", 128, at_least=1)
        mamba_groups = aliased(hf, hf.integer, "n_groups", "mamba_n_groups", 8, at_least=1)
        if mamba_heads % mamba_groups:
            raise ValueError(f"mamba_num_heads ({mamba_heads}) must be a multiple of n_groups ({mamba_groups}): each "
                             "group's B and C serve mamba_num_heads / n_groups heads")
        return NemotronHConfig(
            family=cls.model_type,
            d_model=hf.integer("hidden_size", 4096, at_least=1),
            n_layers=n_layers,
            n_heads=n_heads,
            n_kv_heads=hf.integer("num_key_value_heads", 8, at_least=1),
            d_head=hf.integer("head_dim", 128, at_least=1),
            d_vocab=hf.integer("vocab_size", 131072, at_least=1),
            norm_eps=hf.number("layer_norm_epsilon", 1e-5, at_least=0),
            rope=RopeConfig(theta=10000.0),  # built by the model, never applied: no positional encoding
            max_position_embeddings=hf.integer("max_position_embeddings", 4096, at_least=1),
            act_fn=hf.text("mlp_hidden_act", "relu2"),
            d_mlp=hf.integer("intermediate_size", 21504, at_least=1) if "mlp" in kinds else 0,
            **routed,
            d_shared=hf.integer("moe_shared_expert_intermediate_size", 7688, at_least=1) if any_moe else 0,
            norm_topk_prob=hf.flag("norm_topk_prob", True),
            routed_scaling_factor=hf.number("routed_scaling_factor", 1.0),
            n_group=n_group,
            topk_group=topk_group,
            tie_word_embeddings=hf.flag("tie_word_embeddings", False),
            layer_types=kinds,
            moe_latent_size=(hf.integer("moe_latent_size", None, at_least=1) or 0) if any_moe else 0,
            mamba_n_heads=mamba_heads,
            mamba_d_head=hf.integer("mamba_head_dim", 64, at_least=1),
            mamba_n_groups=mamba_groups,
            mamba_d_state=hf.integer("ssm_state_size", 128, at_least=1),
            mamba_d_conv=aliased(hf, hf.integer, "conv_kernel", "mamba_d_conv", 4, at_least=1),
            mamba_chunk_size=aliased(hf, hf.integer, "chunk_size", "mamba_chunk_size", 128, at_least=1),
            mamba_conv_bias=aliased(hf, hf.flag, "use_conv_bias", "mamba_conv_bias", True),
            mamba_proj_bias=hf.flag("use_bias", False),
            mamba_norm_eps=hf.number("layer_norm_epsilon", 1e-5, at_least=0),
            # transformers 5.24 clamps dt to (time_step_min, inf) in the chunked form, not at all in a decode step
            mamba_time_step_limit=(time_step_min, math.inf),
            mamba_decode_time_step_limit=(0.0, math.inf),
            fields_read=tuple(hf.read),
            fields_ignored=tuple(f for f in IGNORED_FIELDS if f in raw),
        )

    @classmethod
    def site_map(cls, cfg: NemotronHConfig) -> SiteMap:
        def keys(name: str) -> tuple[str, ...]:
            return tuple(f"{p}{name}" for p in PREFIXES)

        entries: list[Entry] = [
            Weight("embed.weight", keys("embeddings.weight")),
            Weight("ln_final.weight", keys("norm_f.weight")),
            Weight("unembed.weight", ("lm_head.weight",), required=not cfg.tie_word_embeddings),
            Reference("ln_final.hook_normalized", "model.norm_f"),
            Reference("hook_logits", "lm_head"),
        ]
        for layer, kind in enumerate(cfg.layer_types):
            src, dst = f"model.layers.{layer}", f"blocks.{layer}"
            ln, out = ("ln1", "hook_attn_out") if kind in MIXERS else ("ln2", "hook_mlp_out")
            entries += [
                Weight(f"{dst}.{ln}.weight", keys(f"layers.{layer}.norm.weight")),
                Reference(f"{dst}.hook_resid_pre", src, "in"),
                Reference(f"{dst}.{ln}.hook_normalized", f"{src}.norm"),
                Reference(f"{dst}.{out}", f"{src}.mixer", "out.0" if kind == "full_attention" else "out"),
                Reference(f"{dst}.hook_resid_post", src),
                *_layer_sites(cfg, layer, kind, src, dst, keys),
            ]
        return SiteMap(
            tuple(e for e in entries if not isinstance(e, Reference)), tuple(e for e in entries if isinstance(e, Reference)),
            ("mtp.",),  # the Hub's multi-token-prediction weights are not run, as in transformers
        )


def _layer_sites(cfg: NemotronHConfig, layer: int, kind: str, src: str, dst: str, keys) -> list[Entry]:
    here = f"layers.{layer}.mixer"
    mixer = f"{src}.mixer"
    if kind == "linear_attention":
        names = ["in_proj.weight", "conv1d.weight", "dt_bias", "A_log", "D", "norm.weight", "out_proj.weight"]
        names += ["conv1d.bias"] if cfg.mamba_conv_bias else []
        names += ["in_proj.bias", "out_proj.bias"] if cfg.mamba_proj_bias else []
        return [Weight(f"{dst}.mixer.{n}", keys(f"{here}.{n}")) for n in names]
    if kind == "full_attention":
        entries: list[Entry] = []
        for proj in "qkvo":  # no biases, whatever attention_bias says (as transformers)
            entries.append(Weight(f"{dst}.attn.{proj}_proj.weight", keys(f"{here}.{proj}_proj.weight")))
            if proj != "o":
                entries.append(Reference(f"{dst}.attn.hook_{proj}", f"{mixer}.{proj}_proj"))
        return entries + [Reference(f"{dst}.attn.hook_z", f"{mixer}.o_proj", "in")]
    if kind == "mlp":
        return [
            Weight(f"{dst}.mlp.up_proj.weight", keys(f"{here}.up_proj.weight")),
            Weight(f"{dst}.mlp.down_proj.weight", keys(f"{here}.down_proj.weight")),
            Reference(f"{dst}.mlp.hook_post", f"{mixer}.down_proj", "in"),
        ]
    # the mixture: the per-expert keys under either prefix, the stacked pair under the Hub's (backbone.)
    entries = [
        Weight(f"{dst}.mlp.router.weight", keys(f"{here}.gate.weight")),
        Weight(f"{dst}.mlp.router.e_score_correction_bias", keys(f"{here}.gate.e_score_correction_bias")),
        routed_experts(cfg, keys(f"{here}.experts"), dst, (UP_DOWN,), fused_gate_up="up_proj"),
        Weight(f"{dst}.mlp.shared_expert.up_proj.weight", keys(f"{here}.shared_experts.up_proj.weight")),
        Weight(f"{dst}.mlp.shared_expert.down_proj.weight", keys(f"{here}.shared_experts.down_proj.weight")),
        *router_references(dst, f"{mixer}.gate"),
        Reference(f"{dst}.mlp.shared_expert.hook_out", f"{mixer}.shared_experts"),
    ]
    if cfg.moe_latent_size:
        entries += [
            Weight(f"{dst}.mlp.fc1_latent_proj.weight", keys(f"{here}.fc1_latent_proj.weight")),
            Weight(f"{dst}.mlp.fc2_latent_proj.weight", keys(f"{here}.fc2_latent_proj.weight")),
            Reference(f"{dst}.mlp.hook_routed_out", f"{mixer}.fc2_latent_proj"),
        ]
    else:
        entries.append(Reference(f"{dst}.mlp.hook_routed_out", f"{mixer}.experts"))
    return entries
