"""HookedGlm4MoeLite: GLM-4.7-Flash (model_type glm4_moe_lite).

What is special about the family: DeepSeek-V3's blocks (moelens.models.deepseek_v3: multi-head latent attention,
its rotary interleaved where rope_interleave, the float32 sigmoid grouped router with its correction bias, a
shared expert) under GLM's defaults, with the dense and mixture blocks listed per layer by mlp_layer_types
("dense" / "sparse"), transformers' default being one dense block first. transformers does not read
first_k_dense_replace here (GLM-4.7-Flash's config.json has it): it is checked against mlp_layer_types, and a
config where they disagree is refused naming both, since the checkpoint's tensors follow one of them.

Like transformers, the model is the num_hidden_layers blocks: the multi-token-prediction layer the Hub checkpoint
stores after the last one (model.layers.47, num_nextn_predict_layers) is not part of it.
"""

from __future__ import annotations

from moelens.config import HFConfig
from moelens.models.deepseek_v3 import IGNORED_FIELDS, DeepseekV3Config, HookedDeepseekV3, latent_decoder_fields

# transformers' Glm4MoeLiteConfig defaults (GLM-4.7-Flash's sizes), for the fields latent_decoder_fields reads
GLM4_MOE_LITE_DEFAULTS = dict(
    rms_norm_eps=1e-5, max_position_embeddings=202752, hidden_size=2048, qk_nope_head_dim=192, qk_rope_head_dim=64,
    v_head_dim=256, q_lora_rank=768, kv_lora_rank=512, first_k_dense_replace=1, n_routed_experts=64,
    num_experts_per_tok=4, moe_intermediate_size=1536, intermediate_size=10240, n_group=1, topk_group=1,
    routed_scaling_factor=1.8,
)
MLP_LAYER_TYPES = {"dense": False, "sparse": True}


class HookedGlm4MoeLite(HookedDeepseekV3):
    model_type = "glm4_moe_lite"

    @classmethod
    def config_from_hf(cls, raw: dict) -> DeepseekV3Config:
        hf = HFConfig(raw)
        fields = latent_decoder_fields(
            hf, raw, GLM4_MOE_LITE_DEFAULTS, moe_layers=lambda n_layers: mlp_layer_types(hf, raw, n_layers)
        )
        return DeepseekV3Config(
            **fields, family=cls.model_type, fields_read=tuple(hf.read),
            fields_ignored=tuple(f for f in (*IGNORED_FIELDS, "first_k_dense_replace") if f in raw),
        )


def mlp_layer_types(hf: HFConfig, raw: dict, n_layers: int) -> tuple[bool, ...]:
    """Per block, whether it is a mixture: mlp_layer_types, absent or null transformers' default (the first block
    dense, the rest mixtures); a first_k_dense_replace that says otherwise is refused."""
    types = hf.opt("mlp_layer_types")
    if types is None:
        types = ["dense"] + ["sparse"] * (n_layers - 1)
    elif not isinstance(types, list) or len(types) != n_layers or not set(types) <= set(MLP_LAYER_TYPES):
        raise ValueError(
            f"mlp_layer_types must list {n_layers} entries (num_hidden_layers), each one of {sorted(MLP_LAYER_TYPES)}; "
            f"got {types!r}"
        )
    layers = tuple(MLP_LAYER_TYPES[t] for t in types)
    first_dense = raw.get("first_k_dense_replace")
    if first_dense is not None and layers != tuple(i >= first_dense for i in range(n_layers)):
        source = "mlp_layer_types" if "mlp_layer_types" in raw and raw["mlp_layer_types"] is not None else (
            "mlp_layer_types (absent: transformers' default, the first block dense)"
        )
        raise ValueError(
            f"first_k_dense_replace = {first_dense} disagrees with {source} = {types}: transformers builds the blocks "
            "mlp_layer_types lists (it does not read first_k_dense_replace); make them agree"
        )
    return layers
