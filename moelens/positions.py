"""Token positions from an attention mask: what left padding needs to give each row its own positions."""

from __future__ import annotations

import torch
from jaxtyping import Int


def positions_from_mask(mask: Int[torch.Tensor, "batch pos"], start: int | torch.Tensor = 0) -> Int[torch.Tensor, "batch pos"]:
    """Rotary positions that count each row's real tokens (mask 1) from `start`, so a left-padded row gets
    the positions it would get alone; padding repeats the position before it (0 at the start)."""
    return (start + mask.long().cumsum(-1) - 1).clamp(min=0)


def check_attention_mask(mask: object, shape: tuple[int, int]) -> Int[torch.Tensor, "batch pos"]:
    """The mask as a long tensor, once checked to be a [batch pos] tensor of this shape holding only 0
    (padding) and 1 (real token): positions are its running count, so any other value would shift them."""
    if not isinstance(mask, torch.Tensor):
        raise TypeError(
            f"attention_mask must be a tensor [batch pos] of 0/1, got {type(mask).__name__}: pass torch.tensor(...)"
        )
    if mask.dtype.is_floating_point or mask.dtype.is_complex:
        raise TypeError(
            f"attention_mask must hold integers or bools (0 padding, 1 real token), got {mask.dtype}: pass mask.long()"
        )
    if tuple(mask.shape) != tuple(shape):
        raise ValueError(
            f"attention_mask has shape {tuple(mask.shape)}, expected {tuple(shape)} [batch pos] like the input"
        )
    bad = (mask != 0) & (mask != 1)
    if bad.any():
        row, pos = (int(i) for i in bad.nonzero()[0])
        raise ValueError(
            f"attention_mask holds {int(mask[row, pos])} at [{row}, {pos}]: it must be 0 (padding) or 1 (real token)"
        )
    return mask.long()
