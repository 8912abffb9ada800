"""Routing of one prompt: per token and per mixture layer, the chosen experts and their weights."""

from __future__ import annotations

from dataclasses import dataclass

import torch


@dataclass(frozen=True)
class RoutingTable:
    str_tokens: list[str]
    layers: list[int]  # mixture layers, in order
    indices: list[torch.Tensor]  # per mixture layer: [pos, top_k], slots sorted by weight, descending
    weights: list[torch.Tensor]  # per mixture layer: [pos, top_k] (top_k may differ between layers)
    next_tokens: list[tuple[str, float]]  # top predictions after the last token

    def __str__(self) -> str:
        width = max(len(repr(t)) for t in self.str_tokens)
        lines = []
        for li, layer in enumerate(self.layers):
            lines.append(f"layer {layer}")
            for pos, tok in enumerate(self.str_tokens):
                slots = "  ".join(
                    f"E{int(e):<3d}{float(w):.3f}" for e, w in zip(self.indices[li][pos], self.weights[li][pos])
                )
                lines.append(f"  {pos:>4d} {repr(tok):<{width}}  {slots}")
        lines.append("next token:")
        lines += [f"  {p:.4f}  {tok!r}" for tok, p in self.next_tokens]
        return "\n".join(lines)


@torch.no_grad()
def routing_table(model, prompt: str | torch.Tensor, top_next: int = 5) -> RoutingTable:
    """Run one prompt and collect each mixture layer's routing (slots sorted by weight)."""
    tokens = model.to_tokens(prompt) if isinstance(prompt, str) else prompt
    if tokens.dim() == 1:
        tokens = tokens[None]
    if tokens.shape[0] != 1:
        raise ValueError(f"routing_table takes one prompt, got tokens of shape {tuple(tokens.shape)}")
    layers = model.cfg.moe_layer_indices
    names = [f"blocks.{i}.mlp.hook_expert_{what}" for i in layers for what in ("indices", "weights")]
    logits, cache = model.run_with_cache(tokens, names_filter=names)
    indices, weights = [], []
    for layer in layers:
        w = cache["expert_weights", layer][0].float()
        order = w.argsort(-1, descending=True)
        weights.append(w.gather(-1, order))
        indices.append(cache["expert_indices", layer][0].gather(-1, order))
    probs = logits[0, -1].float().softmax(-1)
    top = probs.topk(min(top_next, probs.numel()))
    ids = tokens[0].tolist()
    str_tokens = model.to_str_tokens(tokens[0]) if model.tokenizer is not None else [str(i) for i in ids]
    decode = model.tokenizer.id_to_str if model.tokenizer is not None else str
    return RoutingTable(
        str_tokens=str_tokens,
        layers=layers,
        indices=indices,
        weights=weights,
        next_tokens=[(decode(int(i)), float(p)) for p, i in zip(top.values, top.indices)],
    )
