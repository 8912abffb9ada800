"""HookedKimiLinear: Kimi-Linear-48B-A3B (model_type kimi_linear).

What is special about the family:
- hybrid layers (layer_types): Kimi Delta Attention layers (moelens.models.mixers.kimi_delta_attention, the delta
  rule with a decay per key channel; its sites blocks.L.mixer.*, its state a convolution window and a recurrent
  state) and, every fourth layer by default, multi-head latent attention without any positional encoding (the
  key's qk_rope_head_dim part is still the shared one from kv_a_proj_with_mqa, never rotated);
- config.json keeps the linear layers' sizes and kinds in linear_attn_config (num_heads, head_dim,
  short_conv_kernel_size, and full_attn_layers / kda_layers numbered from 1), and spells several mixture fields
  its own way (num_experts, num_experts_per_token, moe_renormalize, num_expert_group, num_shared_experts,
  model_max_length), as transformers' attribute_map accepts;
- DeepSeek-V3's mixture (the float32 grouped sigmoid router with its correction bias, a shared expert) under the
  Hub's block_sparse_moe with per-expert w1 / w3 / w2, after dense blocks listed by mlp_layer_types (from
  first_k_dense_replace, one by default).

The KDA layers' q_conv1d, k_conv1d and v_conv1d are read into one depthwise convolution over q | k | v, as
transformers concatenates them on load.
"""

from __future__ import annotations

from dataclasses import dataclass

from moelens.config import HFConfig, RopeConfig, check_layer_kinds
from moelens.models.components import SharedExpertMoe, SigmoidGroupedTopK
from moelens.models.components.latent_attention import MultiHeadLatentAttention
from moelens.models.components.norm import RMSNorm
from moelens.models.deepseek_v3 import DeepseekV3Config, HookedDeepseekV3, _attention_sites, latent_decoder_fields
from moelens.models.glm4_moe_lite import MLP_LAYER_TYPES
from moelens.models.mixers.kimi_delta_attention import KimiDeltaAttention, KimiLinearDeltaAttention
from moelens.models.mixtral import block_sparse_experts
from moelens.models.recipe import Dense, LayerSpec, Mixture, Recipe
from moelens.models.sites import Entry, decoder_site_map, gated_mlp, router_references
from moelens.sitemap import Part, Reference, SiteMap, SplitWeight, Weight

LAYER_TYPES = ("linear_attention", "full_attention")
# config.json's names for fields transformers' KimiLinearConfig also accepts under DeepSeek's (its attribute_map)
SPELLINGS = {
    "num_experts": "n_routed_experts", "num_local_experts": "n_routed_experts",
    "num_experts_per_token": "num_experts_per_tok", "moe_renormalize": "norm_topk_prob",
    "num_expert_group": "n_group", "num_shared_experts": "n_shared_experts",
    "model_max_length": "max_position_embeddings",
}
# transformers' KimiLinearConfig defaults (Kimi-Linear-48B-A3B's sizes), for the fields latent_decoder_fields reads
KIMI_LINEAR_DEFAULTS = dict(
    rms_norm_eps=1e-5, max_position_embeddings=1048576, hidden_size=2304, qk_nope_head_dim=128, qk_rope_head_dim=64,
    v_head_dim=128, q_lora_rank=None, kv_lora_rank=512, first_k_dense_replace=1, n_routed_experts=256,
    num_experts_per_tok=8, moe_intermediate_size=1024, intermediate_size=9216, n_group=1, topk_group=1,
    routed_scaling_factor=2.446,
)
# Published in Kimi-Linear's config.json and not read by transformers, which always runs what these say
FIXED_FIELDS = {"mla_use_nope": True, "moe_router_activation_func": "sigmoid", "use_grouped_topk": True,
                "moe_layer_freq": 1}
# linear_attn_config's fields and the top-level names transformers also accepts for them
LINEAR_FIELDS = {"num_heads": "linear_num_heads", "head_dim": "linear_head_dim",
                 "short_conv_kernel_size": "linear_conv_kernel_dim"}
LINEAR_DEFAULTS = {"num_heads": 32, "head_dim": 128, "short_conv_kernel_size": 4}


@dataclass(frozen=True)
class KimiLinearConfig(DeepseekV3Config):
    """DeepseekV3Config (the latent attention's and the mixture's sizes) plus each layer's kind and the Kimi Delta
    Attention sizes (moelens.models.mixers.kimi_delta_attention.KimiDeltaSizes)."""

    layer_types: tuple[str, ...] = ()
    linear_n_heads: int = 0
    linear_d_head: int = 0
    linear_conv_kernel: int = 0

    def __post_init__(self) -> None:
        super().__post_init__()
        check_layer_kinds(self.layer_types, self.n_layers, LAYER_TYPES)


class NoRotaryLatentAttention(MultiHeadLatentAttention):
    """Latent attention with no positional encoding: the qk_rope_head_dim part of each key (shared by the heads)
    and of each query enters the scores as projected (hook_rot_q / hook_rot_k equal hook_q / hook_k)."""

    def position(self, q, k, cos, sin):
        return q, k


class HookedKimiLinear(HookedDeepseekV3):
    model_type = "kimi_linear"
    linear_mixer: type[KimiDeltaAttention] = KimiLinearDeltaAttention  # the linear_attention layers' mixer
    full_attention: type[MultiHeadLatentAttention] = NoRotaryLatentAttention  # the full_attention layers'

    @classmethod
    def recipe(cls, cfg: KimiLinearConfig) -> Recipe:
        mixture, dense = Mixture(SharedExpertMoe, SigmoidGroupedTopK), Dense()
        layers = tuple(
            LayerSpec(cls.linear_mixer if kind == "linear_attention" else cls.full_attention,
                      mixture if is_moe else dense, RMSNorm)
            for kind, is_moe in zip(cfg.layer_types, cfg.moe_layers, strict=True)
        )
        return Recipe(layers, RMSNorm)

    @classmethod
    def site_map(cls, cfg: KimiLinearConfig) -> SiteMap:
        return decoder_site_map(cfg, _layer_sites)

    @classmethod
    def config_from_hf(cls, raw: dict) -> KimiLinearConfig:
        for name, value in FIXED_FIELDS.items():
            if name in raw and raw[name] is not None and raw[name] != value:
                raise ValueError(f"config.json gives {name} = {raw[name]!r}; transformers' Kimi-Linear always runs "
                                 f"{name} = {value!r} (it does not read the field)")
        hf = HFConfig.with_spellings(raw, SPELLINGS)
        n_layers = hf.integer("num_hidden_layers", at_least=1)
        fields = latent_decoder_fields(
            hf, raw, KIMI_LINEAR_DEFAULTS, rope_interleave=False,
            moe_layers=lambda n: mlp_layer_types(hf, n), rope=RopeConfig(theta=10000.0),
        )
        linear = linear_sizes(hf)
        return KimiLinearConfig(
            **fields, family=cls.model_type,
            layer_types=layer_types(hf, n_layers),
            linear_n_heads=linear["num_heads"], linear_d_head=linear["head_dim"],
            linear_conv_kernel=linear["short_conv_kernel_size"],
            fields_read=tuple(hf.read), fields_ignored=tuple(f for f in FIXED_FIELDS if f in raw),
        )


def linear_sizes(hf: HFConfig) -> dict[str, int]:
    """The KDA sizes: linear_attn_config's where it has them (transformers reads those first), else the top-level
    names, else transformers' defaults; the two places disagreeing is refused, naming both."""
    section = hf.opt("linear_attn_config", {})
    if not isinstance(section, dict):
        raise ValueError(f"linear_attn_config = {section!r}; expected an object (num_heads, head_dim, "
                         "short_conv_kernel_size, full_attn_layers, kda_layers)")
    sizes = {}
    for name, top in LINEAR_FIELDS.items():
        top_value = hf.integer(top, None, at_least=1)
        value = section.get(name)
        if value is not None:
            if not isinstance(value, int) or isinstance(value, bool) or value < 1:
                raise ValueError(f"linear_attn_config.{name} = {value!r}; expected a positive integer")
            if top_value is not None and top_value != value:
                raise ValueError(f"linear_attn_config.{name} = {value} disagrees with {top} = {top_value}: transformers "
                                 f"reads linear_attn_config's; make them agree")
        sizes[name] = value if value is not None else top_value if top_value is not None else LINEAR_DEFAULTS[name]
    return sizes


def layer_types(hf: HFConfig, n_layers: int) -> tuple[str, ...]:
    """Each layer's kind as transformers reads it: layer_types where given, else linear_attn_config's
    full_attn_layers and kda_layers (numbered from 1), else full attention on layers 4, 8, ... (from 0)."""
    kinds = hf.opt("layer_types")
    if kinds is not None:
        if not isinstance(kinds, list) or len(kinds) != n_layers or not set(kinds) <= set(LAYER_TYPES):
            raise ValueError(f"layer_types must list {n_layers} entries (num_hidden_layers), each one of "
                             f"{list(LAYER_TYPES)}; got {kinds!r}")
        return tuple(kinds)
    section = hf.opt("linear_attn_config", {})
    if "full_attn_layers" in section and "kda_layers" in section:
        full, kda = section["full_attn_layers"], section["kda_layers"]
        for name, numbers in (("full_attn_layers", full), ("kda_layers", kda)):
            if not isinstance(numbers, list) or not all(isinstance(i, int) and 1 <= i <= n_layers for i in numbers):
                raise ValueError(f"linear_attn_config.{name} = {numbers!r}; expected layer numbers from 1 to "
                                 f"{n_layers} (num_hidden_layers)")
        both = sorted(set(full) & set(kda))
        missing = sorted(set(range(1, n_layers + 1)) - set(full) - set(kda))
        if both or missing:
            raise ValueError(f"linear_attn_config: every layer 1..{n_layers} must be in exactly one of full_attn_layers "
                             f"and kda_layers; in both: {both}, in neither: {missing}")
        return tuple("full_attention" if i + 1 in full else "linear_attention" for i in range(n_layers))
    return tuple("full_attention" if i and i % 4 == 0 else "linear_attention" for i in range(n_layers))


def mlp_layer_types(hf: HFConfig, n_layers: int, first_dense_default: int = 1) -> tuple[bool, ...]:
    """Per block, whether it is a mixture: mlp_layer_types where given, else first_k_dense_replace (the family's
    default where absent) dense blocks then mixtures; both given and disagreeing is refused (transformers would
    read mlp_layer_types)."""
    first_dense = hf.integer("first_k_dense_replace", None, at_least=0)
    types = hf.opt("mlp_layer_types")
    if types is None:
        first_dense = first_dense_default if first_dense is None else first_dense
        if first_dense >= n_layers:
            raise ValueError(f"first_k_dense_replace = {first_dense} makes all {n_layers} blocks (num_hidden_layers) "
                             "dense MLPs, leaving no mixture block")
        return tuple(i >= first_dense for i in range(n_layers))
    if not isinstance(types, list) or len(types) != n_layers or not set(types) <= set(MLP_LAYER_TYPES):
        raise ValueError(f"mlp_layer_types must list {n_layers} entries (num_hidden_layers), each one of "
                         f"{sorted(MLP_LAYER_TYPES)}; got {types!r}")
    layers = tuple(MLP_LAYER_TYPES[t] for t in types)
    if first_dense is not None and layers != tuple(i >= first_dense for i in range(n_layers)):
        raise ValueError(f"first_k_dense_replace = {first_dense} disagrees with mlp_layer_types = {types}: transformers "
                         "builds the blocks mlp_layer_types lists; make them agree")
    return layers


KDA_PARAMETERS = ("q_proj.weight", "k_proj.weight", "v_proj.weight", "f_a_proj.weight", "f_b_proj.weight", "A_log",
                  "b_proj.weight", "g_a_proj.weight", "g_b_proj.weight", "o_norm.weight", "o_proj.weight")


def _layer_sites(cfg: KimiLinearConfig, layer: int, src: str, dst: str) -> list[Entry]:
    attn, hub, ours = f"{src}.self_attn", f"{src}.block_sparse_moe", f"{src}.mlp"  # the Hub's mixture, transformers'
    if cfg.layer_types[layer] == "linear_attention":
        width = cfg.linear_n_heads * cfg.linear_d_head
        mixer = f"{dst}.mixer"
        entries: list[Entry] = [Weight(f"{mixer}.{name}", (f"{attn}.{name}",)) for name in KDA_PARAMETERS]
        entries += [
            Weight(f"{mixer}.dt_bias.weight", (f"{attn}.dt_bias",)),
            *(SplitWeight((f"{attn}.{part}_conv1d.weight",), (Part(f"{mixer}.conv1d.weight", width, (slice(i * width, (i + 1) * width),)),))
              for i, part in enumerate("qkv")),
            Reference(f"{dst}.hook_attn_out", attn),  # its module returns a tensor, not a tuple
            Reference(f"{mixer}.hook_log_decay", f"{attn}.forget_gate"),
            Reference(f"{mixer}.hook_z", f"{attn}.o_proj", "in"),
        ]
    else:
        entries = _attention_sites(cfg, src, dst)
    if not cfg.moe_layers[layer]:  # the Hub's dense block is under mlp; transformers saves it under block_sparse_moe
        return entries + [
            Weight(f"{dst}.mlp.{name}.weight", (f"{ours}.{name}.weight", f"{hub}.{name}.weight"))
            for name in ("gate_proj", "up_proj", "down_proj")
        ] + [Reference(f"{dst}.mlp.hook_post", f"{ours}.down_proj", "in")]
    return entries + [
        Weight(f"{dst}.mlp.router.weight", (f"{hub}.gate.weight",)),
        Weight(f"{dst}.mlp.router.e_score_correction_bias", (f"{hub}.gate.e_score_correction_bias",)),
        block_sparse_experts(cfg, hub, ours, dst),
        *gated_mlp(f"{hub}.shared_experts", f"{dst}.mlp.shared_expert"),
        *router_references(dst, f"{ours}.gate"),
        Reference(f"{dst}.mlp.hook_routed_out", f"{ours}.experts"),
        Reference(f"{dst}.mlp.shared_expert.hook_out", f"{ours}.shared_experts"),
    ]
