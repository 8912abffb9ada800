"""Causal attention whose scores are scaled by a multiplier the config gives instead of 1/sqrt(d_head)
(Granite's muP attention_multiplier)."""

from __future__ import annotations

import math
from typing import Protocol

from moelens.models.components.attention import Attention


class AttentionMultiplierConfig(Protocol):
    attention_multiplier: float


class MultiplierScaledAttention(Attention):
    """Attention with scores q . k * cfg.attention_multiplier (the softmax scale); everything else as Attention."""

    def __init__(self, cfg: AttentionMultiplierConfig, layer: int) -> None:
        super().__init__(cfg, layer)
        scale = cfg.attention_multiplier
        if isinstance(scale, bool) or not isinstance(scale, (int, float)) or not math.isfinite(scale) or scale <= 0:
            raise ValueError(f"attention_multiplier must be a finite positive number, got {scale!r}")
        self.scale = float(scale)

    def extra_repr(self) -> str:
        return f"scale={self.scale}"
