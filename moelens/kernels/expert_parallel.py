"""Expert parallelism over torch.distributed: rank r holds a contiguous range of each layer's routed experts.

Everything else (embeddings, attention, routers, shared experts) is replicated, so every rank computes the
same x, expert indices and router weights. The routed experts then run routed_experts_torch's algorithm
unchanged, except for its two grouped GEMMs: slots sorted by expert put each rank's experts in one
contiguous block of rows, the owner computes that block (each expert's group is the same GEMM, on the
same rows, as in one process), and an all_gather hands the whole sorted tensor to every rank. Gathering
only copies bytes and nothing is summed across ranks, so every hook tensor, the logits and generate() are
bit for bit those of one process, for any number of ranks.

That holds while every rank computes each GEMM on the same rows: the same forwards, on the same tokens and
weights, with hooks that change the same values on every rank. It is checked, not assumed: before each
GEMM's exchange the ranks all_gather a fixed-size fingerprint of it (ExpertExchange.agree: the exchange's
number, the layer, the rows' shape and dtype, the tokens per expert, a hash of the rows' bytes) and every
rank raises ExpertParallelError, naming what differed on which rank, unless all are equal; only then is the
variable-size data exchanged. The down projection's exchange is checked too when any rank hooks a site
between the two GEMMs (otherwise its rows are the gathered gate_up output, the same bytes everywhere). A
hook that only reads (run_with_cache on one rank) changes no row and passes. Every exchange runs on the model's own process group with a timeout (from_pretrained's
expert_parallel_timeout), so a rank that stalls or dies is an ExpertParallelError naming the layer and the
timeout on the others, not a wait of torch's default 30 minutes.
"""

from __future__ import annotations

import datetime
import math
import os

import torch
import torch.distributed as dist
from jaxtyping import Float, Int

from moelens.experts.rounding import Rounding
from moelens.experts.spec import ExpertSpec, ExpertTensors
from moelens.experts.stored import StoredExperts
from moelens.kernels.experts import ExpertHooks, check_indices, grouped_linear, routed_experts_torch

TORCHRUN_ENV = ("RANK", "WORLD_SIZE", "MASTER_ADDR", "MASTER_PORT")
DEFAULT_TIMEOUT_S = 300.0  # from_pretrained(expert_parallel_timeout=None)


class ExpertParallelError(RuntimeError):
    """The ranks of an expert-parallel model cannot exchange a layer's expert outputs: they disagree on what
    they compute (raised on every rank, the process group still usable), or a rank did not answer in time
    or failed (the process group is then unusable)."""


def expert_range(n_experts: int, world: int, rank: int) -> tuple[int, int]:
    """[lo, hi): rank's experts, r*E//N up to (r+1)*E//N (sizes differ by at most one when N does not divide E)."""
    return rank * n_experts // world, (rank + 1) * n_experts // world


def check_timeout(timeout: float | None) -> float:
    """from_pretrained's expert_parallel_timeout in seconds (None: DEFAULT_TIMEOUT_S), checked."""
    if timeout is None:
        return DEFAULT_TIMEOUT_S
    if isinstance(timeout, bool) or not isinstance(timeout, (int, float)) or not math.isfinite(timeout) or timeout <= 0:
        raise ValueError(f"expert_parallel_timeout must be a positive number of seconds, got {timeout!r}")
    return float(timeout)


def init_process_group(device: torch.device) -> tuple[int, int]:
    """(rank, world size) of the default process group, initialised from torchrun's environment variables
    when nobody has yet: nccl for CUDA devices, gloo otherwise."""
    if not dist.is_available():
        raise RuntimeError("expert_parallel needs torch.distributed, which this torch build lacks")
    if not dist.is_initialized():
        missing = [v for v in TORCHRUN_ENV if v not in os.environ]
        if missing:
            raise RuntimeError(
                f"expert_parallel: no process group is initialised and {', '.join(missing)} are not set; run under "
                "torchrun, or call torch.distributed.init_process_group() before from_pretrained"
            )
        if device.type == "cuda" and device.index is not None:
            torch.cuda.set_device(device)  # nccl binds each rank to the current device
        dist.init_process_group("nccl" if device.type == "cuda" else "gloo")
    return dist.get_rank(), dist.get_world_size()


# ---- fingerprints: what a rank is about to exchange, in a fixed number of int64s ---------------------------

HASH_CHUNK = 2**22  # elements hashed at a time: the int32 temporaries stay at 16 MiB whatever the tensor
# multipliers of a 32-bit integer mix (MurmurHash's), as int32-range Python ints: products wrap mod 2**32
_MIX = (0x2545F491, 0x1B873593, 0x5BD1E995)


def _odd_weights(n: int, salt: int, device: torch.device) -> Int[torch.Tensor, "n"]:
    """A pseudo-random odd int32 for each index 0..n-1, a function of (index, salt) only: the same on every
    rank and device, however long the vector asked for."""
    w = (torch.arange(n, dtype=torch.int32, device=device) + salt) * _MIX[0] + _MIX[1]
    w = (w ^ (w >> 15)) * _MIX[2]
    return (w ^ (w >> 13)) | 1


def _int32_bits(t: torch.Tensor) -> Int[torch.Tensor, "R C"]:
    """t's bytes as a [rows, n] int32 tensor, row i holding t[i]'s bytes (one row for a 0-d or 1-d t)."""
    rows = t.detach().contiguous().reshape(t.shape[0] if t.dim() > 1 else 1, -1)
    if rows.element_size() in (4, 8):
        return rows.view(torch.int32)  # 8-byte elements as two int32 each
    return rows.view(torch.int16 if rows.element_size() == 2 else torch.uint8).to(torch.int32)


def content_hash(t: torch.Tensor) -> Int[torch.Tensor, ""]:
    """A 32-bit hash of t's bytes, exact in any summation order: sum over elements of mix(bits) * row weight *
    column weight (mod 2**32), where bits is the element read as an integer, mix a bijection of 32-bit
    values and the weights pseudo-random odd numbers of the position. Equal tensors hash equal on every rank
    and device; a change to any single element always changes the hash (a bijection, then odd factors,
    invertible mod 2**32); other changes collide with probability about 2**-32. A 0-d int32 on t's device.
    On a CPU thread it costs about 1% of a grouped GEMM on the same rows."""
    bits = _int32_bits(t)
    n_rows, n_cols = bits.shape
    col_w = _odd_weights(n_cols, 0, t.device)
    total = torch.zeros((), dtype=torch.int32, device=t.device)
    step = max(1, HASH_CHUNK // max(n_cols, 1))
    for start in range(0, n_rows, step):
        part = bits[start : start + step]
        mixed = part ^ (part >> 16)
        row_sums = (mixed * col_w).sum(dim=1, dtype=torch.int32)
        total += (row_sums * _odd_weights(part.shape[0], start + 0x10000000, t.device)).sum(dtype=torch.int32)
    return total


# fingerprint fields, in order; all but "hooks" must be equal on every rank ("hooks" only helps the message)
FIELDS = ("exchange", "layer", "gemm", "tokens", "rows", "n_in", "n_out", "dtype", "n_experts", "routing", "inputs", "hooks")
GEMMS = ("gate_up", "down")
HOOK_SITES = ("pre", "pre_linear", "post", "outputs")
# hooked sites between the GEMMs: only a hook there can make the down projection's rows differ across ranks
# once the gate_up rows agree (the gathered gate_up output is the same bytes on every rank)
BETWEEN_GEMMS = sum(1 << i for i, s in enumerate(HOOK_SITES) if s != "outputs")
_DTYPES = (torch.float32, torch.bfloat16, torch.float16, torch.float64)
# what a differing field means, in the order the message names them (the first that differs is the cause)
_CAUSES = {
    "exchange": "the ranks are at different exchanges of this model: one ran a forward (or part of one) the others "
    "did not, e.g. it caught an exception the others did not raise, or ran more generate steps",
    "layer": "the ranks are at different layers: one ran a forward (or part of one) the others did not, e.g. it "
    "caught an exception the others did not raise",
    "gemm": "the ranks are at different steps of the layer",
    "tokens": "the ranks run different batch shapes",
    "rows": "the ranks route a different number of slots",
    "n_in": "the ranks hold different models",
    "n_out": "the ranks hold different models",
    "dtype": "the ranks run different dtypes",
    "n_experts": "the ranks hold different models",
    "routing": "the routing differs (tokens per expert): different tokens or weights, or a hook that changes the "
    "routing on some ranks only",
    "inputs": "the experts' input rows differ: different tokens, weights or sampling, or a hook that changes "
    "activations on some ranks only",
}


def _shown(field: str, value: int) -> str:
    if field == "gemm":
        return GEMMS[value] if 0 <= value < len(GEMMS) else str(value)
    if field == "dtype":
        return str(_DTYPES[value]).removeprefix("torch.") if 0 <= value < len(_DTYPES) else f"dtype #{value}"
    if field in ("routing", "inputs"):
        return f"hash {value & 0xFFFFFFFF:08x}"
    if field == "hooks":
        return ", ".join(s for i, s in enumerate(HOOK_SITES) if value >> i & 1) or "none"
    return str(value)


def _by_value(field: str, rows: list[dict[str, int]]) -> str:
    """'ranks 0, 2: X; rank 1: Y' for one field."""
    groups: dict[int, list[int]] = {}
    for rank, row in enumerate(rows):
        groups.setdefault(row[field], []).append(rank)
    return "; ".join(
        f"rank{'s' if len(ranks) > 1 else ''} {', '.join(map(str, ranks))}: {_shown(field, value)}" for value, ranks in groups.items()
    )


def disagreement(rows: list[dict[str, int]]) -> str | None:
    """None when every rank's fingerprint is the same; else the message naming what differs, rank by rank."""
    differ = [f for f in FIELDS if f != "hooks" and len({row[f] for row in rows}) > 1]
    if not differ:
        return None
    first = rows[0]
    where = (
        f"layer {first['layer']}'s {_shown('gemm', first['gemm'])} exchange"
        if "layer" not in differ and "gemm" not in differ
        else "an expert exchange"
    )
    details = "; ".join(f"{field}: {_by_value(field, rows)}" for field in differ)
    return (
        f"expert_parallel: the ranks disagree on {where}, so their results would not be one process's: "
        f"{_CAUSES[differ[0]]} ({details}). Hooks on the routed experts' sites: {_by_value('hooks', rows)}. Every "
        "rank must run the same forwards on the same tokens and weights, with hooks that change the same values "
        "(hooks that only read may differ). Nothing was exchanged: every rank raises this, and the next forward "
        "can run"
    )


class ExpertExchange:
    """The process group one expert-parallel model exchanges on (every rank of the default group, with its own
    timeout), the number of exchanges this rank has made, and whether one failed (which leaves the group
    unusable). Fingerprints go over a gloo group, so that disagreements and timeouts are Python exceptions
    whatever the backend; the data over `group` (nccl on CUDA, else the same gloo group)."""

    def __init__(self, rank: int, world: int, timeout_s: float, group=None, check_group=None) -> None:
        self.rank, self.world, self.timeout_s = rank, world, timeout_s
        self.group, self.check_group = group, check_group
        self.exchanges = 0
        self.failed: str | None = None

    @classmethod
    def create(cls, device: torch.device, timeout_s: float, ranks_per_group: int | None = None) -> ExpertExchange:
        """Join (or initialise, see init_process_group) the default group and make this model's groups: a
        collective call, which every rank makes in the same order (from_pretrained does). ranks_per_group: the
        model spans only this rank's group of that many consecutive ranks (ranks [g*G, (g+1)*G): one model
        per group, as the replicas of a data-parallel trace are); None: every rank."""
        rank, world = init_process_group(device)
        size = world if ranks_per_group is None else ranks_per_group
        if isinstance(size, bool) or not isinstance(size, int) or size < 1 or world % size:
            raise ValueError(f"expert_parallel={ranks_per_group!r} ranks per group: the {world} ranks must be whole groups of a positive size")
        # the new groups' rendezvous waits at most the timeout too, and loading takes each rank its own time:
        # meet on the default group (its own timeout) first
        if dist.get_backend() == "nccl":
            dist.barrier(device_ids=[device.index if device.index is not None else torch.cuda.current_device()])
        else:
            dist.barrier()
        timeout = datetime.timedelta(seconds=timeout_s)
        try:
            if size == world:
                check_group = dist.new_group(backend="gloo", timeout=timeout)
                group = check_group if dist.get_backend() == "gloo" else dist.new_group(timeout=timeout)
            else:  # every rank makes every group (new_group is collective), and keeps its own
                for first in range(0, world, size):
                    ranks = list(range(first, first + size))
                    checks = dist.new_group(ranks, backend="gloo", timeout=timeout)
                    data = checks if dist.get_backend() == "gloo" else dist.new_group(ranks, timeout=timeout)
                    if rank in ranks:
                        check_group, group = checks, data
        except RuntimeError as err:
            raise ExpertParallelError(
                f"expert_parallel: rank {rank} could not set up the model's exchange group with the other ranks within "
                f"expert_parallel_timeout={timeout_s:g} s ({err})"
            ) from err
        return cls(rank % size, size, timeout_s, group, check_group)

    def all_gather(self, tensor: torch.Tensor, layer: int, what: str, group=None) -> list[torch.Tensor]:
        """Every rank's `tensor` (equal shapes), or ExpertParallelError naming the layer (and the timeout, when
        a rank did not answer within it). what: "gate_up exchange", ..."""
        if self.failed is not None:
            raise ExpertParallelError(
                f"expert_parallel: layer {layer}'s {what} cannot run: an earlier one failed ({self.failed}), "
                "which leaves this model's process group unusable; restart every rank"
            )
        parts = [torch.empty_like(tensor) for _ in range(self.world)]
        try:
            dist.all_gather(parts, tensor, group=self.group if group is None else group)
        except RuntimeError as err:  # gloo raises RuntimeError (DistBackendError) on timeouts and lost peers
            timed_out = "timed out" in str(err).lower() or "timeout" in str(err).lower()
            reason = (
                f"no answer from every rank within expert_parallel_timeout={self.timeout_s:g} s: a rank stalled, "
                "died, or is running something else"
                if timed_out
                else "another rank failed or left"
            )
            self.failed = f"layer {layer}'s {what} on rank {self.rank}: {reason}"
            raise ExpertParallelError(
                f"expert_parallel: layer {layer}'s {what} failed on rank {self.rank}: {reason} ({err}). "
                "This model's process group is unusable now; restart every rank "
                "(from_pretrained(expert_parallel_timeout=...) sets how long a rank waits for the others)"
            ) from err
        return parts

    def agree(self, fingerprint: dict[str, int], layer: int, what: str) -> list[dict[str, int]]:
        """Exchange fixed-size fingerprints of what every rank is about to exchange; ExpertParallelError on
        every rank unless all are equal (every rank receives all of them, so all decide alike). Returns them."""
        fingerprint = {"exchange": self.exchanges} | fingerprint
        self.exchanges += 1
        mine = torch.tensor([fingerprint[f] for f in FIELDS], dtype=torch.int64)
        parts = self.all_gather(mine, layer, f"{what} exchange (the check before it)", self.check_group)
        rows = [dict(zip(FIELDS, part.tolist())) for part in parts]
        message = disagreement(rows)
        if message is not None:
            raise ExpertParallelError(message)
        return rows


class _Gathered(torch.autograd.Function):
    """Forward: the gathered tensor. Backward through it would need every rank's row gradients summed
    back into the replicated activations, which this module does not do yet: say so instead of
    returning gradients that miss the other ranks' experts."""

    @staticmethod
    def forward(ctx, rows: torch.Tensor, weight: torch.Tensor, gathered: torch.Tensor) -> torch.Tensor:  # noqa: ARG004
        return gathered

    @staticmethod
    def backward(ctx, grad: torch.Tensor):
        raise NotImplementedError("expert_parallel: gradients through the routed experts are not supported yet")


class ExpertShard:
    """One mixture layer's routed experts on this rank: experts [lo, hi) of n_experts, their tensors stacked
    (ExpertTensors: gate_up [hi-lo, 2I, H], down [hi-lo, H, I], biases where the spec has them; or
    StoredExperts, kept as the checkpoint stores them, of which each call dequantizes the experts its slots
    route to) on the compute device; exchanges through `exchange` (shared by the model's layers), or the
    default group without checks or timeout when None."""

    def __init__(
        self, layer: int, n_experts: int, tensors: ExpertTensors | StoredExperts, rank: int, world: int, group=None,
        exchange: ExpertExchange | None = None,
    ) -> None:
        self.layer, self.n_experts, self.rank, self.world, self.group = layer, n_experts, rank, world, group
        self.exchange = exchange
        self.bounds = [expert_range(n_experts, world, r) for r in range(world)]
        self.lo, self.hi = self.bounds[rank]
        held = tensors.tensors if isinstance(tensors, StoredExperts) else tensors.present()
        if any(t.shape[0] != self.hi - self.lo for t in held):
            raise ValueError(f"layer {layer}: rank {rank} holds experts [{self.lo}, {self.hi}), got {tensors.n_experts} stacked")
        self.tensors = tensors
        # this call's dense experts (the held ones, or the routed ones dequantized), and where each held
        # expert is in them (None: all held, in order)
        self._local: ExpertTensors | None = None
        self._position: Int[torch.Tensor, "E_local"] | None = None
        self._call = {"tokens": 0, "hooks": 0}  # this call's, for the fingerprints of its two GEMMs
        self._check_down = True  # whether the down projection's exchange is checked too (see BETWEEN_GEMMS)

    def follow_dtype(self, dtype: torch.dtype, rounding: Rounding) -> None:
        """The model moved to dtype (moelens.experts.rounding): stored experts dequantize through its
        roundings, dense ones are cast to it, as the model's parameters are."""
        if isinstance(self.tensors, StoredExperts):
            self.tensors = self.tensors.with_rounding(rounding)
        else:
            self.tensors = ExpertTensors(*(None if t is None else t.to(dtype) for t in self.tensors))

    def __call__(
        self,
        x: Float[torch.Tensor, "T H"],
        indices: Int[torch.Tensor, "T k"],
        weights: Float[torch.Tensor, "T k"],
        spec: ExpertSpec,
        hooks: ExpertHooks,
        batch_pos: tuple[int, int],
        backend: str = "torch",
    ) -> Float[torch.Tensor, "T H"]:
        if backend == "triton":
            raise ValueError("expert_parallel runs the routed experts on the torch path: use experts_backend='torch' or 'auto'")
        check_indices(indices, self.n_experts + spec.n_identity)
        self._call = {"tokens": x.shape[0], "hooks": sum(1 << i for i, s in enumerate(HOOK_SITES) if hooks.hooked(s))}
        self._local, self._position = self._dense(indices, x.dtype)
        try:
            return routed_experts_torch(
                x, indices, weights, self._local, spec.activation, hooks, batch_pos,
                n_experts=self.n_experts, linear=self.grouped_linear, bias_rows=self.bias_rows, weight_at=spec.weight_at, combine=spec.combine, rows_by=spec.rows_by,
            )
        finally:
            self._local = self._position = None

    def _dense(self, indices: Int[torch.Tensor, "T k"], dtype: torch.dtype) -> tuple[ExpertTensors, torch.Tensor | None]:
        """(this call's dense experts, each held expert's position in them): the held stacks as they are, or
        the held experts the slots route to, dequantized (the others' groups are empty, so leaving them out
        changes no GEMM)."""
        if not isinstance(self.tensors, StoredExperts):
            return self.tensors, None
        routed = torch.bincount(indices.reshape(-1), minlength=self.n_experts)[self.lo : self.hi] > 0
        used = torch.nonzero(routed).flatten()
        position = torch.full((self.hi - self.lo,), -1, dtype=torch.long, device=indices.device)
        position[used] = torch.arange(used.numel(), device=indices.device)
        return self.tensors.select(used).dequantize(dtype), position

    def bias_rows(self, bias: Float[torch.Tensor, "E_local n"], experts: Int[torch.Tensor, "S"]) -> Float[torch.Tensor, "S n"]:
        """Each sorted row's expert's bias (experts: the rows' expert ids, sorted): the owners look up their
        experts' rows, a contiguous block of the sorted rows, and every rank gathers them. Not fingerprinted:
        the rows follow from the tokens per expert, which the gate_up exchange's check has compared."""
        counts = torch.bincount(experts, minlength=self.n_experts).tolist()
        start, end = sum(counts[: self.lo]), sum(counts[: self.hi])
        local = experts[start:end] - self.lo
        local = local if self._position is None else self._position[local]
        gathered = self._gather(bias.index_select(0, local), counts, "bias exchange")
        if torch.is_grad_enabled() and bias.requires_grad:
            return _Gathered.apply(bias, bias, gathered)
        return gathered

    def fingerprint(self, rows: torch.Tensor, weight: torch.Tensor, counts: list[int]) -> dict[str, int]:
        """What this rank is about to compute and exchange for one GEMM (see FIELDS)."""
        return {
            "layer": self.layer,
            "gemm": 0 if weight is self._local.gate_up else 1,
            "tokens": self._call["tokens"],
            "rows": rows.shape[0],
            "n_in": rows.shape[1],
            "n_out": weight.shape[1],
            "dtype": _DTYPES.index(rows.dtype) if rows.dtype in _DTYPES else len(_DTYPES),
            "n_experts": len(counts),
            "routing": int(content_hash(torch.tensor(counts, dtype=torch.int64))),
            "inputs": int(content_hash(rows)),
            "hooks": self._call["hooks"],
        }

    def grouped_linear(
        self, rows: Float[torch.Tensor, "S n_in"], weight: Float[torch.Tensor, "E_local n_out n_in"], counts: list[int]
    ) -> Float[torch.Tensor, "S n_out"]:
        """kernels.experts.grouped_linear over all experts (counts has one entry per expert of the layer),
        computed by the owners of the groups and gathered: rows and counts are the same on every rank
        (checked first, when the shard has an exchange)."""
        what = GEMMS[0] if weight is self._local.gate_up else GEMMS[1]
        if self.exchange is not None and (what == "gate_up" or self._check_down):
            agreed = self.exchange.agree(self.fingerprint(rows, weight, counts), self.layer, what)
            if what == "gate_up":  # every rank saw every rank's hooks: all decide alike
                self._check_down = any(row["hooks"] & BETWEEN_GEMMS for row in agreed)
        start, end = sum(counts[: self.lo]), sum(counts[: self.hi])
        if end > start:
            held = counts[self.lo : self.hi]  # with dequantized routed experts only, their groups only
            local = grouped_linear(rows[start:end], weight, held if self._position is None else [n for n in held if n])
        else:  # no slot routed here: grouped_mm is not asked for an empty product
            local = rows.new_empty(0, weight.shape[1])
        gathered = self._gather(local, counts, f"{what} exchange")
        if torch.is_grad_enabled() and (rows.requires_grad or weight.requires_grad):
            return _Gathered.apply(rows, weight, gathered)
        return gathered

    def _gather(self, local: Float[torch.Tensor, "n_local n"], counts: list[int], what: str) -> Float[torch.Tensor, "S n"]:
        """Every rank's block of sorted rows (this rank's is `local`), in rank order: rows per rank follow from
        counts, which are the same on every rank. what: the exchange's name in errors."""
        sizes = [sum(counts[lo:hi]) for lo, hi in self.bounds]
        longest = max(sizes)
        if longest == 0:  # the same on every rank (counts are replicated), so all skip the collective together
            return local
        # gloo's all_gather wants equal sizes: pad every part to the longest, drop the padding after
        n = local.shape[1]
        padded = local if sizes[self.rank] == longest else torch.cat([local, local.new_zeros(longest - sizes[self.rank], n)])
        if self.exchange is not None:
            parts = self.exchange.all_gather(padded.contiguous(), self.layer, what)
        else:
            parts = [torch.empty_like(padded) for _ in range(self.world)]
            dist.all_gather(parts, padded.contiguous(), group=self.group)
        return torch.cat([part[:size] for part, size in zip(parts, sizes)])

    def __repr__(self) -> str:
        return f"experts {self.lo}..{self.hi - 1} of {self.n_experts} on rank {self.rank} of {self.world}"
