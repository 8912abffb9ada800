"""HookedMistral4: Mistral Small 4, Mistral-Small-4-119B-2603 (model_type mistral4; the Hub's checkpoint is
multimodal, model_type mistral3 (a Pixtral vision tower and a projector beside the text model), with the text
model's config as text_config and its keys under language_model.; it loads the same, the text model alone: its
tensors under vision_tower. and multi_modal_projector. and the config's vision fields are skipped, and named; its
head is tied as the multimodal config's tie_word_embeddings says, true where absent, as transformers ties it).

DeepSeek-V3's blocks (moelens.models.deepseek_v3: multi-head latent attention, its rotary interleaved where
rope_interleave, YaRN whose mscale_all_dim also scales the softmax, first_k_dense_replace dense blocks, a shared
expert added ungated after the routed experts) with these differences (transformers' modeling_mistral4):
- the router (SoftmaxGroupedTopK) softmaxes the logits in the model's dtype (no float32 anywhere, no correction
  bias) and chooses among the topk_group of n_group groups whose two best scores sum highest (the others' scores
  set to 0 for the choice); the weights are the chosen scores, renormalised when norm_topk_prob, times
  routed_scaling_factor, in the model's dtype;
- after the rotary, the queries are scaled by position (Llama 4's scaling, PositionScaledLatentAttention):
  1 + llama_4_scaling_beta * log(1 + floor(position / original_max_position_embeddings)), both read from
  rope_parameters, where transformers reads them (it cannot run without them);
- transformers' head_dim is qk_nope_head_dim + qk_rope_head_dim and its rotary turns partial_rotary_factor of it:
  that must be the qk_rope_head_dim dims the attention rotates (absent, it is); its unscaled ("default") rotary
  ignores partial_rotary_factor, turns all of head_dim and cannot run, so it is refused (unless
  qk_nope_head_dim is 0).
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass
from typing import ClassVar

import torch
import torch.nn.functional as F
from jaxtyping import Float, Int

from moelens.config import HFConfig, MoeConfig
from moelens.models.components import SharedExpertMoe
from moelens.models.components.latent_attention import MultiHeadLatentAttention
from moelens.models.components.router import GroupedTopK
from moelens.models.deepseek_v3 import DeepseekV3Config, HookedDeepseekV3, _attention_sites, latent_decoder_fields
from moelens.models.recipe import Recipe, decoder_recipe
from moelens.models.sites import Entry, decoder_site_map, dense_mlp, gated_mlp, router_references, routed_experts
from moelens.sitemap import ExpertStack, FusedExperts, PerExpertKeys, Reference, SiteMap, Weight

MULTIMODAL_TYPE, TEXT_TYPE = "mistral3", "mistral4"
HUB_PREFIX = "language_model."  # the multimodal checkpoint's text model (lm_head included)
# the multimodal checkpoint's other parts, not part of the text model
MULTIMODAL_PREFIXES = ("vision_tower.", "multi_modal_projector.")
# the multimodal config's fields about images, which the text model does not read
MULTIMODAL_FIELDS = ("vision_config", "image_token_index", "image_token_id", "spatial_merge_size", "vision_feature_layer",
                     "multimodal_projector_bias", "projector_hidden_act")
# in Mistral 4's config.json, unused by transformers' model (tensor parallelism, training, multi-token prediction)
# or set by it (head_dim and qk_head_dim: qk_nope_head_dim + qk_rope_head_dim, whatever config.json says)
IGNORED_FIELDS = ("pretraining_tp", "output_router_logits", "attention_dropout", "num_nextn_predict_layers", "head_dim",
                  "qk_head_dim")

# transformers' Mistral4Config defaults (Mistral Small 4's sizes), for the fields latent_decoder_fields reads
MISTRAL4_DEFAULTS = dict(
    rms_norm_eps=1e-6, max_position_embeddings=1048576, hidden_size=4096, qk_nope_head_dim=64, qk_rope_head_dim=64,
    v_head_dim=128, q_lora_rank=1024, kv_lora_rank=256, first_k_dense_replace=0, n_routed_experts=128,
    num_experts_per_tok=4, moe_intermediate_size=2048, intermediate_size=12288, n_group=1, topk_group=1,
    routed_scaling_factor=1.0,
)

# transformers' Mistral4Config's rotary where config.json has neither rope_parameters nor rope_scaling (Mistral Small
# 4's own: YaRN from 8192 positions, the queries' scaling by position); a top-level rope_theta is not read then
DEFAULT_ROPE = {
    "rope_type": "yarn", "rope_theta": 10000.0, "factor": 128.0, "original_max_position_embeddings": 8192,
    "beta_fast": 32.0, "beta_slow": 1.0, "mscale_all_dim": 1.0, "mscale": 1.0, "llama_4_scaling_beta": 0.1,
}


@dataclass(frozen=True)
class Mistral4Config(DeepseekV3Config):
    """DeepseekV3Config plus the queries' scaling by position (llama_4_scaling_beta, and the positions per step:
    rope_parameters' original_max_position_embeddings) and the prefix of the checkpoint's keys
    ("language_model." for the Hub's multimodal checkpoint)."""

    query_scaling_beta: float = 0.0
    query_scaling_period: int = 1
    key_prefix: str = ""


class SoftmaxGroupedTopK(GroupedTopK):
    """Mistral Small 4's router: logits and softmax in the weight's dtype (the model's); the top-k scores among the
    topk_group of n_group groups whose two best scores sum highest (the other groups' scores set to 0 for the
    choice); weights the chosen scores, renormalised when norm_topk_prob, times routed_scaling_factor, in the
    logits' dtype."""

    scoring = "softmax"
    masked_group_score = 0.0

    def logits(self, x: Float[torch.Tensor, "... d_model"]) -> Float[torch.Tensor, "... n_experts"]:
        return F.linear(x.to(self.weight.dtype), self.weight)

    def scores(self, logits: torch.Tensor) -> Float[torch.Tensor, "... n_experts"]:
        return logits.softmax(dim=-1)  # in the logits' dtype, as the reference (no float32 upcast)


class PositionScaledLatentAttention(MultiHeadLatentAttention):
    """Latent attention whose rotated queries are scaled by 1 + beta * log(1 + floor(position / period)) (1 for the
    first `period` positions), as they enter the scores: hook_rot_q holds them scaled. The position is the token's
    own (a left-padded row's count of its real tokens), as transformers' position_ids in generation."""

    def __init__(self, cfg: Mistral4Config, layer: int) -> None:
        super().__init__(cfg, layer)
        self.beta, self.period = cfg.query_scaling_beta, cfg.query_scaling_period

    def scale_queries(
        self, q: Float[torch.Tensor, "batch pos head d_head"], positions: Int[torch.Tensor, "batch pos"]
    ) -> Float[torch.Tensor, "batch pos head d_head"]:
        # float32 as the reference computes it, then cast to the queries' dtype before the product
        scale = 1 + self.beta * torch.log(1 + torch.floor(positions / self.period))
        return q * scale[:, :, None, None].to(q.dtype)

    def extra_repr(self) -> str:
        return f"{super().extra_repr()}, query_scaling_beta={self.beta}, query_scaling_period={self.period}"


class HookedMistral4(HookedDeepseekV3):
    model_type = TEXT_TYPE
    model_type_aliases: ClassVar[tuple[str, ...]] = (MULTIMODAL_TYPE,)  # the Hub's multimodal config, text_config nested

    @classmethod
    def recipe(cls, cfg: MoeConfig) -> Recipe:
        return decoder_recipe(cfg, PositionScaledLatentAttention, SharedExpertMoe, SoftmaxGroupedTopK)

    @classmethod
    def site_map(cls, cfg: Mistral4Config) -> SiteMap:
        site_map = decoder_site_map(cfg, _layer_sites)
        return prefixed(site_map, cfg.key_prefix, MULTIMODAL_PREFIXES) if cfg.key_prefix else site_map

    @classmethod
    def config_from_hf(cls, raw: dict) -> Mistral4Config:
        outer, hf, nested = text_config_of(raw)
        # the groups are checked there as GroupedTopK's (the same rule: each group scored by its two best)
        fields = latent_decoder_fields(hf, hf.raw, MISTRAL4_DEFAULTS, rotary_of_head=True)
        if fields["rope"].kind == "default" and fields["qk_nope_head_dim"]:
            raise ValueError(
                f"{hf.label('rope_parameters')}.rope_type 'default': transformers' Mistral 4 then builds its rotary "
                f"for all of head_dim (qk_nope_head_dim + qk_rope_head_dim = {fields['d_head']}) and cannot apply it to the "
                f"qk_rope_head_dim ({fields['qk_rope_head_dim']}) rotated dims; a scaled rotary (yarn, as published) "
                "turns partial_rotary_factor of them"
            )
        # transformers' Mistral 4 has no multi-token-prediction layers: the field is not read (a checkpoint
        # storing such a layer is refused by its keys)
        fields.pop("mtp_layers")
        hf.read.remove("num_nextn_predict_layers")
        beta, period = query_scaling(hf)
        ignored = tuple(hf.label(f) for f in IGNORED_FIELDS if hf.raw.get(f) is not None)
        read = [hf.label(f) for f in hf.read]
        if nested:
            ignored += tuple(f for f in MULTIMODAL_FIELDS if f in raw)
            # the multimodal class ties its head by its own config's flag (transformers' Mistral3Config: true where
            # absent), not by the text config's
            fields["tie_word_embeddings"] = outer.flag("tie_word_embeddings", True)
            read = [f for f in read if f != hf.label("tie_word_embeddings")] + ["tie_word_embeddings"]
            if "tie_word_embeddings" in hf.raw:
                ignored += (hf.label("tie_word_embeddings"),)
        return Mistral4Config(
            **fields, family=cls.model_type, query_scaling_beta=beta, query_scaling_period=period,
            key_prefix=HUB_PREFIX if nested else "", fields_read=tuple(read),
            fields_ignored=ignored,
        )


def text_config_of(raw: dict) -> tuple[HFConfig, HFConfig, bool]:
    """(config.json, the text model's config in it, whether it is the multimodal checkpoint's): the text model's is
    config.json itself, or its text_config under model_type mistral3, which must be Mistral 4's. Without any rotary
    settings, transformers' Mistral4Config's own (DEFAULT_ROPE)."""
    nested = raw.get("model_type") == MULTIMODAL_TYPE
    if nested:
        text = raw.get("text_config")
        if not isinstance(text, dict):
            raise ValueError("model_type 'mistral3' (the multimodal checkpoint) needs its text model's text_config object")
        if text.get("model_type") != TEXT_TYPE:
            raise ValueError(
                f"model_type 'mistral3' with text_config.model_type {text.get('model_type')!r}: moelens reads a "
                "mistral3 checkpoint only where its text model is Mistral 4's mixture (text_config.model_type "
                "'mistral4', Mistral Small 4); Mistral Small 3's text model is dense"
            )
    text = raw["text_config"] if nested else raw
    if text.get("rope_parameters") is None and text.get("rope_scaling") is None:
        # transformers' Mistral4Config then sets its own rotary (the scaling fields with it), not the default one
        text = {**text, "rope_parameters": dict(DEFAULT_ROPE)}
        raw = {**raw, "text_config": text} if nested else text
    outer = HFConfig(raw)
    return outer, (outer.section("text_config") if nested else outer), nested


def query_scaling(hf: HFConfig) -> tuple[float, int]:
    """(llama_4_scaling_beta, original_max_position_embeddings) from the rotary settings; transformers' attention
    reads both there on every forward, so a config without them is refused, naming them."""
    rope = hf.rope_section()
    missing = [f for f in ("llama_4_scaling_beta", "original_max_position_embeddings") if rope.raw.get(f) is None]
    if missing:
        raise ValueError(
            f"{hf.label('rope_parameters')} lacks {' and '.join(missing)}: Mistral 4 scales its queries by position with them "
            "(1 + llama_4_scaling_beta * log(1 + floor(position / original_max_position_embeddings))), and "
            "transformers' model cannot run without them"
        )
    return rope.number("llama_4_scaling_beta"), rope.integer("original_max_position_embeddings", at_least=1)


def prefixed(site_map: SiteMap, prefix: str, ignored: tuple[str, ...]) -> SiteMap:
    """The site map with every checkpoint key under `prefix` (the multimodal checkpoint's text model), and the
    multimodal parts' keys (`ignored`) skipped; references are unchanged, they name transformers' text model's
    modules."""

    def key(k: str | None) -> str | None:
        return None if k is None else prefix + k

    def entry(w):
        if isinstance(w, ExpertStack):
            per_expert = tuple(PerExpertKeys(key(p.gate), key(p.up), key(p.down)) for p in w.per_expert)
            fused = tuple(
                FusedExperts(key(f.gate_up), key(f.down), key(f.gate_up_bias), key(f.down_bias), f.layouts)
                for f in (w.fused, *w.other_fused)
            )
            return dataclasses.replace(w, per_expert=per_expert, fused=fused[0], other_fused=fused[1:])
        if isinstance(w, Weight):
            return dataclasses.replace(w, keys=tuple(key(k) for k in w.keys))
        raise TypeError(f"prefixed: no rule for a {type(w).__name__} entry")

    return dataclasses.replace(
        site_map, weights=tuple(entry(w) for w in site_map.weights),
        ignored_prefixes=(*(prefix + p for p in site_map.ignored_prefixes), *ignored),
    )


def _layer_sites(cfg: Mistral4Config, layer: int, src: str, dst: str) -> list[Entry]:
    if not cfg.moe_layers[layer]:
        return _attention_sites(cfg, src, dst) + dense_mlp(src, dst)
    return _attention_sites(cfg, src, dst) + [
        Weight(f"{dst}.mlp.router.weight", (f"{src}.mlp.gate.weight",)),
        # transformers reads Mistral 4's experts stacked only (no per-expert conversion): a checkpoint moelens
        # writes (the embedded default) is stacked too; per-expert keys are read as well
        dataclasses.replace(routed_experts(cfg, (f"{src}.mlp.experts",), dst), fused_first=True),
        *gated_mlp(f"{src}.mlp.shared_experts", f"{dst}.mlp.shared_expert"),
        *router_references(dst, f"{src}.mlp.gate"),
        Reference(f"{dst}.mlp.hook_routed_out", f"{src}.mlp.experts"),
        Reference(f"{dst}.mlp.shared_expert.hook_out", f"{src}.mlp.shared_experts"),
    ]
