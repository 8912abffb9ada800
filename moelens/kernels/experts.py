"""The routed experts, computed per routing slot so every intermediate can be hooked.

Layout conventions: T tokens (batch * pos flattened), k slots per token, S = T * k slots, E experts,
H = d_model, I = d_expert. Slot s of token t is row t * k + s of the flat slot axis.

Two backends give the same hook tensors: "torch" (the reference, any device) and "triton" (CUDA, or CPU
tensors under TRITON_INTERPRET=1). "auto" picks triton only for CUDA tensors on a GPU architecture where the
kernel tests have passed on real hardware (VERIFIED_TRITON_ARCHS), and the torch path everywhere else.
"""

from __future__ import annotations

import os
from collections.abc import Callable
from dataclasses import dataclass
from typing import Literal

import torch
import torch.nn.functional as F
from jaxtyping import Float, Int

from moelens.hooks import HookPoint

Backend = Literal["auto", "torch", "triton"]
BACKENDS = ("auto", "torch", "triton")

# (major, minor) compute capabilities on which tests/test_triton_kernels.py has passed on a real GPU, with
# where and when. Empty: the kernels have run only in Triton's interpreter and been compiled for sm_80 /
# sm_90 without running, so "auto" never trusts them yet. Add an entry only after `bash
# benchmarks/gpu_check.sh` passed on that architecture.
VERIFIED_TRITON_ARCHS: dict[tuple[int, int], str] = {}


@dataclass(frozen=True)
class ExpertHooks:
    """The hook sites inside the routed experts; tensors are shown as [batch pos top_k ...]."""

    pre: HookPoint
    pre_linear: HookPoint
    post: HookPoint
    outputs: HookPoint  # weighted per-slot outputs


def hooked(hook: HookPoint, t: torch.Tensor, batch_pos: tuple[int, int]) -> torch.Tensor:
    """Show a [T, k, n] tensor to a hook as [batch, pos, k, n] and take back what it returns."""
    return hooked_changed(hook, t, batch_pos)[0]


def hooked_changed(hook: HookPoint, t: torch.Tensor, batch_pos: tuple[int, int]) -> tuple[torch.Tensor, bool]:
    """hooked(), and whether a hook replaced or edited the tensor (or a backward hook waits on the new one)."""
    if not hook.has_hooks:
        return t, False
    view = t.view(*batch_pos, *t.shape[1:])
    out, changed = hook.run(view)
    if not changed and out is view and not hook.has_bwd_hooks:
        return t, False
    return out.reshape(t.shape), True


def grouped_linear(
    rows: Float[torch.Tensor, "S n_in"], weight: Float[torch.Tensor, "E n_out n_in"], counts: list[int]
) -> Float[torch.Tensor, "S n_out"]:
    """rows sorted by expert, counts[e] rows for expert e: each group times its expert's weight.

    One grouped_mm call where torch has it for this dtype, else a loop of per-expert matmuls. On CPU,
    grouped_mm was as fast or faster at every token count measured (benchmarks/bench_torch_experts.py:
    1.0-1.2x faster from 8 to 4096 tokens, float32 and bfloat16), so the loop is only the fallback.
    """
    if hasattr(F, "grouped_mm") and rows.dtype == weight.dtype and rows.dtype in (torch.float32, torch.bfloat16):
        offsets = torch.tensor(counts, device=rows.device).cumsum(0).to(torch.int32)
        return F.grouped_mm(rows, weight.transpose(-2, -1), offs=offsets)
    out = rows.new_empty(rows.shape[0], weight.shape[1])
    start = 0
    for e, n in enumerate(counts):
        if n:
            out[start : start + n] = F.linear(rows[start : start + n], weight[e])
        start += n
    return out


def sort_slots(experts: Int[torch.Tensor, "S"], n_experts: int) -> tuple[Int[torch.Tensor, "S"], list[int]]:
    """(slot order sorted by expert, stable; rows per expert) for the grouped GEMMs."""
    return torch.argsort(experts, stable=True), torch.bincount(experts, minlength=n_experts).tolist()


def slot_linear(
    inputs: Float[torch.Tensor, "R n_in"],
    experts: Int[torch.Tensor, "S"],
    weight: Float[torch.Tensor, "E n_out n_in"],
    top_k: int = 1,
) -> Float[torch.Tensor, "S n_out"]:
    """Slot s's input row (row s // top_k of inputs) times the weight of expert experts[s], in slot order.

    The rows are gathered sorted by expert, once, for the grouped GEMM, and scattered back to slot order.
    """
    order, counts = sort_slots(experts, weight.shape[0])
    out = grouped_linear(inputs[order // top_k if top_k > 1 else order], weight, counts)
    return out.new_empty(out.shape).index_copy_(0, order, out)


def check_indices(indices: torch.Tensor, n_experts: int, where: str = "routed_experts") -> None:
    """Expert ids in range: a clear error on CPU; on CUDA an asynchronous assert, so that no host sync
    breaks CUDA-graph capture (a bad id then fails at the next synchronisation)."""
    if indices.device.type == "cuda":
        torch._assert_async(((indices >= 0) & (indices < n_experts)).all(), f"{where}: expert indices must lie in [0, {n_experts})")
        return
    if indices.numel() and (int(indices.min()) < 0 or int(indices.max()) >= n_experts):
        raise IndexError(
            f"{where}: expert indices must lie in [0, {n_experts}), got range [{int(indices.min())}, {int(indices.max())}]"
        )


def resolve_backend(backend: Backend, device: torch.device) -> Literal["torch", "triton"]:
    if backend not in BACKENDS:
        raise ValueError(f"experts backend must be one of {BACKENDS}, got {backend!r}")
    if backend == "auto":
        return "triton" if device.type == "cuda" and triton_verified_on(device) and triton_available() else "torch"
    if backend == "triton":
        if not triton_available():
            raise RuntimeError("experts_backend='triton' needs the triton package (it ships with CUDA builds of torch)")
        if device.type != "cuda" and os.environ.get("TRITON_INTERPRET") != "1":
            raise RuntimeError(f"experts_backend='triton' runs on CUDA tensors (or on CPU with TRITON_INTERPRET=1); got {device}")
    return backend


def triton_verified_on(device: torch.device) -> bool:
    return torch.cuda.get_device_capability(device) in VERIFIED_TRITON_ARCHS


def triton_available() -> bool:
    try:
        import triton  # noqa: F401
    except ImportError:
        return False
    return True


def routed_experts(
    x: Float[torch.Tensor, "T H"],
    indices: Int[torch.Tensor, "T k"],
    weights: Float[torch.Tensor, "T k"],
    W_gate_up: Float[torch.Tensor, "E 2I H"],
    W_down: Float[torch.Tensor, "E H I"],
    act: Callable[[torch.Tensor], torch.Tensor],
    hooks: ExpertHooks,
    batch_pos: tuple[int, int],
    backend: Backend = "torch",
) -> Float[torch.Tensor, "T H"]:
    """sum over slots of weight * down(act(gate(x)) * up(x)), with hooks on every per-slot tensor.

    The slot sum runs in the promoted dtype of outputs and weights, in slot order, and is cast once,
    as the reference does, so low-precision results agree with it.
    """
    check_indices(indices, W_gate_up.shape[0])
    chosen = resolve_backend(backend, x.device)
    if chosen == "triton" and act is not F.silu:  # the kernels fuse SiLU(gate) * up
        if backend == "triton":
            raise ValueError(
                f"experts_backend='triton' computes SiLU(gate) * up; this model's expert activation is "
                f"{getattr(act, '__name__', act)!r}: use experts_backend='torch' or 'auto'"
            )
        chosen = "torch"
    if chosen == "triton":
        from moelens.kernels.triton_experts import routed_experts_triton

        return routed_experts_triton(x, indices, weights, W_gate_up, W_down, act, hooks, batch_pos)
    return routed_experts_torch(x, indices, weights, W_gate_up, W_down, act, hooks, batch_pos)


# (rows sorted by expert, stacked weights, rows per expert) -> the rows times their experts' weights
GroupedLinear = Callable[[torch.Tensor, torch.Tensor, list[int]], torch.Tensor]


def routed_experts_torch(
    x, indices, weights, W_gate_up, W_down, act, hooks: ExpertHooks, batch_pos,
    n_experts: int | None = None, linear: GroupedLinear = grouped_linear,
):
    """The reference's algorithm: slots sorted by expert once, both GEMMs on sorted rows, back to slot
    order for the weighted outputs. Per-slot hooks see (and replace) tensors in slot order; the sorted
    copies are only permuted for them when a hook is on.

    n_experts (default: the stacks' length) and linear let expert parallelism (kernels.expert_parallel)
    run the same steps with each rank's experts only: its linear computes the rank's groups and gathers."""
    T, k = indices.shape
    experts = indices.reshape(-1)
    order, counts = sort_slots(experts, W_gate_up.shape[0] if n_experts is None else n_experts)
    unsort = torch.empty_like(order).index_copy_(0, order, torch.arange(order.numel(), device=order.device))

    def hooked_sorted(hook: HookPoint, t: torch.Tensor) -> torch.Tensor:
        """Show a sorted [S, n] tensor to its hook in slot order; re-sort only what a hook changed."""
        if not hook.has_hooks:
            return t
        seen, changed = hooked_changed(hook, t[unsort].view(T, k, -1), batch_pos)
        return seen.reshape(T * k, -1)[order] if changed else t

    gate_up = linear(x[order // k], W_gate_up, counts)
    pre, pre_linear = gate_up.chunk(2, dim=-1)
    new_pre, new_pre_linear = hooked_sorted(hooks.pre, pre), hooked_sorted(hooks.pre_linear, pre_linear)
    if new_pre is not pre or new_pre_linear is not pre_linear:
        # written back into the [S, 2I] layout: elementwise kernels can round differently on other
        # layouts, and a run must not depend on which hooks are on
        pre, pre_linear = torch.cat([new_pre, new_pre_linear], dim=-1).chunk(2, dim=-1)
    post = hooked_sorted(hooks.post, act(pre) * pre_linear)
    out = linear(post, W_down, counts) * weights.reshape(-1)[order].unsqueeze(-1)
    weighted = hooked(hooks.outputs, out[unsort].view(T, k, -1), batch_pos)
    return weighted.sum(dim=1).to(x.dtype)
