"""Routed experts that live off the compute device: in host memory or on disk, fetched when routed to.

Offloading moves weights, never math. A layer's forward asks its OffloadedExperts for the experts its tokens
route to; they come from a cache of expert weights on the compute device (least recently used out first),
or from their source (host memory, or the checkpoint's files) on a miss. The routed-expert kernels then run
on the stacked weights of just those experts, with the token-slots' expert ids renumbered to match
(0..n_used-1 in ascending expert id). Both backends compute every slot exactly as they do with all the
experts resident: the slot order, the per-expert groups and each group's GEMM are the same; groups of
experts nobody routed to are simply absent. Tests check the logits and every hook tensor bit for bit.
"""

from __future__ import annotations

import threading
import time
from collections import OrderedDict
from collections.abc import Callable
from dataclasses import dataclass

import torch
from jaxtyping import Float, Int

# (gate_up [2I, H], down [H, I]) of one expert
ExpertWeights = tuple[torch.Tensor, torch.Tensor]


@dataclass
class ExpertCacheStats:
    hits: int = 0
    misses: int = 0
    bytes_moved: int = 0
    seconds_moving: float = 0.0
    evictions: int = 0

    @property
    def hit_rate(self) -> float:
        total = self.hits + self.misses
        return self.hits / total if total else 0.0


class ExpertCache:
    """Expert weights on the compute device(s), keyed by (layer, expert), at most `capacity_bytes` in all
    between layers (a layer's working set may exceed it while the layer runs); least recently used out first."""

    def __init__(self, capacity_bytes: int) -> None:
        if capacity_bytes < 0:
            raise ValueError(f"expert_cache_bytes must be >= 0, got {capacity_bytes}")
        self.capacity_bytes = capacity_bytes
        self.entries: OrderedDict[tuple[int, int], ExpertWeights] = OrderedDict()
        self.bytes = 0
        self.stats = ExpertCacheStats()
        self._lock = threading.Lock()  # two threads may run one model (hooks are per thread; the cache is shared)

    def get(self, key: tuple[int, int], load: Callable[[], ExpertWeights], device: torch.device) -> ExpertWeights:
        with self._lock:
            return self._get(key, load, device)

    def _get(self, key: tuple[int, int], load: Callable[[], ExpertWeights], device: torch.device) -> ExpertWeights:
        if key in self.entries:
            self.stats.hits += 1
            self.entries.move_to_end(key)
            return self.entries[key]
        self.stats.misses += 1
        start = time.perf_counter()
        weights = tuple(t.to(device, non_blocking=True) for t in load())
        self.stats.seconds_moving += time.perf_counter() - start
        size = sum(t.nbytes for t in weights)
        self.stats.bytes_moved += size
        self.entries[key] = weights  # type: ignore[assignment]
        self.bytes += size
        return weights  # type: ignore[return-value]

    def trim(self) -> None:
        """Evict least recently used entries down to the capacity."""
        with self._lock:
            self._trim()

    def _trim(self) -> None:
        while self.bytes > self.capacity_bytes and self.entries:
            _, weights = self.entries.popitem(last=False)
            self.bytes -= sum(t.nbytes for t in weights)
            self.stats.evictions += 1

    def clear(self) -> None:
        self.entries.clear()
        self.bytes = 0


class OffloadedExperts:
    """One mixture layer's routed experts, held by `source` (expert id -> its weights, anywhere) and fetched
    through the model's shared ExpertCache."""

    def __init__(
        self, layer: int, n_experts: int, source: Callable[[int], ExpertWeights], cache: ExpertCache, device: torch.device, where: str
    ) -> None:
        self.layer, self.n_experts, self.source, self.cache, self.device, self.where = layer, n_experts, source, cache, device, where

    def fetch(
        self, indices: Int[torch.Tensor, "T k"]
    ) -> tuple[Float[torch.Tensor, "n 2I H"], Float[torch.Tensor, "n H I"], Int[torch.Tensor, "T k"]]:
        """(gate_up and down weights of the routed experts, stacked in ascending expert id; the indices
        renumbered into that stack)."""
        used = torch.unique(indices).tolist()  # sorted: renumbering keeps the slots' sort order by expert
        weights = [self.cache.get((self.layer, e), lambda e=e: self.source(e), self.device) for e in used]
        gate_up = torch.stack([w[0] for w in weights])
        down = torch.stack([w[1] for w in weights])
        self.cache.trim()  # the stacks hold this layer's working set; the cache keeps what fits
        renumber = torch.full((self.n_experts,), -1, dtype=indices.dtype, device=indices.device)
        renumber[torch.tensor(used, device=indices.device, dtype=torch.long)] = torch.arange(
            len(used), dtype=indices.dtype, device=indices.device
        )
        return gate_up, down, renumber[indices]
