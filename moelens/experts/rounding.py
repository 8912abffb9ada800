"""The roundings a model's weights have been through since they were loaded, so that expert weights made
later (stored experts dequantized when routed to, offloaded experts read from their slots) have the bits of
weights that moved with the model.

A model loaded in bfloat16 and moved to float32 holds bfloat16 values in float32; an expert dequantized
afresh in float32 would hold more bits than the dense model's. A Rounding is the load's dtype, then the
dtype of each move that rounded (a move to a dtype holding every value of the last one rounds nothing and
is left out, so moving back and forth adds nothing); a weight made later is made in the first and cast
through the others, then to the dtype asked for: what the dense weights went through.
"""

from __future__ import annotations

import torch

Rounding = tuple[torch.dtype, ...]

# (from, to) casts that keep every value: to has at least from's exponent range and significand bits
EXACT_CASTS = frozenset(
    {
        (torch.bfloat16, torch.float32),
        (torch.bfloat16, torch.float64),
        (torch.float16, torch.float32),
        (torch.float16, torch.float64),
        (torch.float32, torch.float64),
    }
)


def after_move(rounding: Rounding, dtype: torch.dtype) -> Rounding:
    """`rounding` (never empty: the load's dtype first) after the model moved to `dtype`."""
    last = rounding[-1]
    if dtype == last or (last, dtype) in EXACT_CASTS:
        return rounding
    return (*rounding, dtype)


def cast_through(t: torch.Tensor, rounding: Rounding, dtype: torch.dtype) -> torch.Tensor:
    """t, made in rounding[0] (or with no rounding, in any dtype), cast through the later roundings, then to
    dtype (t itself where nothing changes)."""
    for step in (*rounding[1:], dtype):
        t = t.to(step)
    return t
