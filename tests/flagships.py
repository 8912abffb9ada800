"""The published checkpoints' config.json values at full size, one file per family:
docs/families/flagships/<family>.json (the family's module name, moelens/models/<family>.py), a list of
{"checkpoint": Hub id, "published_billions" and "published_within_billions" (the total as published and how far
the count may be from it, both or neither), "note" (optional), "config": {...}}, the family's flagship first.
The tests read their full-size configs here; tools/gen_family_docs.py prints the flagship's plan on its page."""

from __future__ import annotations

import copy
import json
from functools import cache
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
FOLDER = ROOT / "docs" / "families" / "flagships"
FIELDS = {"checkpoint", "published_billions", "published_within_billions", "note", "config"}


def path(name: str) -> Path:
    return FOLDER / f"{name}.json"


@cache
def _read(name: str) -> tuple[dict, ...]:
    file = path(name)
    if not file.exists():
        raise FileNotFoundError(f"{file}: no flagship file for the family {name!r}")
    entries = json.loads(file.read_text())
    if not isinstance(entries, list) or not entries:
        raise ValueError(f"{file}: expected a non-empty list of checkpoints, the flagship first")
    for i, entry in enumerate(entries):
        where = f"{file}, entry {i}"
        if not isinstance(entry, dict) or not {"checkpoint", "config"} <= set(entry) or set(entry) - FIELDS:
            raise ValueError(f"{where}: expected the fields {sorted(FIELDS)} (checkpoint and config required), "
                             f"got {sorted(entry) if isinstance(entry, dict) else type(entry).__name__}")
        if ("published_billions" in entry) != ("published_within_billions" in entry):
            raise ValueError(f"{where}: published_billions and published_within_billions go together")
        if not isinstance(entry["config"].get("model_type"), str):
            raise ValueError(f"{where}: config has no model_type")
    return tuple(entries)


def entries(name: str) -> list[dict]:
    """Every checkpoint of a family's flagship file (copies: a test may edit what it gets)."""
    return copy.deepcopy(list(_read(name)))


def flagship(name: str, checkpoint: str | None = None) -> dict:
    """The config.json values of a family's checkpoint at full size: its flagship's, or the named checkpoint's."""
    found = entries(name)
    if checkpoint is None:
        return found[0]["config"]
    for entry in found:
        if entry["checkpoint"] == checkpoint:
            return entry["config"]
    raise KeyError(f"{path(name)} has no checkpoint {checkpoint!r}: it has {[e['checkpoint'] for e in found]}")


def names() -> list[str]:
    """The families that have a flagship file."""
    return sorted(p.stem for p in FOLDER.glob("*.json"))
