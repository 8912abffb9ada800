"""The hooked model families; each registers itself by config.json's model_type (moelens.families)."""

from __future__ import annotations

from moelens.families import FAMILIES, family_for
from moelens.models.base import HookedTransformer
from moelens.models.deepseek_v2 import HookedDeepseekV2
from moelens.models.deepseek_v3 import HookedDeepseekV3
from moelens.models.deepseek_v32 import HookedDeepseekV32
from moelens.models.ernie4_5_moe import HookedErnie4_5Moe
from moelens.models.flex_olmo import HookedFlexOlmo
from moelens.models.glm4_moe import HookedGlm4Moe
from moelens.models.glm4_moe_lite import HookedGlm4MoeLite
from moelens.models.glm_moe_dsa import HookedGlmMoeDsa
from moelens.models.gpt_oss import HookedGptOss
from moelens.models.granitemoe import HookedGraniteMoe
from moelens.models.granitemoeshared import HookedGraniteMoeShared
from moelens.models.hunyuan_v1_moe import HookedHunyuanMoe
from moelens.models.llama4_text import HookedLlama4
from moelens.models.longcat_flash import HookedLongcatFlash
from moelens.models.minimax_m2 import HookedMiniMaxM2
from moelens.models.mixtral import HookedMixtral
from moelens.models.nemotron_h import HookedNemotronH
from moelens.models.olmoe import HookedOlmoe
from moelens.models.phimoe import HookedPhimoe
from moelens.models.qwen2_moe import HookedQwen2Moe
from moelens.models.qwen3_5_moe import HookedQwen3_5Moe
from moelens.models.qwen3_moe import HookedQwen3Moe
from moelens.models.qwen3_next import HookedQwen3Next
from moelens.models.solar_open import HookedSolarOpen

__all__ = [
    "FAMILIES", "HookedDeepseekV3", "HookedGptOss", "HookedHunyuanMoe", "HookedMixtral", "HookedOlmoe", "HookedQwen2Moe",
    "HookedQwen3Moe", "HookedSolarOpen", "HookedTransformer", "family_for",
    "HookedGlm4Moe",
    "HookedMiniMaxM2",
    "HookedQwen3Next",
    "HookedQwen3_5Moe",
    "HookedDeepseekV32",
    "HookedGlmMoeDsa",
    "HookedLlama4",
    "HookedNemotronH",
    "HookedLongcatFlash",
    "HookedGlm4MoeLite",
    "HookedDeepseekV2",
    "HookedErnie4_5Moe",
    "HookedFlexOlmo",
    "HookedGraniteMoe",
    "HookedGraniteMoeShared",
    "HookedPhimoe",
]
