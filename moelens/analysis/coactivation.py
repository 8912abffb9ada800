"""Co-activation of experts: how many tokens go to expert e at one layer and to expert f at another."""

from __future__ import annotations

from collections.abc import Sequence

import torch
from jaxtyping import Float, Int

from moelens.analysis.data import Data, Mask, hook_name, iter_batches, resolve_layers, run_sites


def multi_hot(indices: Int[torch.Tensor, "tokens top_k"], n_experts: int) -> torch.Tensor:
    """[tokens n_experts], 1 where the token is routed to the expert (a slot's expert counts once)."""
    hot = torch.zeros(indices.shape[0], n_experts, dtype=torch.float64, device=indices.device)
    return hot.scatter_(1, indices, 1.0)


@torch.no_grad()
def coactivations(
    model,
    data: Data,
    pairs: Sequence[tuple[int, int]],
    attention_mask: Mask | None = None,
    batch_size: int = 8,
) -> dict[tuple[int, int], Int[torch.Tensor, "n_experts_a n_experts_b"]]:
    """For each layer pair (a, b): counts[e, f] = real tokens routed to e at a and to f at b, in one pass.

    With a == b the matrix is within the layer: its diagonal is each expert's token count, and entry [e, f]
    the tokens routed to both. Keys are the pairs as given.
    """
    if not pairs:
        raise ValueError("coactivations needs at least one (layer_a, layer_b) pair")
    resolved = {pair: tuple(resolve_layers(model, list(pair))) for pair in pairs}
    layers = sorted({layer for pair in resolved.values() for layer in pair})
    E = model.cfg.n_routable_experts
    # float64 matmul counts exactly up to 2**53 tokens and runs on every device (integer matmul does not).
    out = {pair: torch.zeros(E, E, dtype=torch.float64) for pair in pairs}
    for tokens, valid in iter_batches(model, data, attention_mask, batch_size):
        cache = run_sites(model, tokens, valid, layers, ("expert_indices",))
        hot = {layer: multi_hot(cache[hook_name(layer, "expert_indices")][valid], E) for layer in layers}
        for pair, (a, b) in resolved.items():
            out[pair] += (hot[a].T @ hot[b]).cpu()
    return {pair: counts.round().long() for pair, counts in out.items()}


def coactivation(
    model,
    data: Data,
    layer_a: int,
    layer_b: int | None = None,
    attention_mask: Mask | None = None,
    batch_size: int = 8,
) -> Int[torch.Tensor, "n_experts_a n_experts_b"]:
    """counts[e, f] of real tokens routed to e at layer_a and f at layer_b (within layer_a when layer_b is None)."""
    pair = (layer_a, layer_a if layer_b is None else layer_b)
    return coactivations(model, data, [pair], attention_mask, batch_size)[pair]


def coactivation_lift(counts: Int[torch.Tensor, "n_experts_a n_experts_b"]) -> Float[torch.Tensor, "n_experts_a n_experts_b"]:
    """The normalised view of co-activation counts (of coactivation, coactivations or
    moelens.traces.trace_coactivation): lift[e, f] = p(e at a, f at b) / (p(e at a) p(f at b)) over tokens, 1
    where the two choices are independent, above 1 where they go together. Computed as counts * total /
    (row sum * column sum), which is that ratio whatever each layer's top_k (a row sums to the expert's tokens
    times layer b's k); within one layer the diagonal is 1 / p(e). NaN where an expert got no token (no rate
    to compare with)."""
    if counts.dim() != 2:
        raise ValueError(f"coactivation_lift takes a [n_experts_a, n_experts_b] count matrix, got shape {tuple(counts.shape)}")
    if counts.is_floating_point() or counts.is_complex() or (counts < 0).any():
        raise ValueError("coactivation_lift takes counts: non-negative integers (coactivation's output)")
    c = counts.double()
    rows, cols = c.sum(1, keepdim=True), c.sum(0, keepdim=True)
    lift = c * c.sum() / (rows * cols)  # 0 / 0 = NaN for an expert with no token
    return lift.float()
