"""The routed experts, computed per routing slot so every intermediate can be hooked.

Layout conventions: T tokens (batch * pos flattened), k slots per token, S = T * k slots, E experts,
H = d_model, I = d_expert. Slot s of token t is row t * k + s of the flat slot axis.

Two backends give the same hook tensors: "torch" (the reference, any device) and "triton" (CUDA, or CPU
tensors under TRITON_INTERPRET=1). "auto" picks triton only for CUDA tensors on a GPU architecture where the
kernel tests have passed on real hardware (VERIFIED_TRITON_ARCHS), and the torch path everywhere else.
resolve_backend turns the backend asked for into the executor ("torch" or "triton") once, when it is set or
the experts move (models.components.moe.Experts); routed_experts takes that executor and looks nothing up.
"""

from __future__ import annotations

import os
from collections.abc import Callable
from dataclasses import dataclass
from typing import Literal

import torch
import torch.nn.functional as F
from jaxtyping import Float, Int

from moelens.experts.spec import ExpertSpec, ExpertTensors, GatedActivation, gather_rows
from moelens.experts.stored import StoredExperts
from moelens.hooks import HookPoint
from moelens.hooks.expert_views import RoutedViews

Backend = Literal["auto", "torch", "triton"]
BACKENDS = ("auto", "torch", "triton")
Executor = Literal["torch", "triton"]  # what "auto" resolves to
EXECUTORS = ("torch", "triton")

# (major, minor) compute capabilities on which tests/test_triton_kernels.py has passed on a real GPU, with
# where and when. Empty: the kernels have run only in Triton's interpreter and been compiled for sm_80 /
# sm_90 without running, so "auto" never trusts them yet. Add an entry only after `bash
# benchmarks/gpu_check.sh` passed on that architecture.
VERIFIED_TRITON_ARCHS: dict[tuple[int, int], str] = {}


@dataclass(frozen=True)
class ExpertHooks:
    """The hook sites inside the routed experts; tensors are shown as [batch pos top_k ...].

    views: TransformerLens's per-expert sites over this forward's routing (RoutedViews), set only for a
    forward in which one of them has a hook, so that a forward without one pays nothing for them."""

    pre: HookPoint
    pre_linear: HookPoint
    post: HookPoint
    out: HookPoint  # per-slot expert outputs before the routing weight (experts.hook_out)
    outputs: HookPoint  # weighted per-slot outputs
    views: RoutedViews | None = None

    def hooked(self, site: str) -> bool:
        """Whether the per-slot site ("pre", "pre_linear", "post", "out") or one of its per-expert views has a hook."""
        return getattr(self, site).has_hooks or (self.views is not None and site in self.views.points and self.views.hooked(site))


def hooked(hook: HookPoint, t: torch.Tensor, batch_pos: tuple[int, int]) -> torch.Tensor:
    """Show a [T, k, n] tensor to a hook as [batch, pos, k, n] and take back what it returns."""
    return hooked_changed(hook, t, batch_pos)[0]


def hooked_site(
    hooks: ExpertHooks, site: str, t: torch.Tensor, batch_pos: tuple[int, int]
) -> tuple[torch.Tensor, bool]:
    """The per-slot hook of `site` on a [T, k, n] tensor in slot order, then its per-expert views' hooks
    (experts in ascending order), which see the per-slot hook's result. (tensor, whether a hook changed it)."""
    t, changed = hooked_changed(getattr(hooks, site), t, batch_pos)
    if hooks.views is None or site not in hooks.views.points:  # "out" has no per-expert views
        return t, changed
    out, viewed = hooks.views.run(site, t)
    return out, changed or viewed


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


def sort_slots(
    experts: Int[torch.Tensor, "S"], n_experts: int, top_k: int | None = None
) -> tuple[Int[torch.Tensor, "S"], list[int]]:
    """(slot order sorted by expert, stable; rows per expert) for the grouped GEMMs. (transformers' grouped_mm
    experts order a group's rows by torch.sort, which is not stable; with several threads a GEMM can round a row
    by its place in its group, so float32 results then differ from transformers' by ~1e-7 per expert output. The
    Triton kernels keep the stable order, and both backends must give the same hook tensors.)

    top_k given: a group's rows by slot, then token (slot 0 of every token first), as a reference that loops over
    the experts and takes each one's rows with torch.where on a [top_k, tokens] mask orders them (DBRX's);
    ExpertSpec.rows_by "slot"."""
    counts = torch.bincount(experts, minlength=n_experts).tolist()
    if top_k is None:
        return torch.argsort(experts, stable=True), counts
    slot_major = experts.view(-1, top_k).T.reshape(-1)  # position j * T + t holds slot t * top_k + j
    by_slot = torch.argsort(slot_major, stable=True)
    n_tokens = experts.numel() // top_k
    return (by_slot % n_tokens) * top_k + by_slot // n_tokens, counts


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


def routed_subset(
    indices: Int[torch.Tensor, "T k"], n_experts: int, n_identity: int = 0
) -> tuple[list[int], Int[torch.Tensor, "T k"]]:
    """(the real experts the slots route to, ascending; the indices renumbered into that list): a stack of just
    those experts runs the same groups and the same GEMMs as the full one, since renumbering keeps the slots'
    order by expert. Identity experts (ids from n_experts on) are renumbered to follow the used ones, in order."""
    check_indices(indices, n_experts + n_identity)
    used = [e for e in torch.unique(indices).tolist() if e < n_experts]
    renumber = torch.full((n_experts + n_identity,), -1, dtype=indices.dtype, device=indices.device)
    renumber[torch.tensor(used, device=indices.device, dtype=torch.long)] = torch.arange(
        len(used), dtype=indices.dtype, device=indices.device
    )
    renumber[n_experts:] = torch.arange(len(used), len(used) + n_identity, dtype=indices.dtype, device=indices.device)
    return used, renumber[indices]


def resolve_backend(
    backend: Backend, device: torch.device, spec: ExpertSpec | None = None, argument: str = "experts_backend"
) -> Executor:
    """The executor for experts computed on `device`: "auto" gives "triton" only for CUDA devices of a verified
    architecture with triton installed and experts the kernels compute (spec), else "torch"; "triton" is
    checked (installed, CUDA or TRITON_INTERPRET=1, experts the kernels compute) and errors name `argument`.
    A "meta" device is not placed yet: "triton" is checked again where the experts are moved to."""
    if backend not in BACKENDS:
        raise ValueError(f"{argument} must be one of {BACKENDS}, got {backend!r}")
    refusal = None if spec is None else spec.triton_refusal()
    if backend == "auto":
        fits = refusal is None and device.type == "cuda" and triton_available()
        return "triton" if fits and triton_verified_on(device) else "torch"
    if backend == "triton":
        if refusal is not None:
            raise ValueError(refusal)
        if not triton_available():
            raise RuntimeError(f"{argument}='triton' needs the triton package (it ships with CUDA builds of torch)")
        if device.type not in ("cuda", "meta") and os.environ.get("TRITON_INTERPRET") != "1":
            raise RuntimeError(
                f"{argument}='triton' runs on CUDA devices (or on CPU with TRITON_INTERPRET=1); the experts are on "
                f"{device}: use {argument}='auto' or 'torch' there"
            )
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
    tensors: ExpertTensors | StoredExperts,
    spec: ExpertSpec,
    hooks: ExpertHooks,
    batch_pos: tuple[int, int],
    executor: Executor = "torch",
) -> Float[torch.Tensor, "T H"]:
    """sum over slots of weight * expert(x), each expert as the spec says (moelens.experts.spec), with hooks
    on every per-slot tensor. tensors: the stacked experts the indices point into, dense or kept stored
    (dequantized into x's dtype: by StoredExperts.dequantize for the torch path, in the kernels' tiles to the
    same bits for fp8 on the triton path). executor: "torch" or "triton", as resolve_backend chose it when the
    backend was set ("auto" is not taken here).

    The slot sum runs in the promoted dtype of outputs and weights, in slot order, and is cast once,
    as the reference does, so low-precision results agree with it.
    """
    check_indices(indices, tensors.n_experts + spec.n_identity)
    if executor not in EXECUTORS:
        raise ValueError(
            f"routed_experts: executor must be one of {EXECUTORS} (resolve a backend such as 'auto' once with "
            f"resolve_backend), got {executor!r}"
        )
    if executor == "triton":
        if (refusal := spec.triton_refusal()) is not None:  # experts the kernels do not compute
            raise ValueError(refusal)
        from moelens.kernels.triton_experts import routed_experts_triton

        return routed_experts_triton(x, indices, weights, tensors, hooks, batch_pos, activation=spec.activation)
    if isinstance(tensors, StoredExperts):
        tensors = tensors.dequantize(x.dtype)
    return routed_experts_torch(
        x, indices, weights, tensors, spec.activation, hooks, batch_pos, weight_at=spec.weight_at, combine=spec.combine,
        rows_by=spec.rows_by,
    )


# (rows sorted by expert, stacked weights, rows per expert) -> the rows times their experts' weights
GroupedLinear = Callable[[torch.Tensor, torch.Tensor, list[int]], torch.Tensor]


def routed_experts_torch(
    x, indices, weights, tensors: ExpertTensors, activation: GatedActivation, hooks: ExpertHooks, batch_pos,
    n_experts: int | None = None, linear: GroupedLinear = grouped_linear,
    bias_rows: Callable[[torch.Tensor, torch.Tensor], torch.Tensor] = gather_rows,
    weight_at: str = "output",
    combine: str = "slots",
    rows_by: str = "token",
):
    """The reference's algorithm: slots sorted by expert once, both GEMMs on sorted rows (each plus its
    expert's bias where the spec has biases), back to slot order for the weighted outputs. Per-slot hooks see
    (and replace) tensors in slot order; the sorted copies are only permuted for them when a hook is on.

    n_experts (default: the stacks' length), linear and bias_rows let expert parallelism
    (kernels.expert_parallel) run the same steps with each rank's experts only: its linear computes the
    rank's groups and gathers, its bias_rows looks up the rank's biases and gathers.

    combine (ExpertSpec.combine): "slots" sums the weighted outputs over slots in their promoted dtype and
    casts once; "experts" casts each to x's dtype and adds them in ascending expert order.

    rows_by (ExpertSpec.rows_by): the order of a GEMM group's rows, "token" (then slot) or "slot" (then token).

    weight_at (ExpertSpec.weight_at): "output" scales each slot's output by its weight; "input" scales the
    slot's input row before gate_up (in the rows' dtype, as Llama 4 does) and leaves the output as it is."""
    T, k = indices.shape
    experts = indices.reshape(-1)
    n_real = tensors.n_experts if n_experts is None else n_experts
    order, counts = sort_slots(experts, n_real, k if rows_by == "slot" else None)
    unsort = torch.empty_like(order).index_copy_(0, order, torch.arange(order.numel(), device=order.device))
    # ids from n_real on are identity experts (ExpertSpec.n_identity): sorted after every real slot, they take
    # no GEMM; their per-slot neurons are zeros and their output is the input row itself
    counts, n_computed = counts[:n_real], sum(counts[:n_real])
    n_identity_slots = order.numel() - n_computed
    sorted_experts = experts[order[:n_computed]] if tensors.gate_up_bias is not None else None

    def hooked_sorted(site: str, t: torch.Tensor) -> torch.Tensor:
        """Show a sorted [S, n] tensor to its hooks in slot order; re-sort only what a hook changed."""
        if not hooks.hooked(site):
            return t
        seen, changed = hooked_site(hooks, site, t.index_select(0, unsort).view(T, k, -1), batch_pos)
        return seen.reshape(T * k, -1).index_select(0, order) if changed else t

    rows = x[order // k]
    if weight_at == "input":
        rows = rows * weights.reshape(-1)[order].unsqueeze(-1).to(rows.dtype)
    elif weight_at != "output":
        raise ValueError(f"routed_experts_torch: weight_at must be 'output' or 'input', got {weight_at!r}")
    identity_rows = rows[n_computed:] if n_identity_slots else None
    rows = rows[:n_computed] if n_identity_slots else rows
    gate_up = linear(rows, tensors.gate_up, counts)
    if tensors.gate_up_bias is not None:
        gate_up = gate_up + bias_rows(tensors.gate_up_bias, sorted_experts)
    if n_identity_slots:  # the identity slots' neurons: zeros (what the hooks see; they feed nothing)
        gate_up = torch.cat([gate_up, gate_up.new_zeros(n_identity_slots, gate_up.shape[1])])
    if activation.gated:
        pre, pre_linear = gate_up.chunk(2, dim=-1)
        new_pre, new_pre_linear = hooked_sorted("pre", pre), hooked_sorted("pre_linear", pre_linear)
        if new_pre is not pre or new_pre_linear is not pre_linear:
            # written back into the [S, 2I] layout: elementwise kernels can round differently on other
            # layouts, and a run must not depend on which hooks are on
            pre, pre_linear = torch.cat([new_pre, new_pre_linear], dim=-1).chunk(2, dim=-1)
        post = hooked_sorted("post", activation(pre, pre_linear))
    else:  # the up rows alone: hook_pre_linear (the up projection, TransformerLens's per-expert hook_pre); no
        # gate, so hook_pre never fires
        post = hooked_sorted("post", activation(hooked_sorted("pre_linear", gate_up)))
    down = linear(post[:n_computed] if n_identity_slots else post, tensors.down, counts)
    if tensors.down_bias is not None:
        down = down + bias_rows(tensors.down_bias, sorted_experts)
    if n_identity_slots:
        down = torch.cat([down, identity_rows.to(down.dtype)])
    down = hooked_sorted("out", down)  # the unweighted outputs; the weighted ones are computed from what it returns
    out = down * weights.reshape(-1)[order].unsqueeze(-1) if weight_at == "output" else down
    weighted = hooked(hooks.outputs, out[unsort].view(T, k, -1), batch_pos)
    if combine == "experts":  # each slot's output in x's dtype, added in ascending expert order (ExpertSpec.combine)
        by_expert = weighted.gather(1, indices.argsort(dim=1, stable=True)[..., None].expand_as(weighted)).to(x.dtype)
        out = torch.zeros_like(x)
        for j in range(k):
            out = out + by_expert[:, j]
        return out
    return weighted.sum(dim=1).to(x.dtype)
