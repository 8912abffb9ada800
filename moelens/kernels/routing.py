"""Routing metadata for grouped expert GEMMs: token-slots sorted by expert, padded per expert to the block size.

Everything is computed with device ops from `indices` alone, with fixed-size outputs (upper bounds), so no
host synchronisation is needed and a launch can be captured in a CUDA graph. Kernels skip padding rows
(slot id == n_slots) and exit early on blocks past `n_padded`.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
from jaxtyping import Int


@dataclass(frozen=True)
class SlotLayout:
    sorted_slots: Int[torch.Tensor, "max_padded"]  # slot id (token * top_k + k) per row; n_slots marks padding
    block_expert: Int[torch.Tensor, "max_blocks"]  # expert of each block of block_m rows
    n_padded: Int[torch.Tensor, "1"]  # rows in use (a multiple of block_m), on the device
    n_slots: int
    block_m: int

    @property
    def max_blocks(self) -> int:
        return self.block_expert.numel()


def max_padded_rows(n_slots: int, n_experts: int, block_m: int) -> int:
    """Upper bound of rows once each expert's segment is padded to a multiple of block_m."""
    return (n_slots + n_experts * (block_m - 1) + block_m - 1) // block_m * block_m


def align_slots(indices: Int[torch.Tensor, "T k"], n_experts: int, block_m: int) -> SlotLayout:
    flat = indices.reshape(-1).to(torch.int64)
    n_slots, device = flat.numel(), flat.device
    # not bincount: on CUDA it reads the max id back to size its output, a host sync
    counts = torch.zeros(n_experts, dtype=torch.int64, device=device).index_add_(0, flat, torch.ones_like(flat))
    padded = (counts + block_m - 1) // block_m * block_m
    padded_end = padded.cumsum(0)
    padded_start = padded_end - padded
    order = torch.argsort(flat, stable=True)
    experts_sorted = flat[order]
    first_of_expert = counts.cumsum(0) - counts
    rank = torch.arange(n_slots, device=device) - first_of_expert[experts_sorted]
    max_rows = max_padded_rows(n_slots, n_experts, block_m)
    sorted_slots = torch.full((max_rows,), n_slots, dtype=torch.int32, device=device)
    sorted_slots[padded_start[experts_sorted] + rank] = order.to(torch.int32)
    block_starts = torch.arange(0, max_rows, block_m, device=device)
    # blocks past the last expert's end get expert n_experts - 1 clamped; the kernels exit on them early
    block_expert = torch.searchsorted(padded_end, block_starts, right=True).clamp(max=n_experts - 1).to(torch.int32)
    return SlotLayout(sorted_slots, block_expert, padded_end[-1:].to(torch.int32), n_slots, block_m)
