"""HookedSarvamMla: Sarvam-105B (model_type sarvam_mla).

What is special about the family: nothing in the arithmetic. transformers runs these checkpoints with
DeepSeek-V3's classes (DeepseekV3ForCausalLM), so the blocks are moelens.models.deepseek_v3's (latent attention,
the float32 sigmoid router with its correction bias, a shared expert); what differs is the config:
- Sarvam's defaults where config.json leaves a field out (no query bottleneck, one expert group, one dense block
  first, 128 experts of 2048, 4096-wide);
- the names Sarvam's original config uses (num_experts, num_shared_experts), read as transformers' attribute_map
  reads them, both names of one field with different values refused, naming both;
- the original config's own spellings, translated as transformers translates them: its head_dim (the latent
  cache's width, kv_lora_rank + qk_rope_head_dim, for vLLM) is not the attention's and is not read, q_head_dim
  is qk_nope_head_dim + qk_rope_head_dim and is checked against them, and a rope_scaling of type
  "deepseek_yarn" is YaRN.
"""

from __future__ import annotations

from moelens.config import HFConfig
from moelens.models.deepseek_v3 import (
    DEEPSEEK_V3_DEFAULTS, IGNORED_FIELDS, DeepseekV3Config, HookedDeepseekV3, latent_decoder_fields,
)

# transformers' SarvamMLAConfig defaults (Sarvam-105B's sizes), for the fields latent_decoder_fields reads
SARVAM_MLA_DEFAULTS = dict(
    DEEPSEEK_V3_DEFAULTS, hidden_size=4096, intermediate_size=16384, n_routed_experts=128, q_lora_rank=None,
    n_group=1, topk_group=1, first_k_dense_replace=1,
)
SPELLINGS = {"num_experts": "n_routed_experts", "num_shared_experts": "n_shared_experts", "num_local_experts": "n_routed_experts"}


class HookedSarvamMla(HookedDeepseekV3):
    model_type = "sarvam_mla"

    @classmethod
    def config_from_hf(cls, raw: dict) -> DeepseekV3Config:
        raw = original_config_read(raw)
        hf = HFConfig.with_spellings(raw, SPELLINGS)
        return DeepseekV3Config(
            **latent_decoder_fields(hf, hf.raw, SARVAM_MLA_DEFAULTS), family=cls.model_type,
            fields_read=tuple(hf.label(f) for f in hf.read),
            fields_ignored=tuple(f for f in (*IGNORED_FIELDS, "q_head_dim") if f in raw),
        )


def original_config_read(raw: dict) -> dict:
    """Sarvam's original config.json in DeepSeek-V3's spelling: "deepseek_yarn" is YaRN; q_head_dim must be the
    query head it says (qk_nope_head_dim + qk_rope_head_dim, else the file describes another model)."""
    out = dict(raw)
    scaling = raw.get("rope_scaling") or {}
    if "deepseek_yarn" in (scaling.get("type"), scaling.get("rope_type")):
        out["rope_scaling"] = {k: v for k, v in scaling.items() if k != "type"} | {"rope_type": "yarn"}
    q_head_dim = raw.get("q_head_dim")
    if q_head_dim is not None:
        nope = raw.get("qk_nope_head_dim", SARVAM_MLA_DEFAULTS["qk_nope_head_dim"])
        rope = raw.get("qk_rope_head_dim", SARVAM_MLA_DEFAULTS["qk_rope_head_dim"])
        if q_head_dim != nope + rope:
            raise ValueError(
                f"q_head_dim = {q_head_dim!r} is not qk_nope_head_dim + qk_rope_head_dim ({nope} + {rope}): the "
                "query heads' width must be their sum"
            )
    return out
