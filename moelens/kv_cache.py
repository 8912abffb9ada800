"""Key/value cache for incremental decoding: what attention already computed for earlier positions.

Per layer it keeps keys and values exactly as attention uses them (after rotary and, for Hunyuan, the q/k
norm: what hook_rot_k and hook_v produce, kv heads not repeated), so a hook that edits those sites edits
what later positions see. Alongside: the attention-mask history (1 real token, 0 padding) and each row's
next rotary position (its count of real tokens so far), which keep left-padded rows correct.

    cache = KVCache.for_model(model)
    logits = model(prompt, attention_mask=mask, past_kv_cache=cache)   # fills the cache
    logits = model(next_tokens, past_kv_cache=cache)                   # sees the prompt through the cache
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator
from dataclasses import dataclass

import torch
from jaxtyping import Float, Int

from moelens.positions import positions_from_mask


@dataclass
class LayerKV:
    """One layer's cached keys and values, [batch pos kv_head d_head]; None until the first forward."""

    keys: Float[torch.Tensor, "batch pos kv_head d_head"] | None = None
    values: Float[torch.Tensor, "batch pos kv_head d_head"] | None = None

    def append(
        self, keys: Float[torch.Tensor, "batch new kv_head d_head"], values: Float[torch.Tensor, "batch new kv_head d_head"]
    ) -> tuple[Float[torch.Tensor, "batch all kv_head d_head"], Float[torch.Tensor, "batch all kv_head d_head"]]:
        """Store the new positions' keys and values; return those of every position, cached first."""
        if self.keys is not None:
            keys, values = torch.cat([self.keys, keys], dim=1), torch.cat([self.values, values], dim=1)
        self.keys, self.values = keys, values
        return keys, values

    def truncate(self, length: int) -> None:
        if self.keys is not None:
            self.keys, self.values = self.keys[:, :length], self.values[:, :length]


class KVCache:
    """Keys and values of every layer, the attention-mask history and each row's next position."""

    def __init__(self, n_layers: int) -> None:
        self.layers = [LayerKV() for _ in range(n_layers)]
        self.attention_mask: Int[torch.Tensor, "batch pos"] | None = None  # None: nothing cached yet
        self.next_position: Int[torch.Tensor, " batch"] | None = None

    @classmethod
    def for_model(cls, model: torch.nn.Module) -> KVCache:
        return cls(model.cfg.n_layers)

    def __len__(self) -> int:
        """Number of cached positions (padding included)."""
        return 0 if self.attention_mask is None else self.attention_mask.shape[1]

    def __repr__(self) -> str:
        batch = None if self.attention_mask is None else self.attention_mask.shape[0]
        return f"KVCache(n_layers={len(self.layers)}, batch={batch}, positions={len(self)})"

    def positions(self, new_mask: Int[torch.Tensor, "batch new"]) -> Int[torch.Tensor, "batch new"]:
        """Rotary positions of the new tokens: each row continues its count of real tokens, so a left-padded
        row gets the positions it would get alone (as the uncached forward computes them from the mask)."""
        start = 0 if self.next_position is None else self.next_position[:, None]
        return positions_from_mask(new_mask, start)

    def check_fits(self, n_layers: int, batch: int) -> None:
        """A cache made for another model, or another batch, would silently run the wrong blocks or rows."""
        if len(self.layers) != n_layers:
            raise ValueError(
                f"this KVCache has {len(self.layers)} layers, the model has {n_layers}: "
                "make it with KVCache.for_model(model)"
            )
        if self.attention_mask is not None and self.attention_mask.shape[0] != batch:
            raise ValueError(f"this KVCache holds {self.attention_mask.shape[0]} rows, the input has {batch}")

    def full_mask(self, new_mask: Int[torch.Tensor, "batch new"]) -> Int[torch.Tensor, "batch all"]:
        """Mask over every key the new tokens attend to: the cached history, then the new tokens."""
        if self.attention_mask is None:
            return new_mask
        return torch.cat([self.attention_mask, new_mask.to(self.attention_mask)], dim=1)

    @contextlib.contextmanager
    def extending(self, new_mask: Int[torch.Tensor, "batch new"]) -> Iterator[None]:
        """Around one forward: commit the mask and positions when it succeeds; when it raises (a failing hook),
        drop what the layers appended, so the cache is left as it was rather than half extended."""
        length = len(self)
        try:
            yield
        except BaseException:
            for layer in self.layers:
                layer.truncate(length)
            raise
        self.attention_mask = self.full_mask(new_mask.long())
        counts = new_mask.long().sum(-1)
        self.next_position = counts if self.next_position is None else self.next_position + counts
