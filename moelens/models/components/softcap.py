"""Softcapping: cap * tanh(x / cap), a smooth clamp of x to (-cap, cap) (Beam's final logits; Gemma's attention
scores and logits)."""

from __future__ import annotations

import math

import torch
from jaxtyping import Float


def softcap(x: Float[torch.Tensor, "..."], cap: float) -> Float[torch.Tensor, "..."]:
    """cap * tanh(x / cap) in x's dtype, in transformers' order (divide, tanh, multiply)."""
    return torch.tanh(x / cap) * cap


def check_cap(name: str, cap) -> float:
    """A cap must be a finite positive number: 0 would divide by zero, a negative one flip the sign."""
    if isinstance(cap, bool) or not isinstance(cap, (int, float)) or not math.isfinite(cap) or cap <= 0:
        raise ValueError(f"{name} must be a finite positive number, got {cap!r}")
    return float(cap)
