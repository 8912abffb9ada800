"""One routed expert's weights, read from the checkpoint's files when it is needed (expert_offload="disk"),
dequantized into the model's dtype (read) or as the files store them (read_stored, for experts kept stored).

Reads only that expert's bytes: a per-expert tensor whole, or row e of a fused [E, ...] tensor through a
safetensors slice (a quantized one with its scales, dequantized). Each read opens and closes its file, so no
mapped page of the checkpoint stays in the process between reads.

The files are read long after the model was loaded, so every read first checks that they are still the files
the load checked: each file's identity (size, modification time, inode) is recorded when the reader is made
and compared before and after each read, and each tensor's dtype and shape in the header it is read through
against those the load checked. A file that changed is a CheckpointError naming it, never an expert silently
broadcast or cast into its slot. The bytes themselves are not hashed: a rewrite that keeps the size, the
inode, the modification time and the header (e.g. one that restores the time) goes unseen.
"""

from __future__ import annotations

import os
from collections import defaultdict
from dataclasses import dataclass
from pathlib import Path

import torch
from safetensors import safe_open

from moelens.experts.stored import StoredPart
from moelens.loaders.checkpoint import Target
from moelens.loaders.errors import CheckpointError
from moelens.loaders.safetensors_files import SafetensorsFiles


def expert_param(target: Target, params: tuple[str, ...]) -> tuple[int, str] | None:
    """(layer, parameter name) when a key fills one of a routed expert stack's `params`, else None."""
    parts = target.param.split(".")  # blocks.L.mlp.experts.W_...
    if len(parts) == 5 and parts[2:4] == ["mlp", "experts"] and parts[4] in params:
        return int(parts[1]), parts[4]
    return None


@dataclass(frozen=True)
class FileIdentity:
    """What says a file is still the one that was checked, without reading it: one stat() call."""

    size: int
    mtime_ns: int
    inode: int
    device: int

    @classmethod
    def of(cls, path: Path) -> FileIdentity:
        try:
            st = os.stat(path)
        except OSError as err:
            raise CheckpointError(f"{path}: the offloaded experts are read from this file, which is gone ({err})") from err
        return cls(st.st_size, st.st_mtime_ns, st.st_ino, st.st_dev)

    def differences(self, now: FileIdentity) -> str:
        """'size 100 -> 50, mtime_ns ...': the fields that differ in `now`."""
        fields = ("size", "mtime_ns", "inode", "device")
        return ", ".join(f"{f} {getattr(self, f)} -> {getattr(now, f)}" for f in fields if getattr(self, f) != getattr(now, f))


class ExpertReader:
    def __init__(
        self, files: SafetensorsFiles, keys: dict[str, Target], shapes: dict[str, tuple[int, ...]], dtype: torch.dtype
    ) -> None:
        """shapes: the experts' stacked parameters' names and shapes [E, ...], in parameter order
        (ExpertSpec.shapes()), the same in every mixture layer. The files' identities are recorded here: make
        the reader right after the load has checked the files' headers."""
        self.files, self.shapes, self.dtype = files, shapes, dtype
        self.params = tuple(shapes)
        self.sources: dict[tuple[int, str], list[tuple[str, Target]]] = defaultdict(list)
        for key, target in keys.items():
            where = expert_param(target, self.params)
            if where is not None:
                self.sources[where].append((key, target))
        paths = {
            files.location[k] for sources in self.sources.values() for key, target in sources
            for k in (target.stored.keys if target.stored else (key,))
        }
        self.identity: dict[Path, FileIdentity] = {path: FileIdentity.of(path) for path in sorted(paths)}

    def check_unchanged(self, path: Path) -> None:
        """CheckpointError when `path` is not the file whose identity was recorded."""
        now = FileIdentity.of(path)
        if now != self.identity[path]:
            raise CheckpointError(
                f"{path} changed after the model was loaded ({self.identity[path].differences(now)}); the offloaded "
                "experts are read from it when routed to, and would no longer be the checkpoint the load checked. "
                "Load the model again (or use expert_offload='cpu', which reads the experts once)"
            )

    def read(self, layer: int, expert: int) -> tuple[torch.Tensor, ...]:
        """One expert's tensors (gate_up [2I, H], down [H, I], biases where the spec has them), in the model's
        dtype, on the CPU: a quantized checkpoint's dequantized from its stored tensors (row `expert` of each,
        where fused), then mapped from the stored layout."""
        out = {param: torch.empty(self.shapes[param][1:], dtype=self.dtype) for param in self.params}
        wanted = self._wanted(layer, expert)
        tensors = self._read(layer, expert, wanted)
        for key, param, target in wanted:
            if target.stored is None:
                tensor = tensors[key]
            else:
                tensor = target.stored.dequantize(tuple(tensors[k] for k in target.stored.keys), self.dtype)
            out[param][target.index[1:]].copy_(target.layout.load(tensor))
        return tuple(out[param] for param in self.params)

    def stored_parts(self, layer: int, expert: int = 0) -> tuple[StoredPart, ...]:
        """How one expert's stored tensors (read_stored) fill its parameters: a part per checkpoint tensor, in
        read_stored's order. The same for every expert of a layer."""
        return tuple(
            StoredPart(
                param, target.index[1:], None if target.stored is None else target.stored.format, target.layout,
                1 if target.stored is None else len(target.stored.keys),
            )
            for _, param, target in self._wanted(layer, expert)
        )

    def read_stored(self, layer: int, expert: int) -> tuple[torch.Tensor, ...]:
        """One expert's tensors as the files store them (fp8 codes and their scales, MXFP4 blocks and scales,
        a dense tensor in its stored dtype; row `expert` of each, where fused), on the CPU, flat in the order
        of stored_parts(layer): nothing dequantized, cast or re-laid out."""
        wanted = self._wanted(layer, expert)
        tensors = self._read(layer, expert, wanted)
        return tuple(tensors[k] for key, _, target in wanted for k in (target.stored.keys if target.stored else (key,)))

    def _wanted(self, layer: int, expert: int) -> list[tuple[str, str, Target]]:
        """(key, parameter, target) of every checkpoint tensor that holds part of the expert, in parameter order."""
        return [
            (key, param, target)
            for param in self.params
            for key, target in self.sources[layer, param]
            if target.index == () or target.index[0] == expert
        ]

    def _read(self, layer: int, expert: int, wanted: list[tuple[str, str, Target]]) -> dict[str, torch.Tensor]:
        """Every stored tensor of `wanted` (row `expert` of a fused stack's), by key, each file checked unchanged."""
        sliced: dict[str, bool] = {}  # every stored tensor to read -> whether it is a fused stack's (read row `expert`)
        for key, _, target in wanted:
            sliced.update({k: target.index == () for k in (target.stored.keys if target.stored else (key,))})
        by_file: dict = defaultdict(list)
        for key in sliced:
            by_file[self.files.location[key]].append(key)
        tensors: dict[str, torch.Tensor] = {}
        for path, keys in by_file.items():
            self.check_unchanged(path)
            try:
                with safe_open(path, framework="pt") as f:
                    for key in keys:
                        stored = f.get_slice(key)
                        self._check_header(path, key, stored.get_dtype(), tuple(stored.get_shape()))
                        tensors[key] = stored[expert] if sliced[key] else f.get_tensor(key)
            except CheckpointError:
                raise
            except Exception as err:  # safetensors' own error types: a truncated file, a key no longer there, ...
                raise CheckpointError(f"{path}: cannot read expert {expert} of layer {layer} from it ({err})") from err
            self.check_unchanged(path)  # not rewritten while it was being read
        return tensors

    def _check_header(self, path: Path, key: str, dtype: str, shape: tuple[int, ...]) -> None:
        loaded = self.files.dtypes[key], self.files.shapes[key]
        if (dtype, shape) != loaded:
            raise CheckpointError(
                f"{path}: tensor {key!r} is now {dtype} {list(shape)}, but was {loaded[0]} {list(loaded[1])} when the "
                "model was loaded; the file changed since. Load the model again"
            )
