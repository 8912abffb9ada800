"""The routed experts, computed per routing slot so every intermediate can be hooked.

Layout conventions: T tokens (batch * pos flattened), k slots per token, S = T * k slots, E experts,
H = d_model, I = d_expert. Slot s of token t is row t * k + s of the flat slot axis.

Two backends give the same hook tensors: "torch" (the reference, any device) and "triton" (CUDA, or CPU
tensors under TRITON_INTERPRET=1). "auto" picks triton for CUDA tensors when triton is importable.
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
# Below this many slots per expert, one grouped_mm call beats a Python loop of per-expert matmuls on CPU;
# above it the loop's large GEMMs win (benchmarks/bench_torch_experts.py measures the crossover).
GROUPED_MM_MAX_ROWS_PER_EXPERT = 64


@dataclass(frozen=True)
class ExpertHooks:
    """The hook sites inside the routed experts; tensors are shown as [batch pos top_k ...]."""

    pre: HookPoint
    pre_linear: HookPoint
    post: HookPoint
    outputs: HookPoint  # weighted per-slot outputs


def hooked(hook: HookPoint, t: torch.Tensor, batch_pos: tuple[int, int]) -> torch.Tensor:
    """Show a [T, k, n] tensor to a hook as [batch, pos, k, n] and take back what it returns."""
    if not hook.has_hooks:
        return t
    return hook(t.view(*batch_pos, *t.shape[1:])).reshape(t.shape)


def grouped_linear(
    rows: Float[torch.Tensor, "S n_in"], weight: Float[torch.Tensor, "E n_out n_in"], counts: list[int]
) -> Float[torch.Tensor, "S n_out"]:
    """rows sorted by expert, counts[e] rows for expert e: each group times its expert's weight."""
    use_grouped_mm = (
        hasattr(F, "grouped_mm")
        and rows.dtype == weight.dtype
        and rows.dtype in (torch.float32, torch.bfloat16)
        and (rows.device.type != "cpu" or max(counts, default=0) <= GROUPED_MM_MAX_ROWS_PER_EXPERT)
    )
    if use_grouped_mm:
        offsets = torch.tensor(counts, device=rows.device).cumsum(0).to(torch.int32)
        return F.grouped_mm(rows, weight.transpose(-2, -1), offs=offsets)
    out = rows.new_empty(rows.shape[0], weight.shape[1])
    start = 0
    for e, n in enumerate(counts):
        if n:
            out[start : start + n] = F.linear(rows[start : start + n], weight[e])
        start += n
    return out


def slot_linear(
    inputs: Float[torch.Tensor, "R n_in"],
    experts: Int[torch.Tensor, "S"],
    weight: Float[torch.Tensor, "E n_out n_in"],
    top_k: int = 1,
) -> Float[torch.Tensor, "S n_out"]:
    """Slot s's input row (row s // top_k of inputs) times the weight of expert experts[s], in slot order.

    The rows are gathered sorted by expert, once, for the grouped GEMM, and scattered back to slot order.
    """
    order = torch.argsort(experts, stable=True)
    counts = torch.bincount(experts, minlength=weight.shape[0]).tolist()
    out = grouped_linear(inputs[order // top_k if top_k > 1 else order], weight, counts)
    return out.new_empty(out.shape).index_copy_(0, order, out)


def check_indices(indices: torch.Tensor, n_experts: int) -> None:
    if indices.numel() and (int(indices.min()) < 0 or int(indices.max()) >= n_experts):
        raise IndexError(
            f"expert indices must lie in [0, {n_experts}), got range [{int(indices.min())}, {int(indices.max())}]"
        )


def resolve_backend(backend: Backend, device: torch.device) -> Literal["torch", "triton"]:
    if backend not in BACKENDS:
        raise ValueError(f"experts backend must be one of {BACKENDS}, got {backend!r}")
    if backend == "auto":
        return "triton" if device.type == "cuda" and triton_available() else "torch"
    if backend == "triton":
        if not triton_available():
            raise RuntimeError("experts_backend='triton' needs the triton package (it ships with CUDA builds of torch)")
        if device.type != "cuda" and os.environ.get("TRITON_INTERPRET") != "1":
            raise RuntimeError(f"experts_backend='triton' runs on CUDA tensors (or on CPU with TRITON_INTERPRET=1); got {device}")
    return backend


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
    if resolve_backend(backend, x.device) == "triton" and act is F.silu:
        from moelens.kernels.triton_experts import routed_experts_triton

        return routed_experts_triton(x, indices, weights, W_gate_up, W_down, act, hooks, batch_pos)
    return routed_experts_torch(x, indices, weights, W_gate_up, W_down, act, hooks, batch_pos)


def routed_experts_torch(x, indices, weights, W_gate_up, W_down, act, hooks, batch_pos):
    T, k = indices.shape
    experts = indices.reshape(-1)
    gate_up = slot_linear(x, experts, W_gate_up, top_k=k).view(T, k, -1)
    pre, pre_linear = gate_up.chunk(2, dim=-1)
    pre = hooked(hooks.pre, pre, batch_pos)
    pre_linear = hooked(hooks.pre_linear, pre_linear, batch_pos)
    post = hooked(hooks.post, act(pre) * pre_linear, batch_pos)
    out = slot_linear(post.reshape(T * k, -1), experts, W_down).view(T, k, -1)
    weighted = hooked(hooks.outputs, out * weights.unsqueeze(-1), batch_pos)
    return weighted.sum(dim=1).to(x.dtype)
