"""Where a plan's config.json comes from (a dict, a folder, a file, an embedded default, a Hub id: that file
only) and what safetensors files next to it hold, from their headers."""

from __future__ import annotations

import math
from dataclasses import dataclass
from pathlib import Path

from huggingface_hub import hf_hub_download, snapshot_download

from moelens import defaults
from moelens.loaders import read_config
from moelens.loaders.errors import CheckpointError
from moelens.loaders.files import CONFIG_MAX_BYTES, read_json_object
from moelens.loaders.safetensors_files import INDEX_FILE, SafetensorsFiles
from moelens.locate import check_hub_id, check_not_empty, resolve


@dataclass
class Source:
    raw: dict  # config.json
    where: str  # for the printout
    folder: Path | None  # where weights may sit next to the config


def read_source(model: str | Path | dict, revision: str | None = None) -> Source:
    """config.json from a dict, a local folder or file, an embedded default name or a Hub id (that file only)."""
    if isinstance(model, dict):
        return Source(model, "config dict", None)
    name = str(model)
    check_not_empty(name)
    path = Path(name).expanduser()
    if name in defaults.NAMES and not path.exists():  # a shipped default, or a tiny one built (a few kB of weights)
        folder = resolve(name)
        return Source(read_config(folder), name, folder)
    if path.is_dir():
        return Source(read_config(path), str(path), path)
    if path.is_file():  # a config.json on its own
        return Source(read_json_object(path, CONFIG_MAX_BYTES), str(path), None)
    check_hub_id(name, "no checkpoint folder or config file")  # a mistyped name or path never goes to the Hub
    config = hub_config(name, revision)
    # the snapshot folder the config sits in: weights already in the cache for that commit are there too
    return Source(read_json_object(config, CONFIG_MAX_BYTES), f"{name} (Hub)", config.parent)


def hub_config(repo: str, revision: str | None = None) -> Path:
    """config.json of a Hub repo: from the local cache if there, else downloaded (that file only, never weights).

    resolve() is not used: it downloads the safetensors files, which is what planning should avoid.
    """
    try:
        return Path(hf_hub_download(repo, "config.json", revision=revision, local_files_only=True))
    except Exception:  # not cached: fetch it
        pass
    try:
        # snapshot_download, as loading does (moelens.loaders.hub): offline or with the Hub unreachable it fails at
        # once, where hf_hub_download retries its HEAD request for some 25 s
        config = Path(snapshot_download(repo, revision=revision, allow_patterns=["config.json"])) / "config.json"
    except Exception as err:
        first = str(err).strip().splitlines()[0] if str(err).strip() else type(err).__name__
        raise FileNotFoundError(
            f"{repo!r} is not a local folder or file, and its config.json could not be fetched from the Hub nor "
            f"found in the local cache ({first})"
        ) from err
    if not config.is_file():
        raise FileNotFoundError(f"Hub repo {repo!r} has no config.json")
    return config


def stored_weights(folder: Path | None) -> dict | None:
    """What the safetensors files hold, from their headers only; None where there are none.

    A broken or partial set of files (a download in progress) is reported, not raised: the plan needs only
    the config."""
    if folder is None or not (any(folder.glob("*.safetensors")) or (folder / INDEX_FILE).exists()):
        return None
    try:
        files = SafetensorsFiles(folder)
    except CheckpointError as err:
        return {"error": str(err)}
    by_dtype: dict[str, int] = {}
    for key, nbytes in files.nbytes.items():
        by_dtype[files.dtypes[key]] = by_dtype.get(files.dtypes[key], 0) + nbytes
    return {
        "files": len(files.files),
        "file_bytes": sum(p.stat().st_size for p in files.files),  # tensors plus headers
        "tensor_bytes": sum(files.nbytes.values()),
        "parameters": sum(math.prod(s) for s in files.shapes.values()),
        "dtypes": by_dtype,
        "has_lm_head": "lm_head.weight" in files,
    }
