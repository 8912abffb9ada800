"""Where a checkpoint's files are: an embedded default (built on first use), a local folder, or a Hub repo id.

Its own module so that both the loader (moelens.pretrained) and the planner (moelens.plan), which the loader
asks for device_map="auto", can use it without importing each other.
"""

from __future__ import annotations

from pathlib import Path

from moelens import defaults
from moelens.loaders.hub import resolve_checkpoint


def resolve(name_or_path: str | Path, revision: str | None = None) -> Path:
    """Folder of a checkpoint: an embedded default ("tiny-code-moe", shipped; "tiny-qwen2-moe", ...: built on
    first use), a local folder, or a Hub repo id."""
    if str(name_or_path) in defaults.NAMES and not Path(name_or_path).exists():
        return defaults.default_checkpoint(str(name_or_path))
    return resolve_checkpoint(name_or_path, revision)
