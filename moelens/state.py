"""What a layer hands from one forward to the next (its state), by kind: keys and values of softmax attention,
the convolution window and recurrent state of a linear-attention or state-space mixer, or the convolution window
alone of a short-convolution mixer.

Every kind answers the same three questions, so the model's cache (moelens.kv_cache.KVCache) holds one state
per layer without knowing what is in it:
- snapshot() / rollback(snapshot): a failing forward (a hook that raises) leaves the cache as it was;
- nbytes: what it holds now.

A state is made empty by its mixer (mixer.new_state()) and filled by the mixer's forward.
"""

from __future__ import annotations

from typing import Protocol

import torch
from jaxtyping import Float


class LayerState(Protocol):
    def snapshot(self) -> object:
        """Enough to put the state back as it is now (cheap: no copy of what a later forward only appends to)."""

    def rollback(self, snapshot: object) -> None:
        """Back to what snapshot() saw."""

    @property
    def nbytes(self) -> int:
        """Bytes the state holds now."""


class KVState:
    """One softmax-attention layer's cached keys and values, in buffers preallocated along the position axis
    ([batch kv_head capacity d], the layout attention multiplies in): a new position is written in place, so a
    decode step copies only its own keys and values. The buffers grow by doubling when a forward needs more
    than `capacity` (generate reserves the whole length up front).

    Keys and values are stored as attention uses them (after rotary, q/k norm and the hooks of hook_rot_k /
    hook_v), kv heads not repeated."""

    def __init__(self, reserve: int = 0) -> None:
        self.reserve = reserve  # positions to allocate at the first append (at least what it brings)
        self.length = 0
        self._keys: Float[torch.Tensor, "batch kv_head capacity d_k"] | None = None
        self._values: Float[torch.Tensor, "batch kv_head capacity d_v"] | None = None

    @property
    def capacity(self) -> int:
        return 0 if self._keys is None else self._keys.shape[2]

    @property
    def keys(self) -> Float[torch.Tensor, "batch pos kv_head d_k"] | None:
        """The cached keys of every position so far (a view of the buffer), None before the first forward."""
        return None if self._keys is None else self._keys[:, :, : self.length].transpose(1, 2)

    @property
    def values(self) -> Float[torch.Tensor, "batch pos kv_head d_v"] | None:
        return None if self._values is None else self._values[:, :, : self.length].transpose(1, 2)

    def append(
        self, keys: Float[torch.Tensor, "batch new kv_head d_k"], values: Float[torch.Tensor, "batch new kv_head d_v"]
    ) -> tuple[Float[torch.Tensor, "batch all kv_head d_k"], Float[torch.Tensor, "batch all kv_head d_v"]]:
        """Store the new positions' keys and values; return those of every position, cached first.

        On an empty state the new tensors themselves come back (a cached prefill computes exactly what an
        uncached forward does); later, views of the buffers."""
        start, new = self.length, keys.shape[1]
        self._make_room(keys, values, start + new)
        self._keys[:, :, start : start + new] = keys.transpose(1, 2)
        self._values[:, :, start : start + new] = values.transpose(1, 2)
        self.length = start + new
        if start == 0:
            return keys, values
        return self.keys, self.values

    def _make_room(self, keys: torch.Tensor, values: torch.Tensor, needed: int) -> None:
        if self._keys is not None and needed <= self.capacity:
            return
        capacity = max(needed, self.reserve, 2 * self.capacity)
        b, _, h, d_k = keys.shape
        grown_k = keys.new_empty(b, h, capacity, d_k)
        grown_v = values.new_empty(b, values.shape[2], capacity, values.shape[3])
        if self._keys is not None:  # copy what is held (rare: only when the reserve is outgrown)
            grown_k[:, :, : self.length] = self._keys[:, :, : self.length]
            grown_v[:, :, : self.length] = self._values[:, :, : self.length]
        self._keys, self._values = grown_k, grown_v

    def snapshot(self) -> int:
        return self.length

    def rollback(self, snapshot: int) -> None:
        self.length = snapshot

    @property
    def nbytes(self) -> int:
        if self._keys is None:
            return 0
        per_position = (self._keys[:, :, 0].numel() * self._keys.element_size()
                        + self._values[:, :, 0].numel() * self._values.element_size())
        return per_position * self.length

    def __repr__(self) -> str:
        return f"KVState(length={self.length}, capacity={self.capacity})"


class IndexedKVState(KVState):
    """A DeepSeek Sparse Attention layer's state: latent attention's keys and values (KVState) and, beside
    them, its indexer's keys ([batch capacity index_head_dim], one per position, shared by the indexer's
    heads), preallocated and grown the same way. Snapshot and rollback cover both."""

    def __init__(self, reserve: int = 0) -> None:
        super().__init__(reserve)
        self.index_length = 0
        self._index_keys: Float[torch.Tensor, "batch capacity d_index"] | None = None

    @property
    def index_keys(self) -> Float[torch.Tensor, "batch pos d_index"] | None:
        """The cached indexer keys of every position so far (a view of the buffer), None before the first forward."""
        return None if self._index_keys is None else self._index_keys[:, : self.index_length]

    def append_index_keys(
        self, keys: Float[torch.Tensor, "batch new d_index"]
    ) -> Float[torch.Tensor, "batch all d_index"]:
        """Store the new positions' indexer keys; return those of every position, cached first (on an empty
        state the new tensor itself, as KVState.append)."""
        start, new = self.index_length, keys.shape[1]
        if self._index_keys is None or start + new > self._index_keys.shape[1]:
            capacity = max(start + new, self.reserve, 2 * (0 if self._index_keys is None else self._index_keys.shape[1]))
            grown = keys.new_empty(keys.shape[0], capacity, keys.shape[2])
            if self._index_keys is not None:
                grown[:, :start] = self._index_keys[:, :start]
            self._index_keys = grown
        self._index_keys[:, start : start + new] = keys
        self.index_length = start + new
        return keys if start == 0 else self.index_keys

    def snapshot(self) -> tuple[int, int]:
        return self.length, self.index_length

    def rollback(self, snapshot: tuple[int, int]) -> None:
        self.length, self.index_length = snapshot

    @property
    def nbytes(self) -> int:
        held = 0 if self._index_keys is None else self._index_keys[:, 0].numel() * self._index_keys.element_size()
        return super().nbytes + held * self.index_length

    def __repr__(self) -> str:
        return f"IndexedKVState(length={self.length}, index_length={self.index_length}, capacity={self.capacity})"


class RecurrentState:
    """A linear-attention or state-space layer's state: the last inputs of its causal convolution
    (`conv`, [batch channels kernel], as transformers' caches keep them) and its recurrent state
    (`recurrent`, the mixer's layout, e.g. [batch head d_k d_v]); None before the first forward.

    Mixers replace these tensors, never edit them in place, so a snapshot is the two references."""

    def __init__(self) -> None:
        self.conv: torch.Tensor | None = None
        self.recurrent: torch.Tensor | None = None
        self.length = 0  # positions seen (padding included)

    def update(self, conv: torch.Tensor, recurrent: torch.Tensor, new_positions: int) -> None:
        self.conv, self.recurrent = conv, recurrent
        self.length += new_positions

    def snapshot(self) -> tuple[torch.Tensor | None, torch.Tensor | None, int]:
        return self.conv, self.recurrent, self.length

    def rollback(self, snapshot: tuple[torch.Tensor | None, torch.Tensor | None, int]) -> None:
        self.conv, self.recurrent, self.length = snapshot

    @property
    def nbytes(self) -> int:
        return sum(t.numel() * t.element_size() for t in (self.conv, self.recurrent) if t is not None)

    def __repr__(self) -> str:
        shapes = {name: None if t is None else tuple(t.shape) for name, t in (("conv", self.conv), ("recurrent", self.recurrent))}
        return f"RecurrentState(length={self.length}, {shapes})"


class ConvWindowState:
    """A short-convolution layer's state: the last inputs of its causal convolution (`conv`, [batch channels
    kernel], as transformers' conv cache keeps them), None before the first forward; no recurrent state.

    The mixer replaces the tensor, never edits it in place, so a snapshot is the reference."""

    def __init__(self) -> None:
        self.conv: torch.Tensor | None = None
        self.length = 0  # positions seen (padding included)

    def update(self, conv: torch.Tensor, new_positions: int) -> None:
        self.conv = conv
        self.length += new_positions

    def snapshot(self) -> tuple[torch.Tensor | None, int]:
        return self.conv, self.length

    def rollback(self, snapshot: tuple[torch.Tensor | None, int]) -> None:
        self.conv, self.length = snapshot

    @property
    def nbytes(self) -> int:
        return 0 if self.conv is None else self.conv.numel() * self.conv.element_size()

    def __repr__(self) -> str:
        return f"ConvWindowState(length={self.length}, conv={None if self.conv is None else tuple(self.conv.shape)})"
