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


def family_for(model_type: str | None, config_path: Path | str = "config.json") -> type:
    if model_type not in FAMILIES:
        raise CheckpointError(
            f"{config_path}: model_type {model_type!r} is not supported; moelens supports {sorted(FAMILIES)}"
        )
    return FAMILIES[model_type]
