"""Causal attention where each query sees only the last `sliding_window` positions (itself included)."""

from __future__ import annotations

import torch
from jaxtyping import Bool, Float

from moelens.config import MoeConfig
from moelens.kv_cache import LayerKV
from moelens.models.components.attention import Attention, SplitInputs


class SlidingWindowAttention(Attention):
    """Attention whose allowed keys are narrowed to those fewer than cfg.sliding_window positions before the
    query (key index > query index - window, as transformers' sliding_window_overlay); cfg.sliding_window
    None leaves the causal mask as it is (Mixtral). Indices count every position of the input and the KV
    cache, padding included, as transformers' cache positions do."""

    def __init__(self, cfg: MoeConfig, layer: int) -> None:
        super().__init__(cfg, layer)
        self.sliding_window: int | None = cfg.window(layer)

    def forward(
        self,
        x: Float[torch.Tensor, "batch pos d_model"] | SplitInputs,
        cos: torch.Tensor,
        sin: torch.Tensor,
        allowed: Bool[torch.Tensor, "batch 1 query key"],
        kv: LayerKV | None = None,
    ) -> Float[torch.Tensor, "batch pos d_model"]:
        if self.sliding_window is not None:
            # the queries from the mask, not from x: x may be SplitInputs (per-head inputs)
            allowed = allowed & within_window(allowed.shape[-2], allowed.shape[-1], self.sliding_window, allowed.device)
        return super().forward(x, cos, sin, allowed, kv)

    def extra_repr(self) -> str:
        return f"sliding_window={self.sliding_window}"


def within_window(n_queries: int, n_keys: int, window: int, device: torch.device) -> Bool[torch.Tensor, "query key"]:
    """[query key]: the queries are the last n_queries of the n_keys positions (with a KV cache the keys
    start earlier)."""
    query = torch.arange(n_keys - n_queries, n_keys, device=device)[:, None]
    key = torch.arange(n_keys, device=device)[None, :]
    return key > query - window
