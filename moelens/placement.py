"""Device maps: which device each part of a model lives on. Whole blocks per device, in order, so that every
hook sees a whole tensor on its block's device and the residual stream moves only between blocks.

A map names "embed", "blocks.N" or "blocks.A-B" (inclusive), "ln_final" and "unembed", e.g.
    {"embed": "cuda:0", "blocks.0-15": "cuda:0", "blocks.16-31": "cuda:1", "ln_final": "cuda:1", "unembed": "cuda:1"}
"auto" is the map `moelens plan` recommends within max_memory (moelens.plan.auto_device_map): devices filled in
order, the embedding with the first block, the final norm and unembedding with the last.
"""

from __future__ import annotations

import re
from collections.abc import Mapping

import torch

PARTS = ("embed", "ln_final", "unembed")
BLOCK_KEY = re.compile(r"blocks\.(\d+)(?:-(\d+))?$")


def parse_device_map(spec: Mapping[str, str | torch.device | int], n_layers: int) -> dict[str, torch.device]:
    """{"embed" | "blocks.L" | "ln_final" | "unembed": device} for every part, from a user's map."""
    if not isinstance(spec, Mapping):
        raise TypeError(f"device_map must be 'auto' or a mapping of model parts to devices, got {type(spec).__name__}")
    placed: dict[str, torch.device] = {}
    for key, device in spec.items():
        dev = _device(device, key)
        match = BLOCK_KEY.match(str(key))
        if key in PARTS:
            names = [key]
        elif match:
            first, last = int(match[1]), int(match[2] or match[1])
            if not first <= last < n_layers:
                raise ValueError(f"device_map key {key!r}: blocks run from 0 to {n_layers - 1}")
            names = [f"blocks.{i}" for i in range(first, last + 1)]
        else:
            raise ValueError(f"device_map key {key!r} is not one of {PARTS}, 'blocks.N' or 'blocks.A-B'")
        for name in names:
            if name in placed:
                raise ValueError(f"device_map places {name} twice")
            placed[name] = dev
    missing = [n for n in (*PARTS, *(f"blocks.{i}" for i in range(n_layers))) if n not in placed]
    if missing:
        raise ValueError(f"device_map does not place {', '.join(missing)}")
    return placed


def check_available(device: torch.device, what: str) -> None:
    """A device this machine has, else a ValueError naming `what`, the device and what there is. cpu is always
    there (torch keeps "cpu:1" apart as a name, which tests use to stand for a second device); an accelerator
    (cuda, xpu, mps, ...) needs its index below its type's device count here."""
    if device.type in ("cpu", "meta"):
        return
    backend = getattr(torch, device.type, None)
    count_of = getattr(backend, "device_count", None)
    available = getattr(backend, "is_available", None)
    count = count_of() if callable(count_of) and callable(available) and available() else 0
    index = device.index or 0
    if index >= count:
        kind = device.type
        have = f"{count} {kind} device(s), {kind}:0 to {kind}:{count - 1}" if count else f"no {kind} device"
        raise ValueError(f"{what} = {str(device)!r}: this machine has {have}")


def _device(device, key: str) -> torch.device:
    try:
        return torch.device(device)
    except (RuntimeError, TypeError) as err:
        raise ValueError(f"device_map[{key!r}] = {device!r} is not a torch device") from err


UNITS = {
    "": None, "b": 1,
    "k": 10**3, "kb": 10**3, "m": 10**6, "mb": 10**6, "g": 10**9, "gb": 10**9, "t": 10**12, "tb": 10**12,
    "kib": 2**10, "mib": 2**20, "gib": 2**30, "tib": 2**40,
}


def parse_size(text: str | int, what: str = "size") -> int:
    """'141GB' -> 141e9, '80GiB' -> 80 * 2**30, '256G' -> 256e9, '1.5TB'; an int is bytes already.

    A bare number in a string is refused: '80' could mean bytes or gigabytes, and guessing wrong by 1e9 is
    worse than asking.
    """
    if isinstance(text, int) and not isinstance(text, bool):
        if text < 1:
            raise ValueError(f"{what}: expected a positive size, got {text}")
        return text
    match = re.fullmatch(r"\s*(\d+(?:\.\d*)?|\.\d+)\s*([a-zA-Z]*)\s*", str(text))
    unit = match and match.group(2).lower()
    if not match or unit not in UNITS:
        raise ValueError(f"{what}: expected a size like 141GB (1e9 bytes), 80GiB (2**30 bytes) or 256G, got {text!r}")
    if UNITS[unit] is None:
        raise ValueError(f"{what}: size {text!r} has no unit: write {text}GB (1e9 bytes) or {text}GiB (2**30 bytes)")
    value = float(match.group(1)) * UNITS[unit]
    if value < 1:
        raise ValueError(f"{what}: expected a positive size, got {text!r}")
    return int(value)


def parse_max_memory(max_memory: Mapping[str | int | torch.device, int | str] | None) -> dict[str, int]:
    """{device: bytes} for device_map="auto"; without max_memory, 90% of every visible GPU's memory."""
    if max_memory is None:
        if not torch.cuda.is_available():
            raise ValueError("device_map='auto' needs max_memory={device: bytes} on a machine without GPUs")
        return {f"cuda:{i}": int(0.9 * torch.cuda.get_device_properties(i).total_memory) for i in range(torch.cuda.device_count())}
    if not isinstance(max_memory, Mapping) or not max_memory:
        raise ValueError(f"max_memory must be a non-empty mapping of device to bytes, got {max_memory!r}")
    return {str(_device(d, "max_memory")): parse_size(b, f"max_memory[{d!r}]") for d, b in max_memory.items()}


def device_of(placed: Mapping[str, torch.device], param_name: str) -> torch.device:
    """The device of a parameter or buffer named from the model's root (blocks.3.attn.q_proj.weight, ...)."""
    parts = param_name.split(".")
    return placed[".".join(parts[:2]) if parts[0] == "blocks" else parts[0]]
