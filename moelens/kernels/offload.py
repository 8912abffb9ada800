"""Routed experts that live off the compute device: in host memory or on disk, fetched when routed to.

Offloading moves weights, never math. A layer's forward asks its OffloadedExperts for the experts its tokens
route to; they come from a cache of expert weights on the compute device (least recently used out first),
or from their source (host memory, or the checkpoint's files) on a miss. The routed-expert kernels then run
on the stacked weights of just those experts, with the token-slots' expert ids renumbered to match
(0..n_used-1 in ascending expert id). Both backends compute every slot exactly as they do with all the
experts resident: the slot order, the per-expert groups and each group's GEMM are the same; groups of
experts nobody routed to are simply absent. Tests check the logits and every hook tensor bit for bit.

Prefetch (optional, Prefetcher): once a layer's routing is known, a background thread loads into the cache
the experts a predictor expects the next mixture layer to route to, so that reading them overlaps this
layer's compute. The next layer still asks for exactly what it routes to; a prefetched expert is the same
bytes from the same source, so a wrong guess costs time (and is evicted unused), never a result.
"""

from __future__ import annotations

import threading
import time
import warnings
from collections import OrderedDict
from collections.abc import Callable
from dataclasses import dataclass

import torch
from jaxtyping import Int

from moelens.experts.spec import ExpertTensors
from moelens.experts.stored import StoredExperts
from moelens.kernels.experts import routed_subset

# one expert's tensors without the expert axis, in its ExpertSpec's parameter order (gate_up [2I, H], down
# [H, I], then the biases where the spec has them)
ExpertWeights = tuple[torch.Tensor, ...]


@dataclass
class ExpertCacheStats:
    """hits / misses: what the layers asked the cache for (a prefetched expert found there is a hit);
    bytes_moved: every expert loaded, prefetched ones included; seconds_moving: the layers' own loads only
    (the prefetch thread's time is seconds_prefetching, overlapping the forward)."""

    hits: int = 0
    misses: int = 0
    bytes_moved: int = 0
    seconds_moving: float = 0.0
    evictions: int = 0
    prefetched: int = 0  # experts loaded ahead by the prefetch thread
    prefetch_hits: int = 0  # of those, routed to by the layer they were loaded for
    prefetch_wasted: int = 0  # of those, not routed to (evicted when that layer ran, or by the next layer)
    prefetch_errors: int = 0  # prefetch jobs that raised; the layer then loaded what it needed itself
    seconds_prefetching: float = 0.0
    peak_bytes: int = 0  # the most bytes of expert weights the cache held at once

    @property
    def hit_rate(self) -> float:
        total = self.hits + self.misses
        return self.hits / total if total else 0.0

    @property
    def prefetch_hit_rate(self) -> float:
        """Share of the prefetched experts that their layer routed to."""
        return self.prefetch_hits / self.prefetched if self.prefetched else 0.0


class ExpertCache:
    """Expert weights on the compute device(s), keyed by (layer, expert), at most `capacity_bytes` in all
    between layers (a layer's working set may exceed it while the layer runs, and so may the next layer's
    prefetched experts); least recently used out first."""

    def __init__(self, capacity_bytes: int) -> None:
        if capacity_bytes < 0:
            raise ValueError(f"expert_cache_bytes must be >= 0, got {capacity_bytes}")
        self.capacity_bytes = capacity_bytes
        self.entries: OrderedDict[tuple[int, int], ExpertWeights] = OrderedDict()
        self.bytes = 0
        self.stats = ExpertCacheStats()
        self._lock = threading.Lock()  # two threads may run one model (hooks are per thread; the cache is shared)
        self.prefetcher: Prefetcher | None = None  # set by enable_prefetch()
        self._prefetched: set[tuple[int, int]] = set()  # loaded ahead, not yet asked for

    def enable_prefetch(self) -> None:
        self.prefetcher = Prefetcher(self)

    def get(self, key: tuple[int, int], load: Callable[[], ExpertWeights], device: torch.device) -> ExpertWeights:
        with self._lock:
            return self._get(key, load, device)

    def _get(self, key: tuple[int, int], load: Callable[[], ExpertWeights], device: torch.device) -> ExpertWeights:
        if key in self.entries:
            self.stats.hits += 1
            if key in self._prefetched:
                self._prefetched.discard(key)
                self.stats.prefetch_hits += 1
            self.entries.move_to_end(key)
            return self.entries[key]
        self.stats.misses += 1
        start = time.perf_counter()
        weights = tuple(t.to(device, non_blocking=True) for t in load())
        self.stats.seconds_moving += time.perf_counter() - start
        self._insert(key, weights)  # type: ignore[arg-type]
        return weights  # type: ignore[return-value]

    def _insert(self, key: tuple[int, int], weights: ExpertWeights) -> None:
        size = sum(t.nbytes for t in weights)
        self.stats.bytes_moved += size
        self.entries[key] = weights
        self.bytes += size
        self.stats.peak_bytes = max(self.stats.peak_bytes, self.bytes)

    def __contains__(self, key: tuple[int, int]) -> bool:
        with self._lock:
            return key in self.entries

    def put_prefetched(self, key: tuple[int, int], weights: ExpertWeights, seconds: float) -> None:
        """An expert the prefetch thread loaded; dropped if a layer loaded it meanwhile."""
        with self._lock:
            self.stats.seconds_prefetching += seconds
            self.stats.prefetched += 1
            if key in self.entries:
                self.stats.prefetch_wasted += 1
                return
            self._insert(key, weights)
            self._prefetched.add(key)

    def settle_prefetch(self, layer: int, used: list[int]) -> None:
        """Before a layer fetches: stop the prefetch thread (waiting for the expert it is loading), then evict
        every prefetched expert this layer does not route to, so that the cache never holds more than
        capacity + this layer's working set while it runs."""
        if self.prefetcher is not None:
            self.prefetcher.cancel()
        needed = {(layer, e) for e in used}
        with self._lock:
            for key in [k for k in self._prefetched if k not in needed]:
                self._prefetched.discard(key)
                self.stats.prefetch_wasted += 1
                if key in self.entries:
                    self.bytes -= sum(t.nbytes for t in self.entries.pop(key))

    def trim(self) -> None:
        """Evict least recently used entries down to the capacity."""
        with self._lock:
            self._trim()

    def _trim(self) -> None:
        while self.bytes > self.capacity_bytes and self.entries:
            key, weights = self.entries.popitem(last=False)
            self.bytes -= sum(t.nbytes for t in weights)
            self.stats.evictions += 1
            if key in self._prefetched:  # evicted before its layer asked for it
                self._prefetched.discard(key)
                self.stats.prefetch_wasted += 1

    def clear(self) -> None:
        if self.prefetcher is not None:
            self.prefetcher.cancel()
        with self._lock:
            self.entries.clear()
            self._prefetched.clear()
            self.bytes = 0


@dataclass
class PrefetchJob:
    store: OffloadedExperts  # the layer to load for
    x: torch.Tensor  # the input the prediction is made from
    predict: Callable[[torch.Tensor], torch.Tensor]  # x -> expert ids [..., k] the layer is expected to route to


class Prefetcher:
    """A background thread loading predicted experts into an ExpertCache, one job at a time.

    The thread exits when idle (IDLE_SECONDS), so that it never keeps a dropped model's cache alive, and is
    started again by the next job. A job that raises is counted (stats.prefetch_errors, the exception kept as
    .error, a warning the first time): the layer it was for loads what it needs itself, as without prefetch."""

    IDLE_SECONDS = 1.0

    def __init__(self, cache: ExpertCache) -> None:
        self.cache = cache
        self.error: Exception | None = None
        self._cond = threading.Condition()
        self._job: PrefetchJob | None = None
        self._busy = False  # a job is running
        self._cancel = False
        self._thread: threading.Thread | None = None

    def submit(self, job: PrefetchJob) -> None:
        """Run `job` next (replacing one not started yet, after cancelling one running)."""
        self.cancel()
        with self._cond:
            self._job = job
            if self._thread is None or not self._thread.is_alive():
                self._thread = threading.Thread(target=self._work, name="moelens-expert-prefetch", daemon=True)
                self._thread.start()
            self._cond.notify_all()

    def cancel(self) -> None:
        """Drop a job not started yet; stop a running one after the expert it is loading. Returns once the
        thread is idle, so nothing is added to the cache afterwards."""
        with self._cond:
            self._job = None
            if self._busy:
                self._cancel = True
                self._cond.wait_for(lambda: not self._busy)

    def _work(self) -> None:
        while True:
            with self._cond:
                if not self._cond.wait_for(lambda: self._job is not None, timeout=self.IDLE_SECONDS):
                    self._thread = None
                    return
                job, self._job = self._job, None
                self._busy, self._cancel = True, False
            try:
                self._run(job)
            except Exception as err:  # counted, never raised here: the layer loads what it needs itself
                with self.cache._lock:
                    self.cache.stats.prefetch_errors += 1
                first, self.error = self.error is None, err
                if first:
                    warnings.warn(
                        f"expert prefetch failed ({err!r}); layers load the experts they route to themselves, results "
                        "unchanged (counted in expert_cache_stats().prefetch_errors)", RuntimeWarning, stacklevel=1,
                    )
            finally:
                with self._cond:
                    self._busy = False
                    self._cond.notify_all()

    def _run(self, job: PrefetchJob) -> None:
        with torch.no_grad():
            ids = job.predict(job.x).flatten()
        counts = torch.bincount(ids.to(torch.long).cpu(), minlength=job.store.n_experts)
        # most-chosen first: if the layer arrives before the job is done, the likeliest experts are in
        expected = [e for e in torch.argsort(counts, descending=True, stable=True).tolist() if counts[e] > 0]
        for e in expected:
            if self._cancel:
                return
            key = (job.store.layer, e)
            if key in self.cache:
                continue
            start = time.perf_counter()
            weights = tuple(t.to(job.store.device, non_blocking=True) for t in job.store.source(e))
            self.cache.put_prefetched(key, weights, time.perf_counter() - start)  # type: ignore[arg-type]


class OffloadedExperts:
    """One mixture layer's routed experts, held by `source` (expert id -> its weights, anywhere) and fetched
    through the model's shared ExpertCache. stack: the fetched experts' tensors -> their stacks (dense
    ExpertTensors, or StoredExperts where the experts are kept as stored: the cache then holds and moves the
    stored bytes, and the layer dequantizes what it fetched)."""

    def __init__(
        self, layer: int, n_experts: int, source: Callable[[int], ExpertWeights], cache: ExpertCache, device: torch.device, where: str,
        stack: Callable[[list[ExpertWeights]], ExpertTensors | StoredExperts] = ExpertTensors.stack,
    ) -> None:
        self.layer, self.n_experts, self.source, self.cache, self.device, self.where = layer, n_experts, source, cache, device, where
        self.stack = stack
        self.next: OffloadedExperts | None = None  # the layer to prefetch for (prefetch_next)
        self.predict: Callable[[torch.Tensor], torch.Tensor] | None = None

    def prefetch_next(self, store: OffloadedExperts, predict: Callable[[torch.Tensor], torch.Tensor]) -> None:
        """After each fetch, load ahead the experts predict(this layer's mixture input) names for `store`."""
        self.next, self.predict = store, predict

    def fetch(
        self, indices: Int[torch.Tensor, "T k"], x: torch.Tensor | None = None
    ) -> tuple[ExpertTensors | StoredExperts, Int[torch.Tensor, "T k"]]:
        """(the routed experts' tensors, stacked in ascending expert id; the indices renumbered into that
        stack). x: this layer's mixture input, from which the next layer's experts are
        predicted and prefetched where prefetch is on."""
        used, renumbered = routed_subset(indices, self.n_experts)  # sorted: renumbering keeps the slots' order
        self.cache.settle_prefetch(self.layer, used)
        weights = [self.cache.get((self.layer, e), lambda e=e: self.source(e), self.device) for e in used]
        tensors = self.stack(weights)
        self.cache.trim()  # the stacks hold this layer's working set; the cache keeps what fits
        if x is not None and self.next is not None and self.cache.prefetcher is not None:
            self.cache.prefetcher.submit(PrefetchJob(self.next, x.detach(), self.predict))
        return tensors, renumbered
