"""HookedAXK1: SK Telecom's A.X K1 (model_type axk1).

What is special about the family: DeepSeek-V3's blocks (moelens.models.deepseek_v3: multi-head latent attention,
its rotary interleaved where rope_interleave, the float32 sigmoid router with its correction bias among the
topk_group best of n_group groups, a shared expert) with one addition: each mixture's output (routed experts plus
shared expert) is RMS-normed by post_mlp_layernorm before the residual add (blocks.L.ln2_post, a
FeedForwardPostNormBlock); dense blocks have no such norm. Where the blocks are mixtures is mlp_layer_types
("dense" / "sparse"), or, absent, the legacy first_k_dense_replace (default 1) and moe_layer_freq (default 1) as
transformers derives it; both given and disagreeing is refused. The query always goes through the q_lora_rank
bottleneck (a null q_lora_rank is refused).

The released checkpoints store the norm as model.layers.L.post_mlp_layernorm (transformers renames it into its
mixture module, mlp.post_mlp_layernorm; both spellings are read); they store it on dense blocks too, where it
is unused and not read. transformers also accepts a checkpoint without the routers' e_score_correction_bias
(zeros then); moelens reads it from the files and refuses files without it, naming the key.
"""

from __future__ import annotations

from moelens.config import HFConfig, MoeConfig
from moelens.models.components import SharedExpertMoe, SigmoidGroupedTopK
from moelens.models.components.latent_attention import MultiHeadLatentAttention
from moelens.models.components.sandwich_block import FeedForwardPostNormBlock
from moelens.models.deepseek_v3 import (
    DEEPSEEK_V3_DEFAULTS, IGNORED_FIELDS, DeepseekV3Config, HookedDeepseekV3, _attention_sites, _moe_sites,
    latent_decoder_fields,
)
from moelens.models.recipe import Dense, LayerSpec, Mixture, Recipe
from moelens.models.sites import Entry, decoder_site_map, dense_mlp
from moelens.sitemap import Reference, SiteMap, Weight

# transformers' AXK1Config defaults (A.X K1's sizes), for the fields latent_decoder_fields reads
AXK1_DEFAULTS = dict(
    DEEPSEEK_V3_DEFAULTS, max_position_embeddings=32768, n_routed_experts=192, first_k_dense_replace=1,
)
MLP_LAYER_TYPES = {"dense": False, "sparse": True}


class HookedAXK1(HookedDeepseekV3):
    model_type = "axk1"

    @classmethod
    def recipe(cls, cfg: MoeConfig) -> Recipe:
        mixture = LayerSpec(MultiHeadLatentAttention, Mixture(SharedExpertMoe, SigmoidGroupedTopK),
                            block=FeedForwardPostNormBlock)
        dense = LayerSpec(MultiHeadLatentAttention, Dense())
        return Recipe(tuple(mixture if is_moe else dense for is_moe in cfg.moe_layers))

    @classmethod
    def site_map(cls, cfg: MoeConfig) -> SiteMap:
        # the released checkpoints' unused norm of the dense blocks, in either spelling (transformers skips it too)
        unused = tuple(
            f"model.layers.{i}.{where}post_mlp_layernorm." for i, is_moe in enumerate(cfg.moe_layers) if not is_moe
            for where in ("", "mlp.")
        )
        mtp = tuple(f"model.layers.{i}." for i in range(cfg.n_layers, cfg.n_layers + cfg.mtp_layers))
        return decoder_site_map(cfg, _layer_sites, unused + mtp)

    @classmethod
    def config_from_hf(cls, raw: dict) -> DeepseekV3Config:
        if "q_lora_rank" in raw and raw["q_lora_rank"] is None:
            raise ValueError("q_lora_rank is null: A.X K1's queries always go through the q_lora_rank bottleneck "
                             "(transformers' AXK1Config needs an integer)")
        hf = HFConfig(raw)
        fields = latent_decoder_fields(hf, raw, AXK1_DEFAULTS, moe_layers=lambda n: mlp_layer_types(hf, raw, n))
        legacy = ("first_k_dense_replace", "moe_layer_freq")
        return DeepseekV3Config(
            **fields, family=cls.model_type, fields_read=tuple(hf.read),
            fields_ignored=tuple(f for f in (*IGNORED_FIELDS, "qk_head_dim") if f in raw and f not in legacy),
        )


def mlp_layer_types(hf: HFConfig, raw: dict, n_layers: int) -> tuple[bool, ...]:
    """Per block, whether it is a mixture: mlp_layer_types, or where it is absent or null, transformers' reading
    of the legacy fields (a mixture where i >= first_k_dense_replace and i % moe_layer_freq == 0). Legacy fields
    beside mlp_layer_types that say otherwise are refused: transformers builds what mlp_layer_types lists."""
    first_dense = hf.integer("first_k_dense_replace", 1, at_least=0)
    freq = hf.integer("moe_layer_freq", 1, at_least=1)
    legacy = tuple(i >= first_dense and i % freq == 0 for i in range(n_layers))
    types = hf.opt("mlp_layer_types")
    if types is None:
        return legacy
    if not isinstance(types, list) or len(types) != n_layers or not set(types) <= set(MLP_LAYER_TYPES):
        raise ValueError(
            f"mlp_layer_types must list {n_layers} entries (num_hidden_layers), each one of {sorted(MLP_LAYER_TYPES)}; "
            f"got {types!r}"
        )
    layers = tuple(MLP_LAYER_TYPES[t] for t in types)
    given = [f"{f} = {raw[f]}" for f in ("first_k_dense_replace", "moe_layer_freq") if raw.get(f) is not None]
    if given and layers != legacy:
        raise ValueError(
            f"{' and '.join(given)} disagree with mlp_layer_types = {types}: transformers builds the blocks "
            "mlp_layer_types lists (it reads the legacy fields only without it); make them agree"
        )
    return layers


def _layer_sites(cfg: DeepseekV3Config, layer: int, src: str, dst: str) -> list[Entry]:
    if not cfg.moe_layers[layer]:
        return _attention_sites(cfg, src, dst) + dense_mlp(src, dst)
    norm = f"{src}.mlp.post_mlp_layernorm"
    return _attention_sites(cfg, src, dst) + _moe_sites(cfg, src, dst) + [
        Weight(f"{dst}.ln2_post.weight", (f"{src}.post_mlp_layernorm.weight", f"{norm}.weight")),
        Reference(f"{dst}.ln2_post.hook_normalized", norm),
    ]
