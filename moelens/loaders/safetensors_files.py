"""The safetensors files of a checkpoint: which key lives in which file, its shape, and lazy reads."""

from __future__ import annotations

import math
from collections.abc import Iterator
from contextlib import ExitStack
from pathlib import Path

import torch
from safetensors import safe_open

from moelens.loaders.errors import CheckpointError
from moelens.loaders.files import brief, checkpoint_file, read_json_object

INDEX_FILE = "model.safetensors.index.json"
PICKLE_SUFFIXES = (".bin", ".pt", ".pth", ".ckpt")
# safetensors maps a file; every page read stays resident until the file is closed. Reopening it every
# READ_CHUNK_BYTES keeps the load's peak near the model's own size instead of model + file.
READ_CHUNK_BYTES = 16 * 2**20
ITEMSIZE = {"F64": 8, "I64": 8, "U64": 8, "F32": 4, "I32": 4, "U32": 4, "F16": 2, "BF16": 2, "I16": 2, "U16": 2}


class SafetensorsFiles:
    """Reads only headers when built; tensors are read one at a time, file by file."""

    def __init__(self, folder: Path) -> None:
        self.folder = folder
        self.files = self._find_files()
        self.location: dict[str, Path] = {}
        self.shapes: dict[str, tuple[int, ...]] = {}
        self.nbytes: dict[str, int] = {}
        self.dtypes: dict[str, str] = {}  # safetensors' names: F32, BF16, I64, F8_E4M3, ...
        for path in self.files:
            for key, (shape, dtype) in self._read_header(path).items():
                if key in self.location:
                    raise CheckpointError(f"tensor {key!r} appears in both {self.location[key].name} and {path.name}")
                self.location[key], self.shapes[key], self.dtypes[key] = path, shape, dtype
                self.nbytes[key] = math.prod(shape) * ITEMSIZE.get(dtype, 1)
        self._check_index()

    def _find_files(self) -> list[Path]:
        index = checkpoint_file(self.folder, INDEX_FILE)
        if index is not None:
            weight_map = read_json_object(index).get("weight_map")
            if not isinstance(weight_map, dict):
                raise CheckpointError(
                    f"{index}: not a valid safetensors index (needs a 'weight_map' object of tensor name -> file "
                    f"name, got {brief(weight_map)})"
                )
            bad = next(((k, v) for k, v in weight_map.items() if not isinstance(v, str)), None)
            if bad is not None:  # JSON object keys are always strings
                raise CheckpointError(
                    f"{index}: weight_map must map tensor names to file names (strings), but maps {bad[0]!r} to "
                    f"{brief(bad[1])}"
                )
            names = sorted(set(weight_map.values()))
            paths = {n: checkpoint_file(self.folder, n, listed_in=index) for n in names}
            missing = [n for n, path in paths.items() if path is None]
            if missing:
                raise CheckpointError(f"{index} lists files that are not in {self.folder}: {missing}")
            self._index = weight_map
            return list(paths.values())
        self._index = None
        files = [checkpoint_file(self.folder, p.name) for p in sorted(self.folder.glob("*.safetensors"))]
        if not files:
            pickles = sorted(p.name for p in self.folder.iterdir() if p.suffix in PICKLE_SUFFIXES)
            if pickles:
                raise CheckpointError(
                    f"{self.folder} has only pickle weights ({', '.join(pickles)}); moelens reads safetensors "
                    "and never loads pickle files. Convert the checkpoint to safetensors first."
                )
            raise CheckpointError(f"no *.safetensors files in {self.folder}")
        return files

    @staticmethod
    def _read_header(path: Path) -> dict[str, tuple[tuple[int, ...], str]]:
        try:
            with safe_open(path, framework="pt") as f:
                return {key: (tuple(f.get_slice(key).get_shape()), f.get_slice(key).get_dtype()) for key in f.keys()}
        except Exception as err:  # safetensors raises its own error types for bad headers and short files
            raise CheckpointError(f"{path}: unreadable or truncated safetensors file ({err})") from err

    def _check_index(self) -> None:
        if self._index is None:
            return
        for key, file in self._index.items():
            if self.location.get(key) is None or self.location[key].name != file:
                actual = f"it is in {self.location[key].name}" if key in self.location else "no listed file holds it"
                raise CheckpointError(
                    f"{self.folder / INDEX_FILE} places tensor {key!r} in {file}, but that file does not hold it "
                    f"({actual})"
                )

    def __contains__(self, key: str) -> bool:
        return key in self.location

    def keys(self) -> list[str]:
        return list(self.location)

    def read(self, keys: list[str]) -> Iterator[tuple[str, torch.Tensor]]:
        """Yield (key, tensor) for these keys, file by file, reopening a file every READ_CHUNK_BYTES."""
        chunks: list[tuple[Path, list[str]]] = []
        size = 0
        for key in sorted(keys, key=lambda k: str(self.location[k])):
            path = self.location[key]
            if not chunks or chunks[-1][0] != path or size >= READ_CHUNK_BYTES:
                chunks.append((path, []))
                size = 0
            chunks[-1][1].append(key)
            size += self.nbytes[key]
        for path, chunk in chunks:
            try:
                with safe_open(path, framework="pt") as f:
                    for key in chunk:
                        yield key, f.get_tensor(key)
            except CheckpointError:
                raise
            except Exception as err:
                raise CheckpointError(f"{path}: cannot read its tensors ({err})") from err

    def read_groups(self, groups: list[tuple[str, ...]]) -> Iterator[tuple[tuple[str, ...], tuple[torch.Tensor, ...]]]:
        """Yield (group, its tensors) with a group's tensors together (a quantized weight and its scale, which
        may sit in different files): groups in the order of their first key's file, every file a chunk of
        READ_CHUNK_BYTES touches opened for that chunk and closed after it."""
        ordered = sorted(groups, key=lambda g: str(self.location[g[0]]))
        chunks: list[list[tuple[str, ...]]] = []
        size = 0
        for group in ordered:
            if not chunks or self.location[chunks[-1][0][0]] != self.location[group[0]] or size >= READ_CHUNK_BYTES:
                chunks.append([])
                size = 0
            chunks[-1].append(group)
            size += sum(self.nbytes[k] for k in group)
        for chunk in chunks:
            paths = sorted({self.location[k] for group in chunk for k in group}, key=str)
            try:
                with ExitStack() as stack:
                    handles = {path: stack.enter_context(safe_open(path, framework="pt")) for path in paths}
                    for group in chunk:
                        yield group, tuple(handles[self.location[k]].get_tensor(k) for k in group)
            except CheckpointError:
                raise
            except Exception as err:
                raise CheckpointError(f"{', '.join(str(p) for p in paths)}: cannot read their tensors ({err})") from err
