"""Checkpoint loading: resolve (hub.py) -> read lazily (safetensors_files.py) -> map and fill (checkpoint.py)."""

from __future__ import annotations

import dataclasses
import json
from pathlib import Path

import torch

from moelens.loaders.checkpoint import CheckpointNames, fill, plan_load
from moelens.loaders.errors import CheckpointError
from moelens.loaders.hub import resolve_checkpoint
from moelens.loaders.safetensors_files import SafetensorsFiles
from moelens.tokenizer import MoeTokenizer

__all__ = ["CheckpointError", "CheckpointNames", "load_pretrained", "read_config"]


def read_config(folder: Path) -> dict:
    path = folder / "config.json"
    if not path.is_file():
        raise CheckpointError(f"{folder} has no config.json")
    try:
        config = json.loads(path.read_text())
    except json.JSONDecodeError as err:
        raise CheckpointError(f"{path}: not valid JSON ({err})") from err
    if not isinstance(config, dict):
        raise CheckpointError(f"{path}: expected a JSON object")
    return config


def materialize(model: torch.nn.Module, device: torch.device | str) -> None:
    """Give every meta parameter and buffer uninitialised storage on `device`.

    Like Module.to_empty, but through torch.empty with plain shapes: to_empty's empty_like on meta tensors
    runs torch's Python reference implementation, which imports sympy and torch.fx (~300 MB resident).
    """
    for module in model.modules():
        for name, param in module._parameters.items():
            if param is not None and param.is_meta:
                empty = torch.empty(param.shape, dtype=param.dtype, device=device)
                module._parameters[name] = torch.nn.Parameter(empty, requires_grad=param.requires_grad)
        for name, buffer in module._buffers.items():
            if buffer is not None and buffer.is_meta:
                module._buffers[name] = torch.empty(buffer.shape, dtype=buffer.dtype, device=device)


def load_pretrained(
    cls, name_or_path, dtype=torch.float32, device="cpu", revision=None, progress=None, fold_ln=False, center_unembed=False
):
    from moelens.models import family_for

    folder = resolve_checkpoint(name_or_path, revision)
    hf = read_config(folder)
    family = family_for(hf.get("model_type"), folder / "config.json")
    if not issubclass(family, cls):
        raise TypeError(f"{folder} holds a {hf.get('model_type')} model; {cls.__name__} cannot load it")
    try:
        cfg = family.config_from_hf(hf)
    except KeyError as err:
        raise CheckpointError(f"{folder / 'config.json'} lacks the field {err.args[0]!r} that {family.__name__} needs") from err
    except ValueError as err:
        raise CheckpointError(f"{folder / 'config.json'}: {err}") from err
    cfg = dataclasses.replace(cfg, dtype=dtype)
    files = SafetensorsFiles(folder)
    keys, untie = plan_load(cfg, family.checkpoint_names, files)
    if untie:  # tie_word_embeddings, but the checkpoint stores its own head: use it, as transformers does
        cfg = dataclasses.replace(cfg, tie_word_embeddings=False)
    with torch.device("meta"):
        model = family(cfg)
    model.to(dtype)
    if cfg.router_in_float32:  # kept float32 at load, as the reference keeps it
        for block in model.blocks:
            if block.is_moe:
                block.mlp.router.float()
    materialize(model, device)
    model.tie_weights()
    fill(model, files, keys, progress=progress)
    model.process_weights_(fold_ln=fold_ln, center_unembed=center_unembed)  # moelens.fold; no-op by default
    model.tokenizer = MoeTokenizer.from_folder(folder, hf)
    model.name_or_path = str(name_or_path)
    return model.eval()
