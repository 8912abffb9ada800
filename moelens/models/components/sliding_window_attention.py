"""Causal attention where each query sees only the last `sliding_window` positions (itself included)."""

from __future__ import annotations

import torch
from jaxtyping import Bool

from moelens.config import MoeConfig
from moelens.models.components.attention import Attention
from moelens.models.context import LayerInputs


class SlidingWindowAttention(Attention):
    """Attention whose allowed keys are narrowed to those fewer than cfg.sliding_window positions before the
    query (key index > query index - window, as transformers' sliding_window_overlay); cfg.sliding_window
    None leaves the causal mask as it is (Mixtral). Indices count every position of the input and the KV
    cache, padding included, as transformers' cache positions do."""

    def __init__(self, cfg: MoeConfig, layer: int) -> None:
        super().__init__(cfg, layer)
        self.sliding_window: int | None = cfg.window(layer)

    def allowed(self, inputs: LayerInputs) -> Bool[torch.Tensor, "batch 1 query key"]:
        return inputs.allowed if self.sliding_window is None else inputs.within(self.sliding_window)

    def extra_repr(self) -> str:
        return f"sliding_window={self.sliding_window}"

