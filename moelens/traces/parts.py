"""Parquet parts of a trace: the schema, rows from one batch's routing, crash-safe part files, and the
checks that a part file is the part its manifest records.

A part is written under a temporary name, fsynced and renamed into place only when complete, so a part
file that exists is whole; its size and sha256 go into the manifest with it. Row groups are flushed as they fill: memory stays bounded whatever a part holds.

A part also carries, in its Parquet footer (key PART_KEY), what it is: the trace's model identity, its
index, windows, tokens, rows, layers and the hash of its token windows. A reader compares that with the
manifest from the footer alone (part_footer_problem); a re-run also recomputes the layers and the token
windows' hash from the rows (part_rows_problem). So a part copied in from another trace (another model or
other data) is refused even where the manifest's size and sha256 were edited to match it.
"""

from __future__ import annotations

import os
import hashlib
import json
from collections.abc import Iterable
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import pyarrow as pa
import pyarrow.parquet as pq

from moelens.traces.manifest import TEMP_SUFFIX, file_sha256, fsync_dir, sha256_json

ROW_GROUP_ROWS = 1 << 20
PART_KEY = b"moelens.trace.part"  # the footer's key-value metadata: what the part is (part_identity)


def schema(router_logits: bool) -> pa.Schema:
    fields = [
        pa.field("doc", pa.int64(), nullable=False),  # document index in the data, from 0
        pa.field("start", pa.int64(), nullable=False),  # the window's first token index in the document
        pa.field("pos", pa.int32(), nullable=False),  # position in the window
        pa.field("token", pa.int32(), nullable=False),
        pa.field("layer", pa.int16(), nullable=False),  # block index of the mixture layer
        pa.field("experts", pa.list_(pa.int16()), nullable=False),  # routed experts, in slot order
        pa.field("weights", pa.list_(pa.float32()), nullable=False),  # their weights, same order
    ]
    if router_logits:
        fields.append(pa.field("router_logits", pa.list_(pa.float32()), nullable=False))  # [n_experts]
    return pa.schema(fields)


def _lists(values: np.ndarray, value_type: pa.DataType) -> pa.ListArray:
    """[n, k] numpy -> list array of n rows of k values."""
    n, k = values.shape
    offsets = pa.array(np.arange(0, (n + 1) * k, k, dtype=np.int32))
    return pa.ListArray.from_arrays(offsets, pa.array(values.reshape(-1), type=value_type))


def batch_rows(
    schema: pa.Schema,
    docs: np.ndarray,
    starts: np.ndarray,
    positions: np.ndarray,
    tokens: np.ndarray,
    routing: list[tuple[int, np.ndarray, np.ndarray, np.ndarray | None]],
) -> pa.Table:
    """Rows of one batch, layer by layer: the real tokens (docs/starts/positions/tokens, each [n]) times
    each (layer, experts [n k], weights [n k], router_logits [n E] or None)."""
    n = len(tokens)
    columns: dict[str, list] = {name: [] for name in schema.names}
    for layer, experts, weights, logits in routing:
        columns["doc"].append(pa.array(docs, pa.int64()))
        columns["start"].append(pa.array(starts, pa.int64()))
        columns["pos"].append(pa.array(positions, pa.int32()))
        columns["token"].append(pa.array(tokens, pa.int32()))
        columns["layer"].append(pa.array(np.full(n, layer, dtype=np.int16)))
        columns["experts"].append(_lists(experts.astype(np.int16, copy=False), pa.int16()))
        columns["weights"].append(_lists(weights.astype(np.float32, copy=False), pa.float32()))
        if "router_logits" in columns:
            columns["router_logits"].append(_lists(logits.astype(np.float32, copy=False), pa.float32()))
    arrays = [pa.chunked_array(columns[f.name], f.type) for f in schema]
    return pa.Table.from_arrays(arrays, schema=schema)


class PartWriter:
    """Writes one part to ``final``'s temporary name; commit() makes it appear whole under ``final``."""

    def __init__(self, final: Path, schema: pa.Schema, row_group_rows: int = ROW_GROUP_ROWS, identity: dict | None = None) -> None:
        self.final = final
        self.temp = final.with_name(final.name + TEMP_SUFFIX)
        if identity is not None:  # what the part is, in its footer (see part_identity)
            schema = schema.with_metadata({PART_KEY: json.dumps(identity, sort_keys=True).encode()})
        self.schema = schema
        self.row_group_rows = row_group_rows
        self.pending: list[pa.Table] = []
        self.pending_rows = 0
        self.rows = 0
        self.writer = pq.ParquetWriter(self.temp, schema, compression="zstd")

    def add(self, table: pa.Table) -> None:
        self.pending.append(table)
        self.pending_rows += table.num_rows
        if self.pending_rows >= self.row_group_rows:
            self._flush()

    def _flush(self) -> None:
        if self.pending_rows:
            self.writer.write_table(pa.concat_tables(self.pending), row_group_size=self.row_group_rows)
            self.rows += self.pending_rows
        self.pending, self.pending_rows = [], 0

    def commit(self) -> Committed:
        """Finish the file, make it durable and rename it into place; returns its rows, size and sha256."""
        self._flush()
        self.writer.close()
        with open(self.temp, "rb+") as fh:
            os.fsync(fh.fileno())
        committed = Committed(self.rows, self.temp.stat().st_size, file_sha256(self.temp))
        os.replace(self.temp, self.final)
        fsync_dir(self.final.parent)
        return committed


@dataclass(frozen=True)
class Committed:
    """A part as written: what the manifest records of it, so that a re-run or a reader can check it."""

    rows: int
    size: int  # bytes
    sha256: str


# ---- what a part is, and the checks that a file is the part the manifest records ------------------------------


def windows_sha256(windows: Iterable[tuple[int, int, np.ndarray]]) -> str:
    """The identity of a part's token windows, each (doc, start, token ids): recorded in the manifest as the
    part's data_sha256, compared when a resumed run passes over a recorded part or a part file is checked."""
    digest = hashlib.sha256()
    for doc, start, tokens in windows:
        digest.update(np.array([doc, start, len(tokens)], dtype=np.int64).tobytes())
        digest.update(np.asarray(tokens).astype(np.int64, copy=False).tobytes())
    return digest.hexdigest()


def part_identity(manifest: dict, index: int, record: dict) -> dict:
    """What part ``index`` of the trace ``manifest`` describes is, as its footer states it."""
    return {
        "model": sha256_json(manifest["model"]), "part": index, "layers": list(manifest["layers"]),
        "router_logits": bool(manifest["settings"]["router_logits"]),
        **{key: record[key] for key in ("first_window", "windows", "tokens", "rows", "data_sha256")},
    }


def part_footer_problem(path: Path, manifest: dict, index: int) -> str | None:
    """What makes the file at path another part than the manifest's part ``index``, from its footer alone
    (schema, row count, the identity the writer put there), or None. A part without that identity (written
    by an earlier moelens) is checked by its rows (part_rows_problem)."""
    record = manifest["parts"][str(index)]
    try:
        meta = pq.read_metadata(path)
    except Exception as err:  # pyarrow raises its own errors on a file that is not Parquet
        return f"{path.name} is damaged: not a Parquet file ({err})"
    expected = schema(bool(manifest["settings"]["router_logits"]))
    found = meta.schema.to_arrow_schema()
    if not found.equals(expected, check_metadata=False):
        return f"{path.name} has other columns than this trace's ({_columns(found)}; expected {_columns(expected)}): it is not a part of this trace"
    if meta.num_rows != record["rows"]:
        return f"{path.name} holds {meta.num_rows} rows, the manifest records {record['rows']}: it is not this trace's part {index}"
    stated = (found.metadata or {}).get(PART_KEY)
    if stated is None:
        return part_rows_problem(path, manifest, index)
    try:
        identity = json.loads(stated)
    except ValueError:
        return f"{path.name}: its footer's {PART_KEY.decode()} is not JSON: the part is damaged"
    wanted = part_identity(manifest, index, record)
    differ = [key for key in sorted(set(identity) | set(wanted)) if identity.get(key) != wanted.get(key)]
    if differ:
        return f"{path.name} is not this trace's part {index} (its {', '.join(differ)} differ: copied from another trace?)"
    return None


def part_rows_problem(path: Path, manifest: dict, index: int) -> str | None:
    """What makes the rows of the file at path other rows than the manifest's part ``index`` describes, or
    None: every recorded layer exactly once per token (and no other layer), each layer's rows on the same
    tokens in the same order, positions counting up from 0 in each window, and the hash of its token windows
    equal to the recorded data_sha256. Reads the columns doc, start, pos, token and layer."""
    record = manifest["parts"][str(index)]
    layers = list(manifest["layers"])
    table = pq.read_table(path, columns=["doc", "start", "pos", "token", "layer"])
    layer = table["layer"].to_numpy()
    found, counts = np.unique(layer, return_counts=True)
    if found.tolist() != sorted(layers) or not (counts == record["tokens"]).all():
        shown = ", ".join(f"{int(f)}: {int(c)}" for f, c in zip(found[:8], counts[:8]))
        return (f"{path.name} holds rows of layers {{{shown}}}, the manifest records layers {layers} with {record['tokens']} "
                f"tokens each: it is not this trace's part {index}")
    columns = {name: table[name].to_numpy() for name in ("doc", "start", "pos", "token")}
    first = {name: values[layer == layers[0]] for name, values in columns.items()}
    for other in layers[1:]:
        if not all(np.array_equal(values[layer == other], first[name]) for name, values in columns.items()):
            return f"{path.name}: the rows of layer {other} are on other tokens than those of layer {layers[0]}: the part is damaged"
    pos = first["pos"]
    starts = np.flatnonzero(pos == 0)
    if len(pos) and (not len(starts) or starts[0] != 0):
        return f"{path.name}: its first row is not a window's first token: the part is damaged"
    bounds = np.append(starts, len(pos))
    lengths = np.diff(bounds)
    if not np.array_equal(pos, np.arange(len(pos)) - np.repeat(starts, lengths)):
        return f"{path.name}: positions do not count up from 0 in each window: the part is damaged"
    digest = windows_sha256(
        (int(first["doc"][a]), int(first["start"][a]), first["token"][a:b]) for a, b in zip(bounds[:-1], bounds[1:])
    )
    if len(starts) != record["windows"] or digest != record["data_sha256"]:
        return f"{path.name} holds other token windows than the manifest records for part {index}: it is not this trace's part"
    return None


def _columns(s: pa.Schema) -> str:
    return ", ".join(f"{f.name} {f.type}" for f in s)
