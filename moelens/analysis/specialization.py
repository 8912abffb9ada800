"""Expert specialization: how far each expert's tokens are from its layer's (Jensen-Shannon divergence), and
REAP's saliency (how much an expert writes when it is chosen)."""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass

import torch
from jaxtyping import Float, Int

from moelens.analysis.data import Data, Mask, hook_name, iter_batches, resolve_layers

EXPERT_OUT = "blocks.{layer}.mlp.experts.hook_out"


def jensen_shannon(p: Float[torch.Tensor, "... n"], q: Float[torch.Tensor, "... n"]) -> Float[torch.Tensor, "..."]:
    """JSD(p, q) = H(m) - (H(p) + H(q)) / 2 with m = (p + q) / 2, in bits (0 for equal distributions, 1 for
    disjoint ones), along the last axis; p and q are normalised first (counts are accepted), 0 log 0 = 0.
    A row of zeros (an expert with no token) gives NaN: it has no distribution to compare."""
    p, q = p.double(), q.double()
    p, q = p / p.sum(-1, keepdim=True), q / q.sum(-1, keepdim=True)
    m = (p + q) / 2

    def h(x):
        return -torch.special.xlogy(x, x).sum(-1) / torch.log(torch.tensor(2.0, dtype=torch.float64))

    return (h(m) - (h(p) + h(q)) / 2).clamp(min=0)  # rounding can leave -1e-17 on equal rows


@dataclass(frozen=True)
class Specialization:
    """Row i of every tensor is block ``layers[i]``; column c of ``counts`` is class ``classes[c]``.

    counts[l, e, c]: routing slots of class c sent to expert e (a token routed to k experts counts once for
    each); jsd[l, e]: JSD(p(class | e) || p(class)) in bits, p(class) the layer's distribution over all its
    slots (every real token, k times); saliency[l, e]: REAP's saliency (see expert_specialization), None
    where it was not computed."""

    layers: list[int]
    classes: list[str]
    counts: Int[torch.Tensor, "n_layers n_experts n_classes"]
    jsd: Float[torch.Tensor, "n_layers n_experts"]
    saliency: Float[torch.Tensor, "n_layers n_experts"] | None

    @property
    def n_routed(self) -> Int[torch.Tensor, "n_layers n_experts"]:
        """Tokens routed to each expert."""
        return self.counts.sum(-1)

    def __str__(self) -> str:
        """Per layer, the three most specialized experts with the class each takes most above its share (its
        lift p(class | e) / p(class)), and the three most salient."""
        lines = [f"expert specialization over {len(self.classes)} classes: JSD(p(class | expert), p(class)) in bits"
                 + ("; REAP saliency" if self.saliency is not None else "")]
        for i, layer in enumerate(self.layers):
            c = self.counts[i].double()
            lift = (c / c.sum(-1, keepdim=True)) / (c.sum(0) / c.sum())
            shown = []
            for e in self.jsd[i].nan_to_num(-1.0).argsort(descending=True)[:3].tolist():
                best = int(lift[e].nan_to_num(-1.0).argmax())
                shown.append(f"E{e} {float(self.jsd[i, e]):.3f} ({_clip(self.classes[best])} x{float(lift[e, best]):.1f})")
            row = f"  layer {layer}: most specialized {', '.join(shown)}"
            if self.saliency is not None:
                s = self.saliency[i].nan_to_num(-1.0)
                row += "; most salient " + ", ".join(f"E{e} {float(self.saliency[i, e]):.2f}" for e in s.argsort(descending=True)[:3].tolist())
            lines.append(row)
        return "\n".join(lines)

    __repr__ = __str__


def _clip(name: str, width: int = 16) -> str:
    return name if len(name) <= width else name[: width - 3] + "..."


def class_index(classes: str | Mapping[int, str], default: str | None = None):
    """(map from token ids to class indices, class names): "token" gives every token id its own class (named
    by the id); a mapping token id -> class name groups them (ids it lacks take ``default``)."""
    if isinstance(classes, str):
        if classes != "token":
            raise ValueError(f"classes must be 'token' or a mapping token id -> class name, got {classes!r}")
        return None, None
    if not isinstance(classes, Mapping):
        raise TypeError(f"classes must be 'token' or a mapping token id -> class name, got {type(classes).__name__}")
    names = sorted({str(c) for c in classes.values()} | ({str(default)} if default is not None else set()))
    index = {n: i for i, n in enumerate(names)}
    return {int(t): index[str(c)] for t, c in classes.items()}, names


def specialization_from_counts(
    layers: list[int], classes: list[str], counts: torch.Tensor, saliency: torch.Tensor | None
) -> Specialization:
    """The JSD of each expert's class distribution against its layer's, from slot counts [layer expert class]."""
    layer_dist = counts.sum(1, keepdim=True).expand_as(counts)
    return Specialization(layers, classes, counts, jensen_shannon(counts, layer_dist).float(), saliency)


@torch.no_grad()
def expert_specialization(
    model,
    data: Data,
    layers: int | Sequence[int] | None = None,
    classes: str | Mapping[int, str] = "token",
    default: str | None = None,
    saliency: bool = True,
    attention_mask: Mask | None = None,
    batch_size: int = 8,
) -> Specialization:
    """Per expert, the Jensen-Shannon divergence (Lin 1991, in bits) between the distribution of the token
    classes routed to it and the layer's (0: the expert sees the layer's mix; towards 1: its own classes),
    and REAP's saliency (Router-weighted Expert Activation Pruning: Lasby et al. 2025, "REAP the Experts: Why
    Pruning Prevails for One-Shot MoE Compression"): S_e = mean over the tokens routed to e of g_e(x) ||f_e(x)||_2,
    the routing weight (hook_expert_weights) times the L2 norm of the expert's output before the weight
    (blocks.L.mlp.experts.hook_out). NaN for an expert no token reached; for a layer whose experts take the
    weight on their input (Llama 4) the unweighted output does not exist and its row is NaN.

    classes: "token" (each token id its own class) or a mapping token id -> class name (tokens it lacks take
    ``default``; without one they are an error). Padding never counts. saliency=False reads only the routing."""
    layers = resolve_layers(model, layers)
    index, names = class_index(classes, default)
    E = model.cfg.n_routable_experts
    weight_at_input = {layer: any(p.kind == "routed" and p.module.spec.weight_at == "input" for p in model.blocks[layer].mlp.parts())
                       for layer in layers}
    sites = ("expert_indices", "expert_weights") if saliency else ("expert_indices",)
    seen: dict[int, int] = {}  # token id -> column, for classes="token" (in first-seen order, sorted at the end)
    slots: list[tuple[int, torch.Tensor, torch.Tensor]] = []  # (layer i, experts [n], class [n]) per batch
    sal_sum = torch.zeros(len(layers), E, dtype=torch.float64)
    sal_n = torch.zeros(len(layers), E, dtype=torch.float64)
    for tokens, valid in iter_batches(model, data, attention_mask, batch_size):
        outs = [EXPERT_OUT.format(layer=layer) for layer in layers if saliency and not weight_at_input[layer]]
        cache = _run(model, tokens, valid, layers, sites, outs)
        real = tokens[valid].cpu()
        if index is None:
            cls = torch.tensor([seen.setdefault(int(t), len(seen)) for t in real.tolist()], dtype=torch.long)
        else:
            missing = [int(t) for t in real.unique().tolist() if int(t) not in index]
            if missing and default is None:
                raise ValueError(f"classes has no class for token {missing[0]} ({len(missing)} tokens unmapped): map them or pass default=")
            fallback = names.index(str(default)) if default is not None else -1
            cls = torch.tensor([index.get(int(t), fallback) for t in real.tolist()], dtype=torch.long)
        for i, layer in enumerate(layers):
            experts = cache[hook_name(layer, "expert_indices")][valid].cpu()  # [n k]
            slots.append((i, experts.flatten(), cls.repeat_interleave(experts.shape[1])))
            if saliency and not weight_at_input[layer]:
                w = cache[hook_name(layer, "expert_weights")][valid].double().cpu()
                norm = cache[EXPERT_OUT.format(layer=layer)][valid].double().norm(dim=-1).cpu()
                sal_sum[i].index_add_(0, experts.flatten(), (w * norm).flatten())
                sal_n[i].index_add_(0, experts.flatten(), torch.ones(experts.numel(), dtype=torch.float64))
    if not slots:
        raise ValueError("the data holds no (unpadded) tokens")
    if index is None:  # columns in token id order
        ids = sorted(seen)
        names = [str(t) for t in ids]
        remap = torch.empty(len(seen), dtype=torch.long)
        remap[torch.tensor([seen[t] for t in ids])] = torch.arange(len(ids))
    C = len(names)
    counts = torch.zeros(len(layers), E, C, dtype=torch.long)
    for i, experts, cls in slots:
        cls = remap[cls] if index is None else cls
        counts[i].view(-1).index_add_(0, experts * C + cls, torch.ones_like(cls))
    sal = None
    if saliency:
        sal = (sal_sum / sal_n).float()  # 0 / 0 = NaN: no token, or a weight-at-input layer
    return specialization_from_counts(layers, names, counts, sal)


def _run(model, tokens, valid, layers, sites, extra) -> dict:
    """run_sites with further full site names (the per-slot expert outputs are not under blocks.L.mlp.hook_*)."""
    names = [hook_name(layer, site) for layer in layers for site in sites] + list(extra)
    mask = None if bool(valid.all()) else valid.long()
    _, cache = model.run_with_cache(tokens, names_filter=names, attention_mask=mask, stop_at_layer=max(layers) + 1)
    return cache.cache_dict
