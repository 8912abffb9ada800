"""The routed experts, computed per routing slot so every intermediate can be hooked.

Layout conventions: T tokens (batch * pos flattened), k slots per token, E experts, H = d_model,
I = d_expert. Slot s of token t is row t * k + s of the flat slot axis.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

import torch
import torch.nn.functional as F
from jaxtyping import Float, Int

from moelens.hooks import HookPoint


@dataclass(frozen=True)
class ExpertHooks:
    """The hook sites inside the routed experts; tensors are shown as [batch pos top_k ...]."""

    pre: HookPoint
    pre_linear: HookPoint
    post: HookPoint
    outputs: HookPoint  # weighted per-slot outputs


def _hooked(hook: HookPoint, t: torch.Tensor, batch_pos: tuple[int, int]) -> torch.Tensor:
    """Show a [T, k, n] tensor to a hook as [batch, pos, k, n] and take back what it returns."""
    if not hook.has_hooks:
        return t
    return hook(t.view(*batch_pos, *t.shape[1:])).reshape(t.shape)


def _grouped_linear(
    rows: Float[torch.Tensor, "S n_in"], weight: Float[torch.Tensor, "E n_out n_in"], counts: list[int]
) -> Float[torch.Tensor, "S n_out"]:
    """rows sorted by expert, counts[e] rows for expert e: each group times its expert's weight."""
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


def routed_experts(
    x: Float[torch.Tensor, "T H"],
    indices: Int[torch.Tensor, "T k"],
    weights: Float[torch.Tensor, "T k"],
    W_gate_up: Float[torch.Tensor, "E 2I H"],
    W_down: Float[torch.Tensor, "E H I"],
    act: Callable[[torch.Tensor], torch.Tensor],
    hooks: ExpertHooks,
    batch_pos: tuple[int, int],
) -> Float[torch.Tensor, "T H"]:
    """sum over slots of weight * down(act(gate(x)) * up(x)), with hooks on every per-slot tensor.

    The slot sum runs in the promoted dtype of outputs and weights, in slot order, and is cast once,
    as the reference does, so low-precision results agree with it.
    """
    T, k = indices.shape
    n_experts = W_gate_up.shape[0]
    flat = indices.reshape(-1)
    if flat.numel() and (int(flat.min()) < 0 or int(flat.max()) >= n_experts):
        raise IndexError(f"expert indices must lie in [0, {n_experts}), got range [{int(flat.min())}, {int(flat.max())}]")
    order = torch.argsort(flat, stable=True)
    counts = torch.bincount(flat, minlength=n_experts).tolist()
    unsort = torch.empty_like(order)
    unsort[order] = torch.arange(order.numel(), device=order.device)

    gate_up = _grouped_linear(x[order // k], W_gate_up, counts)[unsort].view(T, k, -1)
    pre, pre_linear = gate_up.chunk(2, dim=-1)
    pre = _hooked(hooks.pre, pre, batch_pos)
    pre_linear = _hooked(hooks.pre_linear, pre_linear, batch_pos)
    post = _hooked(hooks.post, act(pre) * pre_linear, batch_pos)

    out = _grouped_linear(post.reshape(T * k, -1)[order], W_down, counts)[unsort].view(T, k, -1)
    weighted = _hooked(hooks.outputs, out * weights.unsqueeze(-1), batch_pos)
    return weighted.sum(dim=1).to(x.dtype)
