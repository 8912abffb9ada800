"""Expert ablation: zero (the slot's weight becomes 0) or mean (the slot's output becomes the expert's mean)."""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import Literal

import torch
from jaxtyping import Float

from moelens.analysis.compare import InterventionResult, compare_runs
from moelens.analysis.data import Data, Mask, hook_name, iter_batches, resolve_layers, run_sites

Experts = Mapping[int, int | Sequence[int]]  # layer -> expert(s)
Mode = Literal["zero", "mean"]


def _normalise(model, experts: Experts) -> dict[int, list[int]]:
    out = {}
    for layer, chosen in experts.items():
        (block,) = resolve_layers(model, layer)
        chosen = [chosen] if isinstance(chosen, int) else list(chosen)
        bad = [e for e in chosen if not 0 <= e < model.cfg.n_routable_experts]
        if bad:
            raise IndexError(f"experts {bad} are out of range: layer {block} has {model.cfg.n_routable_experts} experts")
        out[block] = chosen
    return out


@torch.no_grad()
def expert_mean_outputs(
    model, reference: Data, layers: Sequence[int], attention_mask: Mask | None = None, batch_size: int = 8
) -> dict[int, tuple[Float[torch.Tensor, "n_experts d_model"], torch.Tensor]]:
    """Per layer: (each expert's mean weighted slot output over the real tokens routed to it, token counts).

    The slot output is hook_expert_outputs, i.e. already times the slot's weight: the mean is what the
    expert adds to a token it is chosen for, on average.
    """
    layers = resolve_layers(model, list(layers))
    E, d = model.cfg.n_routable_experts, model.cfg.d_model
    sums = {layer: torch.zeros(E, d, dtype=torch.float64, device=model.device) for layer in layers}
    counts = {layer: torch.zeros(E, dtype=torch.long, device=model.device) for layer in layers}
    for tokens, valid in iter_batches(model, reference, attention_mask, batch_size):
        cache = run_sites(model, tokens, valid, layers, ("expert_indices", "expert_outputs"))
        for layer in layers:
            idx = cache[hook_name(layer, "expert_indices")][valid].flatten()
            out = cache[hook_name(layer, "expert_outputs")][valid].reshape(-1, d)
            sums[layer].index_add_(0, idx, out.double())
            counts[layer] += torch.bincount(idx, minlength=E)
    return {layer: ((sums[layer] / counts[layer].clamp(min=1)[:, None]).float(), counts[layer]) for layer in layers}


def ablate_experts_hooks(
    model,
    experts: Experts,
    mode: Mode = "zero",
    reference: Data | None = None,
    reference_mask: Mask | None = None,
) -> list[tuple[str, object]]:
    """Hooks for run_with_hooks / model.hooks(): ablate the given experts of each layer on every token.

    "zero" sets the weight of each slot routed to an ablated expert to 0 (the term leaves the sum; no
    renormalisation). "mean" replaces those slots' outputs by the expert's mean output over ``reference``
    (required). The other slots and the routing itself are untouched.
    """
    if mode not in ("zero", "mean"):
        raise ValueError(f"mode must be 'zero' or 'mean', got {mode!r}")
    chosen = _normalise(model, experts)
    if mode == "mean":
        if reference is None:
            raise ValueError("mean ablation needs reference data to take the experts' mean outputs over")
        means = expert_mean_outputs(model, reference, list(chosen), reference_mask)
        for layer, ids in chosen.items():
            unseen = [e for e in ids if int(means[layer][1][e]) == 0]
            if unseen:
                raise ValueError(f"layer {layer}: experts {unseen} get no token of the reference data, so have no mean output")
    hooks: list[tuple[str, object]] = []
    for layer, ids in chosen.items():
        seen: dict[str, torch.Tensor] = {}
        ablated = torch.tensor(ids, device=model.device)

        # The slot -> expert map of this forward is read at hook_expert_indices, which fires first.
        def remember(indices, hook, seen=seen):
            seen["indices"] = indices

        def hit(seen=seen, ablated=ablated) -> torch.Tensor:
            return torch.isin(seen["indices"], ablated)

        hooks.append((hook_name(layer, "expert_indices"), remember))
        if mode == "zero":
            hooks.append((hook_name(layer, "expert_weights"), lambda w, hook, hit=hit: w.masked_fill(hit(), 0)))
        else:
            mean = means[layer][0]

            def to_mean(out, hook, hit=hit, mean=mean, seen=seen):
                replacement = mean.to(out.dtype)[seen["indices"]]
                return torch.where(hit()[..., None], replacement, out)

            hooks.append((hook_name(layer, "expert_outputs"), to_mean))
    return hooks


def ablate_experts(
    model,
    tokens: torch.Tensor | str | list[str],
    experts: Experts,
    mode: Mode = "zero",
    reference: Data | None = None,
    attention_mask: Mask | None = None,
    reference_mask: Mask | None = None,
) -> InterventionResult:
    """Run ``tokens`` with and without ``experts`` ({layer: expert or experts}) ablated; mean ablation takes the
    means over ``reference`` (default: ``tokens`` themselves)."""
    if mode == "mean" and reference is None:
        reference, reference_mask = tokens, attention_mask
    return compare_runs(model, tokens, ablate_experts_hooks(model, experts, mode, reference, reference_mask), attention_mask)
