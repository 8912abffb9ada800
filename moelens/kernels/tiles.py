"""Tile sizes for the expert GEMMs, chosen per token-count bucket from a small table; nothing autotunes.

Starting points follow the public defaults for fused-MoE kernels: small tiles for decode (few tokens per
expert), 128-wide tiles for prefill. An offline tuning run (benchmarks/tune_triton_tiles.py) writes a
table per GPU as JSON; point $MOELENS_TILE_TABLE at it to use it. Tables are written for 16-bit weights;
`Tile.for_dtype` shrinks a tile for float32 (see there).
"""

from __future__ import annotations

import json
import os
from dataclasses import asdict, dataclass, replace
from functools import cache
from pathlib import Path

import torch

MIN_TILE = 16  # tl.dot needs every tile dimension >= 16


@dataclass(frozen=True)
class Tile:
    block_m: int
    block_n: int
    block_k: int
    num_warps: int = 4
    num_stages: int = 3

    def __post_init__(self) -> None:
        if min(self.block_m, self.block_n, self.block_k) < MIN_TILE:
            raise ValueError(f"every tile dimension must be >= {MIN_TILE}, got {self}")

    def for_dtype(self, dtype: torch.dtype) -> Tile:
        """This tile for `dtype`. 4-byte elements halve block_n and block_k: at 16-bit sizes, float32 tiles
        ask for more shared memory than an A100 has (192 KiB for the prefill gate_up tile) and spill
        registers, as compiling them for sm_80/sm_90 shows (python -m moelens.kernels.aot)."""
        if dtype.itemsize <= 2:
            return self
        return replace(self, block_n=max(MIN_TILE, self.block_n // 2), block_k=max(MIN_TILE, self.block_k // 2))


    def for_storage(self, storage: str | None, scale_cols: tuple[int, ...] = (), dtype: torch.dtype | None = None) -> Tile:
        """This tile for experts kept stored as `storage`, whose weights' scale blocks span scale_cols columns
        (the GEMMs' inner dimension). fp8 weight tiles are decoded in registers, and compiled for sm_90
        (python -m moelens.kernels.aot --storage fp8):
        - the 4-warp 32x128x64 gate_up tile spilled (255 registers, 16 bytes) where 32x128x32 used 158 and
          none: 4-warp tiles of 32 rows or more halve block_k;
        - a tile whose columns cut scale blocks looks a scale up per element, and every such tile spilled
          (164 to 1040 bytes): block_k is halved (down to MIN_TILE) until it divides every block's columns,
          so that one scale per row serves the tile. Blocks no power of two >= MIN_TILE divides keep the
          tile (and the per-element lookup).
        mxfp4 tiles (e2m1 nibbles decoded with their exponent in registers, one exponent per 32 columns) follow
        the same rules, and their 4-warp tiles of 32 rows or more quarter block_k: the bfloat16 32x128x32
        gate_up tile spilled on sm_90 (255 registers, 296 bytes; gpt-oss's shape, biases, ClampedSwiGLU) where
        32x128x16 used 128 and none.
        For float32 (dtype; IEEE dots on CUDA cores) the 8-warp 128x64x32 tiles spilled on sm_90 (fp8: 1068 to
        1976 bytes; mxfp4: 1152 to 23440) and 64x64x32 fp8 down 24 bytes: 8-warp float32 tiles take at most 64
        rows and block_k 16 (64x64x16: 196 registers, no spill)."""
        if storage not in ("fp8", "mxfp4"):
            return self
        narrowed = self.num_warps == 4 and self.block_m >= 32
        block_k = self.block_k // (4 if storage == "mxfp4" else 2) if narrowed else self.block_k
        block_m = self.block_m
        if dtype is not None and dtype.itemsize == 4 and self.num_warps == 8:
            block_m, block_k = min(block_m, 64), min(block_k, MIN_TILE)
        block_k = max(MIN_TILE, block_k)
        while block_k > MIN_TILE and any(cols % block_k for cols in scale_cols):
            block_k //= 2
        return replace(self, block_m=max(MIN_TILE, block_m), block_k=block_k)


# (largest token count of the bucket, tile); None closes the table
DEFAULT_TABLE: tuple[tuple[int | None, Tile], ...] = (
    (16, Tile(16, 64, 64, num_warps=4, num_stages=3)),
    (64, Tile(16, 128, 64, num_warps=4, num_stages=3)),
    (256, Tile(32, 128, 64, num_warps=4, num_stages=3)),
    (1024, Tile(64, 128, 64, num_warps=8, num_stages=3)),
    (None, Tile(128, 128, 64, num_warps=8, num_stages=3)),
)


@cache
def active_table() -> tuple[tuple[int | None, Tile], ...]:
    """The table in use: a tuned one named by $MOELENS_TILE_TABLE (JSON), else the default."""
    path = os.environ.get("MOELENS_TILE_TABLE")
    return load_table(Path(path)) if path else DEFAULT_TABLE


def tile_for(n_tokens: int, table: tuple[tuple[int | None, Tile], ...] | None = None) -> Tile:
    for upper, tile in table or active_table():
        if upper is None or n_tokens <= upper:
            return tile
    raise ValueError(f"tile table does not cover {n_tokens} tokens: its last bucket must be open (None)")


def load_table(path: Path) -> tuple[tuple[int | None, Tile], ...]:
    """A tuned table: JSON list of {"max_tokens": int | null, "tile": {block_m, block_n, block_k, ...}}."""
    rows = json.loads(Path(path).read_text())
    return tuple((row["max_tokens"], Tile(**row["tile"])) for row in rows)


def dump_table(table: tuple[tuple[int | None, Tile], ...]) -> str:
    return json.dumps([{"max_tokens": upper, "tile": asdict(tile)} for upper, tile in table], indent=2)
