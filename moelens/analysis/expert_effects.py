"""Causal expert importance: the change in next-token loss when one expert of one layer is removed.

The measure of the causal expert audits of OLMoE, Qwen1.5-MoE and DeepSeek-V2-Lite and of REAP's pruning
criterion's check: for every (layer, expert), remove the expert on every token of a corpus and take the mean
change of the next-token loss. Two removals:

- ``"zero"``: each slot routed to the expert gets weight 0, so its term leaves the layer's sum. The other slots
  keep the weights the router gave them (no renormalisation): the token then gets k - 1 experts' worth of
  output, which is what removing the expert from the model does, and matches ``ablate_experts(mode="zero")``.
- ``"reroute"``: equal compute. A token that chose the expert is routed as the router would route it if the
  expert's router logit were -inf (only on the tokens that chose it; the others keep their route): for a
  softmax top-k that is the next-ranked unchosen expert in its place, every weight computed by the family's
  rule from the new scores (without renormalisation, Qwen2-MoE's and OLMoE's, the other slots' weights grow
  by 1 / (1 - p_removed), as the softmax over the remaining experts gives). Where the rule would still choose
  the expert with its logit at -inf (a choice bias added to sigmoid scores can outweigh a score of 0) the
  removal is not defined and an error says so.

Cost: one full forward caches each layer's residual stream entering the block (hook_resid_pre); each
expert's run then starts at its layer (``start_at_layer``; at the layer before where a layer reuses what an
earlier one carried, GLM-5's shared DSA selection), several experts side by side in one batch, so a layer's
experts cost about (n_layers - layer) / n_layers of a forward each, not a whole one.
"""

from __future__ import annotations

import os
from collections.abc import Sequence
from typing import Literal

import torch
from jaxtyping import Float
from tqdm.auto import tqdm

from moelens.analysis.data import Data, Mask, hook_name, iter_batches, resolve_layers
from moelens.analysis.resume import Progress

RemovalMode = Literal["zero", "reroute"]
Hooks = list[tuple[str, object]]


def start_layer(model, layer: int) -> int:
    """The latest block at or before ``layer`` that a forward can start at (start_at_layer): not one whose
    token mixer reads what an earlier layer of the same forward carried (GLM-5's shared DSA selection)."""
    while layer > 0 and getattr(model.blocks[layer].token_mixer, "reads_carried", False):
        layer -= 1
    return layer


def _removal_hooks(
    model, layer: int, experts: torch.Tensor, clean_indices: torch.Tensor, mode: RemovalMode
) -> Hooks:
    """Hooks removing experts[r] from batch row r of a run of layer ``layer`` (clean_indices: that layer's
    expert indices [rows pos top_k] in the unablated run, which say where the reroute acts)."""
    seen: dict[str, torch.Tensor] = {}
    per_row = experts[:, None, None]

    def remember(indices, hook):
        seen["indices"] = indices

    if mode == "zero":

        def zero(weights, hook):
            return weights.masked_fill(seen["indices"] == per_row, 0)

        return [(hook_name(layer, "expert_indices"), remember), (hook_name(layer, "expert_weights"), zero)]

    removed = (clean_indices == per_row).any(-1)  # [rows pos]: the tokens that chose the row's expert
    onehot = torch.nn.functional.one_hot(experts, model.cfg.n_routable_experts).bool()[:, None, :]

    def to_minus_inf(logits, hook):
        return logits.masked_fill(onehot & removed[..., None], float("-inf"))

    def check(indices, hook):
        again = (indices == per_row).any(-1) & removed
        if bool(again.any()):
            row = int(again.nonzero()[0, 0])
            router = type(model.blocks[layer].mlp.router).__name__
            raise ValueError(
                f"mode='reroute': layer {layer}'s router ({router}) still chooses expert {int(experts[row])} with its "
                "router logit at -inf (a choice bias can outweigh the lowest score), so re-routing its tokens is not "
                "defined for this routing rule; use mode='zero'"
            )

    def finite(weights, hook):
        if not bool(torch.isfinite(weights).all()):
            raise ValueError(f"mode='reroute': layer {layer}'s router gives non-finite weights with a logit at -inf")

    return [
        (hook_name(layer, "router_logits"), to_minus_inf),
        (hook_name(layer, "expert_indices"), check),
        (hook_name(layer, "expert_weights"), finite),
    ]


@torch.no_grad()
def expert_loss_effects(
    model,
    tokens: Data,
    layers: int | Sequence[int] | None = None,
    mode: RemovalMode = "zero",
    attention_mask: Mask | None = None,
    batch_size: int = 8,
    per_token: bool = False,
    experts_per_pass: int | None = None,
    progress: bool | None = None,
    resume: str | os.PathLike | None = None,
) -> Float[torch.Tensor, "n_layers n_experts"] | tuple[
    Float[torch.Tensor, "n_layers n_experts"], Float[torch.Tensor, "n_layers n_experts n_predictions"]
]:
    """The mean change in next-token loss (nats, removed minus intact) when each expert of each layer is removed.

    Row i is block ``layers[i]`` (default: every mixture layer, in order); column e is expert e. The mean is
    over every prediction of the corpus (``tokens``: a batch or a dataset, see moelens.analysis.data; pad
    positions left out as model.loss leaves them out), not only over the tokens routed to the expert: the
    experts' numbers add up like their shares of the loss. ``mode``: "zero" drops the expert's weighted term
    (no renormalisation), "reroute" sends its tokens where the router would with the expert's logit at -inf
    (equal compute); see the module's docstring. This is the causal expert-importance measure of the OLMoE,
    Qwen1.5-MoE and DeepSeek-V2-Lite audits and of REAP's expert pruning.

    With ``per_token`` also returns every prediction's change, [n_layers n_experts n_predictions], the
    predictions (unpadded (token, next token) pairs) in the order of the batches, rows and positions.
    Each layer's runs start at that layer from the cached residual stream, ``experts_per_pass`` experts at a
    time stacked along the batch (default: batch_size // the batch's rows, at least 1); an expert no token of
    a batch chose changes nothing there and is not run.

    ``resume``: a file that holds the run's progress, written after each batch: a run killed part way through,
    started again with the same file, arguments and data, goes on from the last batch done and gives the
    numbers an uninterrupted run gives, bit for bit (other arguments or data are refused, naming them). The
    file is left in place, complete, when the run ends.
    """
    if mode not in ("zero", "reroute"):
        raise ValueError(f"mode must be 'zero' or 'reroute', got {mode!r}")
    if experts_per_pass is not None and experts_per_pass < 1:
        raise ValueError(f"experts_per_pass must be at least 1, got {experts_per_pass}")
    layers = resolve_layers(model, layers)
    E = model.cfg.n_routable_experts
    sums = torch.zeros(len(layers), E, dtype=torch.float64)
    per_token_parts: list[torch.Tensor] = []
    n_predictions = 0
    bar = tqdm(desc="expert_loss_effects", unit="pass", disable=None if progress is None else not progress)
    starts = {layer: start_layer(model, layer) for layer in layers}
    names = [f"blocks.{s}.hook_resid_pre" for s in set(starts.values())] + [hook_name(layer, "expert_indices") for layer in layers]
    saved = None
    if resume is not None:
        router = next(b.mlp.router.weight for b in model.blocks if b.is_moe)
        key = dict(model=type(model).__name__, n_layers=model.cfg.n_layers, d_model=model.cfg.d_model, n_experts=E,
                   router_digest=float(router.double().sum()), layers=list(layers), mode=mode, batch_size=batch_size,
                   per_token=per_token, experts_per_pass=experts_per_pass)
        saved = Progress(resume, key)
        if saved.batches:
            sums, n_predictions = saved.state["sums"], saved.state["n_predictions"]
            per_token_parts = list(saved.state["per_token"])
    seen = 0
    for index, (batch, valid) in enumerate(iter_batches(model, tokens, attention_mask, batch_size)):
        seen += 1
        if saved is not None and saved.skip(index, batch, valid):
            continue
        b, p = batch.shape
        if p < 2:
            raise ValueError(f"a loss needs at least two positions, got a batch of shape {tuple(batch.shape)}")
        mask = None if bool(valid.all()) else valid.long()
        logits, cache = model.run_with_cache(batch, names_filter=names, attention_mask=mask)
        base = model.loss(logits, batch, mask, per_token=True)  # [b p-1], 0 where left out
        keep = valid[:, 1:] & valid[:, :-1]
        n_predictions += int(keep.sum())
        deltas = torch.zeros(len(layers), E, int(keep.sum()), dtype=torch.float64) if per_token else None
        group = experts_per_pass or max(1, batch_size // b)
        for li, layer in enumerate(layers):
            resid = cache[f"blocks.{starts[layer]}.hook_resid_pre"]
            clean = cache[hook_name(layer, "expert_indices")]
            chosen = torch.unique(clean[valid]).tolist()  # an expert no real token chose changes nothing
            for start in range(0, len(chosen), group):
                ids = chosen[start:start + group]
                g = len(ids)
                experts = torch.tensor(ids, device=batch.device).repeat_interleave(b)  # row r*b+i: expert ids[r]
                hooks = _removal_hooks(model, layer, experts, clean.repeat(g, 1, 1), mode)
                rows_mask = None if mask is None else mask.repeat(g, 1)
                out = model.run_with_hooks(
                    resid.repeat(g, 1, 1), fwd_hooks=hooks, start_at_layer=starts[layer], attention_mask=rows_mask
                )
                loss = model.loss(out, batch.repeat(g, 1), rows_mask, per_token=True).view(g, b, p - 1)
                delta = (loss - base).double()
                for r, e in enumerate(ids):
                    sums[li, e] += float(delta[r][keep].sum())
                    if deltas is not None:
                        deltas[li, e] = delta[r][keep].cpu()
                bar.update(1)
        if deltas is not None:
            per_token_parts.append(deltas)
        if saved is not None:
            saved.done(batch, valid, {"sums": sums.clone(), "n_predictions": n_predictions, "per_token": per_token_parts})
    bar.close()
    if saved is not None:
        saved.finish(seen)
    if n_predictions == 0:
        raise ValueError("the data holds no prediction: no two consecutive unpadded tokens")
    mean = (sums / n_predictions).float()
    if per_token:
        return mean, torch.cat(per_token_parts, -1).float()
    return mean
