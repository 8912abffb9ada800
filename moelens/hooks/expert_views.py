"""TransformerLens's per-expert hook sites over moelens's per-slot expert tensors.

moelens computes the routed experts per routing slot (blocks.L.mlp.experts.hook_pre / hook_pre_linear /
hook_post, [batch pos top_k d_expert]); TransformerLens's MoE hooks each expert's own rows
(blocks.L.mlp.experts.E.hook_gate / hook_pre / hook_post). The views here show, and take back, those rows
of the per-slot tensors; the expert computation (moelens.kernels) runs them through ExpertHooks.views.
"""

from __future__ import annotations

import contextvars
from collections.abc import Sequence
from dataclasses import dataclass

import torch
from jaxtyping import Int

from moelens.hooks.points import HookPoint, SliceInput, call_hooked_points, slice_pos
from moelens.hooks.sites import PER_EXPERT_SITES, site_form

# ---- TransformerLens's per-expert sites: ragged views of the per-slot tensors ------------------------------
# TL's MoE runs each expert on the tokens routed to it: for expert e, `idx, top_x = torch.where(
# one_hot(expert_indices, E).permute(2, 1, 0)[e])`, so its rows are ordered by routing slot first, then by
# token (batch * pos flattened, batch-major). Its MoEGatedMLP hooks them as hook_gate (gate projection, before
# the activation), hook_pre (the linear "up" projection) and hook_post (act(gate) * up, before the routing
# weight). moelens computes the same numbers per slot; these views show the rows routed to one expert.
# view -> the per-slot site (an ExpertHooks field) it shows rows of, from the table of hook sites:
# {"hook_gate": "pre", "hook_pre": "pre_linear", "hook_post": "post"}
VIEW_SITES: dict[str, str] = {s.tail: s.rows_of.rsplit(".hook_", 1)[1] for s in PER_EXPERT_SITES}

# The routing of the view being hooked in this thread (rows, batch_pos, k): what run_with_cache's pos_slice /
# remove_batch_dim need to select a view's rows. A context variable, so that threads never see each other's.
_ROUTING: contextvars.ContextVar[tuple[torch.Tensor, tuple[int, int], int] | None] = contextvars.ContextVar(
    "moelens_expert_view_routing", default=None
)


def rows_by_expert(indices: Int[torch.Tensor, "T k"], n_experts: int) -> tuple[Int[torch.Tensor, "n"], ...]:
    """For each expert, the flat slot ids (t * k + j) routed to it, in TransformerLens's row order: by slot j,
    then by token t. A stable sort of the [k, T]-ordered expert ids gives exactly torch.where's order."""
    T, k = indices.shape
    by_slot = indices.t().reshape(-1)  # entry q = j * T + t
    order = torch.argsort(by_slot, stable=True)
    counts = torch.bincount(by_slot, minlength=n_experts).tolist()
    return ((order % T) * k + order // T).split(counts)


class ExpertViewPoint(HookPoint):
    """A per-expert site (TL's blocks.L.mlp.experts.E.hook_gate / hook_pre / hook_post): a [routed, d_expert]
    tensor, the rows of its per-slot site routed to expert E, in TL's order (rows_by_expert). Hooks may read,
    replace or edit it in place; the result is written back into those rows of the per-slot tensor.

    Order: the per-slot site's hooks run first (a cache of it holds their result, not the views' edits); the
    views' hooks see that result, experts in ascending order, site by site (hook_gate, hook_pre, hook_post)
    where TL goes expert by expert; what the views return is what the computation goes on with."""

    ragged = True  # no batch or pos axis: run_with_cache and ActivationCache slice it with select_for_cache

    def __init__(self, group: ViewGroup, expert: int, site: str) -> None:
        form = site_form(f"blocks.L.mlp.experts.E.{site}")
        super().__init__(form.layout, form.meaning)
        self.expert, self.slot_site = expert, VIEW_SITES[site]
        self.group = group  # not a module: a plain reference
        group.add(self)

    def add_hook(self, hook, dir="fwd", is_permanent=False, level=None, prepend=False, reads_only=False):
        record = super().add_hook(hook, dir, is_permanent, level, prepend, reads_only)
        self.group.module_hooks += 1
        return record

    def remove_hooks(self, dir="fwd", including_permanent=False, level=None) -> None:
        before = len(self._hooks)
        super().remove_hooks(dir, including_permanent, level)
        self.group.module_hooks -= before - len(self._hooks)

    def _grad_hook(self, hook):
        """The backward runs after the forward has left this view: give its hooks the forward's routing."""
        call, routing = super()._grad_hook(hook), _ROUTING.get()

        def with_routing(grad: torch.Tensor):
            token = _ROUTING.set(routing)
            try:
                return call(grad)
            finally:
                _ROUTING.reset(token)

        return with_routing

    def select_for_cache(self, t: torch.Tensor, pos_slice: SliceInput, remove_batch_dim: bool) -> torch.Tensor:
        """run_with_cache's pos_slice and remove_batch_dim on a view: the rows are kept, in order, for the
        tokens at the selected positions; remove_batch_dim (a batch of one) leaves the rows as they are."""
        routing = _ROUTING.get()
        if routing is None:
            raise RuntimeError(f"{self.name}: a per-expert view can only be cached while its routing is known")
        rows, (batch, pos), k = routing
        if remove_batch_dim and batch != 1:
            raise ValueError(
                f"run_with_cache(remove_batch_dim=True) needs a batch of one, {self.name} has batch size {batch}"
            )
        if pos_slice is None:
            return t
        kept = slice_pos(torch.arange(pos, device=rows.device), pos_slice, 0).reshape(-1)
        return t[torch.isin((rows // k) % pos, kept)]


class ViewGroup:
    """One mixture layer's per-expert views, and a cheap test of whether any of them has a hook.

    module_hooks counts hooks added to the views' modules (an over-count only costs the exact check); one
    call's hooks are found among the points the calling thread has call hooks on. With neither, the test is
    O(1), so a forward with no per-expert hook pays nothing for them."""

    def __init__(self, n_experts: int) -> None:
        self.n_experts = n_experts
        self.points: list[ExpertViewPoint] = []
        self.members: set[ExpertViewPoint] = set()
        self.module_hooks = 0

    def add(self, point: ExpertViewPoint) -> None:
        self.points.append(point)
        self.members.add(point)

    def any_hooked(self) -> bool:
        calls = call_hooked_points()
        if self.module_hooks <= 0 and (not calls or self.members.isdisjoint(calls)):
            return False
        return any(p.has_hooks for p in self.points)

    def bind(self, indices: Int[torch.Tensor, "T k"], batch_pos: tuple[int, int]) -> RoutedViews:
        """This forward's views: indices are the real expert ids (not an offload renumbering)."""
        by_site: dict[str, list[ExpertViewPoint]] = {site: [] for site in VIEW_SITES.values()}
        for p in self.points:
            by_site[p.slot_site].append(p)
        return RoutedViews(by_site, rows_by_expert(indices, self.n_experts), batch_pos, indices.shape[1])


@dataclass(frozen=True)
class RoutedViews:
    """The per-expert views of one forward: points[site][e] views rows[e] of the per-slot tensor at site."""

    points: dict[str, Sequence[ExpertViewPoint]]
    rows: tuple[torch.Tensor, ...]
    batch_pos: tuple[int, int]
    top_k: int

    def hooked(self, site: str) -> bool:
        return any(p.has_hooks for p in self.points[site])

    def run(self, site: str, t: torch.Tensor) -> tuple[torch.Tensor, bool]:
        """Each hooked view's hooks on its rows of t [T, k, n]; what they return or edit goes back into those
        rows (out of place, so autograd sees it). A view with backward hooks is spliced in even unchanged, so
        that the gradient of its rows flows through it. (tensor, whether a view changed it)."""
        flat = t.reshape(-1, t.shape[-1])
        rows, outs = [], []
        for expert, point in enumerate(self.points[site]):
            if not point.has_hooks:
                continue
            # index_select, not flat[rows]: the same rows, and on CPU several times faster than advanced indexing
            view = flat.index_select(0, self.rows[expert])
            token = _ROUTING.set((self.rows[expert], self.batch_pos, self.top_k))
            try:
                out, changed = point.run(view)
            finally:
                _ROUTING.reset(token)
            if changed or out is not view or point.has_bwd_hooks:
                rows.append(self.rows[expert])
                outs.append(out)
        if not outs:
            return t, False
        return flat.index_copy(0, torch.cat(rows), torch.cat(outs)).view(t.shape), True
