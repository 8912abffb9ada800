"""One routed expert's weights, read from the checkpoint's files when it is needed (expert_offload="disk"),
dequantized into the model's dtype (read) or as the files store them (read_stored, for experts kept stored).

Reads only that expert's bytes: a per-expert tensor whole, or row e of a fused [E, ...] tensor (a quantized
one with its scales, dequantized). read_into, what offload's cache loads through, reads them with pread
straight into the caller's tensors (the cache's slots) where the stored bytes are the slot's (same dtype,
stored as laid out, contiguous), else into a buffer mapped from; it keeps each file open (a descriptor, no
mapping: no page of the checkpoint stays in the process between reads) and each header parsed, from the
first read. read / read_stored go through safetensors' own reader, opening the file each time.

The files are read long after the model was loaded, so every read first checks that they are still the files
the load checked: each file's identity (size, modification time, inode) is recorded when the reader is made
and compared before and after each read (read_into: the path's before, the open descriptor's after, which
is the path's file when it was opened), and each
tensor's dtype and shape in the header it is read through against those the load checked (read_into: the
header's bytes of each tensor it reads, and the header's length, against those it parsed; any difference
sends the read through safetensors' reader, whose checks name the change). A file that changed is a
CheckpointError naming it, never an expert silently broadcast or cast into its slot. The bytes themselves are
not hashed: a rewrite that keeps the size, the inode, the modification time and the header (e.g. one that
restores the time) goes unseen.
"""

from __future__ import annotations

import ctypes
import json
import os
import struct
import threading
import weakref
from collections import defaultdict
from dataclasses import dataclass
from pathlib import Path

import torch
from safetensors import safe_open

from moelens.experts.stored import StoredPart
from moelens.loaders.checkpoint import SplitTarget, Target, Targets
from moelens.loaders.errors import CheckpointError
from moelens.loaders.safetensors_files import SafetensorsFiles
from moelens.sitemap import AS_STORED


def expert_param(target: Targets, params: tuple[str, ...]) -> tuple[int, str] | None:
    """(layer, parameter name) when a key fills one of a routed expert stack's `params`, else None. A key split
    into several parameters (experts stored flat) is refused: its experts cannot be read one at a time."""
    if isinstance(target, SplitTarget):
        for part in target.parts:
            if expert_param(part, params) is not None:
                raise CheckpointError(
                    f"the routed experts' {part.param.rsplit('.', 1)[-1]} is stored flat, all experts in one tensor "
                    f"read into {', '.join(target.params)}, which is not read one expert at a time: load without "
                    "expert_offload, expert_parallel or expert_storage"
                )
        return None
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
    def of(cls, path: Path, fd: int | None = None) -> FileIdentity:
        """The file at path, or (fd) the one open there."""
        try:
            st = os.stat(path) if fd is None else os.fstat(fd)
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
        self.params_of: dict[str, str] = {}  # key -> the parameter it fills
        for key, target in keys.items():
            where = expert_param(target, self.params)
            if where is not None:
                self.sources[where].append((key, target))
                self.params_of[key] = where[1]
        self.expert_keys = {  # every stored tensor an expert is read from
            k for sources in self.sources.values() for key, target in sources
            for k in (target.stored.keys if target.stored else (key,))
        }
        paths = {files.location[k] for k in self.expert_keys}
        self.identity: dict[Path, FileIdentity] = {path: FileIdentity.of(path) for path in sorted(paths)}
        self._open: dict[Path, OpenFile] = {}  # read_into's files, opened and parsed at their first read
        self._plans: dict[tuple[int, int, bool], list] = {}  # read_into's byte ranges per (layer, expert, stored)
        self._open_lock = threading.RLock()


    def read_into(self, layer: int, expert: int, out: tuple[torch.Tensor, ...], stored: bool = False) -> None:
        """Write one expert into `out` (contiguous CPU tensors): read's tensors (stored=False) or
        read_stored's (True), the same values, checked as the module says, without safetensors' per-read open
        and header parse: the expert's byte ranges read in file order, contiguous ones in one preadv."""
        plan = self._plans.get((layer, expert, stored))
        if plan is None:
            plan = self._plans[layer, expert, stored] = self._plan(layer, expert, stored)
        if not plan:  # a tensor whose header entry is not spelt as parsed: safetensors' reader
            self._read_into_slowly(layer, expert, out, stored)
            return
        read: dict[str, torch.Tensor] = {}  # tensors read into buffers, mapped or dequantized below
        for f, span, pieces in plan:
            self.check_unchanged(f.path)  # the path: in place or renamed over (the descriptor was checked at open)
            if not f.header_unchanged(span):
                # changed in place: safetensors' reader and _check_header name how; parsed again next time
                with self._open_lock:
                    if self._open.get(f.path) is f:
                        del self._open[f.path]
                    self._plans.clear()
                self._read_into_slowly(layer, expert, out, stored)
                return
            runs: list[tuple[int, list[memoryview]]] = []
            end = -1
            for piece in pieces:
                into = out[piece.position][piece.index]
                if not (piece.direct and into.is_contiguous() and into.dtype == piece.dtype and tuple(into.shape) == piece.shape):
                    into = read[piece.stored_key] = torch.empty(piece.shape, dtype=piece.dtype)
                if piece.offset == end:
                    runs[-1][1].append(bytes_of(into))
                else:
                    runs.append((piece.offset, [bytes_of(into)]))
                end = piece.offset + piece.length
            for offset, buffers in runs:
                f.preadv_all(buffers, offset)
            self.check_unchanged(f.path, f.fd)  # not rewritten while it was being read (what it read is the descriptor's)
        if read:
            self._map_into(layer, expert, out, stored, read)

    def _map_into(self, layer: int, expert: int, out, stored: bool, read: dict[str, torch.Tensor]) -> None:
        """The tensors read into buffers (not straight into out) into out: copied, or (dense) dequantized and
        mapped from the stored layout, as read() does."""
        if stored:
            keys = [k for key, _, target in self._wanted(layer, expert) for k in (target.stored.keys if target.stored else (key,))]
            for into, k in zip(out, keys, strict=True):
                if k in read:
                    if tuple(into.shape) != tuple(read[k].shape) or into.dtype != read[k].dtype:
                        raise CheckpointError(
                            f"{self.files.location[k]}: tensor {k!r} is {read[k].dtype} {list(read[k].shape)} per expert, "
                            f"its slot {into.dtype} {list(into.shape)}"
                        )
                    into.copy_(read[k])
            return
        params = dict(zip(self.params, out))
        for key, param, target in self._wanted(layer, expert):
            into = params[param][target.index[1:]]
            if target.stored is not None:
                into.copy_(target.layout.load(target.stored.dequantize(tuple(read[k] for k in target.stored.keys), self.dtype)))
            elif key in read:
                tensor = target.layout.load(read[key])
                if tuple(tensor.shape) != tuple(into.shape):
                    raise CheckpointError(
                        f"{self.files.location[key]}: tensor {key!r} maps to {list(tensor.shape)}, its place holds {list(into.shape)}"
                    )
                into.copy_(tensor)

    def _plan(self, layer: int, expert: int, stored: bool) -> list[tuple[OpenFile, tuple[int, int], list[Piece]]]:
        """Per file: (the open file, the span of the header holding the expert's tensors' entries, its pieces
        in file order); [] where an entry is not as parsed."""
        pieces: dict[Path, list[Piece]] = defaultdict(list)
        position = 0
        for key, param, target in self._wanted(layer, expert):
            for k in target.stored.keys if target.stored else (key,):
                path = self.files.location[k]
                f = self._file(path)
                entry = f.entries.get(k)
                if entry is None:
                    return []
                shape, offset, length = f.row(k, expert if target.index == () else None)  # a fused stack: its row
                if stored:
                    where, index, direct = position, (), True
                else:
                    where, index = self.params.index(param), target.index[1:]
                    direct = target.stored is None and target.layout is AS_STORED
                pieces[path].append(Piece(k, where, index, direct, entry.dtype, shape, offset, length, entry))
                position += 1
        plan = []
        for path, ps in pieces.items():
            f = self._file(path)
            span = min(p.entry.entry_at for p in ps), max(p.entry.entry_at + len(p.entry.entry) for p in ps)
            plan.append((f, span, sorted(ps, key=lambda p: p.offset)))
        return plan

    def _read_into_slowly(self, layer: int, expert: int, out: tuple[torch.Tensor, ...], stored: bool) -> None:
        tensors = self.read_stored(layer, expert) if stored else self.read(layer, expert)
        for into, t in zip(out, tensors, strict=True):
            if tuple(into.shape) != tuple(t.shape) or into.dtype != t.dtype:
                raise CheckpointError(f"layer {layer} expert {expert}: read a {t.dtype} {list(t.shape)} for a {into.dtype} {list(into.shape)}")
            into.copy_(t)

    def _file(self, path: Path) -> OpenFile:
        with self._open_lock:
            if path not in self._open:
                f = OpenFile.open(path, self)
                self.check_unchanged(path, f.fd)  # the file the load checked, opened after it
                self._open[path] = f
            return self._open[path]

    def check_unchanged(self, path: Path, fd: int | None = None) -> None:
        """CheckpointError when `path` (or the file open as fd) is not the file whose identity was recorded."""
        now = FileIdentity.of(path, fd)
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

    def pieces_of(self, layer: int, expert: int) -> list[tuple[str, str, Target]]:
        """(key, parameter, target) of every checkpoint tensor that holds part of the expert, in parameter order:
        target.index[1:] is the part of read()'s parameter tensor the key fills."""
        return self._wanted(layer, expert)

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


# safetensors' dtype names -> torch dtypes, for the tensors an expert may be stored in
TORCH_DTYPES = {
    "F64": torch.float64, "F32": torch.float32, "F16": torch.float16, "BF16": torch.bfloat16,
    "F8_E4M3": torch.float8_e4m3fn, "F8_E5M2": torch.float8_e5m2, "F8_E8M0": torch.float8_e8m0fnu,
    "I64": torch.int64, "I32": torch.int32, "I16": torch.int16, "I8": torch.int8, "U8": torch.uint8, "BOOL": torch.bool,
}


@dataclass(frozen=True)
class HeaderEntry:
    """One tensor of a safetensors file: where its bytes lie, and its entry's bytes in the JSON header."""

    dtype: torch.dtype
    shape: tuple[int, ...]
    start: int  # absolute file offset of its data
    end: int
    entry: bytes  # '"key":{...}' as the header spells it
    entry_at: int  # its offset in the file


def bytes_of(t: torch.Tensor) -> memoryview:
    """A writable view of a contiguous CPU tensor's bytes (any dtype)."""
    return memoryview((ctypes.c_char * t.nbytes).from_address(t.data_ptr())) if t.nbytes else memoryview(bytearray())


@dataclass(frozen=True)
class Piece:
    """One stored tensor (or a fused stack's row) of an expert: where it goes in read_into's out (out[position]
    [index]; straight there when direct and the tensor there matches), and where its bytes lie."""

    stored_key: str
    position: int
    index: tuple
    direct: bool
    dtype: torch.dtype
    shape: tuple[int, ...]
    offset: int
    length: int
    entry: HeaderEntry


class OpenFile:
    """A checkpoint file open for preads (closed when dropped), its header parsed once and checked against
    the load's."""

    def __init__(self, path: Path, fd: int, prefix: bytes, raw: bytes, entries: dict[str, HeaderEntry]) -> None:
        self.path, self.fd, self.prefix, self.raw, self.entries = path, fd, prefix, raw, entries
        # closed when dropped, and at interpreter exit while module globals still exist (a __del__ can run after)
        weakref.finalize(self, os.close, fd)

    @classmethod
    def open(cls, path: Path, reader: ExpertReader) -> OpenFile:
        try:
            fd = os.open(path, os.O_RDONLY)
        except OSError as err:
            raise CheckpointError(f"{path}: the offloaded experts are read from this file, which is gone ({err})") from err
        try:
            prefix = os.pread(fd, 8, 0)
            (n,) = struct.unpack("<Q", prefix) if len(prefix) == 8 else (0,)
            raw = os.pread(fd, n, 8)
            if len(raw) != n or n == 0:
                raise CheckpointError(f"{path}: truncated safetensors header (read {len(raw)} of {n} bytes)")
            header = json.loads(raw)
            entries = {}
            for key, info in header.items():
                if key not in reader.expert_keys or reader.files.location.get(key) != path:
                    continue
                dtype, shape = info["dtype"], tuple(info["shape"])
                reader._check_header(path, key, dtype, shape)
                spelled = json.dumps(key, ensure_ascii=False).encode() + b":"
                at = raw.find(spelled)
                end = raw.find(b"}", at) + 1
                if at < 0 or json.loads(raw[at + len(spelled) : end]) != info or dtype not in TORCH_DTYPES:
                    continue  # not found as expected: this key is read through safetensors' reader
                start, stop = info["data_offsets"]
                entries[key] = HeaderEntry(TORCH_DTYPES[dtype], shape, 8 + n + start, 8 + n + stop, raw[at:end], 8 + at)
        except BaseException as err:
            os.close(fd)
            if isinstance(err, CheckpointError) or not isinstance(err, Exception):
                raise
            raise CheckpointError(f"{path}: unreadable safetensors header ({err})") from err
        return cls(path, fd, prefix, raw, entries)

    def header_unchanged(self, span: tuple[int, int]) -> bool:
        """Whether the header's length and its bytes in span (file offsets) still read as parsed."""
        start, end = span
        return os.pread(self.fd, 8, 0) == self.prefix and os.pread(self.fd, end - start, start) == self.raw[start - 8 : end - 8]

    def row(self, key: str, row: int | None) -> tuple[tuple[int, ...], int, int]:
        """(shape, file offset, bytes) of the tensor, or of its row `row` (a fused stack's expert)."""
        entry = self.entries[key]
        if row is None:
            return entry.shape, entry.start, entry.end - entry.start
        each = (entry.end - entry.start) // entry.shape[0]
        return entry.shape[1:], entry.start + row * each, each

    def preadv_all(self, buffers: list[memoryview], offset: int) -> None:
        """Fill the buffers from the file's consecutive bytes at offset."""
        total = sum(len(b) for b in buffers)
        done = os.preadv(self.fd, buffers, offset)
        while done < total:  # a short read (rare): go on from where it stopped
            skip, rest = done, []
            for b in buffers:
                if skip >= len(b):
                    skip -= len(b)
                    continue
                rest.append(b[skip:])
                skip = 0
            got = os.preadv(self.fd, rest, offset + done)
            if got <= 0:
                raise CheckpointError(f"{self.path}: ends before the expert's bytes (read {done} of {total} at offset {offset})")
            done += got
