"""Where a checkpoint's files are: an embedded default (built on first use), a local folder, or a Hub repo id.

Its own module so that both the loader (moelens.pretrained) and the planner (moelens.plan), which the loader
asks for device_map="auto", can use it without importing each other.

A name goes to the Hub only if it has a Hub repo id's shape, owner/name. A mistyped embedded default
("tiny-code-mo") or a path that is not there ("./my-model", "config.json", "a/b/c") is an error at once,
with the nearest embedded names, instead of a download attempt and its retries.
"""

from __future__ import annotations

import difflib
import os
from pathlib import Path

from huggingface_hub.utils import HFValidationError, validate_repo_id

from moelens import defaults
from moelens.loaders.hub import resolve_checkpoint


def resolve(name_or_path: str | Path, revision: str | None = None) -> Path:
    """Folder of a checkpoint: an embedded default ("tiny-code-moe", shipped; "tiny-qwen2-moe", ...: built on
    first use), a local folder, or a Hub repo id."""
    check_not_empty(str(name_or_path))
    if str(name_or_path) in defaults.NAMES and not Path(name_or_path).exists():
        return defaults.default_checkpoint(str(name_or_path))
    if not Path(name_or_path).expanduser().exists():
        check_hub_id(str(name_or_path), "no checkpoint folder")
    return resolve_checkpoint(name_or_path, revision)


def check_not_empty(name: str) -> None:
    """An empty name would read as the current folder (Path("") is ".")."""
    if not name:
        raise FileNotFoundError(
            f"the model name is empty: give an embedded default ({defaults.DEFAULT}, ...), a folder or a Hub repo id"
        )


def is_hub_id(name: str) -> bool:
    """owner/name, as the Hub spells repo ids (letters, digits, '-', '_', '.')."""
    if name.count("/") != 1:
        return False
    try:
        validate_repo_id(name)
    except HFValidationError:
        return False
    return True


def looks_like_path(name: str) -> bool:
    """A name meant as a local path: it starts with '.', '/' or '~', ends in '.json', or has a path
    separator without being owner/name."""
    separators = [s for s in (os.sep, os.altsep, "/") if s]
    return (
        name.startswith((".", "/", "~"))
        or name.endswith(".json")
        or (any(s in name for s in separators) and not is_hub_id(name))
    )


def check_hub_id(name: str, what: str) -> None:
    """Nothing if `name` (which is not a local path that exists, nor an embedded default) may be sent to the
    Hub; else a FileNotFoundError saying why, with the nearest embedded default names.

    what: how the caller names what it looked for locally ("no checkpoint folder")."""
    near = nearest_defaults(name)
    did_you_mean = f"; did you mean {' or '.join(repr(n) for n in near)} (embedded default)?" if near else ""
    if looks_like_path(name):
        expanded = f" ({Path(name).expanduser()})" if name.startswith("~") else ""
        raise FileNotFoundError(f"{what} at {name}{expanded}: the path does not exist{did_you_mean}")
    if not is_hub_id(name):
        raise FileNotFoundError(
            f"{name!r} is not an embedded default, a local path, or a Hub repo id (owner/name)"
            + (did_you_mean or f"; the embedded defaults are {', '.join(defaults.NAMES)}")
        )


def nearest_defaults(name: str) -> list[str]:
    """The embedded default names nearest `name` (its last path part, without .json), nearest first: those
    at least 60% alike (difflib's ratio) and within 0.1 of the nearest, so that one clear match stands alone."""
    stem = Path(name).name.removesuffix(".json")
    ratios = sorted(((difflib.SequenceMatcher(None, stem, n).ratio(), n) for n in defaults.NAMES), key=lambda r: -r[0])
    return [n for ratio, n in ratios if ratio >= 0.6 and ratio >= ratios[0][0] - 0.1]
