"""Embedded default checkpoints: tiny models moelens builds itself, deterministically, from shipped configs.

No download and no transformers: weights come from a seeded generator, the tokenizer is byte-level.
They exist so that `moelens inspect` and the examples run on a fresh machine.
"""

from __future__ import annotations

import json
import os
from pathlib import Path

import torch
from safetensors.torch import save_file

CONFIGS = {
    "tiny-qwen2-moe": "tiny_qwen2_moe.json",
    "tiny-hunyuan-moe": "tiny_hunyuan_v1_moe.json",
    "tiny-solar-open": "tiny_solar_open.json",
}
DEFAULT = "tiny-qwen2-moe"
SEED = 0


def cache_root() -> Path:
    return Path(os.environ.get("MOELENS_CACHE", Path.home() / ".cache" / "moelens"))


def default_checkpoint(name: str | None = None, root: Path | None = None) -> Path:
    """Folder of the named default checkpoint, built on first use."""
    name = name or DEFAULT
    if name not in CONFIGS:
        raise KeyError(f"no embedded default {name!r}; there are {sorted(CONFIGS)}")
    config = json.loads((Path(__file__).parent / CONFIGS[name]).read_text())
    folder = (root or cache_root()) / "defaults" / f"{name}-seed{SEED}"
    if not (folder / "model.safetensors").is_file() or json.loads((folder / "config.json").read_text()) != config:
        build_checkpoint(config, folder)
    return folder


def build_checkpoint(config: dict, folder: Path) -> None:
    from moelens.loaders.checkpoint import expected_keys
    from moelens.models import family_for

    family = family_for(config["model_type"])
    cfg = family.config_from_hf(config)
    gen = torch.Generator().manual_seed(SEED)
    keys = expected_keys(cfg, family.checkpoint_names, fused_layers=set(), lm_head=not cfg.tie_word_embeddings)
    model = family(cfg)
    tensors = {}
    with torch.no_grad():
        slots = dict(model.named_parameters()) | dict(model.named_buffers())
        for key, target in keys.items():
            shape = slots[target.param][target.index].shape
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
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers

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
