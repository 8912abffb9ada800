"""HookedGlmMoeDsa: GLM-5 (model_type glm_moe_dsa).

What is special about the family: DeepSeek-V3.2's DeepSeek Sparse Attention (moelens.models.deepseek_v32) with
two differences transformers' GlmMoeDsa makes: the indexer's rotary is interleaved (DeepSeek-V3.2's is
half-split), and a layer may reuse the key selection of the layer before it instead of running an indexer of
its own (indexer_types: "full" runs one, "shared" reuses; transformers derives them from index_topk_pattern,
or from index_topk_freq and index_skip_topk_offset, when config.json has no indexer_types). A shared layer has
no indexer weights; its blocks.L.attn.hook_index_topk holds the selection it reuses, and what that hook holds
is what the next shared layer reuses. Its defaults are GLM-5's sizes (transformers' GlmMoeDsaConfig).
"""

from __future__ import annotations

import dataclasses

from moelens.config import HFConfig
from moelens.models.deepseek_v32 import DEEPSEEK_V32_DEFAULTS, INDEXER_DEFAULTS, DeepseekV32Config, HookedDeepseekV32
from moelens.sitemap import Reference, SiteMap

GLM_MOE_DSA_DEFAULTS = DEEPSEEK_V32_DEFAULTS | dict(
    rms_norm_eps=1e-5, max_position_embeddings=202752, hidden_size=6144, qk_nope_head_dim=192, v_head_dim=256,
    q_lora_rank=2048, intermediate_size=12288, n_group=1, topk_group=1,
)


class HookedGlmMoeDsa(HookedDeepseekV32):
    model_type = "glm_moe_dsa"
    index_rope_interleaved = True
    defaults = GLM_MOE_DSA_DEFAULTS
    indexer_defaults = INDEXER_DEFAULTS | dict(index_n_heads=32)

    @classmethod
    def site_map(cls, cfg: DeepseekV32Config) -> SiteMap:
        # transformers' GlmMoeDsaDecoderLayer returns (hidden states, top-k indices): the stream is its output 0
        site_map = super().site_map(cfg)
        references = tuple(
            dataclasses.replace(r, read="out.0") if r.hook.endswith(".hook_resid_post") and r.read == "out" else r
            for r in site_map.references
        )
        return dataclasses.replace(site_map, references=references)

    @staticmethod
    def _selection_reference(layer: int, src: str, dst: str) -> Reference:
        # transformers' GlmMoeDsaAttention returns (output, weights, top-k indices), shared layers included
        return Reference(f"{dst}.attn.hook_index_topk", f"{src}.self_attn", "out.2")

    @classmethod
    def indexer_layers(cls, hf: HFConfig, n_layers: int) -> tuple[bool, ...]:
        """Per layer, True where it runs its own indexer: config.json's indexer_types, else transformers'
        derivation from index_topk_pattern ("F" full, "S" shared), else from index_topk_freq (default 1) and
        index_skip_topk_offset (default 2): layer i is full where max(i - offset + 1, 0) % freq == 0."""
        kinds = hf.opt("indexer_types")
        name = "indexer_types"
        if kinds is None and hf.opt("index_topk_pattern") is not None:
            name, pattern = "index_topk_pattern", hf.opt("index_topk_pattern")
            letters = {"F": "full", "S": "shared"}
            if isinstance(pattern, str):
                if set(pattern) - set(letters):
                    raise ValueError(f"index_topk_pattern {pattern!r}: expected letters F (full) and S (shared)")
                kinds = [letters[c] for c in pattern]
            else:
                kinds = list(pattern)
        if kinds is None:
            freq = max(hf.integer("index_topk_freq", 1), 1)
            offset = hf.integer("index_skip_topk_offset", 2)
            return tuple(max(i - offset + 1, 0) % freq == 0 for i in range(n_layers))
        if not isinstance(kinds, list) or len(kinds) != n_layers or set(kinds) - {"full", "shared"}:
            raise ValueError(
                f"{hf.label(name)} is {kinds!r}; expected one of 'full' / 'shared' per layer ({n_layers} layers)"
            )
        if kinds[0] != "full":
            raise ValueError(f"{hf.label(name)}: layer 0 is {kinds[0]!r}; a shared layer needs a full one before it")
        return tuple(k == "full" for k in kinds)
