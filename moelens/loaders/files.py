"""The files of a checkpoint folder: only regular files inside it are opened, and JSON files must hold objects."""

from __future__ import annotations

import json
import os
import reprlib
import stat
from pathlib import Path, PurePath

from moelens.loaders.errors import CheckpointError

_BRIEF = reprlib.Repr()
_BRIEF.maxstring = 160  # file names whole; a huge or deeply nested value abbreviated

# a config.json is a few kB (the largest published ones, with per-layer lists, tens of kB): anything past this
# is not a model's config, and is refused before it is read rather than parsed whole into memory
CONFIG_MAX_BYTES = 16 * 2**20

KINDS = (
    (stat.S_ISDIR, "a directory"),
    (stat.S_ISFIFO, "a FIFO"),
    (stat.S_ISSOCK, "a socket"),
    (stat.S_ISCHR, "a character device"),
    (stat.S_ISBLK, "a block device"),
)


def _kind(path: Path) -> str:
    mode = path.stat().st_mode
    return next((kind for test, kind in KINDS if test(mode)), "not a regular file")


def checkpoint_file(folder: Path, name: str, listed_in: Path | None = None) -> Path | None:
    """folder / name if it is a regular file of the checkpoint; None if absent.

    A name leading out of the folder (absolute, or through ..), and anything but a regular file once links
    are followed (a FIFO would block the read forever), is a CheckpointError naming it, raised before the
    file is opened. Links themselves are followed wherever they lead: the Hub cache's snapshots are links
    into its blob store, and users link weights kept on another disk.
    """
    where = f"{listed_in} lists {name!r}, which" if listed_in else f"{folder / name}"
    pure = PurePath(name)
    if pure.is_absolute() or ".." in pure.parts:
        raise CheckpointError(f"{where} points outside the checkpoint folder {folder}")
    path = folder / name
    if not path.exists():
        if path.is_symlink():
            raise CheckpointError(f"{where} is a link to {path.readlink()}, which does not exist")
        return None
    if not path.is_file():
        link = f" (a link to {path.resolve()})" if path.is_symlink() else ""
        raise CheckpointError(f"{where}{link} is {_kind(path)}, not a regular file")
    return path


def read_json_object(path: Path, max_bytes: int | None = None) -> dict:
    """A JSON file that must hold an object: anything else is a CheckpointError naming the file. max_bytes: a
    file larger than this is a CheckpointError naming its size, raised before it is read."""
    try:
        data = json.loads(_read_text(path, max_bytes))
    except UnicodeDecodeError as err:
        raise CheckpointError(f"{path}: not UTF-8 text ({err})") from err
    except ValueError as err:  # JSONDecodeError, or an integer of more digits than Python converts
        raise CheckpointError(f"{path}: not valid JSON ({err})") from err
    except RecursionError as err:
        raise CheckpointError(f"{path}: JSON nested too deeply to read") from err
    if not isinstance(data, dict):
        raise CheckpointError(f"{path}: expected a JSON object, got {type(data).__name__} {brief(data)}")
    return data


def _read_text(path: Path, max_bytes: int | None) -> str:
    with path.open("rb") as f:
        size = os.fstat(f.fileno()).st_size
        raw = f.read() if max_bytes is None else f.read(max_bytes + 1)  # +1: a file grown since the fstat shows too
    if max_bytes is not None and max(size, len(raw)) > max_bytes:
        raise CheckpointError(
            f"{path} is {max(size, len(raw)):,} bytes; moelens reads a {path.name} of at most {max_bytes:,} bytes "
            f"({max_bytes / 2**20:g} MiB; a model's config is a few kB), so this is not one"
        )
    return raw.decode("utf-8")


def brief(value) -> str:
    """repr of a value read from a checkpoint file, abbreviated if it is large or deeply nested."""
    return _BRIEF.repr(value)
