"""Parquet parts of a trace: the schema, rows from one batch's routing, and crash-safe part files.

A part is written under a temporary name, fsynced and renamed into place only when complete, so a part
file that exists is whole; its size and sha256 go into the manifest with it. Row groups are flushed as they fill: memory stays bounded whatever a part holds.
"""

from __future__ import annotations

import os
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import pyarrow as pa
import pyarrow.parquet as pq

from moelens.traces.manifest import TEMP_SUFFIX, file_sha256, fsync_dir

ROW_GROUP_ROWS = 1 << 20


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

    def __init__(self, final: Path, schema: pa.Schema, row_group_rows: int = ROW_GROUP_ROWS) -> None:
        self.final = final
        self.temp = final.with_name(final.name + TEMP_SUFFIX)
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
