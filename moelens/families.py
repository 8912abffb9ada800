"""The registry of model families by config.json's model_type; each family class registers itself when it is
defined (HookedTransformer.__init_subclass__), so that loading can choose one without importing them."""

from __future__ import annotations

from pathlib import Path

from moelens.loaders.errors import CheckpointError

FAMILIES: dict[str, type] = {}


def register(family: type) -> None:
    """Under its model_type and any further spellings it reads (model_type_aliases: a multimodal checkpoint's
    model_type whose text_config is the family's)."""
    for model_type in (family.model_type, *getattr(family, "model_type_aliases", ())):
        if model_type in FAMILIES and FAMILIES[model_type] is not family:
            raise ValueError(f"model_type {model_type!r} is already registered to {FAMILIES[model_type].__name__}")
        FAMILIES[model_type] = family


# model_types moelens does not register, whose architecture is a registered family's (README, "Large models")
SAME_ARCHITECTURE = {
    "kimi_k2": ("deepseek_v3", "Kimi-K2 is DeepSeek-V3's architecture (its config.json's architectures says "
                "DeepseekV3ForCausalLM)"),
}


def family_for(model_type: str | None, config_path: Path | str = "config.json") -> type:
    if model_type not in FAMILIES:
        hint = ""
        if model_type in SAME_ARCHITECTURE:
            family, why = SAME_ARCHITECTURE[model_type]
            hint = (
                f". {why}: set \"model_type\": \"{family}\" in a copy of config.json (or in the dict given to "
                f"plan) and it loads and plans as {family}"
            )
        raise CheckpointError(
            f"{config_path}: model_type {model_type!r} is not supported; moelens supports {sorted(FAMILIES)}{hint}"
        )
    return FAMILIES[model_type]
