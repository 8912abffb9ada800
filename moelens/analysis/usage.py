"""Expert usage per mixture layer over a batch or a dataset: counts, load, routing entropy, bias effect."""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass

import torch
from jaxtyping import Float, Int

from moelens.analysis.data import Data, Mask, hook_name, iter_batches, resolve_layers, run_sites


@dataclass(frozen=True)
class ExpertUsage:
    """Routing statistics of the real (unpadded) tokens; row i of every tensor is block ``layers[i]``."""

    layers: list[int]
    n_tokens: int
    counts: Int[torch.Tensor, "n_moe_layers n_experts"]  # routing slots sent to each expert
    load: Float[torch.Tensor, "n_moe_layers n_experts"]  # counts / all slots of the layer (rows sum to 1)
    routing_entropy: Float[torch.Tensor, "n_moe_layers"]  # mean over tokens of H(router probabilities), nats
    load_entropy: Float[torch.Tensor, "n_moe_layers"]  # H(load), nats; ln(n_experts) is perfectly balanced
    bias_changed: Float[torch.Tensor, "n_moe_layers"] | None  # Solar: share of tokens the correction bias re-routed

    @property
    def n_experts(self) -> int:
        return self.counts.shape[1]

    def __str__(self) -> str:
        top = math.log(self.n_experts)
        lines = [f"expert usage over {self.n_tokens} tokens, {self.n_experts} experts (max entropy ln E = {top:.3f})"]
        head = f"{'layer':>5}  {'H(route)':>8}  {'H(load)':>8}  {'min/max load':>13}"
        lines.append(head + ("  bias re-routed" if self.bias_changed is not None else "") + "  most used")
        for i, layer in enumerate(self.layers):
            load = self.load[i]
            order = load.argsort(descending=True)[:3].tolist()
            busiest = ", ".join(f"E{e} {float(load[e]):.1%}" for e in order)
            row = f"{layer:>5}  {float(self.routing_entropy[i]):>8.3f}  {float(self.load_entropy[i]):>8.3f}  "
            row += f"{float(load.min()):>6.1%}/{float(load.max()):<6.1%}"
            if self.bias_changed is not None:
                row += f"  {float(self.bias_changed[i]):>14.1%}"
            lines.append(f"{row}  {busiest}")
        return "\n".join(lines)


def entropy(p: Float[torch.Tensor, "... n"]) -> Float[torch.Tensor, "..."]:
    """Shannon entropy in nats along the last axis (0 log 0 = 0)."""
    return -torch.special.xlogy(p, p).sum(-1)


@torch.no_grad()
def expert_usage(
    model,
    data: Data,
    layers: int | Sequence[int] | None = None,
    attention_mask: Mask | None = None,
    batch_size: int = 8,
) -> ExpertUsage:
    """Count which experts the real tokens of ``data`` are routed to (see moelens.analysis.data for ``data``).

    Routing entropy uses each token's router probabilities (``hook_router_probs``, one distribution over the
    experts for every family: sigmoid scores (Solar) normalised to sum to one, logit scores (gpt-oss) through a
    softmax over all experts), so the number is comparable across families. ``bias_changed`` compares the chosen experts
    with the model's own choice rule (groups included) applied to the scores without the correction bias.
    """
    layers = resolve_layers(model, layers)
    biased = any(block.is_moe and block.mlp.router.choice_bias for block in model.blocks)
    n, E = len(layers), model.cfg.n_routable_experts
    counts = torch.zeros(n, E, dtype=torch.long)
    entropy_sum = torch.zeros(n, dtype=torch.float64)
    changed = torch.zeros(n, dtype=torch.long)
    n_tokens = 0
    for tokens, valid in iter_batches(model, data, attention_mask, batch_size):
        cache = run_sites(model, tokens, valid, layers, ("expert_indices", "router_probs") + (("router_scores",) if biased else ()))
        n_tokens += int(valid.sum())
        for i, layer in enumerate(layers):
            indices = cache[hook_name(layer, "expert_indices")][valid]  # [tokens top_k]
            router = model.blocks[layer].mlp.router
            probs = cache[hook_name(layer, "router_probs")][valid]
            counts[i] += torch.bincount(indices.flatten(), minlength=E).cpu()
            entropy_sum[i] += entropy(probs).double().sum().cpu()
            if biased:
                # The router's own choice rule (groups, top-k) on the unbiased scores: what the bias changed.
                unbiased = router.choose(cache[hook_name(layer, "router_scores")][valid].float())
                differs = (unbiased.sort(-1).values != indices.sort(-1).values).any(-1)
                changed[i] += int(differs.sum())
    if n_tokens == 0:
        raise ValueError("the data holds no (unpadded) tokens")
    load = counts.double() / counts.sum(-1, keepdim=True).clamp(min=1)
    return ExpertUsage(
        layers=layers,
        n_tokens=n_tokens,
        counts=counts,
        load=load.float(),
        routing_entropy=(entropy_sum / n_tokens).float(),
        load_entropy=entropy(load).float(),
        bias_changed=(changed.double() / n_tokens).float() if biased else None,
    )
