"""The hooked model families, chosen by config.json's model_type."""

from __future__ import annotations

from pathlib import Path

from moelens.loaders.errors import CheckpointError
from moelens.models.base import HookedTransformer
from moelens.models.hunyuan_v1_moe import HookedHunyuanMoe
from moelens.models.qwen2_moe import HookedQwen2Moe
from moelens.models.solar_open import HookedSolarOpen

FAMILIES: dict[str, type[HookedTransformer]] = {
    cls.model_type: cls for cls in (HookedQwen2Moe, HookedHunyuanMoe, HookedSolarOpen)
}


def family_for(model_type: str | None, config_path: Path | str = "config.json") -> type[HookedTransformer]:
    if model_type not in FAMILIES:
        raise CheckpointError(
            f"{config_path}: model_type {model_type!r} is not supported; moelens supports {sorted(FAMILIES)}"
        )
    return FAMILIES[model_type]


__all__ = ["FAMILIES", "HookedHunyuanMoe", "HookedQwen2Moe", "HookedSolarOpen", "HookedTransformer", "family_for"]
