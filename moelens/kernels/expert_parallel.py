"""Expert parallelism over torch.distributed: rank r holds a contiguous range of each layer's routed experts.

Everything else (embeddings, attention, routers, shared experts) is replicated, so every rank computes the
same x, expert indices and router weights. The routed experts then run routed_experts_torch's algorithm
unchanged, except for its two grouped GEMMs: slots sorted by expert put each rank's experts in one
contiguous block of rows, the owner computes that block (each expert's group is the same GEMM, on the
same rows, as in one process), and an all_gather hands the whole sorted tensor to every rank. Gathering
only copies bytes and nothing is summed across ranks, so every hook tensor, the logits and generate() are
bit for bit those of one process, for any number of ranks.

Collectives run in the order the layers run, so every rank must run the same forwards with hooks that act
the same on every rank (a hook that re-routes on one rank only would desynchronise them).
"""

from __future__ import annotations

import os

import torch
import torch.distributed as dist
from jaxtyping import Float, Int

from moelens.experts.spec import ExpertSpec, ExpertTensors
from moelens.kernels.experts import ExpertHooks, check_indices, grouped_linear, routed_experts_torch

TORCHRUN_ENV = ("RANK", "WORLD_SIZE", "MASTER_ADDR", "MASTER_PORT")


def expert_range(n_experts: int, world: int, rank: int) -> tuple[int, int]:
    """[lo, hi): rank's experts, r*E//N up to (r+1)*E//N (sizes differ by at most one when N does not divide E)."""
    return rank * n_experts // world, (rank + 1) * n_experts // world


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
    (ExpertTensors: gate_up [hi-lo, 2I, H], down [hi-lo, H, I], biases where the spec has them) on the
    compute device."""

    def __init__(self, layer: int, n_experts: int, tensors: ExpertTensors, rank: int, world: int, group=None) -> None:
        self.layer, self.n_experts, self.rank, self.world, self.group = layer, n_experts, rank, world, group
        self.bounds = [expert_range(n_experts, world, r) for r in range(world)]
        self.lo, self.hi = self.bounds[rank]
        if any(t.shape[0] != self.hi - self.lo for t in tensors.present()):
            raise ValueError(f"layer {layer}: rank {rank} holds experts [{self.lo}, {self.hi}), got {tensors.n_experts} stacked")
        self.tensors = tensors

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
        check_indices(indices, self.n_experts)
        return routed_experts_torch(
            x, indices, weights, self.tensors, spec.activation, hooks, batch_pos,
            n_experts=self.n_experts, linear=self.grouped_linear, bias_rows=self.bias_rows,
        )

    def bias_rows(self, bias: Float[torch.Tensor, "E_local n"], experts: Int[torch.Tensor, "S"]) -> Float[torch.Tensor, "S n"]:
        """Each sorted row's expert's bias (experts: the rows' expert ids, sorted): the owners look up their
        experts' rows, a contiguous block of the sorted rows, and every rank gathers them."""
        counts = torch.bincount(experts, minlength=self.n_experts).tolist()
        start, end = sum(counts[: self.lo]), sum(counts[: self.hi])
        gathered = self._gather(bias.index_select(0, experts[start:end] - self.lo), counts)
        if torch.is_grad_enabled() and bias.requires_grad:
            return _Gathered.apply(bias, bias, gathered)
        return gathered

    def grouped_linear(
        self, rows: Float[torch.Tensor, "S n_in"], weight: Float[torch.Tensor, "E_local n_out n_in"], counts: list[int]
    ) -> Float[torch.Tensor, "S n_out"]:
        """kernels.experts.grouped_linear over all experts (counts has one entry per expert of the layer),
        computed by the owners of the groups and gathered: rows and counts are the same on every rank."""
        start, end = sum(counts[: self.lo]), sum(counts[: self.hi])
        if end > start:
            local = grouped_linear(rows[start:end], weight, counts[self.lo : self.hi])
        else:  # no slot routed here: grouped_mm is not asked for an empty product
            local = rows.new_empty(0, weight.shape[1])
        gathered = self._gather(local, counts)
        if torch.is_grad_enabled() and (rows.requires_grad or weight.requires_grad):
            return _Gathered.apply(rows, weight, gathered)
        return gathered

    def _gather(self, local: Float[torch.Tensor, "n_local n"], counts: list[int]) -> Float[torch.Tensor, "S n"]:
        """Every rank's block of sorted rows (this rank's is `local`), in rank order: rows per rank follow from
        counts, which are the same on every rank."""
        sizes = [sum(counts[lo:hi]) for lo, hi in self.bounds]
        longest = max(sizes)
        if longest == 0:  # the same on every rank (counts are replicated), so all skip the collective together
            return local
        # gloo's all_gather wants equal sizes: pad every part to the longest, drop the padding after
        n = local.shape[1]
        padded = local if sizes[self.rank] == longest else torch.cat([local, local.new_zeros(longest - sizes[self.rank], n)])
        parts = [torch.empty_like(padded) for _ in range(self.world)]
        dist.all_gather(parts, padded.contiguous(), group=self.group)
        return torch.cat([part[:size] for part, size in zip(parts, sizes)])

    def __repr__(self) -> str:
        return f"experts {self.lo}..{self.hi - 1} of {self.n_experts} on rank {self.rank} of {self.world}"
