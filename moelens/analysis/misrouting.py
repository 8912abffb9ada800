"""Misrouting: would another route of the same compute have predicted the next token better?

As in "When Are Experts Misrouted?": for each token and one mixture layer, every equal-compute alternative
to the router's route (one chosen expert swapped for one unchosen one: top_k * (n_experts - top_k) routes) is
scored by the probability the model then gives the correct next token; a token is misrouted where its best
alternative beats the router's route.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
from jaxtyping import Bool, Float, Int
from tqdm.auto import tqdm

from moelens.analysis.data import Data, Mask, hook_name, iter_batches, resolve_layers
from moelens.analysis.expert_effects import start_layer


@dataclass(frozen=True)
class Misrouting:
    """One layer's routes scored on one batch. ``pred`` is the position predicting the next token (pos - 1
    of them); route 0 is the router's own, routes 1.. its alternatives (slot s's expert swapped for each
    unchosen expert in turn, s = 0 .. top_k - 1, the unchosen experts in increasing id)."""

    layer: int
    routes: Int[torch.Tensor, "batch pred n_routes top_k"]
    probs: Float[torch.Tensor, "batch pred n_routes"]  # p(correct next token) under each route; NaN where not valid
    valid: Bool[torch.Tensor, "batch pred"]  # the token and the next one both unpadded

    @property
    def router_prob(self) -> Float[torch.Tensor, "batch pred"]:
        return self.probs[..., 0]

    @property
    def best_alternative(self) -> Int[torch.Tensor, "batch pred"]:
        """Index (into routes) of each token's best alternative route (1 .. n_routes - 1)."""
        return self.probs[..., 1:].nan_to_num(-1.0).argmax(-1) + 1

    @property
    def best_route(self) -> Int[torch.Tensor, "batch pred top_k"]:
        best = self.best_alternative
        return self.routes.gather(2, best[..., None, None].expand(*best.shape, 1, self.routes.shape[-1]))[:, :, 0]

    @property
    def gain(self) -> Float[torch.Tensor, "batch pred"]:
        """The best alternative's probability minus the router's route's (NaN where not valid)."""
        return self.probs.gather(-1, self.best_alternative[..., None])[..., 0] - self.router_prob

    @property
    def share(self) -> float:
        """The share of valid tokens whose best route is not the router's (an alternative scores higher)."""
        return float((self.gain[self.valid] > 0).double().mean())


def alternative_routes(
    indices: Int[torch.Tensor, "... top_k"], n_experts: int
) -> Int[torch.Tensor, "... n_routes top_k"]:
    """The route itself, then each route that swaps one of its experts for one it does not use: slot s for
    s = 0 .. top_k - 1, each unchosen expert in increasing id (1 + top_k * (n_experts - top_k) routes)."""
    k = indices.shape[-1]
    ids = torch.arange(n_experts, device=indices.device)
    chosen = (indices[..., None] == ids).any(-2)  # [... n_experts]
    if bool((chosen.sum(-1) != k).any()):
        raise ValueError("alternative_routes: a route names the same expert in two slots")
    # unchosen ids first, in increasing order: chosen ones pushed past n_experts by the sort key
    unchosen = torch.sort(torch.where(chosen, ids + n_experts, ids), -1).values[..., : n_experts - k]
    swapped = indices[..., None, None, :].expand(*indices.shape[:-1], k, n_experts - k, k).clone()
    for s in range(k):
        swapped[..., s, :, s] = unchosen
    return torch.cat([indices[..., None, :], swapped.flatten(-3, -2)], -2)


@torch.no_grad()
def misrouting(
    model,
    tokens: Data,
    layer: int,
    attention_mask: Mask | None = None,
    batch_size: int = 64,
    progress: bool | None = None,
) -> Misrouting:
    """Score every equal-compute alternative route of every token at ``layer`` ("When Are Experts Misrouted?").

    ``tokens``: one batch (ids, a text or a list of texts; see moelens.analysis.data). For each position and
    each route (the router's, then each swap of one chosen expert for one unchosen, see Misrouting), the layer's
    expert indices at that position alone are replaced (hook_expert_indices: the weights then follow the
    router's rule for the new experts, as for any re-routing) and the probability of the correct next token at
    that position is read. Exact and bounded: a route at position t changes nothing before t and only the
    prediction at t is read, so each run is the prefix up to t, started at ``layer`` from the cached residual
    stream; ``batch_size`` such rows run at a time (1 + top_k * (n_experts - top_k) rows per token).
    """
    (layer,) = resolve_layers(model, layer)
    batches = list(iter_batches(model, tokens, attention_mask, batch_size))
    if len(batches) != 1:
        raise ValueError(f"misrouting takes one batch of tokens, got a dataset of {len(batches)} batches")
    (batch, valid), = batches
    b, p = batch.shape
    if p < 2:
        raise ValueError(f"misrouting needs at least two positions (a next token), got tokens of shape {tuple(batch.shape)}")
    mask = None if bool(valid.all()) else valid.long()
    start = start_layer(model, layer)
    resid_name, indices_name = f"blocks.{start}.hook_resid_pre", hook_name(layer, "expert_indices")
    _, cache = model.run_with_cache(batch, names_filter=[resid_name, indices_name], attention_mask=mask, stop_at_layer=layer + 1)
    resid, clean = cache[resid_name], cache[indices_name]
    routes = alternative_routes(clean[:, :-1], model.cfg.n_routable_experts)  # [b p-1 n_routes k]
    n_routes = routes.shape[2]
    keep = valid[:, 1:] & valid[:, :-1]
    probs = torch.full((b, p - 1, n_routes), float("nan"))
    bar = tqdm(total=int(keep.sum()) * n_routes, desc="misrouting", unit="route", disable=None if progress is None else not progress)
    for t in range(p - 1):
        rows = keep[:, t].nonzero()[:, 0]
        jobs_row = rows.repeat_interleave(n_routes)
        jobs_route = torch.arange(n_routes, device=rows.device).repeat(len(rows))
        for first in range(0, len(jobs_row), batch_size):
            row, route = jobs_row[first:first + batch_size], jobs_route[first:first + batch_size]
            new = routes[row, t, route]  # [n k]

            def set_route(indices, hook, new=new, t=t):
                indices = indices.clone()
                indices[:, t] = new
                return indices

            logits = model.run_with_hooks(
                resid[row, : t + 1],
                fwd_hooks=[(indices_name, set_route)],
                start_at_layer=start,
                attention_mask=None if mask is None else mask[row, : t + 1],
            )
            p_next = logits[:, t].float().softmax(-1).gather(-1, batch[row, t + 1, None])[:, 0]
            probs[row.cpu(), t, route.cpu()] = p_next.cpu()
            bar.update(len(row))
    bar.close()
    return Misrouting(layer=layer, routes=routes.cpu(), probs=probs, valid=keep.cpu())
