"""HookedBailingHybrid: Ling 3 hybrid models (model_type bailing_hybrid, e.g. Ling-3.0-Flash).

What is special about the family, beside Kimi-Linear's hybrid (moelens.models.kimi_linear: Kimi Delta Attention
layers and latent attention, DeepSeek-V3's grouped sigmoid router and shared expert, dense blocks first):
- the KDA layers' gates are full-rank (f_proj, g_proj) and the forget gate bounded: log decay kda_lower_bound *
  sigmoid(exp(A_log) * (f + dt_bias)) with kda_safe_gate (moelens.models.mixers.kimi_delta_attention.
  BailingDeltaAttention), A_log, dt_bias and the short convolution kept float32 in any model dtype;
- the KDA layers have num_attention_heads heads of head_dim (transformers reads no other field for them) and the
  layers' kinds come in groups: the last of every layer_group_size layers is full attention;
- the latent attention has a rotary on interleaved pairs (rope_theta 6e6 by default, YaRN's mscale in the softmax
  scale) and a sigmoid gate per head on its output (g_proj: hook_attn_gate, one value per head, before its
  sigmoid; hook_z the gated outputs o_proj reads);
- the checkpoint's own tensor names, which transformers' conversion mapping renames on loading and writes back on
  saving: model.word_embeddings, attention.* for self_attn.*, attention.dense for o_proj, q_conv1d / k_conv1d /
  v_conv1d for the one convolution over q | k | v, mlp.gate.expert_bias for the correction bias; hooks name
  transformers' modules (self_attn, forget_gate, ...);
- the multi-token-prediction layers the checkpoint stores after the last block (num_mtp_layers) are not run.

transformers' save_pretrained writes head_dim as qk_rope_head_dim (its config overwrites it after taking the KDA
width from it) and the KDA width as linear_head_dim, which its own loading does not read: such a config.json
whose two differ is refused, naming both, rather than read either way.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass

from torch import nn

from moelens.config import HFConfig
from moelens.hooks.sites import site_hook
from moelens.models.components.latent_attention import MultiHeadLatentAttention
from moelens.models.deepseek_v3 import _attention_sites, latent_decoder_fields
from moelens.models.kimi_linear import LAYER_TYPES, SPELLINGS, HookedKimiLinear, KimiLinearConfig, mlp_layer_types
from moelens.models.mixers.kimi_delta_attention import BailingDeltaAttention
from moelens.models.sites import Entry, decoder_site_map, gated_mlp, router_references, routed_experts
from moelens.models.terms import ParamTerm, linear
from moelens.sitemap import Part, Reference, SiteMap, SplitWeight, Weight

# transformers' BailingHybridConfig defaults (Ling-3.0-Flash's sizes), for the fields latent_decoder_fields reads
BAILING_DEFAULTS = dict(
    rms_norm_eps=1e-6, max_position_embeddings=262144, hidden_size=2560, qk_nope_head_dim=128, qk_rope_head_dim=64,
    v_head_dim=128, q_lora_rank=None, kv_lora_rank=512, first_k_dense_replace=2, n_routed_experts=512,
    num_experts_per_tok=8, moe_intermediate_size=768, intermediate_size=6144, n_group=8, topk_group=4,
    routed_scaling_factor=2.5,
)
# present in config.json, not read by transformers' model: the training loss's weight of the MTP layers
IGNORED_FIELDS = ("mtp_loss_scaling_factor",)


@dataclass(frozen=True)
class BailingHybridConfig(KimiLinearConfig):
    """KimiLinearConfig plus the KDA forget gate's bound (kda_safe_gate, kda_lower_bound)."""

    kda_safe_gate: bool = True
    kda_lower_bound: float = -5.0


class HeadGatedLatentAttention(MultiHeadLatentAttention):
    """Latent attention whose heads' outputs are each multiplied by sigmoid(g_proj(x)) of their head (computed in
    float32 and cast to the model's dtype), as transformers' BailingHybridAttention."""

    @classmethod
    def param_terms(cls, cfg, layer: int) -> tuple[ParamTerm, ...]:
        return super().param_terms(cfg, layer) + linear("g_proj", cfg.d_model, cfg.n_heads, False, "attention")

    def __init__(self, cfg, layer: int) -> None:
        super().__init__(cfg, layer)
        self.g_proj = nn.Linear(cfg.d_model, cfg.n_heads, bias=False)
        self.hook_attn_gate = site_hook("blocks.L.attn.hook_attn_gate", "per_head")
        self.hook_z = site_hook("blocks.L.attn.hook_z", "gated_latent")

    def gate_heads(self, x, z):
        gate = self.hook_attn_gate(self.g_proj(x))
        return z * gate.float().sigmoid().to(x.dtype).unsqueeze(-1)

    def input_projections(self):
        return [*super().input_projections(), self.g_proj]


class HookedBailingHybrid(HookedKimiLinear):
    model_type = "bailing_hybrid"
    linear_mixer = BailingDeltaAttention
    full_attention = HeadGatedLatentAttention

    @classmethod
    def site_map(cls, cfg: BailingHybridConfig) -> SiteMap:
        mtp = tuple(f"model.layers.{i}." for i in range(cfg.n_layers, cfg.n_layers + cfg.mtp_layers))
        skeleton = decoder_site_map(cfg, _layer_sites, mtp)
        weights = tuple(
            dataclasses.replace(w, keys=("model.word_embeddings.weight",)) if getattr(w, "param", None) == "embed.weight"
            else w for w in skeleton.weights
        )
        return dataclasses.replace(skeleton, weights=weights)

    @classmethod
    def config_from_hf(cls, raw: dict) -> BailingHybridConfig:
        hf = HFConfig.with_spellings(raw, {**SPELLINGS, "num_mtp_layers": "num_nextn_predict_layers"})
        n_layers = hf.integer("num_hidden_layers", at_least=1)
        rope = hf.rope(theta=6_000_000.0)
        if rope.partial_rotary_factor != 1.0:
            raise ValueError(f"partial_rotary_factor {rope.partial_rotary_factor}: Ling's latent attention rotates its "
                             "qk_rope_head_dim dims, set by qk_rope_head_dim (partial_rotary_factor must be 1)")
        fields = latent_decoder_fields(
            hf, raw, BAILING_DEFAULTS, rope_interleave=True,
            moe_layers=lambda n: mlp_layer_types(hf, n, first_dense_default=2), rope=rope,
        )
        # transformers' default: one multi-token-prediction layer stored after the blocks
        fields["mtp_layers"] = hf.integer("num_nextn_predict_layers", 1, at_least=0)
        return BailingHybridConfig(
            **fields, family=cls.model_type,
            layer_types=layer_types(hf, n_layers),
            **kda_sizes(hf, fields["n_heads"]),
            kda_safe_gate=hf.flag("kda_safe_gate", True),
            kda_lower_bound=hf.number("kda_lower_bound", -5.0),
            fields_read=tuple(hf.read), fields_ignored=tuple(f for f in IGNORED_FIELDS if f in raw),
        )


def kda_sizes(hf: HFConfig, n_heads: int) -> dict[str, int]:
    """The KDA layers' sizes as transformers' BailingHybridConfig takes them: num_attention_heads heads of head_dim,
    short_conv_kernel_size. The names it writes them back under (linear_num_heads, linear_head_dim,
    linear_conv_kernel_dim) and does not read are refused where they disagree."""
    sizes = dict(linear_n_heads=n_heads, linear_d_head=hf.integer("head_dim", 128, at_least=1),
                 linear_conv_kernel=hf.integer("short_conv_kernel_size", 4, at_least=1))
    for written, field, source in (("linear_num_heads", "linear_n_heads", "num_attention_heads"),
                                   ("linear_head_dim", "linear_d_head", "head_dim"),
                                   ("linear_conv_kernel_dim", "linear_conv_kernel", "short_conv_kernel_size")):
        value = hf.integer(written, None, at_least=1)
        if value is not None and value != sizes[field]:
            raise ValueError(f"{written} = {value} disagrees with {source} = {sizes[field]}: transformers' Ling takes the "
                             f"linear layers' size from {source} and does not read {written}; make them agree")
    return sizes


def layer_types(hf: HFConfig, n_layers: int) -> tuple[str, ...]:
    """layer_types where given, else full attention on the last layer of every layer_group_size (6) layers."""
    kinds = hf.opt("layer_types")
    if kinds is None:
        group = hf.integer("layer_group_size", 6, at_least=1)
        return tuple("full_attention" if (i + 1) % group == 0 else "linear_attention" for i in range(n_layers))
    if not isinstance(kinds, list) or len(kinds) != n_layers or not set(kinds) <= set(LAYER_TYPES):
        raise ValueError(f"layer_types must list {n_layers} entries (num_hidden_layers), each one of "
                         f"{list(LAYER_TYPES)}; got {kinds!r}")
    return tuple(kinds)


KDA_PARAMETERS = ("q_proj.weight", "k_proj.weight", "v_proj.weight", "f_proj.weight", "b_proj.weight",
                  "g_proj.weight", "o_norm.weight")


def _layer_sites(cfg: BailingHybridConfig, layer: int, src: str, dst: str) -> list[Entry]:
    attn, stored = f"{src}.self_attn", f"{src}.attention"  # transformers' module, the checkpoint's name
    if cfg.layer_types[layer] == "linear_attention":
        width = cfg.linear_n_heads * cfg.linear_d_head
        mixer = f"{dst}.mixer"
        entries: list[Entry] = [Weight(f"{mixer}.{name}", (f"{stored}.{name}",)) for name in KDA_PARAMETERS]
        entries += [
            Weight(f"{mixer}.o_proj.weight", (f"{stored}.dense.weight",)),
            Weight(f"{mixer}.A_log.weight", (f"{stored}.A_log",)),
            Weight(f"{mixer}.dt_bias.weight", (f"{stored}.dt_bias",)),
            *(SplitWeight((f"{stored}.{part}_conv1d.weight",),
                          (Part(f"{mixer}.conv1d.weight", width, (slice(i * width, (i + 1) * width),)),))
              for i, part in enumerate("qkv")),
            Reference(f"{dst}.hook_attn_out", attn),  # its module returns a tensor, not a tuple
            Reference(f"{mixer}.hook_log_decay", f"{attn}.forget_gate"),
            Reference(f"{mixer}.hook_z", f"{attn}.o_proj", "in"),
        ]
    else:
        entries = [_stored_as_attention(e) for e in _attention_sites(cfg, src, dst)] + [
            Weight(f"{dst}.attn.g_proj.weight", (f"{stored}.g_proj.weight",)),
            Reference(f"{dst}.attn.hook_attn_gate", f"{attn}.g_proj"),
        ]
    mlp = f"{src}.mlp"
    if not cfg.moe_layers[layer]:
        return entries + [*gated_mlp(mlp, f"{dst}.mlp"), Reference(f"{dst}.mlp.hook_post", f"{mlp}.down_proj", "in")]
    return entries + [
        Weight(f"{dst}.mlp.router.weight", (f"{mlp}.gate.weight",)),
        Weight(f"{dst}.mlp.router.e_score_correction_bias", (f"{mlp}.gate.expert_bias",)),
        routed_experts(cfg, (f"{mlp}.experts",), dst),
        *gated_mlp(f"{mlp}.shared_experts", f"{dst}.mlp.shared_expert"),
        *router_references(dst, f"{mlp}.gate"),
        Reference(f"{dst}.mlp.hook_routed_out", f"{mlp}.experts"),
        Reference(f"{dst}.mlp.shared_expert.hook_out", f"{mlp}.shared_experts"),
    ]


def _stored_as_attention(entry: Entry) -> Entry:
    """DeepSeek-V3's attention entries with the checkpoint's names: attention.* for self_attn.*, dense for o_proj."""
    if not isinstance(entry, Weight):
        return entry
    keys = tuple(k.replace(".self_attn.o_proj.", ".attention.dense.").replace(".self_attn.", ".attention.")
                 for k in entry.keys)
    return dataclasses.replace(entry, keys=keys)
