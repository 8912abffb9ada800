"""Routed experts that live off the compute device: in host memory or on disk, fetched when routed to.

Offloading moves weights, never math. A layer's forward asks the model's ExpertCache for the experts its
tokens route to; they are held in the cache's slots on the compute device (least recently used out first),
loaded from their source (host memory, or the checkpoint's files) on a miss. The slots are preallocated
buffers, one per expert tensor, [n_slots, ...] on each device that runs offloaded layers, n_slots =
expert_cache_bytes // one expert's bytes (at least one): the routed experts take no memory beyond them.

The kernels read the experts from their slots, never from a copy: the torch path runs each expert's rows
with a linear over its slot (the same GEMM, row for row, as the grouped GEMM over a resident stack: checked
bit for bit on CPU), the Triton path reads the slot buffers as its weight stack with the slots' expert ids
mapped to slot numbers (its per-expert tiles are the same). When a layer routes to more experts than the
cache has slots, the torch path runs it in groups of experts that fit, contiguous ranges of the slots
sorted by expert: the gate_up GEMMs group by group, then the hooks and the activation on the whole
layer's tensors as always, then the down GEMMs group by group (last group first, so that it is still
held); every row is computed exactly as with all the experts resident. Tests check the logits and every
hook tensor bit for bit, under every cache size.

Prefetch (optional, Prefetcher): once a layer has loaded its experts, a background thread loads into free
or least recently used slots the experts a predictor expects the next mixture layer to route to, so that
reading them overlaps this layer's compute; it never takes a slot in use, nor loads beyond the slots. The
next layer still asks for exactly what it routes to; a prefetched expert is the same bytes from the same
source, so a wrong guess costs time (and is evicted unused), never a result.

With gradients recorded (autograd keeps the weights a backward needs), the kernels read copies of the
slots, since a slot is reused by later layers: such a forward holds each layer's routed experts until its
backward, beyond the cache.
"""

from __future__ import annotations

import threading
import time
import warnings
from collections import Counter, OrderedDict
from collections.abc import Callable
from dataclasses import dataclass

import torch
import torch.nn.functional as F
from jaxtyping import Float, Int

from moelens.experts.rounding import Rounding, cast_through
from moelens.experts.spec import ExpertSpec, ExpertTensors
from moelens.experts.stored import StoredExperts
from moelens.kernels.experts import ExpertHooks, Executor, check_indices, routed_experts, routed_experts_torch

# one expert's tensors without the expert axis, in its ExpertSpec's parameter order (gate_up [2I, H], down
# [H, I], then the biases where the spec has them), or as the files store them (experts kept stored)
ExpertWeights = tuple[torch.Tensor, ...]
Key = tuple[int, int]  # (layer, expert)


@dataclass
class ExpertCacheStats:
    """hits / misses: what the layers asked the cache for (a prefetched expert found there is a hit; a layer
    run in groups asks again, in its down pass, for the experts its gate_up pass evicted); bytes_moved: every
    expert loaded, prefetched ones included; seconds_moving: the layers' own loads only (the prefetch
    thread's time is seconds_prefetching, overlapping the forward)."""

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
    grouped_layers: int = 0  # layer forwards run in groups of experts (more routed experts than slots)
    slot_bytes: int = 0  # bytes of the slot buffers allocated, on all devices: what the experts take

    @property
    def hit_rate(self) -> float:
        total = self.hits + self.misses
        return self.hits / total if total else 0.0

    @property
    def prefetch_hit_rate(self) -> float:
        """Share of the prefetched experts that their layer routed to."""
        return self.prefetch_hits / self.prefetched if self.prefetched else 0.0


def weights_nbytes(weights: ExpertWeights) -> int:
    return sum(t.nbytes for t in weights)


class SlotPool:
    """One device's expert slots: for each of an expert's tensors a buffer [n_slots, ...], allocated when the
    first expert is loaded on that device; every expert held there has that template's shapes and dtypes."""

    def __init__(self, device: torch.device, template: ExpertWeights, n_slots: int) -> None:
        self.device, self.n_slots = device, n_slots
        self.signature = tuple((tuple(t.shape), t.dtype) for t in template)
        self.buffers = tuple(torch.empty((n_slots, *shape), dtype=dtype, device=device) for shape, dtype in self.signature)
        self.free = list(range(n_slots - 1, -1, -1))  # pop() takes slot 0 first

    def views(self, slot: int) -> ExpertWeights:
        return tuple(b[slot] for b in self.buffers)

    @property
    def nbytes(self) -> int:
        return sum(b.nbytes for b in self.buffers)

    def check(self, template: ExpertWeights, what: str) -> None:
        got = tuple((tuple(t.shape), t.dtype) for t in template)
        if got != self.signature:
            raise ValueError(
                f"{what}: its tensors are {got}; the expert cache's slots on {self.device} hold experts of {self.signature}"
            )


class ExpertCache:
    """Routed experts' weights in slots on the compute device(s), keyed by (layer, expert): at most
    max(1, capacity_bytes // one expert's bytes) experts on each device that runs offloaded layers (fewer
    where fewer experts are offloaded to it), least recently used out first. A layer's forward holds
    (pins) the experts it computes with; nothing evicts a held expert."""

    def __init__(self, capacity_bytes: int) -> None:
        if capacity_bytes < 0:
            raise ValueError(f"expert_cache_bytes must be >= 0, got {capacity_bytes}")
        self.capacity_bytes = capacity_bytes
        self.entries: OrderedDict[Key, ExpertWeights] = OrderedDict()  # views of the slots, LRU order
        self.bytes = 0
        self.stats = ExpertCacheStats()
        # two threads may run one model (hooks are per thread; the cache is shared); a layer waits here for
        # another's held slots
        self._lock = threading.Condition()
        self.prefetcher: Prefetcher | None = None  # set by enable_prefetch()
        self._prefetched: set[Key] = set()  # loaded ahead, not yet asked for
        self._where: dict[Key, tuple[SlotPool, int]] = {}
        self._pools: dict[torch.device, SlotPool] = {}
        self._pinned: Counter[Key] = Counter()
        self._offloaded: Counter[torch.device] = Counter()  # experts offloaded to each device's layers

    def enable_prefetch(self) -> None:
        self.prefetcher = Prefetcher(self)

    def register(self, store: OffloadedExperts) -> None:
        """A layer whose experts this cache holds: the slots on its device need be no more than all of theirs."""
        with self._lock:
            if store.device in self._pools:
                raise RuntimeError(f"register layer {store.layer} before the cache's slots on {store.device} are in use")
            self._offloaded[store.device] += store.n_experts

    def n_slots(self, store: OffloadedExperts) -> int:
        """How many experts the cache holds at once on the store's device."""
        fit = self.capacity_bytes // max(1, store.expert_nbytes)
        return max(1, min(fit, self._offloaded[store.device] or store.n_experts))

    def _pool(self, store: OffloadedExperts) -> SlotPool:
        pool = self._pools.get(store.device)
        if pool is None:
            pool = self._pools[store.device] = SlotPool(store.device, store.template, self.n_slots(store))
            self.stats.slot_bytes += pool.nbytes
        return pool

    def __contains__(self, key: Key) -> bool:
        with self._lock:
            return key in self.entries

    # ---- a layer's own loads ---------------------------------------------------------------------------

    def slots(self, store: OffloadedExperts) -> SlotPool:
        """The slot buffers on the store's device."""
        with self._lock:
            return self._pool(store)

    def hold(self, store: OffloadedExperts, experts: list[int]) -> dict[int, int]:
        """The experts' slots (expert -> its slot in slots(store)), loading the missing ones; each is held until
        release(). At most n_slots(store) experts at once; waits while another thread holds the slots."""
        with self._lock:
            pool = self._pool(store)
            if len(experts) > pool.n_slots:
                raise ValueError(f"layer {store.layer}: {len(experts)} experts asked for at once, the cache holds {pool.n_slots}")
            keys = [(store.layer, e) for e in experts]

            def room() -> bool:  # slots for the missing experts, without taking one of the others asked for
                missing = sum(1 for k in keys if k not in self.entries)
                evictable = sum(
                    1 for k in self.entries if self._where[k][0] is pool and k not in self._pinned and k not in wanted
                )
                return len(pool.free) + evictable >= missing

            wanted = set(keys)
            # nothing is held while waiting (another thread's layer holds slots until its group is done), so
            # two threads never wait on each other
            self._lock.wait_for(room)
            held: list[Key] = []  # pinned so far: released again if a load fails
            for key in keys:
                if key in self.entries:  # pinned before any eviction below can take it
                    self._pinned[key] += 1
                    held.append(key)
            for key in keys:
                if key in self.entries:
                    self.stats.hits += 1
                    if key in self._prefetched:
                        self._prefetched.discard(key)
                        self.stats.prefetch_hits += 1
                    self.entries.move_to_end(key)
                    continue
                self.stats.misses += 1
                slot = self._take_slot(pool, lambda k: True)
                start = time.perf_counter()
                try:
                    store.load_into(key[1], pool.views(slot))
                except BaseException:
                    pool.free.append(slot)
                    self._release_locked(held)
                    raise
                self.stats.seconds_moving += time.perf_counter() - start
                self._insert(key, pool, slot)
                self._pinned[key] += 1
                held.append(key)
            return {key[1]: self._where[key][1] for key in keys}

    def release(self, layer: int, experts: list[int]) -> None:
        with self._lock:
            self._release_locked([(layer, e) for e in experts])

    def _release_locked(self, keys: list[Key]) -> None:
        for key in keys:
            self._pinned[key] -= 1
            if self._pinned[key] <= 0:
                del self._pinned[key]
        self._lock.notify_all()

    def _take_slot(self, pool: SlotPool, may_evict: Callable[[Key], bool]) -> int | None:
        """A free slot of pool, else the least recently used unheld entry's that may_evict allows; None if none."""
        if pool.free:
            return pool.free.pop()
        for key in self.entries:
            if self._where[key][0] is pool and key not in self._pinned and may_evict(key):
                return self._evict(key)
        return None

    def _evict(self, key: Key) -> int:
        weights = self.entries.pop(key)
        _, slot = self._where.pop(key)
        self.bytes -= weights_nbytes(weights)
        self.stats.evictions += 1
        if key in self._prefetched:  # evicted before its layer asked for it
            self._prefetched.discard(key)
            self.stats.prefetch_wasted += 1
        return slot

    def _insert(self, key: Key, pool: SlotPool, slot: int) -> None:
        weights = pool.views(slot)
        size = weights_nbytes(weights)
        self.stats.bytes_moved += size
        self.entries[key] = weights
        self._where[key] = (pool, slot)
        self.bytes += size
        self.stats.peak_bytes = max(self.stats.peak_bytes, self.bytes)

    # ---- prefetch --------------------------------------------------------------------------------------

    def reserve_for_prefetch(self, store: OffloadedExperts, expert: int) -> int | None:
        """A slot for the prefetch thread to load `expert` of store's layer into (free, or the least recently
        used entry's that no layer holds and that is neither of that layer nor prefetched); None when the
        expert is already held or no slot can be taken."""
        key = (store.layer, expert)
        with self._lock:
            if key in self.entries:
                return None
            pool = self._pool(store)
            return self._take_slot(pool, lambda k: k[0] != store.layer and k not in self._prefetched)

    def put_prefetched(self, store: OffloadedExperts, expert: int, slot: int | None, seconds: float) -> None:
        """The expert the prefetch thread loaded into `slot` (None: the load failed; the slot is freed)."""
        key = (store.layer, expert)
        with self._lock:
            pool = self._pools[store.device]
            if slot is None:
                return
            self.stats.seconds_prefetching += seconds
            self.stats.prefetched += 1
            if key in self.entries:  # a layer loaded it meanwhile
                self.stats.prefetch_wasted += 1
                pool.free.append(slot)
            else:
                self._insert(key, pool, slot)
                self._prefetched.add(key)
            self._lock.notify_all()

    def free_slot(self, store: OffloadedExperts, slot: int) -> None:
        with self._lock:
            self._pools[store.device].free.append(slot)
            self._lock.notify_all()

    def settle_prefetch(self, layer: int, used: list[int]) -> None:
        """Before a layer loads: stop the prefetch thread (waiting for the expert it is loading), then evict
        every prefetched expert this layer does not route to."""
        if self.prefetcher is not None:
            self.prefetcher.cancel()
        needed = {(layer, e) for e in used}
        with self._lock:
            for key in [k for k in self._prefetched if k not in needed]:
                if key in self.entries:
                    pool, _ = self._where[key]
                    pool.free.append(self._evict(key))
                    self.stats.evictions -= 1  # counted as wasted, not as an eviction
                else:
                    self._prefetched.discard(key)
                    self.stats.prefetch_wasted += 1
            self._lock.notify_all()

    def clear(self) -> None:
        if self.prefetcher is not None:
            self.prefetcher.cancel()
        with self._lock:
            for key in list(self.entries):
                pool, slot = self._where.pop(key)
                pool.free.append(slot)
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
            slot = self.cache.reserve_for_prefetch(job.store, e)
            if slot is None:
                if (job.store.layer, e) in self.cache:
                    continue
                return  # every slot is held, or holds an expert of that layer or one loaded ahead: never beyond
            start = time.perf_counter()
            try:
                job.store.load_into(e, self.cache.slots(job.store).views(slot))
            except BaseException:
                self.cache.free_slot(job.store, slot)
                raise
            self.cache.put_prefetched(job.store, e, slot, time.perf_counter() - start)


class OffloadedExperts:
    """One mixture layer's routed experts, held by `source` (expert id -> its weights, anywhere) and loaded
    through the model's shared ExpertCache into its slots.

    template: one expert's tensors (meta tensors will do) as source gives them: what the slots hold.
    wrap: stacked expert tensors (in the template's order, an expert axis first) -> ExpertTensors, or
    StoredExperts where the experts are kept as stored (the cache then holds and moves the stored bytes, and
    the layer dequantizes each expert it computes with). read_into (optional): writes expert e into the given
    tensors straight from its source, without source's intermediate tensors.

    rounding (moelens.experts.rounding; set by the layer when the model moves to another dtype): the slots
    hold experts as loaded, and an expert computed with is made in the model's dtype through the roundings
    the model's dense weights went through, so that it has their bits."""

    def __init__(
        self, layer: int, n_experts: int, source: Callable[[int], ExpertWeights], cache: ExpertCache, device: torch.device,
        where: str, template: ExpertWeights,
        wrap: Callable[[ExpertWeights], ExpertTensors | StoredExperts] = lambda tensors: ExpertTensors(*tensors),
        read_into: Callable[[int, ExpertWeights], None] | None = None,
    ) -> None:
        self.layer, self.n_experts, self.source, self.cache, self.device, self.where = layer, n_experts, source, cache, device, where
        self.template = tuple(torch.empty(t.shape, dtype=t.dtype, device="meta") for t in template)
        self.expert_nbytes = weights_nbytes(self.template)
        self.wrap, self.read_into = wrap, read_into
        self.rounding: Rounding = ()
        self.next: OffloadedExperts | None = None  # the layer to prefetch for (prefetch_next)
        self.predict: Callable[[torch.Tensor], torch.Tensor] | None = None
        cache.register(self)

    def prefetch_next(self, store: OffloadedExperts, predict: Callable[[torch.Tensor], torch.Tensor]) -> None:
        """After its loads, this layer loads ahead the experts predict(its mixture input) names for `store`."""
        self.next, self.predict = store, predict

    def submit_prefetch(self, x: torch.Tensor) -> None:
        if self.next is not None and self.cache.prefetcher is not None:
            self.cache.prefetcher.submit(PrefetchJob(self.next, x.detach(), self.predict))

    def load_into(self, expert: int, slot: ExpertWeights) -> None:
        """Expert `expert`'s tensors written into `slot`: read there directly where read_into can (host
        slots), else copied from source(expert); a tensor of another shape or dtype is an error, never
        broadcast or cast into the slot."""
        if self.read_into is not None and slot[0].device.type == "cpu":
            self.read_into(expert, slot)
            return
        weights = self.source(expert)
        got = [(tuple(t.shape), t.dtype) for t in weights]
        want = [(tuple(t.shape), t.dtype) for t in slot]
        if got != want:
            raise ValueError(f"layer {self.layer} expert {expert}: its source gave tensors {got}, its cache slot holds {want}")
        for into, t in zip(slot, weights):
            into.copy_(t, non_blocking=True)

    def stack(self, tensors: ExpertWeights, dtype: torch.dtype) -> ExpertTensors | StoredExperts:
        """Tensors stacked over experts as the slots hold them, for a forward in dtype: StoredExperts that
        dequantize through the model's roundings, or dense stacks in dtype (the tensors themselves where the
        model has not moved to another dtype since the load, else copies cast through its roundings)."""
        stack = self.wrap(tensors)
        if isinstance(stack, StoredExperts):
            return stack.with_rounding(self.rounding)
        if self.rounding and stack.gate_up.dtype != dtype:
            return ExpertTensors(*(None if t is None else cast_through(t, self.rounding, dtype) for t in stack))
        return stack

    def expert_weights(self, slot: ExpertWeights, dtype: torch.dtype) -> ExpertWeights:
        """One expert's dense tensors in parameter order, from its slot: the slot's views, or, for experts kept
        stored, dequantized into dtype (new tensors; cast copies too where the model moved to another dtype)."""
        stack = self.stack(tuple(t.unsqueeze(0) for t in slot), dtype)
        if isinstance(stack, StoredExperts):
            return stack.dequantize(dtype).expert(0)
        return tuple(t[0] for t in stack.present())

    def __repr__(self) -> str:
        return f"OffloadedExperts(layer {self.layer}, {self.n_experts} experts in {self.where}, on {self.device})"


class GroupRun:
    """One layer's forward over its routed experts `used`, in groups of at most the cache's slots: holds one
    group at a time, and submits the layer's prefetch once it has loaded all it will load."""

    def __init__(self, store: OffloadedExperts, spec: ExpertSpec, used: list[int], x: torch.Tensor) -> None:
        self.store, self.spec, self.x = store, spec, x
        size = store.cache.n_slots(store)
        self.groups = [used[i : i + size] for i in range(0, len(used), size)]
        self.grad = torch.is_grad_enabled()  # autograd saves the weights: compute with copies of the slots
        self.held: int | None = None
        self.slots: dict[int, int] = {}  # the held group's experts -> their slots
        self._last: tuple[int, ExpertWeights] | None = None  # the expert last computed with, and its weights
        self.last_pass = len(self.groups) == 1  # the next group held is the last load of the layer
        self.bias_rows_of: dict[int, torch.Tensor] = {}
        if len(self.groups) > 1:
            with store.cache._lock:
                store.cache.stats.grouped_layers += 1

    def hold(self, g: int) -> None:
        if self.held == g:
            return
        self.release()  # first: another group may need every slot
        self.slots = self.store.cache.hold(self.store, self.groups[g])
        self.held = g
        if self.last_pass and g == 0:
            self.store.submit_prefetch(self.x)

    def release(self) -> None:
        if self.held is not None:
            self.store.cache.release(self.store.layer, self.groups[self.held])
            self.held, self.slots, self._last = None, {}, None

    def expert(self, e: int) -> ExpertWeights:
        """Expert e's dense tensors (of the held group): its slot's views, or, kept stored, dequantized when
        first computed with (one expert's dense copy at a time)."""
        if self._last is None or self._last[0] != e:
            self._last = None  # dropped before the next is made
            pool = self.store.cache.slots(self.store)
            self._last = e, self.store.expert_weights(pool.views(self.slots[e]), self.x.dtype)
        return self._last[1]

    def linear(self, rows: Float[torch.Tensor, "S n_in"], param: int, counts: list[int]) -> Float[torch.Tensor, "S n_out"]:
        """kernels.experts.grouped_linear with the weight `param` (its position in the spec's parameters) of
        each expert read from its slot: rows sorted by expert, counts[e] rows for expert e. Fills the rows'
        biases (the parameter two places on) for bias_rows."""
        names = self.spec.param_names
        out = rows.new_empty(rows.shape[0], self.spec.shapes()[names[param]][1])
        bias = param + 2 if self.spec.bias else None
        starts = [0]
        for n in counts:
            starts.append(starts[-1] + n)
        if param == 1:  # the down pass: last group first, which the gate_up pass left held
            self.last_pass = True
        order = range(len(self.groups)) if param == 0 else reversed(range(len(self.groups)))
        for g in order:
            self.hold(g)
            for e in self.groups[g] if param == 0 else reversed(self.groups[g]):
                start, n = starts[e], counts[e]
                if not n:
                    continue
                weights = self.expert(e)
                w = weights[param]
                out[start : start + n] = F.linear(rows[start : start + n], w.clone() if self.grad else w)
                if bias is not None:
                    b = weights[bias]
                    if bias not in self.bias_rows_of:
                        self.bias_rows_of[bias] = rows.new_empty(rows.shape[0], b.shape[0], dtype=b.dtype)
                    self.bias_rows_of[bias][start : start + n] = b
        return out

    def bias_rows(self, param: int, experts: Int[torch.Tensor, "S"]) -> Float[torch.Tensor, "S n"]:
        """Each sorted row's expert's bias `param`, gathered by the linear of its weight just before."""
        return self.bias_rows_of.pop(param)


def offloaded_routed_experts(
    store: OffloadedExperts, x: Float[torch.Tensor, "T H"], indices: Int[torch.Tensor, "T k"],
    weights: Float[torch.Tensor, "T k"], spec: ExpertSpec, hooks: ExpertHooks, batch_pos: tuple[int, int],
    executor: Executor,
) -> Float[torch.Tensor, "T H"]:
    """kernels.experts.routed_experts, with the layer's routed experts read from the cache's slots (module
    docstring): the same slots, groups and GEMMs, the same bits. executor: the backend the layer resolved
    when it was set or moved ("torch" or "triton")."""
    check_indices(indices, store.n_experts + spec.n_identity)
    used = [e for e in torch.unique(indices).tolist() if e < store.n_experts]  # identity experts: nothing to fetch
    store.cache.settle_prefetch(store.layer, used)
    run = GroupRun(store, spec, used, x)
    try:
        if executor == "triton":
            return _triton_from_slots(run, x, indices, weights, spec, hooks, batch_pos)
        positions = ExpertTensors(0, 1, 2 if spec.bias else None, 3 if spec.bias else None)  # the linears' `param`
        return routed_experts_torch(
            x, indices, weights, positions, spec.activation, hooks, batch_pos, n_experts=store.n_experts,
            linear=run.linear, bias_rows=run.bias_rows, weight_at=spec.weight_at, combine=spec.combine, rows_by=spec.rows_by,
        )
    finally:
        run.release()


def _triton_from_slots(run: GroupRun, x, indices, weights, spec, hooks, batch_pos) -> torch.Tensor:
    """The Triton kernels over the slot buffers as the weight stack, each slot's expert id mapped to its slot
    (the kernels' per-expert tiles are the same whatever an expert's position in the stack)."""
    store = run.store
    if len(run.groups) > 1:
        used = sum(map(len, run.groups))
        raise ValueError(
            f"layer {store.layer} routes to {used} experts and the expert cache holds {len(run.groups[0])} "
            f"({store.expert_nbytes:,} bytes each); experts_backend='triton' computes a layer's experts in one "
            f"pass: give expert_cache_bytes >= {used * store.expert_nbytes:,}, or use experts_backend='torch'"
        )
    used = run.groups[0] if run.groups else []
    slots = store.cache.hold(store, used) if used else {}
    run.held, run.slots = (0, slots) if used else (None, {})
    if used:
        store.submit_prefetch(x)
    pool = store.cache.slots(store)
    if run.grad:  # autograd saves the weights: a copy of the routed ones, renumbered in ascending expert id
        ids = torch.tensor([slots[e] for e in used], dtype=torch.long, device=x.device)
        tensors = store.stack(tuple(b.index_select(0, ids.to(b.device)) for b in pool.buffers), x.dtype)
        to = torch.arange(len(used), dtype=indices.dtype, device=indices.device)
    else:
        tensors = store.stack(pool.buffers, x.dtype)
        to = torch.tensor([slots[e] for e in used], dtype=indices.dtype, device=indices.device)
    renumber = torch.full((store.n_experts,), -1, dtype=indices.dtype, device=indices.device)
    renumber[torch.tensor(used, dtype=torch.long, device=indices.device)] = to
    return routed_experts(x, renumber[indices], weights, tensors, spec, hooks, batch_pos, "triton")
