"""HookedQwen3_5Moe: Qwen3.5-MoE, Qwen3.5-35B-A3B and Qwen3.5-397B-A17B (model_type qwen3_5_moe_text; the Hub's
multimodal checkpoints, model_type qwen3_5_moe, nest it as text_config and store its keys under
model.language_model., and load the same; their vision tower (model.visual.*) is not loaded).

Qwen3-Next's hybrid (moelens.models.qwen3_next) with these differences (transformers' modeling_qwen3_5_moe):
- the Gated DeltaNet's projections stored one per part (in_proj_qkv, in_proj_z, in_proj_b, in_proj_a:
  SeparateProjectionsGatedDeltaNet), not fused per key head;
- a mixture on every layer: transformers' config has no mlp_only_layers, decoder_sparse_step nor
  intermediate_size, and its router always renormalises the top-k weights (no norm_topk_prob); config.json
  values of those fields are ignored, as transformers ignores them;
- the rotary is the multimodal one (rope_parameters.mrope_section, interleaved T H W frequencies): each
  frequency turns by its own axis's position. For text the three axes' positions are the token's position
  (transformers' text model, and its multimodal model without images or videos), so it is the 1-D rotary
  Qwen3-Next has; mrope_section and mrope_interleaved are read only for images and videos, which moelens
  does not take.
The multi-token-prediction weights (mtp.*) are not run, as in transformers.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass
from typing import ClassVar

from moelens.config import HFConfig, common_fields, routed_fields
from moelens.models.mixers.gated_deltanet import GatedDeltaNet, SeparateProjectionsGatedDeltaNet
from moelens.models.qwen3_next import HookedQwen3Next, Qwen3NextConfig, gated_deltanet_fields, read_layer_types
from moelens.models.sites import decoder_site_map
from moelens.sitemap import ExpertStack, FusedExperts, PerExpertKeys, SiteMap, Weight

TEXT_KEYS, NESTED_KEYS = "model.", "model.language_model."  # the text model's keys, flat and in the Hub's nesting
# config.json fields transformers' Qwen3.5-MoE does not read (its text config removes them; a mixture everywhere)
IGNORED_FIELDS = ("mlp_only_layers", "decoder_sparse_step", "norm_topk_prob", "intermediate_size",
                  "router_aux_loss_coef", "output_router_logits", "attention_dropout")
# the multimodal rotary's sections: they matter only where a token's three positions differ (images, videos)
TEXT_ONLY_ROPE_FIELDS = ("mrope_section", "mrope_interleaved")
MULTIMODAL_FIELDS = ("vision_config", "image_token_id", "video_token_id", "vision_start_token_id", "vision_end_token_id")


@dataclass(frozen=True)
class Qwen3_5MoeConfig(Qwen3NextConfig):
    """Qwen3NextConfig, and whether the checkpoint is the Hub's multimodal one (keys under
    model.language_model.)."""

    nested: bool = False


def nest_keys(site_map: SiteMap) -> SiteMap:
    """The site map with the text model's keys (model.*) under model.language_model., as the Hub's multimodal
    checkpoints store them (lm_head.weight and mtp.* stay where they are); references are unchanged, they name
    transformers' text model's modules."""

    def key(k: str | None) -> str | None:
        return NESTED_KEYS + k[len(TEXT_KEYS):] if k is not None and k.startswith(TEXT_KEYS) else k

    def entry(w):
        if isinstance(w, ExpertStack):
            per_expert = tuple(PerExpertKeys(key(p.gate), key(p.up), key(p.down)) for p in w.per_expert)
            f = w.fused
            fused = FusedExperts(key(f.gate_up), key(f.down), key(f.gate_up_bias), key(f.down_bias), f.layouts)
            return dataclasses.replace(w, per_expert=per_expert, fused=fused)
        if isinstance(w, Weight):
            return dataclasses.replace(w, keys=tuple(key(k) for k in w.keys))
        raise TypeError(f"nest_keys: no rule for a {type(w).__name__} entry")

    ignored = (*site_map.ignored_prefixes, f"{TEXT_KEYS}visual.")
    return dataclasses.replace(site_map, weights=tuple(entry(w) for w in site_map.weights), ignored_prefixes=ignored)


class HookedQwen3_5Moe(HookedQwen3Next):
    model_type = "qwen3_5_moe_text"
    model_type_aliases: ClassVar[tuple[str, ...]] = ("qwen3_5_moe",)  # the Hub's multimodal config, text_config nested
    linear_mixer: type[GatedDeltaNet] = SeparateProjectionsGatedDeltaNet
    linear_parameters: tuple[str, ...] = (
        "in_proj_qkv.weight", "in_proj_z.weight", "in_proj_b.weight", "in_proj_a.weight", "conv1d.weight", "dt_bias",
        "A_log", "norm.weight", "out_proj.weight",
    )

    @classmethod
    def site_map(cls, cfg: Qwen3_5MoeConfig) -> SiteMap:
        # the Hub checkpoint's multi-token-prediction weights (mtp.*) are not run, as in transformers
        site_map = decoder_site_map(cfg, cls._layer_sites, ignored_prefixes=("mtp.",))
        return nest_keys(site_map) if cfg.nested else site_map

    @classmethod
    def config_from_hf(cls, raw: dict) -> Qwen3_5MoeConfig:
        nested = raw.get("model_type") == "qwen3_5_moe"
        if nested and not isinstance(raw.get("text_config"), dict):
            raise ValueError(
                "model_type 'qwen3_5_moe' (the multimodal checkpoint) needs its text model's text_config object"
            )
        hf = HFConfig(raw).section("text_config") if nested else HFConfig(raw)
        fields = common_fields(
            hf, rms_norm_eps=1e-6, max_position_embeddings=32768, hidden_size=2048, partial_rotary_factor=0.25,
            d_head=hf.integer("head_dim", 256, at_least=1),
        )
        n_layers = fields["n_layers"]
        n_experts = hf.integer("num_experts", 256, at_least=1)
        moe_layers = (True,) * n_layers
        bias = hf.flag("attention_bias", False)
        rope = hf.rope_section()
        ignored = tuple(hf.label(f) for f in IGNORED_FIELDS if hf.raw.get(f) is not None)
        ignored += tuple(rope.label(f) for f in TEXT_ONLY_ROPE_FIELDS if rope.raw.get(f) is not None)
        if nested:
            ignored += tuple(f for f in MULTIMODAL_FIELDS if f in raw)
        return Qwen3_5MoeConfig(
            **fields,
            **routed_fields(hf, moe_layers, n_experts, hf.integer("moe_intermediate_size", 512, at_least=1),
                            num_experts_per_tok=8),
            **gated_deltanet_fields(hf),
            family=cls.model_type,
            layer_types=read_layer_types(hf, n_layers),
            qkv_bias=bias,
            o_bias=bias,
            d_shared=hf.integer("shared_expert_intermediate_size", 512, at_least=1),
            norm_topk_prob=True,  # transformers' router always renormalises
            nested=nested,
            fields_read=tuple(hf.label(f) for f in hf.read),
            fields_ignored=ignored,
        )
