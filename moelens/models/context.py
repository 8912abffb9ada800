"""LayerInputs: what a layer's token mixer reads besides its input stream, built once per forward by the model.

- positions: each new token's absolute position (its row's count of real tokens before it, so a left-padded
  row gets the positions it would get alone; with a cache, continued from it);
- rotary: the cos / sin tables of those positions (None for a model without a rotary);
- allowed: the causal and padding mask over every key the new tokens see (cached ones first), [batch|1, 1,
  query, key]; a mixer that narrows it (a sliding window, chunks) calls `within(...)`;
- mask: 1 for a real new token, 0 for padding, [batch pos], or None when every new token is real;
- state: the layer's own state in the cache (moelens.state), or None without a cache;
- carried: what a layer hands to the later layers of the same forward, by name (GLM-5's DSA layers that reuse
  an earlier layer's key selection read it here); one dict per forward, shared by every layer's inputs.

The model builds one LayerInputs per forward and hands each layer `inputs.for_layer(state)`.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass, field

import torch
from jaxtyping import Bool, Float, Int

from moelens.state import LayerState


@dataclass(frozen=True)
class LayerInputs:
    positions: Int[torch.Tensor, "batch pos"]
    cos: Float[torch.Tensor, "batch pos d_rot"] | None
    sin: Float[torch.Tensor, "batch pos d_rot"] | None
    allowed: Bool[torch.Tensor, "batch 1 query key"]
    mask: Int[torch.Tensor, "batch pos"] | None = None
    state: LayerState | None = None
    carried: dict[str, torch.Tensor] = field(default_factory=dict)

    @property
    def n_queries(self) -> int:
        return self.allowed.shape[-2]

    @property
    def n_keys(self) -> int:
        return self.allowed.shape[-1]

    def for_layer(self, state: LayerState | None) -> LayerInputs:
        return dataclasses.replace(self, state=state)

    def to(self, device: torch.device) -> LayerInputs:
        """The same inputs on `device` (a device map moves the stream between whole blocks)."""
        if self.allowed.device == torch.device(device):
            return self
        moved = {
            f.name: getattr(self, f.name).to(device)
            for f in dataclasses.fields(self)
            if isinstance(getattr(self, f.name), torch.Tensor)
        }
        return dataclasses.replace(self, **moved)

    def key_offsets(self) -> tuple[Int[torch.Tensor, "query 1"], Int[torch.Tensor, "1 key"]]:
        """Indices of the queries among all keys (the queries are the last n_queries of them) and of the keys:
        the grid that sliding and chunked masks are drawn on. They count every position of the input and of
        the cache, padding included, as transformers' cache positions do."""
        device = self.allowed.device
        query = torch.arange(self.n_keys - self.n_queries, self.n_keys, device=device)[:, None]
        key = torch.arange(self.n_keys, device=device)[None, :]
        return query, key

    def within(self, window: int) -> Bool[torch.Tensor, "batch 1 query key"]:
        """`allowed` narrowed to keys fewer than `window` positions before the query (key > query - window,
        as transformers' sliding_window_overlay)."""
        query, key = self.key_offsets()
        return self.allowed & (key > query - window)
