"""Experts kept stored as fp8, described as the GEMM operands the Triton kernels read and dequantize in tiles.

An operand is one weight of every expert in a stack, in the parameter's orientation [E, rows, cols] (rows:
the GEMM's output features, cols: its inputs): the float8_e4m3fn codes as bytes, their block scales as
float32 (bfloat16 / float16 scales widened, E8M0 exponents turned into their powers of two, exactly as the
dequantization does), the block's (rows, cols), and the parameter's first row within the codes (the up rows
of a fused gate_up stack start at d_expert). Element (r, c) of the parameter is code[row0 + r, c] times
scale[(row0 + r) // block_rows, c // block_cols]: the kernels index the scale per element, so any tile shape
works with any block, partial last blocks included.

Only views are made of the codes (no copy, no dequantization); a stored layout other than as-stored or
transposed, or a format other than fp8, gives None and the caller dequantizes with the load's function. The
format itself (its tile_parts: moelens.loaders.quantized.Fp8Blocks) says how its tensors are read.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
from jaxtyping import Float, UInt8

from moelens.experts.stored import StoredExperts, StoredPart
from moelens.sitemap import Layout, Transposed


@dataclass(frozen=True)
class Fp8Operand:
    codes: UInt8[torch.Tensor, "E code_rows cols"]  # float8_e4m3fn bits
    scales: Float[torch.Tensor, "E row_blocks col_blocks"]
    block: tuple[int, int]  # (rows, cols) one scale covers
    row0: int  # the parameter's row 0 within codes
    n_rows: int  # the parameter's rows: codes rows [row0, row0 + n_rows)


@dataclass(frozen=True)
class Fp8Experts:
    """The three operands of fp8-stored experts (gate rows and up rows of W_gate_up, W_down), and the stack
    they view (dequantized only where a backward needs the dense weights; None: no backward)."""

    gate: Fp8Operand
    up: Fp8Operand
    down: Fp8Operand
    stored: StoredExperts | None

    @property
    def n_experts(self) -> int:
        return self.gate.codes.shape[0]


def _oriented(part: StoredPart, tensors: tuple[torch.Tensor, ...]) -> tuple[torch.Tensor, torch.Tensor, tuple[int, int]] | None:
    """(codes as bytes, float32 scales, block) in the parameter's orientation, or None for a layout the
    kernels do not read."""
    codes, scales, block = part.format.tile_parts(*tensors)
    if type(part.layout) is Layout:
        return codes, scales, block
    if type(part.layout) is Transposed:  # stored [in, out]: both grids transposed, the block too
        return codes.transpose(-2, -1), scales.transpose(-2, -1), (block[1], block[0])
    return None


def _first_row(part: StoredPart) -> int | None:
    """The parameter row the part's first stored row fills (None: an index the kernels do not read)."""
    if part.index == ():
        return 0
    if len(part.index) == 1 and isinstance(part.index[0], slice) and part.index[0].step in (None, 1):
        return part.index[0].start or 0
    return None


def fp8_experts(stored: StoredExperts) -> Fp8Experts | None:
    """The operands of fp8-stored experts without biases, or None where the kernels cannot read them in tiles."""
    if stored.spec.storage != "fp8" or stored.spec.bias:
        return None
    d_expert = stored.spec.d_expert
    pieces: dict[str, list[tuple[int, int, torch.Tensor, torch.Tensor, tuple[int, int]]]] = {"W_gate_up": [], "W_down": []}
    start = 0
    for part in stored.parts:
        tensors = stored.tensors[start : start + part.n_tensors]
        start += part.n_tensors
        if getattr(part.format, "method", None) != "fp8" or part.param not in pieces:
            return None
        first = _first_row(part)
        oriented = None if first is None else _oriented(part, tensors)
        if oriented is None:
            return None
        codes, scales, block = oriented
        pieces[part.param].append((first, first + codes.shape[1], codes, scales, block))

    def operand(param: str, row: int, n_rows: int) -> Fp8Operand | None:
        for first, end, codes, scales, block in pieces[param]:
            if first <= row and row + n_rows <= end:
                return Fp8Operand(codes, scales, block, row - first, n_rows)
        return None

    gate, up = operand("W_gate_up", 0, d_expert), operand("W_gate_up", d_expert, d_expert)
    down = operand("W_down", 0, stored.spec.d_model)
    if gate is None or up is None or down is None:
        return None
    return Fp8Experts(gate, up, down, stored)
