"""HookedSarvamMoe: Sarvam-30B (model_type sarvam_moe).

What is special about the family: nothing in the arithmetic. transformers runs these checkpoints with GLM-4.5's
classes (Glm4MoeForCausalLM), so the blocks are moelens.models.glm4_moe's (the q/k norm, the float32 sigmoid
router with its correction bias, a shared expert, dense blocks first); what differs:
- Sarvam's defaults where config.json leaves a field out: the rotary over the whole head (GLM's turns half),
  rope_theta 8e6, head_dim 64, the q/k norm on, 4 key-value heads, 128 experts of 1024, 6 chosen, weights
  times 2.5;
- the names Sarvam's original config uses (num_experts, num_shared_experts, use_qkv_bias), read as transformers'
  attribute_map reads them, both names of one field with different values refused, naming both;
- the checkpoint's own tensor names, which transformers' conversion mapping renames on loading and writes back
  on saving (so save_pretrained writes them too): model.word_embeddings, attention.* for self_attn.*, one fused
  attention.query_key_value (rows q | k | v, biases alike) read into q_proj, k_proj and v_proj
  (moelens.sitemap.SplitWeight), attention.dense for o_proj, attention.query_layernorm / key_layernorm for the
  q/k norms, mlp.gate.expert_bias for the correction bias. A checkpoint in transformers' module names
  (self_attn.q_proj, ...) is not one Sarvam or save_pretrained writes; it is refused, naming the missing keys.
  Hooks name transformers' modules, which it builds under GLM-4.5's names.
"""

from __future__ import annotations

import re
from dataclasses import replace

from moelens.models.glm4_moe import Glm4MoeConfig, HookedGlm4Moe
from moelens.sitemap import Part, SiteMap, SplitWeight, Weight

# GLM-4.5's checkpoint names -> Sarvam's: transformers' sarvam_moe conversion mapping, read backwards
RENAMES = (
    (r"^model\.embed_tokens\.", "model.word_embeddings."),
    (r"\.self_attn\.o_proj\.", ".attention.dense."),
    (r"\.self_attn\.q_norm\.", ".attention.query_layernorm."),
    (r"\.self_attn\.k_norm\.", ".attention.key_layernorm."),
    (r"\.mlp\.gate\.e_score_correction_bias$", ".mlp.gate.expert_bias"),
)
_QKV = re.compile(r"^blocks\.(\d+)\.attn\.([qkv])_proj\.(weight|bias)$")


class HookedSarvamMoe(HookedGlm4Moe):
    model_type = "sarvam_moe"

    # transformers' SarvamMoEConfig defaults (Sarvam-30B's sizes), for the fields config.json leaves out
    defaults = dict(
        HookedGlm4Moe.defaults, rms_norm_eps=1e-6, num_key_value_heads=4, partial_rotary_factor=1.0,
        rope_theta=8_000_000.0, head_dim=64, moe_intermediate_size=1024, num_experts_per_tok=6,
        intermediate_size=8192, routed_scaling_factor=2.5, use_qk_norm=True,
    )
    spellings = {
        "num_local_experts": "n_routed_experts", "num_experts": "n_routed_experts",
        "num_shared_experts": "n_shared_experts", "use_qkv_bias": "attention_bias",
    }

    @classmethod
    def site_map(cls, cfg: Glm4MoeConfig) -> SiteMap:
        glm = super().site_map(cfg)
        weights = []
        for entry in glm.weights:
            match = _QKV.match(entry.param) if isinstance(entry, Weight) else None
            if match is None:
                weights.append(_renamed(entry))
            elif match[2] == "q":  # k and v join q's fused tensor
                weights.append(fused_qkv(cfg, int(match[1]), match[3]))
        return replace(glm, weights=tuple(weights))


def _renamed(entry):
    if not isinstance(entry, Weight):
        return entry
    keys = []
    for key in entry.keys:
        for pattern, spelling in RENAMES:
            key = re.sub(pattern, spelling, key)
        keys.append(key)
    return replace(entry, keys=tuple(keys))


def fused_qkv(cfg: Glm4MoeConfig, layer: int, kind: str) -> SplitWeight:
    """Layer `layer`'s attention.query_key_value.<kind> (weight or bias): its rows are q's, then k's, then v's."""
    q_rows, kv_rows = cfg.n_heads * cfg.d_head, cfg.n_kv_heads * cfg.d_head
    attn = f"blocks.{layer}.attn"
    return SplitWeight((f"model.layers.{layer}.attention.query_key_value.{kind}",), (
        Part(f"{attn}.q_proj.{kind}", q_rows), Part(f"{attn}.k_proj.{kind}", kv_rows),
        Part(f"{attn}.v_proj.{kind}", kv_rows),
    ))
