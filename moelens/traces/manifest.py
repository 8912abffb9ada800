"""DIR/manifest.json: what a trace was made from (model, data, settings) and which parts are complete.

It is replaced whole (temporary file, fsync, os.replace), so a reader sees the old or the new one, never a mix.
A part counts only once the manifest records it, with its size and sha256: anything else in DIR is left over
from a killed run. A run holds DIR/trace.lock (an exclusive flock) while it writes, so two runs never write
one folder at once.
"""

from __future__ import annotations

import contextlib
import dataclasses
import hashlib
import json
import os
import re
from collections.abc import Iterator
from pathlib import Path

import torch

try:
    import fcntl
except ImportError:  # not POSIX: no lock (two runs into one folder are then the user's to avoid)
    fcntl = None

FORMAT = "moelens-trace/1"
MANIFEST = "manifest.json"
PART = "part-{:06d}.parquet"
LOCK = "trace.lock"
TEMP_SUFFIX = ".tmp"  # every temporary file a trace writes ends with it
JOURNAL = "rank-{:05d}.json"  # a data-parallel rank's record of the parts it wrote (moelens.traces.run)
_SHA256 = re.compile(r"[0-9a-f]{64}")
# The only names a trace writes in DIR (besides manifest.json and trace.lock): a run deletes nothing else.
_OWN_TEMPORARY = re.compile(r"(part-[0-9]{6,}\.parquet|manifest\.json|rank-[0-9]{5,}\.json)" + re.escape(TEMP_SUFFIX))
_OWN_PART = re.compile(r"part-[0-9]{6,}\.parquet")
_OWN_JOURNAL = re.compile(r"rank-[0-9]{5,}\.json")
# How every manifest.json this moelens writes begins (json.dump, indent=1, "format" first): a manifest's
# temporary file left by a run killed before its first manifest was in place begins so, or is empty.
_MANIFEST_HEAD = ('{\n "format": "' + FORMAT + '"').encode()


def is_own_temporary(name: str) -> bool:
    """A temporary name a trace writes under (a part, the manifest, a rank's journal, each + .tmp)."""
    return _OWN_TEMPORARY.fullmatch(name) is not None


def is_own_part(name: str) -> bool:
    return _OWN_PART.fullmatch(name) is not None


def is_own_journal(name: str) -> bool:
    return _OWN_JOURNAL.fullmatch(name) is not None


def is_first_manifest_leftover(path: Path) -> bool:
    """path is the manifest's temporary file as a run killed inside its very first manifest write leaves it:
    a regular file holding a beginning of what moelens writes there (read: its first bytes only)."""
    if path.name != MANIFEST + TEMP_SUFFIX or path.is_symlink() or not path.is_file():
        return False
    with open(path, "rb") as fh:
        head = fh.read(len(_MANIFEST_HEAD))
    return _MANIFEST_HEAD.startswith(head)


class TraceMismatch(ValueError):
    """The trace in DIR was made from another model, data or settings than this run's."""


class FolderBusy(OSError):
    """Another run holds the trace folder's lock."""


@contextlib.contextmanager
def folder_lock(folder: Path) -> Iterator[None]:
    """Hold DIR/trace.lock exclusively (flock: released when the process ends, however it ends)."""
    if fcntl is None:
        yield
        return
    with open(folder / LOCK, "a") as fh:
        try:
            fcntl.flock(fh.fileno(), fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            raise FolderBusy(
                f"out: {folder} is being written by another moelens trace (it holds {folder / LOCK}): wait for it to "
                "end, or trace into another folder"
            ) from None
        try:
            yield
        finally:
            fcntl.flock(fh.fileno(), fcntl.LOCK_UN)


def file_sha256(path: Path) -> str:
    digest = hashlib.sha256()
    with open(path, "rb") as fh:
        for block in iter(lambda: fh.read(1 << 20), b""):
            digest.update(block)
    return digest.hexdigest()


def jsonable(value):
    """dataclasses, tuples and dicts made JSON-able; anything else that JSON lacks (a torch.dtype) as str()."""
    if dataclasses.is_dataclass(value) and not isinstance(value, type):
        return {f.name: jsonable(getattr(value, f.name)) for f in dataclasses.fields(value)}
    if isinstance(value, dict):
        return {str(k): jsonable(v) for k, v in value.items()}
    if isinstance(value, (list, tuple)):
        return [jsonable(v) for v in value]
    if value is None or isinstance(value, (bool, int, float, str)):
        return value
    return str(value)


def config_identity(cfg) -> dict:
    """The config fields that define the model (those compared for equality; bookkeeping fields left out)."""
    return {f.name: jsonable(getattr(cfg, f.name)) for f in dataclasses.fields(cfg) if f.compare}


def sha256_json(obj) -> str:
    return hashlib.sha256(json.dumps(obj, sort_keys=True).encode()).hexdigest()


@torch.no_grad()
def weights_fingerprint(model: torch.nn.Module, samples: int = 64) -> str:
    """A cheap identity of the weights: every tensor's name, shape, dtype and `samples` evenly spaced values.

    Reads a few values per tensor, not the weights, so it is instant for any model size; it catches other
    checkpoints and other seeds, not an edit of a single value."""
    digest = hashlib.sha256()
    tensors = dict(model.named_parameters()) | dict(model.named_buffers())
    for name in sorted(tensors):
        t = tensors[name]
        digest.update(f"{name}:{tuple(t.shape)}:{t.dtype};".encode())
        if t.device.type == "meta" or t.numel() == 0:
            continue
        flat = t.detach().reshape(-1)
        index = torch.linspace(0, flat.numel() - 1, min(samples, flat.numel())).long().to(flat.device)
        digest.update(flat[index].float().cpu().numpy().tobytes())
    return digest.hexdigest()


def model_identity(model, name: str, dtype: torch.dtype) -> dict:
    config = config_identity(model.cfg)
    return {
        "name": name,
        "family": model.cfg.family,
        "dtype": str(dtype).removeprefix("torch."),
        "config_sha256": sha256_json(config),
        "weights_fingerprint": weights_fingerprint(model),
    }


def write_json_atomic(path: Path, obj) -> None:
    """Write obj to path whole or not at all: a temporary file, fsync, rename over path, fsync the folder."""
    temp = path.with_name(path.name + TEMP_SUFFIX)
    with open(temp, "w") as fh:
        json.dump(obj, fh, indent=1)
        fh.flush()
        os.fsync(fh.fileno())
    os.replace(temp, path)
    fsync_dir(path.parent)


def fsync_dir(folder: Path) -> None:
    """Make a rename in folder durable (POSIX; a no-op where folders cannot be opened)."""
    try:
        fd = os.open(folder, os.O_RDONLY)
    except OSError:
        return
    try:
        os.fsync(fd)
    except OSError:
        pass
    finally:
        os.close(fd)


def read_manifest(folder: Path) -> dict | None:
    path = folder / MANIFEST
    if not path.exists():
        return None
    try:
        manifest = json.loads(path.read_text())
    except ValueError as err:
        raise ValueError(f"{path}: not a trace manifest ({err})") from None
    if not isinstance(manifest, dict) or manifest.get("format") != FORMAT:
        raise ValueError(f"{path}: not a {FORMAT} manifest (format {manifest.get('format') if isinstance(manifest, dict) else None!r})")
    check_manifest(path, manifest)
    return manifest


def check_manifest(path: Path, manifest: dict) -> None:
    """Refuse a manifest that moelens did not write as it is (damaged or edited), naming the field at fault:
    every field a run or a reader uses has its type, and every part's file is the part's own name in DIR."""

    def bad(field: str, expected: str, value) -> ValueError:
        shown = repr(value) if len(repr(value)) <= 80 else repr(value)[:77] + "..."
        return ValueError(f"{path}: {field} should be {expected}, got {shown}: the manifest is damaged or edited")

    def count(value) -> bool:
        return isinstance(value, int) and not isinstance(value, bool) and value >= 0

    for key, kind, expected in (("model", dict, "an object"), ("settings", dict, "an object"), ("data", dict, "an object"),
                                ("layers", list, "a list of layer indices"), ("top_k", dict, "an object"),
                                ("parts", dict, "an object {part index: part}"), ("complete", bool, "true or false")):
        if not isinstance(manifest.get(key), kind):
            raise bad(key, expected, manifest.get(key, "nothing"))
    if not all(count(layer) for layer in manifest["layers"]):
        raise bad("layers", "a list of layer indices", manifest["layers"])
    if not count(manifest.get("n_experts")):
        raise bad("n_experts", "a count", manifest.get("n_experts", "nothing"))
    if not isinstance(manifest["settings"].get("router_logits"), bool):
        raise bad("settings.router_logits", "true or false", manifest["settings"].get("router_logits", "nothing"))
    if not all(key.isdigit() and count(k) for key, k in manifest["top_k"].items()):
        raise bad("top_k", "an object {layer: k}", manifest["top_k"])
    data = manifest["data"]
    if data.get("kind") not in ("files", "iterable"):
        raise bad("data.kind", "'files' or 'iterable'", data.get("kind", "nothing"))
    if data.get("kind") == "files":
        files = data.get("files")
        if not isinstance(files, list) or not all(
            isinstance(f, dict) and isinstance(f.get("path"), str) and count(f.get("first_doc")) and count(f.get("n_docs")) for f in files
        ):
            raise bad("data.files", "a list of {path, size, sha256, first_doc, n_docs}", files)
    for key, part in manifest["parts"].items():
        field = f"parts[{key!r}]"
        if not key.isdigit():
            raise bad("parts", "keyed by part index", key)
        if not isinstance(part, dict):
            raise bad(field, "an object {file, windows, tokens, rows, ...}", part)
        if part.get("file") != PART.format(int(key)):  # also refuses any name that leads out of DIR
            raise bad(f"{field}.file", repr(PART.format(int(key))), part.get("file", "nothing"))
        for name in ("first_window", "windows", "tokens", "rows"):
            if not count(part.get(name)):
                raise bad(f"{field}.{name}", "a count", part.get(name, "nothing"))
        if not isinstance(part.get("data_sha256"), str):
            raise bad(f"{field}.data_sha256", "a sha256", part.get("data_sha256", "nothing"))
        if "size" in part and not count(part["size"]):
            raise bad(f"{field}.size", "a size in bytes", part["size"])
        if "sha256" in part and not (isinstance(part["sha256"], str) and _SHA256.fullmatch(part["sha256"])):
            raise bad(f"{field}.sha256", "a sha256 (64 hex digits)", part["sha256"])
    if manifest["complete"]:
        totals = manifest.get("totals")
        if not isinstance(totals, dict) or not all(count(totals.get(k)) for k in ("parts", "tokens", "rows")):
            raise bad("totals", "an object {parts, docs, windows, tokens, rows}", totals)


def check_same_run(folder: Path, old: dict, new: dict) -> None:
    """Refuse to continue a trace made from another model, data or settings, naming every difference."""
    changes: list[str] = []
    for key in ("name", "family", "dtype", "config_sha256", "weights_fingerprint"):
        a, b = old["model"].get(key), new["model"].get(key)
        if a != b:
            if key == "config_sha256":
                changes.append("model config differs")
            elif key == "weights_fingerprint":
                changes.append("model weights differ")
            else:
                changes.append(f"model {key}: {a!r} -> {b!r}")
    for key in sorted(set(old["settings"]) | set(new["settings"])):
        a, b = old["settings"].get(key), new["settings"].get(key)
        if a != b:
            changes.append(f"{key}: {a!r} -> {b!r}")
    changes += _data_changes(old["data"], new["data"])
    if changes:
        raise TraceMismatch(
            f"{folder} holds a trace of other inputs; changed: {'; '.join(changes)}. "
            "Trace into a new folder (or delete this one) to start over"
        )


def _data_changes(old: dict, new: dict) -> list[str]:
    if old["kind"] != new["kind"]:
        return [f"data: {old['kind']} -> {new['kind']}"]
    if old["kind"] != "files":
        # An iterable cannot be hashed up front: each recorded part's token hash is checked as it is passed over.
        if old.get("fingerprint") != new.get("fingerprint") or old.get("type") != new.get("type"):
            return [f"data: {old.get('type')} {old.get('fingerprint') or ''} -> {new.get('type')} {new.get('fingerprint') or ''}".replace("  ", " ")]
        return []
    before = {f["path"]: f for f in old["files"]}
    after = {f["path"]: f for f in new["files"]}
    changes = [f"data file removed: {p}" for p in before if p not in after]
    changes += [f"data file added: {p}" for p in after if p not in before]
    for path in before.keys() & after.keys():
        a, b = before[path], after[path]
        if (a["size"], a["sha256"]) != (b["size"], b["sha256"]):
            changes.append(f"data file changed: {path} (size {a['size']} -> {b['size']}, sha256 {a['sha256'][:12]} -> {b['sha256'][:12]})")
    if not changes and [f["path"] for f in old["files"]] != [f["path"] for f in new["files"]]:
        changes.append("data files are in another order")
    return changes
