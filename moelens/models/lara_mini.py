"""HookedLaraMini: Translated's Lara Mini (Lara-4-Mini-Base; model_type lara_mini).

Qwen3-Next's hybrid (moelens.models.qwen3_next) with these differences (transformers' modeling_lara_mini):
- three layer kinds (layer_types; by default the period-5 pattern linear, sliding, linear, full, sliding):
  Gated DeltaNet layers, and attention layers that are Qwen3's (per-head q/k RMSNorm, no output gate):
  sliding_attention layers turn queries and keys by the rotary (every dim of a head) and attend within the last
  sliding_window positions, full_attention layers attend everywhere without positions (NoPE);
- every RMSNorm plain (weight, not 1 + weight), the weight applied to the float32 normed input before the cast
  back (the block norms, the final norm, the q/k norms, and the Gated DeltaNet's gated norm);
- the Gated DeltaNet's projections stored fused as one in_proj whose rows are [q | k | v | z | b | a]
  (read into Qwen3.5's four projections) and its gated norm stored as out_norm;
- a mixture on every layer: the router's logits float32 (input and weight upcast), softmax, top-k, renormalised
  where norm_topk_prob, the weights cast to the stream's dtype; a shared expert added ungated;
- tied embeddings by default.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import ClassVar

import torch
import torch.nn.functional as F
from jaxtyping import Float

from moelens.config import HFConfig, common_fields, routed_fields
from moelens.models.base import HookedTransformer
from moelens.models.components import SharedExpertMoe, SoftmaxTopK
from moelens.models.components.norm import CastAfterWeightRMSNorm
from moelens.models.components.qk_norm_attention import QKNormNoRotaryAttention, QKNormSlidingWindowAttention
from moelens.models.mixers.gated_deltanet import SeparateProjectionsGatedDeltaNet
from moelens.models.mixers.gated_norm import GatedRMSNorm
from moelens.models.qwen3_next import Qwen3NextConfig, gated_deltanet_fields
from moelens.models.recipe import LayerSpec, Mixture, Recipe
from moelens.models.sites import Entry, attention_projections, decoder_site_map, gated_mlp, router_references, routed_experts
from moelens.sitemap import Part, Reference, SiteMap, SplitWeight, Weight

LAYER_TYPES = ("linear_attention", "sliding_attention", "full_attention")
PATTERN = ("linear_attention", "sliding_attention", "linear_attention", "full_attention", "sliding_attention")
# transformers' LaraMiniConfig defaults (Lara-4-Mini's sizes)
DEFAULTS = dict(
    hidden_size=1024, num_key_value_heads=4, max_position_embeddings=131072, rms_norm_eps=1e-6, head_dim=128,
    sliding_window=512, moe_intermediate_size=512, shared_expert_intermediate_size=512, num_experts=128,
    num_experts_per_tok=4, linear_num_key_heads=8, linear_num_value_heads=16,
)
# present in config.json (Qwen3-Next's names among them), unused by transformers' Lara Mini model
IGNORED_FIELDS = ("attention_dropout", "router_aux_loss_coef", "output_router_logits", "intermediate_size",
                  "decoder_sparse_step", "mlp_only_layers", "full_attention_interval")


@dataclass(frozen=True)
class LaraMiniConfig(Qwen3NextConfig):
    """Qwen3NextConfig whose layers are of three kinds (the sliding ones' window in attention_windows)."""

    layer_kinds: ClassVar[tuple[str, ...]] = LAYER_TYPES


class Float32GatedRMSNorm(GatedRMSNorm):
    """The weight applied to the float32 normed input (transformers' LaraMiniRMSNormGated), then times silu of the
    float32 gate, one cast back at the end."""

    def apply_weight(self, normed: Float[torch.Tensor, "... d"], dtype: torch.dtype) -> Float[torch.Tensor, "... d"]:
        return self.weight.float() * normed


class LaraGatedDeltaNet(SeparateProjectionsGatedDeltaNet):
    norm_class = Float32GatedRMSNorm


class LaraSlidingAttention(QKNormSlidingWindowAttention):
    qk_norm = CastAfterWeightRMSNorm


class LaraNoRotaryAttention(QKNormNoRotaryAttention):
    qk_norm = CastAfterWeightRMSNorm


class Float32LogitsSoftmaxTopK(SoftmaxTopK):
    """Logits from the float32 input and the float32-cast weight (kept in the model's dtype), a float32 softmax,
    top-k, the k weights divided by their plain sum where norm_topk_prob, then cast to the stream's dtype."""

    weights_in_stream_dtype = True

    def logits(self, x: Float[torch.Tensor, "... d_model"]) -> Float[torch.Tensor, "... n_experts"]:
        return F.linear(x.float(), self.weight.float())

    def weights(
        self, scores: torch.Tensor, indices: torch.Tensor, logits_dtype: torch.dtype
    ) -> Float[torch.Tensor, "... top_k"]:
        """logits_dtype: the dtype the mixture asks for, here the stream's (weights_in_stream_dtype)."""
        w = scores.gather(-1, indices)
        return (w / w.sum(-1, keepdim=True) if self.norm_topk_prob else w).to(logits_dtype)


MIXERS = {"linear_attention": LaraGatedDeltaNet, "sliding_attention": LaraSlidingAttention,
          "full_attention": LaraNoRotaryAttention}


class HookedLaraMini(HookedTransformer):
    model_type = "lara_mini"

    @classmethod
    def recipe(cls, cfg: LaraMiniConfig) -> Recipe:
        norm, mixture = CastAfterWeightRMSNorm, Mixture(SharedExpertMoe, Float32LogitsSoftmaxTopK)
        return Recipe(tuple(LayerSpec(MIXERS[kind], mixture, norm) for kind in cfg.layer_types), norm)

    @classmethod
    def site_map(cls, cfg: LaraMiniConfig) -> SiteMap:
        return decoder_site_map(cfg, _layer_sites)

    @classmethod
    def config_from_hf(cls, raw: dict) -> LaraMiniConfig:
        hf = HFConfig(raw)
        d = DEFAULTS
        fields = common_fields(
            hf, rms_norm_eps=d["rms_norm_eps"], max_position_embeddings=d["max_position_embeddings"],
            num_key_value_heads=d["num_key_value_heads"], hidden_size=d["hidden_size"],
            d_head=hf.integer("head_dim", d["head_dim"], at_least=1),
        )
        fields["tie_word_embeddings"] = hf.flag("tie_word_embeddings", True)
        if fields["rope"].partial_rotary_factor != 1.0:  # transformers' Lara Mini rotary turns every dim of a head
            raise ValueError(f"partial_rotary_factor = {fields['rope'].partial_rotary_factor}: Lara Mini turns every "
                             "dim of a head (transformers does not read it), so only 1.0 is supported")
        n_layers = fields["n_layers"]
        layer_types = hf.opt("layer_types")
        if layer_types is None:  # transformers' default: the released period-5 pattern
            layer_types = [PATTERN[i % len(PATTERN)] for i in range(n_layers)]
        if not isinstance(layer_types, list) or len(layer_types) != n_layers or not set(layer_types) <= set(LAYER_TYPES):
            raise ValueError(f"layer_types must list {n_layers} entries (num_hidden_layers), each one of "
                             f"{list(LAYER_TYPES)}; got {layer_types!r}")
        if "sliding_window" in raw and raw["sliding_window"] is None:  # transformers' default is for an absent field
            raise ValueError("sliding_window = null: transformers' Lara Mini builds a sliding-window mask for its "
                             "sliding_attention layers and cannot run this config; give an integer (512 where absent)")
        window = hf.integer("sliding_window", d["sliding_window"], at_least=1)
        n_experts = hf.integer("num_experts", d["num_experts"], at_least=1)
        bias = hf.flag("attention_bias", False)
        return LaraMiniConfig(
            **fields,
            **routed_fields(hf, (True,) * n_layers, n_experts,
                            hf.integer("moe_intermediate_size", d["moe_intermediate_size"], at_least=1),
                            num_experts_per_tok=d["num_experts_per_tok"]),
            **gated_deltanet_fields(hf, d["linear_num_key_heads"], d["linear_num_value_heads"]),
            family=cls.model_type,
            layer_types=tuple(layer_types),
            attention_windows=tuple(window if kind == "sliding_attention" else None for kind in layer_types),
            qkv_bias=bias,
            o_bias=bias,
            d_shared=hf.integer("shared_expert_intermediate_size", d["shared_expert_intermediate_size"], at_least=1),
            norm_topk_prob=hf.flag("norm_topk_prob", True),
            fields_read=tuple(hf.label(f) for f in hf.read),
            fields_ignored=tuple(f for f in IGNORED_FIELDS if f in raw),
        )


def _layer_sites(cfg: LaraMiniConfig, layer: int, src: str, dst: str) -> list[Entry]:
    if cfg.layer_types[layer] == "linear_attention":
        mixer, ours = f"{src}.linear_attn", f"{dst}.mixer"
        key_dim, value_dim = cfg.linear_n_key_heads * cfg.linear_d_key, cfg.linear_n_value_heads * cfg.linear_d_value
        entries: list[Entry] = [
            # the checkpoints' fused in_proj, rows [q | k | v | z | b | a] (transformers splits it on load)
            SplitWeight((f"{mixer}.in_proj.weight",), (
                Part(f"{ours}.in_proj_qkv.weight", 2 * key_dim + value_dim), Part(f"{ours}.in_proj_z.weight", value_dim),
                Part(f"{ours}.in_proj_b.weight", cfg.linear_n_value_heads),
                Part(f"{ours}.in_proj_a.weight", cfg.linear_n_value_heads),
            )),
            *(Weight(f"{ours}.{name}", (f"{mixer}.{name}",)) for name in ("conv1d.weight", "dt_bias", "A_log", "out_proj.weight")),
            # the checkpoints' name, then transformers' module's
            Weight(f"{ours}.norm.weight", (f"{mixer}.out_norm.weight", f"{mixer}.norm.weight")),
            Reference(f"{dst}.hook_attn_out", mixer),  # its module returns a tensor, not a tuple
        ]
    else:
        attn = f"{src}.self_attn"
        entries = attention_projections(cfg, src, dst) + [
            Weight(f"{dst}.attn.q_norm.weight", (f"{attn}.q_norm.weight",)),
            Weight(f"{dst}.attn.k_norm.weight", (f"{attn}.k_norm.weight",)),
            Reference(f"{dst}.attn.hook_z", f"{attn}.o_proj", "in"),
        ]
    mlp = f"{src}.mlp"
    return entries + [
        Weight(f"{dst}.mlp.router.weight", (f"{mlp}.gate.weight",)),
        routed_experts(cfg, (f"{mlp}.experts",), dst),
        *gated_mlp(f"{mlp}.shared_expert", f"{dst}.mlp.shared_expert"),
        *router_references(dst, f"{mlp}.gate"),
        Reference(f"{dst}.mlp.hook_routed_out", f"{mlp}.experts"),
        Reference(f"{dst}.mlp.shared_expert.hook_out", f"{mlp}.shared_expert"),
    ]
