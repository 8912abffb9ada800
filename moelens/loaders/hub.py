"""Find a checkpoint: a local folder is read in place; anything else is a Hub repo id. Embedded defaults, and
names that cannot be Hub ids (mistyped defaults, paths that are not there), are dealt with above the loaders,
in moelens.locate, before anything is asked of the Hub."""

from __future__ import annotations

from pathlib import Path

from huggingface_hub import snapshot_download

# Only what moelens reads: no pickle weights, no remote code.
HUB_FILES = [
    "config.json",
    "*.safetensors",
    "model.safetensors.index.json",
    "tokenizer.json",
    "tokenizer_config.json",
    "special_tokens_map.json",
    "generation_config.json",
]


def resolve_checkpoint(name_or_path: str | Path, revision: str | None = None) -> Path:
    """Folder of a checkpoint: a local folder or a Hub repo."""
    path = Path(name_or_path).expanduser()
    if path.is_dir():
        return path
    if path.exists():
        raise NotADirectoryError(f"{path} is a file; a checkpoint is a folder with config.json and *.safetensors")
    name = str(name_or_path)
    if name.startswith((".", "/", "~")) or name.count("/") > 1:
        raise FileNotFoundError(f"no checkpoint folder at {path}")

    try:
        return Path(snapshot_download(name, revision=revision, allow_patterns=HUB_FILES))
    except Exception as online_error:  # offline, or the Hub unreachable: fall back on the local cache
        try:
            return Path(snapshot_download(name, revision=revision, allow_patterns=HUB_FILES, local_files_only=True))
        except Exception:
            text = str(online_error).strip()
            first = " ".join(text.split()) if text else type(online_error).__name__  # one line: commands print it
            raise FileNotFoundError(
                f"{name!r} is not a local folder, and the Hub repo could not be fetched nor found in the local "
                f"cache: {first}"
            ) from online_error
