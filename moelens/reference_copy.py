"""A dense float32 copy of a block-fp8 checkpoint, for `moelens verify` to load transformers from.

transformers' CPU dequantization of block fp8 takes a block to be rows // scale_rows, so it misreads a
dimension the block does not divide (an expert width of 192 under 128 blocks is read as blocks of 96) or
refuses it. Reading the copy, transformers holds exactly the weights the format defines, and its forward is a
correct reference for moelens's. The dequantization here is written out from the format (each value times its
block's scale, the blocks cropped at the edge), apart from the loader's, so that verify also checks that.
"""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import torch
from jaxtyping import Float
from safetensors.torch import save_file

from moelens.loaders.quantized import Fp8Blocks, scales_as_float32, stored_format
from moelens.loaders.safetensors_files import INDEX_FILE, SafetensorsFiles

CONFIG = "config.json"


def fp8_blocks(folder: Path) -> Fp8Blocks | None:
    """The checkpoint's block-fp8 format where config.json's quantization_config says it has one, else None."""
    config = json.loads((folder / CONFIG).read_text())
    stored = stored_format(config, folder / CONFIG)
    return stored if isinstance(stored, Fp8Blocks) else None


def by_the_format(
    weight: torch.Tensor, scale: torch.Tensor, block: tuple[int, int]
) -> Float[torch.Tensor, "*lead rows cols"]:
    """Each float8 value times the scale of its block (float32); the last block of a dimension the block size
    does not divide is partial (cropped)."""
    rows, cols = weight.shape[-2:]
    scales = scales_as_float32(scale).repeat_interleave(block[0], -2).repeat_interleave(block[1], -1)
    return weight.float() * scales[..., :rows, :cols]


def write_dequantized_copy(folder: Path, dest: Path, fmt: Fp8Blocks) -> Path:
    """`folder` as a float32 checkpoint in `dest`: its fp8 weights dequantized (their scales dropped), every
    other tensor as stored, the same file names and index, config.json without quantization_config, and its
    other top-level files (tokenizer, generation config) copied. Returns dest."""
    files = SafetensorsFiles(folder)
    scale_keys = {fmt.scale_key(k) for k in files.keys() if fmt.scale_key(k) in files}
    for path in files.files:
        groups = [
            (key, fmt.scale_key(key)) if fmt.scale_key(key) in files else (key,)
            for key in files.keys() if files.location[key] == path and key not in scale_keys
        ]
        tensors = {
            group[0]: by_the_format(*stored, fmt.block) if len(group) == 2 else stored[0]
            for group, stored in files.read_groups(groups)
        }
        out = dest / path.relative_to(folder)
        out.parent.mkdir(parents=True, exist_ok=True)
        save_file(tensors, out, metadata={"format": "pt"})
    for entry in folder.iterdir():
        if entry.is_file() and entry.suffix != ".safetensors" and entry.name not in (CONFIG, INDEX_FILE):
            shutil.copy2(entry, dest / entry.name)
    config = json.loads((folder / CONFIG).read_text())
    config.pop("quantization_config")
    (dest / CONFIG).write_text(json.dumps(config, indent=2))
    if (folder / INDEX_FILE).exists():
        index = json.loads((folder / INDEX_FILE).read_text())
        index["weight_map"] = {k: v for k, v in index["weight_map"].items() if k not in scale_keys}
        (dest / INDEX_FILE).write_text(json.dumps(index, indent=2))
    return dest
