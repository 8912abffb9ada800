"""Embedded default checkpoints, so that `moelens inspect`, `moelens trace` and the examples run on a fresh
machine with no download and no transformers.

- TRAINED: checkpoints shipped inside the package, trained by tools/train_tiny_moe.py (tiny-code-moe, the
  default: a Qwen2-MoE-family model trained on Python's standard library; its MODEL_CARD.md says how).
- CONFIGS: one tiny model per family, built on first use from a shipped config with seeded random weights and
  a byte-level tokenizer; their routing means nothing, they exist for tests and for trying each family.
"""

from __future__ import annotations

import json
import os
import shutil
import tempfile
from pathlib import Path

import torch
from safetensors.torch import save_file
from tokenizers import Tokenizer, decoders, models, pre_tokenizers

from moelens.families import family_for
from moelens.loaders.checkpoint import expected_keys

# name -> file: every tiny-*.json beside this file is one, named by its file (a new family's tiny default is a
# file dropped here, no list to edit); tests/test_cli_and_defaults.py holds every registered family to having one
CONFIGS = {p.stem: p.name for p in sorted(Path(__file__).parent.glob("tiny-*.json"))}
TRAINED = {"tiny-code-moe": "tiny-code-moe"}  # name -> folder beside this file
DEFAULT = "tiny-code-moe"
NAMES = (*TRAINED, *CONFIGS)
SEED = 0
TRAINED_FILES = ("config.json", "model.safetensors", "tokenizer.json", "tokenizer_config.json")


def is_random(name: str) -> bool:
    """Whether the named embedded default has seeded random weights (its routing shows the tools, not a model)."""
    return name in CONFIGS


def cache_root() -> Path:
    return Path(os.environ.get("MOELENS_CACHE", Path.home() / ".cache" / "moelens"))


def default_checkpoint(name: str | None = None, root: Path | None = None) -> Path:
    """Folder of the named default checkpoint, built on first use.

    Safe when many processes start at once and when a build is killed: each build writes a private temporary
    folder and renames it into place whole, so the folder is either absent or complete (its COMPLETE marker,
    written last, holds the config it was built from). A folder without the marker, or built from another
    config, is rebuilt."""
    name = name or DEFAULT
    if name in TRAINED:
        return trained_checkpoint(name)
    if name not in CONFIGS:
        raise KeyError(f"no embedded default {name!r}; there are {list(NAMES)}")
    config = json.loads((Path(__file__).parent / CONFIGS[name]).read_text())
    folder = (root or cache_root()) / "defaults" / f"{name}-seed{SEED}"
    if not _is_complete(folder, config):
        folder.parent.mkdir(parents=True, exist_ok=True)
        building = Path(tempfile.mkdtemp(prefix=f".{folder.name}-", dir=folder.parent))
        try:
            build_checkpoint(config, building)
            (building / COMPLETE).write_text(json.dumps(config))
            _move_into_place(building, folder, config)
        finally:
            shutil.rmtree(building, ignore_errors=True)
    return folder


COMPLETE = "COMPLETE"


def trained_checkpoint(name: str) -> Path:
    """The shipped folder of a trained default; an installation that lost a file is an error naming it."""
    folder = Path(__file__).parent / TRAINED[name]
    missing = [f for f in TRAINED_FILES if not (folder / f).is_file()]
    if missing:
        raise FileNotFoundError(
            f"the embedded default {name!r} is incomplete at {folder}: {', '.join(missing)} missing (reinstall moelens)"
        )
    return folder


def _is_complete(folder: Path, config: dict) -> bool:
    try:
        return json.loads((folder / COMPLETE).read_text()) == config
    except (OSError, ValueError):
        return False


def _move_into_place(built: Path, folder: Path, config: dict) -> None:
    """Rename the finished build to `folder`. If another process got there first with a complete build, keep
    theirs; a stale or half-built folder (from an older moelens, or a killed build) is moved aside first."""
    for _ in range(3):
        try:
            os.rename(built, folder)  # atomic; fails if folder exists and is not empty
            return
        except OSError:
            if _is_complete(folder, config):
                return
            stale = Path(tempfile.mkdtemp(prefix=f".{folder.name}-stale-", dir=folder.parent))
            try:
                os.rename(folder, stale / "old")
            except FileNotFoundError:  # someone else moved it aside meanwhile: try again
                pass
            finally:
                shutil.rmtree(stale, ignore_errors=True)
    raise RuntimeError(f"could not put the embedded default in place at {folder}")


def build_checkpoint(config: dict, folder: Path) -> None:
    family = family_for(config["model_type"])
    cfg = family.config_from_hf(config)
    gen = torch.Generator().manual_seed(SEED)
    keys = expected_keys(family.site_map(cfg))
    model = family.build(cfg)
    tensors = {}
    with torch.no_grad():
        slots = dict(model.named_parameters()) | dict(model.named_buffers())
        for key, target in keys.items():
            shape = target.stored_shape(slots)
            noise = torch.randn(shape, generator=gen)
            if key.endswith("norm.weight") or "layernorm" in key:
                tensors[key] = 1.0 + 0.1 * noise
            elif key.endswith(".bias"):
                tensors[key] = 0.1 * noise
            else:
                tensors[key] = noise * shape[-1] ** -0.5
    folder.mkdir(parents=True, exist_ok=True)
    save_file(tensors, folder / "model.safetensors", metadata={"format": "pt"})
    byte_level_tokenizer(config["vocab_size"], config["eos_token_id"], config["pad_token_id"]).save(str(folder / "tokenizer.json"))
    (folder / "tokenizer_config.json").write_text(json.dumps({"eos_token": "<|endoftext|>", "pad_token": "<|pad|>"}))
    (folder / "config.json").write_text(json.dumps(config, indent=2))


def byte_level_tokenizer(vocab_size: int, eos_id: int, pad_id: int):
    """One token per byte (ids 0-255) plus end-of-text and padding: any text round-trips."""

    alphabet = sorted(pre_tokenizers.ByteLevel.alphabet(), key=lambda ch: _byte_of(ch))
    vocab = {ch: i for i, ch in enumerate(alphabet)}
    tok = Tokenizer(models.BPE(vocab=vocab, merges=[]))
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False)
    tok.decoder = decoders.ByteLevel()
    tok.add_special_tokens(["<|endoftext|>", "<|pad|>"])
    assert tok.token_to_id("<|endoftext|>") == eos_id and tok.token_to_id("<|pad|>") == pad_id <= vocab_size
    return tok


def _byte_of(ch: str) -> int:
    """The byte a ByteLevel alphabet character stands for (GPT-2's bytes_to_unicode, inverted)."""
    code = ord(ch)
    printable = list(range(ord("!"), ord("~") + 1)) + list(range(ord("¡"), ord("¬") + 1)) + list(range(ord("®"), ord("ÿ") + 1))
    if code in printable:
        return code
    others = [b for b in range(256) if b not in printable]
    return others[code - 256]
