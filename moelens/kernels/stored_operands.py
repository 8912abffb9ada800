"""Experts kept stored (fp8, MXFP4), described as the GEMM operands the Triton kernels read and dequantize in tiles.

An operand is one weight of every expert in a stack, in the parameter's orientation [E, rows, cols] (rows:
the GEMM's output features, cols: its inputs), as its format's tile_parts gives it:
- fp8 (moelens.loaders.quantized.Fp8Blocks): the float8_e4m3fn codes as bytes, one per element, and their
  block scales as float32 (bfloat16 / float16 scales widened, E8M0 exponents turned into their powers of two,
  exactly as the dequantization does); element (r, c) is code[r, c] * scale[r // block_rows, c // block_cols].
- mxfp4 (Mxfp4): two e2m1 codes per byte along the columns (column c in byte c // 2, low nibble first) and
  one E8M0 exponent byte per 32 columns of a row; element (r, c) is e2m1(nibble) * 2 ** (scale[r, c // 32] - 127).
Rows are stored rows: the parameter's row p is stored row row0 + p * row_step (the up rows of a fused gate_up
stack start at d_expert; gpt-oss's MXFP4 gate_up interleaves gate and up rows: gate rows 0, 2, ..., up rows
1, 3, ...).

Only views are made of the stored weights (no copy, no dequantization); the dense biases (gpt-oss's) are cast
to the model's dtype through their layout, as StoredExperts.dequantize does. A stored layout other than
as-stored, transposed (fp8 only: MXFP4 packs along the input axis) or row-interleaved, or another format, gives
None and the caller dequantizes with the load's function.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
from jaxtyping import Float, UInt8

from moelens.experts.stored import StoredExperts, StoredPart
from moelens.sitemap import InterleavedRows, Layout, Transposed

TILE_FORMATS = ("fp8", "mxfp4")  # the stored formats the kernels dequantize in their tiles


@dataclass(frozen=True)
class StoredOperand:
    method: str  # "fp8" or "mxfp4"
    codes: UInt8[torch.Tensor, "E code_rows code_cols"]  # fp8: one byte per element; mxfp4: two per byte
    scales: torch.Tensor  # fp8: float32 [E, row_blocks, col_blocks]; mxfp4: uint8 exponents [E, code_rows, groups]
    block: tuple[int, int]  # (rows, cols) one scale covers
    row0: int  # the parameter's row 0 within codes
    n_rows: int  # the parameter's rows: codes rows row0 + row_step * [0, n_rows)
    row_step: int = 1


@dataclass(frozen=True)
class StoredOperands:
    """The three operands of stored experts (gate rows and up rows of W_gate_up, W_down), their biases in the
    model's dtype (None without), and the stack they view (dequantized only where a backward needs the dense
    weights; None: no backward)."""

    gate: StoredOperand
    up: StoredOperand
    down: StoredOperand
    stored: StoredExperts | None
    gate_up_bias: Float[torch.Tensor, "E 2I"] | None = None
    down_bias: Float[torch.Tensor, "E H"] | None = None

    @property
    def n_experts(self) -> int:
        return self.gate.codes.shape[0]


def _oriented(part: StoredPart, tensors: tuple[torch.Tensor, ...]) -> tuple[torch.Tensor, torch.Tensor, tuple[int, int], int] | None:
    """(codes as bytes, scales, block, row step) in the parameter's orientation, or None for a layout the kernels
    do not read."""
    codes, scales, block = part.format.tile_parts(*tensors)
    if type(part.layout) is Layout:
        return codes, scales, block, 1
    if type(part.layout) is InterleavedRows and part.index == ():
        return codes, scales, block, 2
    if type(part.layout) is Transposed and part.format.method == "fp8":  # stored [in, out]: grids and block transposed
        return codes.transpose(-2, -1), scales.transpose(-2, -1), (block[1], block[0]), 1
    return None


def _first_row(part: StoredPart) -> int | None:
    """The parameter row the part's first stored row fills (None: an index the kernels do not read)."""
    if part.index == ():
        return 0
    if len(part.index) == 1 and isinstance(part.index[0], slice) and part.index[0].step in (None, 1):
        return part.index[0].start or 0
    return None


def _bias(stored: StoredExperts, param: str, dtype: torch.dtype) -> torch.Tensor | None:
    """A dense bias stack in dtype, written through its parts' layouts as StoredExperts.dequantize writes it."""
    if param not in stored.spec.param_names:
        return None
    out = torch.empty((stored.n_experts, *stored.spec.shapes()[param][1:]), dtype=dtype, device=stored.device)
    start = 0
    for part in stored.parts:
        if part.param == param:
            out[(slice(None), *part.index)] = part.layout.load(stored.tensors[start])
        start += part.n_tensors
    return out


def stored_operands(stored: StoredExperts, dtype: torch.dtype) -> StoredOperands | None:
    """The operands of experts stored in a format the tiles dequantize (biases in `dtype`), or None where the
    kernels cannot read them in tiles."""
    if stored.spec.storage not in TILE_FORMATS:
        return None
    d_expert = stored.spec.d_expert
    pieces: dict[str, list[tuple[int, int, StoredPart, torch.Tensor, torch.Tensor, tuple[int, int], int]]] = {"W_gate_up": [], "W_down": []}
    start = 0
    for part in stored.parts:
        tensors = stored.tensors[start : start + part.n_tensors]
        start += part.n_tensors
        if part.param not in pieces:
            if part.format is None and part.param in ("b_gate_up", "b_down"):
                continue  # dense biases: read by _bias
            return None
        if getattr(part.format, "method", None) not in TILE_FORMATS:
            return None
        first = _first_row(part)
        oriented = None if first is None else _oriented(part, tensors)
        if oriented is None:
            return None
        codes, scales, block, step = oriented
        pieces[part.param].append((first, first + codes.shape[1], part, codes, scales, block, step))

    def operand(param: str, row: int, n_rows: int) -> StoredOperand | None:
        for first, end, part, codes, scales, block, step in pieces[param]:
            if step == 2:  # rows interleaved: gate p at 2p, up p at 2p + 1 (param rows [0, 2 * d_expert))
                if first == 0 and end == 2 * n_rows and row in (0, n_rows):
                    return StoredOperand(part.format.method, codes, scales, block, row // n_rows, n_rows, 2)
            elif first <= row and row + n_rows <= end:
                return StoredOperand(part.format.method, codes, scales, block, row - first, n_rows)
        return None

    gate, up = operand("W_gate_up", 0, d_expert), operand("W_gate_up", d_expert, d_expert)
    down = operand("W_down", 0, stored.spec.d_model)
    if gate is None or up is None or down is None:
        return None
    return StoredOperands(gate, up, down, stored, _bias(stored, "b_gate_up", dtype), _bias(stored, "b_down", dtype))
