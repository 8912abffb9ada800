"""Token positions from an attention mask: what left padding needs to give each row its own positions."""

from __future__ import annotations

import torch
from jaxtyping import Int


def positions_from_mask(mask: Int[torch.Tensor, "batch pos"], start: int | torch.Tensor = 0) -> Int[torch.Tensor, "batch pos"]:
    """Rotary positions that count each row's real tokens (mask 1) from `start`, so a left-padded row gets
    the positions it would get alone; padding repeats the position before it (0 at the start)."""
    return (start + mask.long().cumsum(-1) - 1).clamp(min=0)
