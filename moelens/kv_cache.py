"""The cache for incremental decoding: what each layer hands on to later positions (its state, of the kind its
token mixer asks for: moelens.state), the attention-mask history and each row's next position.

A softmax-attention layer keeps keys and values exactly as attention uses them (after rotary and, for Hunyuan,
the q/k norm: what hook_rot_k and hook_v produce, kv heads not repeated), in buffers preallocated along the
position axis, so a hook that edits those sites edits what later positions see and a decode step copies only
its own keys and values. The mask history (1 real token, 0 padding) and each row's next rotary position (its
count of real tokens so far) keep left-padded rows correct.

    cache = KVCache.for_model(model)
    logits = model(prompt, attention_mask=mask, past_kv_cache=cache)   # fills the cache
    logits = model(next_tokens, past_kv_cache=cache)                   # sees the prompt through the cache
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator

import torch
from jaxtyping import Int

from moelens.state import KVState, LayerState
from moelens.positions import positions_from_mask


class KVCache:
    """Every layer's state (None for a layer without a token mixer), the attention-mask history and each row's
    next position."""

    def __init__(self, layers: int | list[LayerState | None]) -> None:
        """layers: the states, one per layer (KVCache.for_model makes the ones a model's layers ask for); an int
        n makes n empty key/value states (for a model of softmax attention on every layer)."""
        self.layers: list[LayerState | None] = [KVState() for _ in range(layers)] if isinstance(layers, int) else list(layers)
        self.attention_mask: Int[torch.Tensor, "batch pos"] | None = None  # None: nothing cached yet
        self.next_position: Int[torch.Tensor, " batch"] | None = None

    @classmethod
    def for_model(cls, model: torch.nn.Module, reserve: int = 0) -> KVCache:
        """An empty cache of the states model's layers ask for; reserve: positions to allocate room for up front
        (generate reserves prompt + new tokens, so no buffer is ever copied)."""
        return cls([None if b.token_mixer is None else b.new_state(reserve) for b in model.blocks])

    @property
    def nbytes(self) -> int:
        """Bytes the layers' states hold now."""
        return sum(state.nbytes for state in self.layers if state is not None)

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
        roll every layer's state back, so the cache is left as it was rather than half extended."""
        snapshots = [None if state is None else state.snapshot() for state in self.layers]
        try:
            yield
        except BaseException:
            for state, snapshot in zip(self.layers, snapshots):
                if state is not None:
                    state.rollback(snapshot)
            raise
        self.attention_mask = self.full_mask(new_mask.long())
        counts = new_mask.long().sum(-1)
        self.next_position = counts if self.next_position is None else self.next_position + counts
