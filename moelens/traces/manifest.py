"""DIR/manifest.json: what a trace was made from (model, data, settings) and which parts are complete.

It is replaced whole (temporary file, fsync, os.replace), so a reader sees the old or the new one, never a mix.
A part counts only once the manifest records it: anything else in DIR is left over from a killed run.
"""

from __future__ import annotations

import dataclasses
import hashlib
import json
import os
from pathlib import Path

import torch

FORMAT = "moelens-trace/1"
MANIFEST = "manifest.json"
PART = "part-{:06d}.parquet"
TEMP_SUFFIX = ".tmp"  # every temporary file a trace writes ends with it


class TraceMismatch(ValueError):
    """The trace in DIR was made from another model, data or settings than this run's."""


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
    return manifest


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
