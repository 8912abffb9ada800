"""The files of a checkpoint folder: only regular files inside it are opened, and JSON files must hold objects."""

from __future__ import annotations

import json
import reprlib
import stat
from pathlib import Path, PurePath

from moelens.loaders.errors import CheckpointError

_BRIEF = reprlib.Repr()
_BRIEF.maxstring = 160  # file names whole; a huge or deeply nested value abbreviated

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


def read_json_object(path: Path) -> dict:
    """A JSON file that must hold an object: anything else is a CheckpointError naming the file."""
    try:
        data = json.loads(path.read_text(encoding="utf-8"))
    except UnicodeDecodeError as err:
        raise CheckpointError(f"{path}: not UTF-8 text ({err})") from err
    except ValueError as err:  # JSONDecodeError, or an integer of more digits than Python converts
        raise CheckpointError(f"{path}: not valid JSON ({err})") from err
    except RecursionError as err:
        raise CheckpointError(f"{path}: JSON nested too deeply to read") from err
    if not isinstance(data, dict):
        raise CheckpointError(f"{path}: expected a JSON object, got {type(data).__name__} {brief(data)}")
    return data


def brief(value) -> str:
    """repr of a value read from a checkpoint file, abbreviated if it is large or deeply nested."""
    return _BRIEF.repr(value)
