"""HookedDeepseekV3: DeepSeek-V3 / R1 (model_type deepseek_v3).

What is special about the family: multi-head latent attention (MultiHeadLatentAttention: queries through an
optional q_lora_rank bottleneck, keys and values decompressed from a kv_lora_rank latent, the rotary on
qk_rope_head_dim dims of each head only, optionally stored interleaved (rope_interleave), YaRN whose
mscale_all_dim also scales the softmax); the first first_k_dense_replace blocks are dense MLPs
(intermediate_size wide), the rest mixtures: a float32 sigmoid router whose e_score_correction_bias is added
only to choose experts, among the topk_group best of n_group groups (SigmoidGroupedTopK, the same rule as
Solar-Open), weights renormalised when norm_topk_prob and times routed_scaling_factor; a shared expert
(moe_intermediate_size * n_shared_experts wide) added after the routed experts, ungated.

Like transformers, the model is the num_hidden_layers blocks: the Hub checkpoint's multi-token-prediction
layer (model.layers.61 of DeepSeek-V3, num_nextn_predict_layers) is not part of it.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable, Mapping
from dataclasses import dataclass

from moelens.config import REQUIRED, HFConfig, MoeConfig, RopeConfig, common_fields, routed_fields
from moelens.models.base import HookedTransformer
from moelens.models.components import SharedExpertMoe, SigmoidGroupedTopK
from moelens.models.components.latent_attention import MultiHeadLatentAttention
from moelens.models.recipe import Recipe, decoder_recipe
from moelens.models.sites import Entry, decoder_site_map, dense_mlp, gated_mlp, router_references, routed_experts
from moelens.sitemap import Reference, SiteMap, Weight

# Present in DeepSeek's config.json, unused by transformers' model: the MTP layers it does not build, the routing
# rule's names (always sigmoid / noaux_tc in transformers), training settings, and head_dim (it sets it itself).
IGNORED_FIELDS = (
    "num_mtp_layers", "head_dim", "topk_method", "scoring_func", "moe_layer_freq",
    "aux_loss_alpha", "seq_aux", "ep_size",
)


@dataclass(frozen=True)
class DeepseekV3Config(MoeConfig):
    """MoeConfig plus MLA's sizes. d_head is qk_nope_head_dim + qk_rope_head_dim (queries and keys); the
    rotary turns the last qk_rope_head_dim of them."""

    q_lora_rank: int | None = None  # None: a plain q_proj
    kv_lora_rank: int = 0
    qk_nope_head_dim: int = 0
    qk_rope_head_dim: int = 0
    v_head_dim: int = 0
    first_k_dense_replace: int = 0
    mtp_layers: int = 0  # multi-token-prediction layers stored after the last block (not run; see site_map)

    @property
    def d_rot(self) -> int:
        return self.qk_rope_head_dim


class HookedDeepseekV3(HookedTransformer):
    model_type = "deepseek_v3"

    @classmethod
    def recipe(cls, cfg: MoeConfig) -> Recipe:
        return decoder_recipe(cfg, MultiHeadLatentAttention, SharedExpertMoe, SigmoidGroupedTopK)

    @classmethod
    def site_map(cls, cfg: MoeConfig) -> SiteMap:
        # the Hub checkpoint's multi-token-prediction layers follow the last block; transformers skips them too
        mtp = tuple(f"model.layers.{i}." for i in range(cfg.n_layers, cfg.n_layers + cfg.mtp_layers))
        return decoder_site_map(cfg, _layer_sites, mtp)

    @classmethod
    def config_from_hf(cls, raw: dict) -> DeepseekV3Config:
        hf = HFConfig(raw)
        return DeepseekV3Config(
            **latent_decoder_fields(hf, raw, DEEPSEEK_V3_DEFAULTS), family=cls.model_type,
            fields_read=tuple(hf.read), fields_ignored=tuple(f for f in IGNORED_FIELDS if f in raw),
        )


# transformers' DeepseekV3Config defaults (DeepSeek-V3's own sizes), for the fields latent_decoder_fields reads
DEEPSEEK_V3_DEFAULTS = dict(
    rms_norm_eps=1e-6, max_position_embeddings=4096, hidden_size=7168, qk_nope_head_dim=128, qk_rope_head_dim=64,
    v_head_dim=128, q_lora_rank=1536, kv_lora_rank=512, first_k_dense_replace=3, n_routed_experts=256,
    num_experts_per_tok=8, moe_intermediate_size=2048, intermediate_size=18432, n_group=8, topk_group=4,
    routed_scaling_factor=2.5,
)


def latent_decoder_fields(
    hf: HFConfig, raw: dict, defaults: dict, rope_interleave: bool | None = None,
    moe_layers: Callable[[int], tuple[bool, ...]] | None = None, rotary_of_head: bool = False,
    rope: RopeConfig | None = None,
) -> dict:
    """DeepseekV3Config's fields (all but family and the bookkeeping) from config.json, which DeepSeek-V3.2 and
    GLM-5 spell the same way; `defaults`: the family's transformers defaults (DEEPSEEK_V3_DEFAULTS' keys).
    rope_interleave: None reads config.json's rope_interleave (DeepSeek-V3); True or False is the family's fixed
    layout, and a config.json saying otherwise is refused (transformers would not read it). moe_layers: the
    family's reading of which blocks are mixtures from n_layers (GLM-4.7-Flash's mlp_layer_types); None:
    first_k_dense_replace dense blocks, then mixtures. rotary_of_head: partial_rotary_factor is the rotated share of
    the whole query head, which must come to qk_rope_head_dim (Mistral 4's config); else it must be 1. rope: the
    family's fixed rotary where its transformers config reads none (Kimi-Linear's attention has no positions); the
    rotary fields of config.json are then not read."""
    if rope is None and rotary_of_head:  # transformers' rotary turns partial_rotary_factor of head_dim (nope + rope) dims
        d_nope = hf.integer("qk_nope_head_dim", defaults["qk_nope_head_dim"], at_least=0)
        d_rope = hf.integer("qk_rope_head_dim", defaults["qk_rope_head_dim"], at_least=2)
        rope = hf.rope(partial_rotary_factor=d_rope / (d_nope + d_rope))
        if int((d_nope + d_rope) * rope.partial_rotary_factor) != d_rope:  # its cos / sin would not fit
            raise ValueError(
                f"partial_rotary_factor {rope.partial_rotary_factor}: the rotary must turn the qk_rope_head_dim "
                f"({d_rope}) of the head's qk_nope_head_dim + qk_rope_head_dim ({d_nope + d_rope}) dims, "
                f"{d_rope}/{d_nope + d_rope} (absent, it is)"
            )
        rope = dataclasses.replace(rope, partial_rotary_factor=1.0)  # of the rotated dims, d_rot
    elif rope is None:
        rope = hf.rope()
        if rope.partial_rotary_factor != 1.0:  # transformers' MLA would fail on the cos / sin width
            raise ValueError(
                f"partial_rotary_factor {rope.partial_rotary_factor}: DeepSeek-V3 rotates qk_rope_head_dim dims, "
                "set by qk_rope_head_dim (partial_rotary_factor must be 1)"
            )
    if rope_interleave is None:
        interleaved = hf.flag("rope_interleave", True)
    else:
        interleaved = rope_interleave
        if hf.flag("rope_interleave", rope_interleave) != rope_interleave:
            raise ValueError(
                f"rope_interleave {raw['rope_interleave']}: this family's latent attention always lays its rotary "
                f"dims out {'interleaved' if rope_interleave else 'half-split'} (transformers does not read the field)"
            )
    d_nope = hf.integer("qk_nope_head_dim", defaults["qk_nope_head_dim"], at_least=0)
    d_rope = hf.integer("qk_rope_head_dim", defaults["qk_rope_head_dim"], at_least=2)
    fields = common_fields(
        hf, rms_norm_eps=defaults["rms_norm_eps"], max_position_embeddings=defaults["max_position_embeddings"],
        hidden_size=defaults["hidden_size"], d_head=d_nope + d_rope, rope=dataclasses.replace(rope, interleaved=interleaved),
    )
    if fields["n_kv_heads"] != fields["n_heads"]:  # kv_b_proj decompresses one key and value per query head
        raise ValueError(
            f"num_key_value_heads ({fields['n_kv_heads']}) must equal num_attention_heads ({fields['n_heads']}): "
            "latent attention decompresses a key and a value for every head"
        )
    if moe_layers is None:
        first_dense, layers = hf.integer("first_k_dense_replace", defaults["first_k_dense_replace"], at_least=0), None
    else:
        layers = moe_layers(fields["n_layers"])
        first_dense = layers.index(True) if True in layers else len(layers)
    attention_bias = hf.flag("attention_bias", False)
    mixture = {k: defaults[k] for k in (
        "n_routed_experts", "num_experts_per_tok", "moe_intermediate_size", "intermediate_size", "n_group", "topk_group",
        "routed_scaling_factor",
    )}
    return dict(
        **fields,
        **deepseek_mixture_fields(hf, fields["n_layers"], first_dense, moe_layers=layers, **mixture),
        qkv_bias=attention_bias,  # q_a_proj and kv_a_proj_with_mqa (q_proj, q_b_proj, kv_b_proj have none)
        o_bias=attention_bias,
        # null: a plain q_proj; absent: transformers' default
        q_lora_rank=hf.integer("q_lora_rank", None, at_least=1) if "q_lora_rank" in raw else defaults["q_lora_rank"],
        kv_lora_rank=hf.integer("kv_lora_rank", defaults["kv_lora_rank"], at_least=1),
        qk_nope_head_dim=d_nope,
        qk_rope_head_dim=d_rope,
        v_head_dim=hf.integer("v_head_dim", defaults["v_head_dim"], at_least=1),
        first_k_dense_replace=first_dense,
        mtp_layers=hf.integer("num_nextn_predict_layers", 0, at_least=0),
    )


def deepseek_mixture_fields(
    hf: HFConfig,
    n_layers: int,
    first_dense: int,
    *,
    n_routed_experts: int = REQUIRED,
    num_experts_per_tok: int = REQUIRED,
    moe_intermediate_size: int = REQUIRED,
    intermediate_size: int = REQUIRED,
    n_group: int,
    topk_group: int,
    routed_scaling_factor: float,
    n_shared_experts: int = 1,
    norm_topk_prob: bool = True,
    moe_layers: tuple[bool, ...] | None = None,
    fixed: Mapping[str, int | bool] | None = None,
) -> dict:
    """DeepSeek-V3's mixture fields, which GLM-4.5 and Solar-Open spell and mean the same way: the first
    `first_dense` blocks dense MLPs (intermediate_size wide, read only where there is one), the rest mixtures of
    n_routed_experts experts (moe_intermediate_size wide), num_experts_per_tok of them chosen by the grouped sigmoid
    router (SigmoidGroupedTopK: n_group, topk_group, norm_topk_prob, routed_scaling_factor), and a shared expert
    n_shared_experts times moe_intermediate_size wide. The keywords are the family's defaults for the fields of
    their name (REQUIRED: no default). At least one block must be a mixture: first_dense below n_layers.
    moe_layers: which blocks are mixtures where the family says so per layer (first_dense is then not used).
    fixed: the grouping and renormalisation fields (n_group, topk_group, norm_topk_prob) the family's
    transformers model does not read, with the value it always runs as (Hunyuan v3: no groups, renormalised);
    they are not read from config.json."""
    fixed = fixed or {}
    if moe_layers is not None:
        if not any(moe_layers):
            raise ValueError("mlp_layer_types makes every block a dense MLP, leaving no mixture block")
    elif first_dense >= n_layers:  # else it would surface as the mixture tensors' "missing" dense weights
        raise ValueError(
            f"first_k_dense_replace = {first_dense} makes all {n_layers} blocks (num_hidden_layers) dense MLPs, leaving "
            f"no mixture block; expected first_k_dense_replace below num_hidden_layers ({n_layers})"
        )
    else:
        moe_layers = tuple(i >= first_dense for i in range(n_layers))
    n_experts = hf.integer("n_routed_experts", n_routed_experts, at_least=1)
    d_expert = hf.integer("moe_intermediate_size", moe_intermediate_size, at_least=1)
    routed = routed_fields(hf, moe_layers, n_experts, d_expert, num_experts_per_tok=num_experts_per_tok)
    n_group = fixed["n_group"] if "n_group" in fixed else hf.integer("n_group", n_group, at_least=1)
    topk_group = fixed["topk_group"] if "topk_group" in fixed else hf.integer("topk_group", topk_group, at_least=1)
    SigmoidGroupedTopK.check_groups(n_experts, max(routed["top_k_per_layer"]), n_group, topk_group)
    return dict(
        **routed,
        d_mlp=hf.integer("intermediate_size", intermediate_size, at_least=1) if not all(moe_layers) else 0,
        d_shared=d_expert * hf.integer("n_shared_experts", n_shared_experts, at_least=1),
        norm_topk_prob=fixed["norm_topk_prob"] if "norm_topk_prob" in fixed else hf.flag("norm_topk_prob", norm_topk_prob),
        routed_scaling_factor=hf.number("routed_scaling_factor", routed_scaling_factor),
        n_group=n_group,
        topk_group=topk_group,
    )


def _layer_sites(cfg: DeepseekV3Config, layer: int, src: str, dst: str) -> list[Entry]:
    mlp = _moe_sites(cfg, src, dst) if cfg.moe_layers[layer] else dense_mlp(src, dst)
    return _attention_sites(cfg, src, dst) + mlp


def _attention_sites(cfg: DeepseekV3Config, src: str, dst: str) -> list[Entry]:
    attn, ours = f"{src}.self_attn", f"{dst}.attn"
    if cfg.q_lora_rank is None:
        modules, biased = ["q_proj"], []
        entries: list[Entry] = [Reference(f"{ours}.hook_q", f"{attn}.q_proj")]
    else:
        modules, biased = ["q_a_proj", "q_a_layernorm", "q_b_proj"], ["q_a_proj"]
        entries = [
            Reference(f"{ours}.hook_q_latent", f"{attn}.q_a_layernorm"),
            Reference(f"{ours}.hook_q", f"{attn}.q_b_proj"),
        ]
    modules += ["kv_a_proj_with_mqa", "kv_a_layernorm", "kv_b_proj", "o_proj"]
    biased = (biased + ["kv_a_proj_with_mqa"] if cfg.qkv_bias else []) + (["o_proj"] if cfg.o_bias else [])
    tensors = [f"{m}.weight" for m in modules] + [f"{m}.bias" for m in biased]
    entries += [Weight(f"{ours}.{t}", (f"{attn}.{t}",)) for t in tensors]
    return entries + [
        Reference(f"{ours}.hook_kv_latent", f"{attn}.kv_a_layernorm"),
        Reference(f"{ours}.hook_z", f"{attn}.o_proj", "in"),
    ]


def _moe_sites(cfg: DeepseekV3Config, src: str, dst: str) -> list[Entry]:
    return [
        Weight(f"{dst}.mlp.router.weight", (f"{src}.mlp.gate.weight",)),
        Weight(f"{dst}.mlp.router.e_score_correction_bias", (f"{src}.mlp.gate.e_score_correction_bias",)),
        routed_experts(cfg, (f"{src}.mlp.experts",), dst),
        *gated_mlp(f"{src}.mlp.shared_experts", f"{dst}.mlp.shared_expert"),
        *router_references(dst, f"{src}.mlp.gate"),
        Reference(f"{dst}.mlp.hook_routed_out", f"{src}.mlp.experts"),
        Reference(f"{dst}.mlp.shared_expert.hook_out", f"{src}.mlp.shared_experts"),
    ]
