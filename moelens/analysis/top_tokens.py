"""The tokens that route most strongly to one expert, with the few tokens before each."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Literal

import torch

from moelens.analysis.data import Data, Mask, hook_name, iter_batches, resolve_layers, run_sites

By = Literal["weight", "score"]


@dataclass(frozen=True)
class TopToken:
    value: float  # the expert's slot weight, or its router score
    batch: int  # which batch of the data (0 for a single batch)
    row: int
    pos: int
    token: int
    context: list[int]  # the real tokens just before, oldest first
    token_str: str
    context_str: str


@dataclass(frozen=True)
class TopTokens:
    layer: int
    expert: int
    by: By
    entries: list[TopToken] = field(default_factory=list)  # strongest first

    def __iter__(self):
        return iter(self.entries)

    def __len__(self) -> int:
        return len(self.entries)

    def __getitem__(self, i: int) -> TopToken:
        return self.entries[i]

    def __str__(self) -> str:
        lines = [f"tokens routed most strongly to expert {self.expert} of layer {self.layer} (by {self.by})"]
        for t in self.entries:
            lines.append(f"  {t.value:.4f}  [{t.batch}:{t.row},{t.pos}]  {t.context_str}[[{t.token_str}]]")
        return "\n".join(lines)


@torch.no_grad()
def top_tokens(
    model,
    data: Data,
    layer: int,
    expert: int,
    k: int = 10,
    by: By = "weight",
    context: int = 5,
    attention_mask: Mask | None = None,
    batch_size: int = 8,
) -> TopTokens:
    """The k real tokens with the highest weight on ``expert`` (tokens not routed to it do not count), or the
    highest router score for it (every token counts: hook_router_scores as the family defines it, the logit
    where the router takes the top-k on logits). Contexts are decoded with the tokenizer when the model
    has one, shown as ids otherwise."""
    if by not in ("weight", "score"):
        raise ValueError(f"by must be 'weight' or 'score', got {by!r}")
    (layer,) = resolve_layers(model, layer)
    if not 0 <= expert < model.cfg.n_routable_experts:
        raise IndexError(f"expert {expert} is out of range: layer {layer} has {model.cfg.n_routable_experts} experts")
    best: list[tuple[float, int, int, int, int, list[int]]] = []
    for b, (tokens, valid) in enumerate(iter_batches(model, data, attention_mask, batch_size)):
        cache = run_sites(model, tokens, valid, [layer], ("expert_indices", "expert_weights", "router_scores"))
        values = _values(cache, layer, expert, by).masked_fill(~valid, float("-inf"))
        top = values.flatten().topk(min(k, values.numel()))
        for value, flat in zip(top.values.tolist(), top.indices.tolist()):
            if value == float("-inf"):
                break
            row, pos = divmod(flat, values.shape[1])
            before = tokens[row, :pos][valid[row, :pos]][-context:].tolist() if context > 0 else []
            best.append((value, b, row, pos, int(tokens[row, pos]), before))
        # Keep k across batches: the order is value, then first seen, so ties keep the data's order.
        best = sorted(best, key=lambda t: -t[0])[:k]
    return TopTokens(layer, expert, by, [_entry(model, *t) for t in best])


def _values(cache: dict, layer: int, expert: int, by: By) -> torch.Tensor:
    if by == "score":
        return cache[hook_name(layer, "router_scores")][..., expert].float()
    indices, weights = cache[hook_name(layer, "expert_indices")], cache[hook_name(layer, "expert_weights")]
    chosen = indices == expert
    # A token sends at most one slot to an expert (top-k picks distinct experts); sum covers a forced route.
    weight = (weights.float() * chosen).sum(-1)
    return weight.masked_fill(~chosen.any(-1), float("-inf"))


def _entry(model, value: float, batch: int, row: int, pos: int, token: int, context: list[int]) -> TopToken:
    tok = model.tokenizer
    if tok is None:
        token_str, context_str = str(token), "".join(f"{i} " for i in context)
    else:
        token_str, context_str = tok.id_to_str(token), tok.decode(context)
    return TopToken(value, batch, row, pos, token, context, token_str, context_str)
