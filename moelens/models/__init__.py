"""The hooked model families; each registers itself by config.json's model_type (moelens.families).

Every module of this package is imported here, so a family is found from its file alone: defining the class
registers it, and this package (and moelens) export it under its class name. No list names the families."""

from __future__ import annotations

import importlib
import pkgutil

from moelens.families import FAMILIES, family_for
from moelens.models.base import HookedTransformer

for _module in pkgutil.iter_modules(__path__):
    if not _module.ispkg:
        importlib.import_module(f"{__name__}.{_module.name}")

# class name -> family class, for every registered family (a family registered under several model_types once)
FAMILY_CLASSES: dict[str, type[HookedTransformer]] = {cls.__name__: cls for cls in FAMILIES.values()}
globals().update(FAMILY_CLASSES)

__all__ = ["FAMILIES", "FAMILY_CLASSES", "HookedTransformer", "family_for", *sorted(FAMILY_CLASSES)]
