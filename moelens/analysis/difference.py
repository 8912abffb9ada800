"""SteerMoE's activation-rate difference between two prompt sets: which experts fire more on A than on B.

The same Δ as moelens.traces.trace_activation_difference, computed in memory from two sets of prompts (each
as moelens.analysis.data takes them), for sets too small to be worth a trace."""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import torch
from jaxtyping import Float

from moelens.analysis.data import Data, Mask, resolve_layers
from moelens.analysis.usage import expert_usage


@dataclass(frozen=True)
class ExpertDelta:
    layer: int
    expert: int
    rate_a: float  # share of set A's tokens routed to the expert
    rate_b: float
    delta: float  # rate_a - rate_b: above 0, the expert is more active on A


def ranked_deltas(
    layers: Sequence[int], rate_a: Float[torch.Tensor, "n_layers n_experts"], rate_b: Float[torch.Tensor, "n_layers n_experts"]
) -> list[ExpertDelta]:
    """One ExpertDelta per (layer, expert), ranked by |Δ| (ties: layer, then expert)."""
    if rate_a.shape != rate_b.shape or rate_a.shape[0] != len(layers):
        raise ValueError(f"rates of {len(layers)} layers: got shapes {tuple(rate_a.shape)} and {tuple(rate_b.shape)}")
    deltas = [
        ExpertDelta(layer, e, float(rate_a[i, e]), float(rate_b[i, e]), float(rate_a[i, e] - rate_b[i, e]))
        for i, layer in enumerate(layers) for e in range(rate_a.shape[1])
    ]
    return sorted(deltas, key=lambda d: (-abs(d.delta), d.layer, d.expert))


def activation_difference(
    model,
    data_a: Data,
    data_b: Data,
    layers: int | Sequence[int] | None = None,
    attention_mask_a: Mask | None = None,
    attention_mask_b: Mask | None = None,
    batch_size: int = 8,
) -> list[ExpertDelta]:
    """SteerMoE's Δ per (layer, expert): the share of set A's real tokens routed to the expert minus set B's,
    ranked by |Δ|. moelens.traces.delta_experts / delta_steer_hooks turn it into ablate_experts and
    steer_router arguments, as for traces."""
    layers = resolve_layers(model, layers)
    usage_a = expert_usage(model, data_a, layers, attention_mask_a, batch_size)
    usage_b = expert_usage(model, data_b, layers, attention_mask_b, batch_size)
    rate_a = usage_a.counts.double() / usage_a.n_tokens
    rate_b = usage_b.counts.double() / usage_b.n_tokens
    return ranked_deltas(layers, rate_a.float(), rate_b.float())
