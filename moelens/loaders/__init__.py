"""Checkpoint files: resolve (hub.py) -> read lazily (safetensors_files.py) -> map and fill by a site map
(checkpoint.py). Loaders know nothing of models: moelens.pretrained hands them the family's site map."""

from __future__ import annotations

from pathlib import Path

from moelens.loaders.errors import CheckpointError, CheckpointWarning
from moelens.loaders.files import CONFIG_MAX_BYTES, checkpoint_file, read_json_object

__all__ = ["CheckpointError", "CheckpointWarning", "read_config"]


def read_config(folder: Path) -> dict:
    path = checkpoint_file(folder, "config.json")
    if path is None:
        raise CheckpointError(f"{folder} has no config.json")
    return read_json_object(path, CONFIG_MAX_BYTES)
