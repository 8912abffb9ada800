"""HookedQwen3Next: Qwen3-Next-80B-A3B (model_type qwen3_next).

What is special about the family:
- hybrid layers (`layer_types`, by default three Gated DeltaNet linear-attention layers to one full attention
  layer): the linear layers' mixer is moelens.models.mixers.gated_deltanet (its sites blocks.L.mixer.*, its state
  a convolution window and a recurrent state), stored fused as in_proj_qkvz / in_proj_ba;
- full attention with an output gate (q_proj twice as wide, sigmoid(gate) on the heads' outputs), zero-centred
  per-head q/k norms before a partial rotary (a quarter of each head by default);
- every norm zero-centred: (1 + w) times the normed input, computed in float32 before the cast back;
- Qwen2-MoE's mixture: a softmax router renormalised where norm_topk_prob says (true by default), a shared
  expert gated by a sigmoid; dense blocks where mlp_only_layers / decoder_sparse_step say so.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import ClassVar

from moelens.config import HFConfig, MoeConfig, check_layer_kinds, common_fields, routed_fields
from moelens.models.base import HookedTransformer
from moelens.models.components import GatedSharedExpertMoe, SoftmaxTopK
from moelens.models.components.gated_attention import OutputGatedAttention
from moelens.models.components.norm import ZeroCenteredRMSNorm
from moelens.models.mixers.gated_deltanet import FusedProjectionsGatedDeltaNet, GatedDeltaNet
from moelens.models.qwen2_moe import dense_width, feed_forward_sites, mixture_layers
from moelens.models.recipe import Dense, LayerSpec, Mixture, Recipe
from moelens.models.sites import Entry, attention_projections, decoder_site_map
from moelens.sitemap import Reference, SiteMap, Weight

LAYER_TYPES = ("linear_attention", "full_attention")


@dataclass(frozen=True)
class Qwen3NextConfig(MoeConfig):
    """MoeConfig plus the Gated DeltaNet sizes and each layer's kind ("linear_attention" or "full_attention")."""

    # the layer kinds this family's layer_types may name
    layer_kinds: ClassVar[tuple[str, ...]] = LAYER_TYPES
    layer_types: tuple[str, ...] = ()
    linear_n_key_heads: int = 0
    linear_n_value_heads: int = 0
    linear_d_key: int = 0
    linear_d_value: int = 0
    linear_conv_kernel: int = 0

    def __post_init__(self) -> None:
        super().__post_init__()
        check_layer_kinds(self.layer_types, self.n_layers, self.layer_kinds)


def read_layer_types(hf: HFConfig, n_layers: int) -> tuple[str, ...]:
    """layer_types as transformers reads it: the list given, else full attention every full_attention_interval-th
    layer (default 4) and linear attention on the others."""
    if hf.opt("layer_types") is None:
        interval = hf.integer("full_attention_interval", 4, at_least=1)
        return tuple("linear_attention" if (i + 1) % interval else "full_attention" for i in range(n_layers))
    kinds = hf.opt("layer_types")
    if not isinstance(kinds, list) or not all(isinstance(k, str) for k in kinds):
        raise ValueError(f"layer_types = {kinds!r}; expected a list of layer kinds ({', '.join(LAYER_TYPES)})")
    return tuple(kinds)


def gated_deltanet_fields(hf: HFConfig, linear_num_key_heads: int = 16, linear_num_value_heads: int = 32) -> dict:
    """The Gated DeltaNet sizes, under the names the mixer reads (transformers' defaults are Qwen3-Next's; the
    keywords: a family's other defaults for the head counts)."""
    return dict(
        linear_n_key_heads=hf.integer("linear_num_key_heads", linear_num_key_heads, at_least=1),
        linear_n_value_heads=hf.integer("linear_num_value_heads", linear_num_value_heads, at_least=1),
        linear_d_key=hf.integer("linear_key_head_dim", 128, at_least=1),
        linear_d_value=hf.integer("linear_value_head_dim", 128, at_least=1),
        linear_conv_kernel=hf.integer("linear_conv_kernel_dim", 4, at_least=1),
    )


def hybrid_recipe(cfg: Qwen3NextConfig, linear: type[GatedDeltaNet]) -> Recipe:
    """Per layer its kind's mixer (`linear` or gated full attention), then a mixture or a dense MLP."""
    mixture = Mixture(GatedSharedExpertMoe, SoftmaxTopK)
    layers = tuple(
        LayerSpec(
            linear if kind == "linear_attention" else OutputGatedAttention,
            mixture if is_moe else Dense(),
            ZeroCenteredRMSNorm,
        )
        for kind, is_moe in zip(cfg.layer_types, cfg.moe_layers, strict=True)
    )
    return Recipe(layers, ZeroCenteredRMSNorm)


class HookedQwen3Next(HookedTransformer):
    model_type = "qwen3_next"
    linear_mixer: type[GatedDeltaNet] = FusedProjectionsGatedDeltaNet
    # the Gated DeltaNet's parameters in the checkpoint, by their name under linear_attn (moelens's under mixer)
    linear_parameters: tuple[str, ...] = (
        "in_proj_qkvz.weight", "in_proj_ba.weight", "conv1d.weight", "dt_bias", "A_log", "norm.weight", "out_proj.weight",
    )

    @classmethod
    def recipe(cls, cfg: Qwen3NextConfig) -> Recipe:
        return hybrid_recipe(cfg, cls.linear_mixer)

    @classmethod
    def site_map(cls, cfg: Qwen3NextConfig) -> SiteMap:
        # the Hub checkpoint's multi-token-prediction weights (mtp.*) are not run, as in transformers
        return decoder_site_map(cfg, cls._layer_sites, ignored_prefixes=("mtp.",))

    @classmethod
    def config_from_hf(cls, raw: dict) -> Qwen3NextConfig:
        hf = HFConfig(raw)
        fields = common_fields(
            hf, rms_norm_eps=1e-6, max_position_embeddings=32768, hidden_size=2048, partial_rotary_factor=0.25,
            d_head=hf.integer("head_dim", 256, at_least=1),
        )
        n_experts = hf.integer("num_experts", 512, at_least=0)
        moe_layers = mixture_layers(hf, fields["n_layers"], n_experts)
        any_moe = any(moe_layers)
        bias = hf.flag("attention_bias", False)
        return Qwen3NextConfig(
            **fields,
            **routed_fields(hf, moe_layers, n_experts, hf.integer("moe_intermediate_size", 512, at_least=1) if any_moe else 0,
                            num_experts_per_tok=10),
            **gated_deltanet_fields(hf),
            family=cls.model_type,
            layer_types=read_layer_types(hf, fields["n_layers"]),
            qkv_bias=bias,
            o_bias=bias,
            d_mlp=dense_width(hf, moe_layers),
            d_shared=hf.integer("shared_expert_intermediate_size", 512, at_least=1) if any_moe else 0,
            norm_topk_prob=hf.flag("norm_topk_prob", True),
            fields_read=tuple(hf.read),
        )

    @classmethod
    def _layer_sites(cls, cfg: Qwen3NextConfig, layer: int, src: str, dst: str) -> list[Entry]:
        if cfg.layer_types[layer] == "linear_attention":
            mixer = f"{src}.linear_attn"
            entries: list[Entry] = [Weight(f"{dst}.mixer.{name}", (f"{mixer}.{name}",)) for name in cls.linear_parameters]
            entries.append(Reference(f"{dst}.hook_attn_out", mixer))  # its module returns a tensor, not a tuple
        else:
            attn = f"{src}.self_attn"
            entries = attention_projections(cfg, src, dst) + [
                Weight(f"{dst}.attn.q_norm.weight", (f"{attn}.q_norm.weight",)),
                Weight(f"{dst}.attn.k_norm.weight", (f"{attn}.k_norm.weight",)),
                Reference(f"{dst}.attn.hook_z", f"{attn}.o_proj", "in"),
            ]
            entries = [e for e in entries if not (isinstance(e, Reference) and e.hook.endswith("attn.hook_q"))]
        return entries + feed_forward_sites(cfg, layer, src, dst)
