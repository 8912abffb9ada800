"""Super experts: the few experts whose down projections emit rare, extreme outliers, and what removing them does.

As in "Unveiling Super Experts in Mixture-of-Experts Large Language Models": an expert's output before its
routing weight (``blocks.L.mlp.experts.hook_out``, the down projection plus its bias) is profiled over a
corpus by its largest magnitude, max |x| over the tokens routed to it and the model dimensions; set against
the layer's typical scale (the median over the layer's experts of those maxima), a super expert's is far
larger. The check that they matter: the corpus loss with them removed (their routing weight zeroed).
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import torch
from jaxtyping import Float, Int

from moelens.analysis.ablation import ablate_experts_hooks
from moelens.analysis.data import Data, Mask, hook_name, iter_batches, resolve_layers


@dataclass(frozen=True)
class SuperExpert:
    """One expert's profile: the largest magnitude of its down-projection output over the corpus, and that
    over the median of its layer's experts' maxima."""

    layer: int
    expert: int
    max_abs: float  # max |down-projection output| over the corpus
    ratio: float  # max_abs / the median over the layer's experts of their max_abs


@dataclass(frozen=True)
class SuperExperts:
    """Row i of the tensors is block ``layers[i]``. ``ranked``: every expert a token was routed to, by ratio,
    largest first; ``found``: those with ratio >= the threshold (at most max_found), which ``loss_removed``
    removes (None where none is found)."""

    layers: list[int]
    max_abs: Float[torch.Tensor, "n_layers n_experts"]  # 0 where no token was routed to the expert
    ratio: Float[torch.Tensor, "n_layers n_experts"]  # NaN where no token was routed to the expert
    counts: Int[torch.Tensor, "n_layers n_experts"]  # routing slots per expert
    ranked: list[SuperExpert]
    found: list[SuperExpert]
    loss: float  # mean next-token loss over the corpus
    loss_removed: float | None
    # greedy continuations of the prompt given, intact and with the found experts removed (None: no prompt, or
    # for generated_removed none found): the paper's check that removing a handful of experts breaks generation
    generated: str | None = None
    generated_removed: str | None = None

    def __str__(self) -> str:
        lines = [f"loss {self.loss:.4f}" + ("" if self.loss_removed is None else f", {self.loss_removed:.4f} without the super experts")]
        if self.generated is not None:
            lines.append(f"generated: {self.generated!r}")
        if self.generated_removed is not None:
            lines.append(f"without them: {self.generated_removed!r}")
        lines += [
            f"{'*' if s in self.found else ' '} layer {s.layer} expert {s.expert}: max |x| {s.max_abs:.4g}, {s.ratio:.2f}x the layer median"
            for s in self.ranked[: max(10, len(self.found))]
        ]
        return "\n".join(lines)


def _loss_sum(model, batch: torch.Tensor, valid: torch.Tensor, hooks) -> tuple[float, int]:
    mask = None if bool(valid.all()) else valid.long()
    nll = model.run_with_hooks(batch, fwd_hooks=hooks, return_type="loss", loss_per_token=True, attention_mask=mask)
    keep = valid[:, 1:] & valid[:, :-1]
    return float(nll[keep].double().sum()), int(keep.sum())


@torch.no_grad()
def super_experts(
    model,
    tokens: Data,
    layers: int | Sequence[int] | None = None,
    threshold: float = 10.0,
    max_found: int | None = None,
    attention_mask: Mask | None = None,
    batch_size: int = 8,
    prompt: str | None = None,
    max_new_tokens: int = 20,
) -> SuperExperts:
    """Profile each expert's largest output magnitude over ``tokens`` (a batch or a dataset, see
    moelens.analysis.data; padding left out) and rank the experts by it over their layer's median
    ("Unveiling Super Experts in Mixture-of-Experts Large Language Models").

    An expert's max |x| is over the slots routed to it (``experts.hook_out``: the down projection's output,
    before the routing weight) and the model dimensions; its ratio is that over the median of the maxima of the
    layer's experts that got a token. The experts at or above ``threshold`` (at most ``max_found``, the
    largest ratios) are the super experts found, and the corpus loss is measured with and without them
    (removed as ablate_experts(mode="zero") removes: their slots' weights set to 0). Only the model's own
    experts are profiled (not identity experts, whose output is their input). With a ``prompt``, also its
    greedy continuation (``max_new_tokens``, eos ignored), intact and with the experts found removed.
    """
    if threshold <= 0:
        raise ValueError(f"threshold must be positive, got {threshold}")
    layers = resolve_layers(model, layers)
    E = model.cfg.n_experts
    maxima = torch.zeros(len(layers), E, device=model.device)
    counts = torch.zeros(len(layers), E, dtype=torch.long, device=model.device)
    batches = list(iter_batches(model, tokens, attention_mask, batch_size))
    loss_sum, n_predictions = 0.0, 0
    for batch, valid in batches:
        hooks = []
        for li, layer in enumerate(layers):
            seen: dict[str, torch.Tensor] = {}

            def remember(indices, hook, seen=seen):
                seen["indices"] = indices

            def profile(out, hook, seen=seen, li=li, valid=valid):
                indices = seen["indices"]
                routed = valid[..., None] & (indices < E)  # [b p k]: real tokens, real experts
                peak = out.detach().abs().amax(-1).float()
                maxima[li].scatter_reduce_(0, indices[routed], peak[routed], "amax")
                counts[li] += torch.bincount(indices[routed], minlength=E)[:E]

            hooks += [(hook_name(layer, "expert_indices"), remember), (f"blocks.{layer}.mlp.experts.hook_out", profile)]
        total, n = _loss_sum(model, batch, valid, hooks)
        loss_sum, n_predictions = loss_sum + total, n_predictions + n
    if n_predictions == 0:
        raise ValueError("the data holds no prediction: no two consecutive unpadded tokens")
    maxima, counts = maxima.cpu(), counts.cpu()
    ratio = torch.full_like(maxima, float("nan"))
    for li in range(len(layers)):
        used = counts[li] > 0
        if bool(used.any()):
            ratio[li, used] = maxima[li, used] / maxima[li, used].quantile(0.5)
    ranked = sorted(
        (SuperExpert(layers[li], e, float(maxima[li, e]), float(ratio[li, e]))
         for li in range(len(layers)) for e in range(E) if counts[li, e] > 0),
        key=lambda s: -s.ratio,
    )
    found = [s for s in ranked if s.ratio >= threshold][:max_found]
    loss_removed = generated = generated_removed = None
    continuation = dict(max_new_tokens=max_new_tokens, do_sample=False, stop_at_eos=False, return_type="str")
    if prompt is not None:
        generated = model.generate(prompt, **continuation)
    if found:
        removed: dict[int, list[int]] = {}
        for s in found:
            removed.setdefault(s.layer, []).append(s.expert)
        hooks = ablate_experts_hooks(model, removed, "zero")
        sums = [_loss_sum(model, batch, valid, hooks) for batch, valid in batches]
        loss_removed = sum(s for s, _ in sums) / n_predictions
        if prompt is not None:
            with model.hooks(fwd_hooks=hooks):
                generated_removed = model.generate(prompt, **continuation)
    return SuperExperts(
        layers=layers, max_abs=maxima, ratio=ratio, counts=counts, ranked=ranked, found=found,
        loss=loss_sum / n_predictions, loss_removed=loss_removed, generated=generated,
        generated_removed=generated_removed,
    )
