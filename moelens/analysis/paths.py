"""Routing across layers: the paths tokens take through the experts of consecutive mixture layers, their
entropy, and how much two models (a base and its fine-tune, say) route the same tokens alike."""

from __future__ import annotations

import math
from collections import Counter
from collections.abc import Sequence
from dataclasses import dataclass

import torch
from jaxtyping import Float, Int

from moelens.analysis.data import Data, Mask, hook_name, iter_batches, resolve_layers, run_sites


@dataclass(frozen=True)
class RoutingPaths:
    """A token's path is its top-1 expert at each of ``layers`` in order: the slot with the largest routing
    weight (the first such slot on a tie). Top-1 rather than the top-k set: a set path has C(E, k)**L values,
    too many to ever repeat on a corpus, while the first choice carries most of the weight.

    paths: the ``top`` most frequent paths with their token counts, most frequent first (ties: the path's
    experts in order); entropy: H(path) in bits over all n_distinct paths (the plug-in estimate: biased low
    when n_distinct is not small against n_tokens); max_entropy: log2 of E**L, or of n_tokens if that is
    smaller (every token its own path)."""

    layers: list[int]
    n_tokens: int
    n_distinct: int
    entropy: float
    max_entropy: float
    paths: list[tuple[tuple[int, ...], int]]

    def __str__(self) -> str:
        lines = [f"routing paths (top-1 expert per layer) through layers {self.layers}, {self.n_tokens} tokens: "
                 f"{self.n_distinct} distinct, H = {self.entropy:.3f} bits (max {self.max_entropy:.3f})"]
        lines += [f"  {n:>8d} {n / self.n_tokens:>7.2%}  " + " -> ".join(f"E{e}" for e in path) for path, n in self.paths]
        return "\n".join(lines)


def top1(indices: Int[torch.Tensor, "n top_k"], weights: Float[torch.Tensor, "n top_k"]) -> Int[torch.Tensor, "n"]:
    """Each row's expert with the largest weight (argmax returns the first of equal maxima)."""
    return indices.gather(-1, weights.float().argmax(-1, keepdim=True))[:, 0]


def paths_from_counter(layers: list[int], n_experts: int, counter: Counter, top: int) -> RoutingPaths:
    n = sum(counter.values())
    if n == 0:
        raise ValueError("the data holds no (unpadded) tokens")
    counts = torch.tensor(list(counter.values()), dtype=torch.float64)
    p = counts / n
    entropy = float(-(p * p.log2()).sum())
    ranked = sorted(counter.items(), key=lambda item: (-item[1], item[0]))[:top]
    max_entropy = min(len(layers) * math.log2(n_experts), math.log2(n))
    return RoutingPaths(layers, n, len(counter), entropy, max_entropy, [(tuple(int(e) for e in path), int(c)) for path, c in ranked])


def _consecutive(layers: list[int], all_layers: list[int]) -> None:
    """Paths run through consecutive mixture layers: a gap would hide a layer's choice."""
    where = [all_layers.index(layer) for layer in layers]
    if len(layers) < 2 or where != list(range(where[0], where[0] + len(layers))):
        raise ValueError(f"layers must be two or more consecutive mixture layers, in order (mixture layers: {all_layers}); got {layers}")


@torch.no_grad()
def routing_paths(
    model,
    data: Data,
    layers: Sequence[int] | None = None,
    top: int = 10,
    attention_mask: Mask | None = None,
    batch_size: int = 8,
) -> RoutingPaths:
    """The most frequent routing paths of the real tokens of ``data`` through consecutive mixture layers
    (all of them without ``layers``), and the Shannon entropy of the path distribution in bits (see
    RoutingPaths): how many distinct routes across depth the mixture actually uses. Cross-layer
    co-activation of pairs of layers is ``coactivations``; a path is the joint choice over all the layers."""
    layers = resolve_layers(model, layers)
    _consecutive(layers, model.cfg.moe_layer_indices)
    counter: Counter = Counter()
    for tokens, valid in iter_batches(model, data, attention_mask, batch_size):
        cache = run_sites(model, tokens, valid, layers, ("expert_indices", "expert_weights"))
        firsts = torch.stack(
            [top1(cache[hook_name(layer, "expert_indices")][valid], cache[hook_name(layer, "expert_weights")][valid]) for layer in layers], -1
        )
        counter.update(map(tuple, firsts.cpu().tolist()))
    return paths_from_counter(layers, model.cfg.n_routable_experts, counter, top)


@dataclass(frozen=True)
class RoutingOverlap:
    """Per layer, how alike two models route the same tokens (row i is block ``layers[i]``).

    token_jaccard: the mean over tokens of the weighted Jaccard similarity of the two routing-weight vectors,
    sum_e min(a_e, b_e) / sum_e max(a_e, b_e) (a_e: the token's weight on expert e, 0 where not routed; 1:
    the same experts with the same weights, 0: disjoint experts); load_jaccard: the same similarity of the two
    layers' expert loads (shares of routing slots); top1_agreement: the share of tokens with the same top-1
    expert."""

    layers: list[int]
    n_tokens: int
    token_jaccard: Float[torch.Tensor, "n_layers"]
    load_jaccard: Float[torch.Tensor, "n_layers"]
    top1_agreement: Float[torch.Tensor, "n_layers"]

    def __str__(self) -> str:
        lines = [f"routing overlap over {self.n_tokens} tokens (weighted Jaccard; 1 = routed alike)",
                 f"{'layer':>5}  {'per token':>9}  {'load':>6}  {'same top-1':>10}"]
        for i, layer in enumerate(self.layers):
            lines.append(f"{layer:>5}  {float(self.token_jaccard[i]):>9.4f}  {float(self.load_jaccard[i]):>6.4f}  "
                         f"{float(self.top1_agreement[i]):>10.2%}")
        return "\n".join(lines)


def weighted_jaccard(a: Float[torch.Tensor, "... n"], b: Float[torch.Tensor, "... n"]) -> Float[torch.Tensor, "..."]:
    """sum min(a, b) / sum max(a, b) along the last axis, of non-negative vectors (NaN where both are zero)."""
    if (a < 0).any() or (b < 0).any():
        raise ValueError("weighted Jaccard takes non-negative weights; got a negative one")
    return torch.minimum(a, b).sum(-1) / torch.maximum(a, b).sum(-1)


def dense_weights(indices: Int[torch.Tensor, "n top_k"], weights: Float[torch.Tensor, "n top_k"], n_experts: int) -> Float[torch.Tensor, "n n_experts"]:
    """[n n_experts]: each token's weight on every expert (0 where not routed; a forced repeat sums)."""
    out = torch.zeros(indices.shape[0], n_experts, dtype=torch.float64, device=indices.device)
    return out.scatter_add_(1, indices, weights.double())


@torch.no_grad()
def routing_overlap(
    model_a,
    model_b,
    data: Data,
    layers: int | Sequence[int] | None = None,
    attention_mask: Mask | None = None,
    batch_size: int = 8,
) -> RoutingOverlap:
    """How alike two models of one family (a checkpoint and its fine-tune) route the same tokens, layer by
    layer: the weighted Jaccard similarity of their routing weights per token and of their expert loads, and
    the share of tokens keeping their top-1 expert (routing stability after fine-tuning). Both models read
    the same token batches: they must share the tokenizer (texts are tokenized by model_a) and the layout
    of mixture layers and experts."""
    layers = resolve_layers(model_a, layers)
    resolve_layers(model_b, layers)
    E = model_a.cfg.n_routable_experts
    if model_b.cfg.n_routable_experts != E:
        raise ValueError(f"model_a has {E} experts per layer, model_b {model_b.cfg.n_routable_experts}: routing is comparable only expert for expert")
    n = 0
    jac = torch.zeros(len(layers), dtype=torch.float64)
    same = torch.zeros(len(layers), dtype=torch.float64)
    load_a = torch.zeros(len(layers), E, dtype=torch.float64)
    load_b = torch.zeros(len(layers), E, dtype=torch.float64)
    for tokens, valid in iter_batches(model_a, data, attention_mask, batch_size):
        cache_a = run_sites(model_a, tokens, valid, layers, ("expert_indices", "expert_weights"))
        tokens_b, valid_b = tokens.to(model_b.device), valid.to(model_b.device)
        cache_b = run_sites(model_b, tokens_b, valid_b, layers, ("expert_indices", "expert_weights"))
        n += int(valid.sum())
        for i, layer in enumerate(layers):
            ia, wa = cache_a[hook_name(layer, "expert_indices")][valid].cpu(), cache_a[hook_name(layer, "expert_weights")][valid].cpu()
            ib, wb = cache_b[hook_name(layer, "expert_indices")][valid_b].cpu(), cache_b[hook_name(layer, "expert_weights")][valid_b].cpu()
            jac[i] += weighted_jaccard(dense_weights(ia, wa, E), dense_weights(ib, wb, E)).sum()
            same[i] += (top1(ia, wa) == top1(ib, wb)).sum()
            load_a[i] += torch.bincount(ia.flatten(), minlength=E).double()
            load_b[i] += torch.bincount(ib.flatten(), minlength=E).double()
    if n == 0:
        raise ValueError("the data holds no (unpadded) tokens")
    return overlap_from_sums(layers, n, jac, same, load_a, load_b)


def overlap_from_sums(layers: list[int], n: int, jac, same, load_a, load_b) -> RoutingOverlap:
    share_a = load_a / load_a.sum(-1, keepdim=True)
    share_b = load_b / load_b.sum(-1, keepdim=True)
    return RoutingOverlap(layers, n, (jac / n).float(), weighted_jaccard(share_a, share_b).float(), (same / n).float())
