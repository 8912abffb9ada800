"""Routing of one prompt: per token and per mixture layer, the chosen experts and their weights."""

from __future__ import annotations

from dataclasses import dataclass

import torch


@dataclass(frozen=True)
class LayerSummary:
    """One mixture layer over the prompt: how many tokens each expert got, how spread each token's router
    probabilities are (mean entropy of hook_router_probs, the router's distribution over the experts, in nats), and the mean
    factor of the shared-expert gate (its sigmoid) where the family gates its shared expert (Qwen2-MoE), else None."""

    load: torch.Tensor  # [n_experts] tokens routed to each expert
    entropy: float
    shared_gate: float | None

    def __str__(self) -> str:
        used = ", ".join(f"E{e}:{int(n)}" for e, n in enumerate(self.load.tolist()) if n)
        gate = "" if self.shared_gate is None else f", shared gate {self.shared_gate:.3f}"
        return f"entropy {self.entropy:.3f} nats{gate}; tokens per expert {used}"


@dataclass(frozen=True)
class RoutingTable:
    str_tokens: list[str]
    layers: list[int]  # mixture layers, in order
    indices: list[torch.Tensor]  # per mixture layer: [pos, top_k], slots sorted by weight, descending
    weights: list[torch.Tensor]  # per mixture layer: [pos, top_k] (top_k may differ between layers)
    next_tokens: list[tuple[str, float]]  # top predictions after the last token
    token_ids: list[int] | None = None
    summaries: list[LayerSummary] | None = None  # per mixture layer

    def __str__(self) -> str:
        width = max(len(repr(t)) for t in self.str_tokens)
        lines = []
        if self.summaries:
            lines.append("per mixture layer:")
            lines += [f"  L{layer}: {summary}" for layer, summary in zip(self.layers, self.summaries)]
        ids = self.token_ids or [None] * len(self.str_tokens)
        id_width = max(len(str(i)) for i in ids)
        for li, layer in enumerate(self.layers):
            lines.append(f"layer {layer}")
            for pos, (tok, tok_id) in enumerate(zip(self.str_tokens, ids)):
                slots = "  ".join(
                    f"E{int(e):<3d}{float(w):.3f}" for e, w in zip(self.indices[li][pos], self.weights[li][pos])
                )
                shown = repr(tok) if tok_id is None else f"{tok_id:>{id_width}} {repr(tok)}"
                lines.append(f"  {pos:>4d} {shown:<{width + id_width + 1}}  {slots}")
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
    names = [f"blocks.{i}.mlp.hook_{what}" for i in layers for what in ("expert_indices", "expert_weights", "router_probs")]
    # each layer's shared-expert gate, where its shared expert has one (Qwen2-MoE's sigmoid)
    gated = {i: [p.gate for p in model.blocks[i].mlp.parts() if p.kind == "shared" and p.gate is not None] for i in layers}
    gates = {i: found[0] for i, found in gated.items() if found}
    names += [gate.hook.name for gate in gates.values()]
    logits, cache = model.run_with_cache(tokens, names_filter=names)
    indices, weights, summaries = [], [], []
    for layer in layers:
        probs = cache["router_probs", layer][0].double()
        entropy = float(-(probs * probs.clamp_min(1e-300).log()).sum(-1).mean())
        load = torch.bincount(cache["expert_indices", layer][0].flatten(), minlength=model.cfg.n_routable_experts)
        gate = float(gates[layer].scale(cache[gates[layer].hook.name][0].float()).mean()) if layer in gates else None
        summaries.append(LayerSummary(load.cpu(), entropy, gate))
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
        token_ids=ids,
        summaries=summaries,
    )
