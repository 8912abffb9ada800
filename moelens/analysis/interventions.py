"""Routing interventions: force a route, steer a router logit, patch routing from a clean run.

Each comes as ``*_hooks`` (hook pairs to combine with run_with_hooks, run_with_cache or model.hooks()) and as
a one-liner that runs the input with and without them and returns an InterventionResult.
"""

from __future__ import annotations

import math
import numbers
from collections.abc import Sequence
from typing import Literal

import torch
from jaxtyping import Float, Int

from moelens.analysis.compare import InterventionResult, as_batch, compare_runs
from moelens.analysis.data import Mask, Positions, hook_name, position_mask, resolve_layers

Layers = int | Sequence[int] | None
Hooks = list[tuple[str, object]]


def _where(positions: Positions, new: torch.Tensor, old: torch.Tensor) -> torch.Tensor:
    """new at the chosen positions, old elsewhere; new broadcasts against [batch pos ...]."""
    chosen = position_mask(positions, old.shape[:2], old.device)
    chosen = chosen.reshape(*chosen.shape, *[1] * (old.dim() - 2))
    return torch.where(chosen, new.to(device=old.device, dtype=old.dtype).expand_as(old), old)


def _number(what: str, value) -> float:
    """`value` as a float, or a TypeError / ValueError naming `what` (a string, a bool or a NaN is no steering)."""
    if isinstance(value, torch.Tensor) and value.numel() == 1 and not value.dtype.is_complex:
        value = value.item()
    if isinstance(value, bool) or not isinstance(value, numbers.Real):
        raise TypeError(f"{what} must be a real number, got {type(value).__name__} {value!r}")
    if math.isnan(value) or value == math.inf:
        raise ValueError(f"{what} must be a number or -inf (which turns the expert off), got {value}")
    return float(value)


def _expert_ids(what: str, experts, n_experts: int) -> torch.Tensor:
    """One int or a sequence of ints in [0, n_experts) as a long tensor, or an error naming `what`."""
    items = [experts] if not isinstance(experts, (Sequence, torch.Tensor)) or isinstance(experts, str) else experts
    if isinstance(items, torch.Tensor):
        if items.is_floating_point() or items.is_complex() or items.dtype == torch.bool:
            raise TypeError(f"{what} must hold integer expert ids, got a {items.dtype} tensor")
    elif not items or any(isinstance(e, bool) or not isinstance(e, numbers.Integral) for e in items):
        raise TypeError(f"{what} must be an expert id (int) or a non-empty sequence of them, got {experts!r}")
    ids = torch.as_tensor(items, dtype=torch.long)
    if ids.numel() == 0:
        raise ValueError(f"{what} is empty")
    if int(ids.min()) < 0 or int(ids.max()) >= n_experts:
        raise IndexError(f"{what}: experts must lie in [0, {n_experts}), got {ids.tolist()}")
    return ids


def force_route_hooks(
    model,
    layers: Layers,
    experts: Sequence[int] | Int[torch.Tensor, "... top_k"],
    weights: Sequence[float] | Float[torch.Tensor, "... top_k"] | None = None,
    positions: Positions = None,
) -> Hooks:
    """Route the chosen positions of these layers to ``experts`` (top_k of them, broadcast to [batch pos top_k]).

    Without ``weights`` each slot's weight is read from the router scores of its new expert, by the family's
    rule (renormalised where the family renormalises); with ``weights`` those are used as given.
    """
    experts = _expert_ids("force_route: experts", experts, model.cfg.n_routable_experts)
    if weights is not None:
        if isinstance(weights, str) or not isinstance(weights, (Sequence, torch.Tensor)):
            raise TypeError(f"force_route: weights must be a sequence or tensor of floats, got {weights!r}")
        try:
            weights = torch.as_tensor(weights, dtype=torch.float32 if not isinstance(weights, torch.Tensor) else None)
        except (TypeError, ValueError) as err:
            raise TypeError(f"force_route: weights must be a sequence or tensor of floats, got {weights!r} ({err})") from None
    hooks: Hooks = []
    for layer in resolve_layers(model, layers):
        k = model.cfg.top_k_per_layer[layer]
        if experts.shape[-1] != k:
            raise ValueError(f"layer {layer} routes to top_k={k} experts, got {experts.shape[-1]} to force")
        hooks.append((hook_name(layer, "expert_indices"), lambda idx, hook: _where(positions, experts, idx)))
        if weights is not None:
            if weights.shape[-1] != k:
                raise ValueError(f"layer {layer} routes to top_k={k} experts, got {weights.shape[-1]} weights")
            hooks.append((hook_name(layer, "expert_weights"), lambda w, hook: _where(positions, weights, w)))
    return hooks


def steer_router_hooks(
    model, layers: Layers, expert: int | Sequence[int], value: float, positions: Positions = None
) -> Hooks:
    """Add ``value`` to the router logit of ``expert`` (one or several) at these layers and positions; the
    choice and the weights then follow from the new logits."""
    ids = _expert_ids("steer_router: expert", expert, model.cfg.n_routable_experts)
    value = _number("steer_router: value", value)
    onehot = torch.zeros(model.cfg.n_routable_experts).index_fill_(0, ids, 1.0)

    def steer(logits, hook):
        added = logits + value * onehot.to(device=logits.device, dtype=logits.dtype)
        return _where(positions, added, logits)

    return [(hook_name(layer, "router_logits"), steer) for layer in resolve_layers(model, layers)]


def patch_routing_hooks(
    model,
    clean_cache,
    layers: Layers = None,
    positions: Positions = None,
    what: Literal["both", "indices", "weights"] = "both",
) -> Hooks:
    """Write the clean run's expert indices and/or weights (from ``clean_cache``, a run_with_cache cache or
    dict holding them) into another run of the same shape, at these layers and positions.

    "indices" alone re-routes and lets the weights follow the other run's scores of the clean experts.
    """
    if what not in ("both", "indices", "weights"):
        raise ValueError(f"what must be 'both', 'indices' or 'weights', got {what!r}")
    sites = ("expert_indices", "expert_weights") if what == "both" else (f"expert_{what}",)
    hooks: Hooks = []
    for layer in resolve_layers(model, layers):
        for site in sites:
            clean = clean_cache[hook_name(layer, site)]

            def patch(t, hook, clean=clean):
                if clean.shape[1:] != t.shape[1:] or clean.shape[0] not in (1, t.shape[0]):
                    raise ValueError(f"{hook.name}: clean run has shape {tuple(clean.shape)}, this run {tuple(t.shape)}")
                return _where(positions, clean, t)

            hooks.append((hook_name(layer, site), patch))
    return hooks


def force_route(
    model,
    tokens: torch.Tensor | str | list[str],
    layers: Layers,
    experts: Sequence[int] | torch.Tensor,
    weights: Sequence[float] | torch.Tensor | None = None,
    positions: Positions = None,
    attention_mask: Mask | None = None,
) -> InterventionResult:
    """Run ``tokens`` with and without the forced route (see force_route_hooks)."""
    return compare_runs(model, tokens, force_route_hooks(model, layers, experts, weights, positions), attention_mask)


def steer_router(
    model,
    tokens: torch.Tensor | str | list[str],
    layers: Layers,
    expert: int | Sequence[int],
    value: float,
    positions: Positions = None,
    attention_mask: Mask | None = None,
) -> InterventionResult:
    """Run ``tokens`` with and without ``value`` added to the expert's router logit (see steer_router_hooks)."""
    return compare_runs(model, tokens, steer_router_hooks(model, layers, expert, value, positions), attention_mask)


@torch.no_grad()
def patch_routing(
    model,
    clean: torch.Tensor | str | list[str],
    corrupted: torch.Tensor | str | list[str],
    layers: Layers = None,
    positions: Positions = None,
    what: Literal["both", "indices", "weights"] = "both",
    clean_attention_mask: Mask | None = None,
    attention_mask: Mask | None = None,
) -> InterventionResult:
    """Run ``corrupted`` with its routing at ``layers`` (default: all) replaced by the clean run's.

    The result's baseline is the unpatched corrupted run and ``source_logits`` the clean run; prompts must
    have the same length (a clean batch of one is broadcast over the corrupted batch).
    """
    layers = resolve_layers(model, layers)
    clean_tokens, clean_valid = as_batch(model, clean, clean_attention_mask)
    corrupted_tokens, corrupted_valid = as_batch(model, corrupted, attention_mask)
    b, p = corrupted_tokens.shape
    if clean_tokens.shape[1] != p or clean_tokens.shape[0] not in (1, b):
        raise ValueError(
            f"patch_routing needs prompts of the same length: clean tokens {tuple(clean_tokens.shape)}, "
            f"corrupted {tuple(corrupted_tokens.shape)} (a clean batch of one is broadcast)"
        )
    mask = None if bool(clean_valid.all()) else clean_valid.long()
    names = [hook_name(layer, site) for layer in layers for site in ("expert_indices", "expert_weights")]
    clean_logits, cache = model.run_with_cache(clean_tokens, names_filter=names, attention_mask=mask)
    hooks = patch_routing_hooks(model, cache, layers, positions, what)
    return compare_runs(model, (corrupted_tokens, corrupted_valid.long()), hooks, source_logits=clean_logits)
