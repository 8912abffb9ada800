"""Plots of routing (matplotlib, the optional ``plot`` extra, imported only when a plot is drawn).

Figures are built with matplotlib.figure.Figure, not pyplot, so no global state or GUI backend is touched;
in a notebook the returned figure displays itself.
"""

from __future__ import annotations

import os
from pathlib import Path
from typing import TYPE_CHECKING

import torch

from moelens.analysis.expert_lens import ExpertLens
from moelens.analysis.paths import RoutingPaths
from moelens.analysis.routing import RoutingTable
from moelens.analysis.specialization import Specialization
from moelens.analysis.usage import ExpertUsage

if TYPE_CHECKING:  # annotations only: moelens.traces builds on moelens.analysis, never the reverse
    from moelens.traces.analysis import Selectivity, SubsetLoad

# Labels that come from data (file and folder names, tokens, class names) are text: a "$" in them must not
# start matplotlib's mathtext ("$x^2$" drawn as math, "$\\foo$" a ParseFatalException).
AS_TEXT = {"parse_math": False}
MAX_ANNOTATED_CELLS = 600  # beyond this the numbers would overlap; the colors still tell the story


def _figure(size: tuple[float, float]):
    try:
        from matplotlib.figure import Figure
    except ImportError as err:
        raise ImportError("moelens plots need matplotlib: pip install '.[plot]' from moelens's checkout") from err
    return Figure(figsize=size, layout="constrained")


def _text_color(rgba) -> str:
    r, g, b = rgba[:3]
    return "black" if 0.299 * r + 0.587 * g + 0.114 * b > 0.5 else "white"


def _expert_colors(n_experts: int):
    """One distinct color per expert up to 20 (tab20's dark shades first, so that E2 and E3 do not look
    alike); past that a continuous map, where the cell labels tell close ids apart."""
    from matplotlib import colormaps
    from matplotlib.colors import ListedColormap

    if n_experts <= 10:
        return ListedColormap(colormaps["tab10"].colors[:n_experts])
    if n_experts <= 20:
        tab20 = colormaps["tab20"].colors
        return ListedColormap([tab20[i] for i in [*range(0, 20, 2), *range(1, 20, 2)]][:n_experts])
    return colormaps["turbo"]


def plot_expert_usage(usage: ExpertUsage, path: str | Path | None = None, value: str = "load"):
    """Heatmap [layer x expert] of the load share (value="load") or token counts (value="counts")."""
    if value not in ("load", "counts"):
        raise ValueError(f"value must be 'load' or 'counts', got {value!r}")
    data = (usage.load if value == "load" else usage.counts).float().numpy()
    n_layers, n_experts = data.shape
    fig = _figure((min(2.5 + 0.45 * n_experts, 24), min(1.5 + 0.45 * n_layers, 24)))
    ax = fig.add_subplot()
    image = ax.imshow(data, aspect="auto", cmap="viridis", interpolation="nearest")
    fig.colorbar(image, ax=ax, label="share of routing slots" if value == "load" else "routing slots")
    ax.set_xlabel("expert")
    ax.set_ylabel("layer")
    ax.set_yticks(range(n_layers), [str(layer) for layer in usage.layers])
    if n_experts <= 64:
        ax.set_xticks(range(n_experts))
    ax.set_title(f"expert usage over {usage.n_tokens} tokens")
    if data.size <= MAX_ANNOTATED_CELLS:
        for i in range(n_layers):
            for e in range(n_experts):
                text = f"{data[i, e]:.2f}" if value == "load" else f"{int(data[i, e])}"
                color = _text_color(image.cmap(image.norm(data[i, e])))
                ax.text(e, i, text, ha="center", va="center", fontsize=7, color=color)
    if path is not None:
        fig.savefig(path, dpi=120)
    return fig


def plot_routing(table: RoutingTable, path: str | Path | None = None, n_experts: int | None = None):
    """Grid [token x mixture layer]: the color and label of each cell are the token's top-1 expert there,
    with its weight underneath. Make the table with ``routing_table(model, prompt)``."""
    n_tok, n_layers = len(table.str_tokens), len(table.layers)
    fig = _figure((min(2.5 + 0.8 * n_layers, 24), min(1.2 + 0.32 * n_tok, 40)))
    # Slots are sorted by weight in a RoutingTable, so slot 0 is the top-1 expert.
    top = torch.stack([ix[:, 0] for ix in table.indices], 1).long().numpy()
    weight = torch.stack([w[:, 0] for w in table.weights], 1).float().numpy()
    n_experts = n_experts or int(top.max()) + 1
    ax = fig.add_subplot()
    image = ax.imshow(top, aspect="auto", cmap=_expert_colors(n_experts), vmin=-0.5, vmax=n_experts - 0.5,
                      interpolation="nearest")
    ax.set_xticks(range(n_layers), [str(layer) for layer in table.layers])
    ax.set_yticks(range(n_tok), [f"{pos} {tok!r}" for pos, tok in enumerate(table.str_tokens)], fontsize=8, **AS_TEXT)
    ax.set_xlabel("layer")
    ax.set_title("top-1 expert per token (weight below)")
    if top.size <= MAX_ANNOTATED_CELLS:
        for pos in range(n_tok):
            for li in range(n_layers):
                color = _text_color(image.cmap(image.norm(top[pos, li])))
                ax.text(li, pos, f"E{top[pos, li]}\n{weight[pos, li]:.2f}", ha="center", va="center",
                        fontsize=7, color=color, linespacing=0.9)
    if path is not None:
        fig.savefig(path, dpi=120)
    return fig


def plot_subset_load(load: SubsetLoad, path: str | Path | None = None):
    """One heat map per mixture layer, [subset x expert]: the share of the subset's routing slots that each
    expert got (Mixtral, section 5). Make it with ``trace_subset_load(trace, by="folder")``."""
    data = load.load.float().numpy()
    n_labels, n_layers, n_experts = data.shape
    width = min(2.0 + n_layers * (1.2 + 0.3 * n_experts), 30)
    fig = _figure((width, min(1.8 + 0.3 * n_labels, 30)))
    axes = fig.subplots(1, n_layers, sharey=True, squeeze=False)[0]
    vmax = float(data.max()) if data.size else 1.0
    for i, (ax, layer) in enumerate(zip(axes, load.layers)):
        image = ax.imshow(data[:, i], aspect="auto", cmap="viridis", vmin=0, vmax=vmax, interpolation="nearest")
        ax.set_title(f"layer {layer}")
        ax.set_xlabel("expert")
        if n_experts <= 64:
            ax.set_xticks(range(n_experts))
    names = _without_common_folder(load.labels)
    axes[0].set_yticks(range(n_labels), [f"{name} ({int(n)} tok)" for name, n in zip(names, load.n_tokens)], fontsize=8, **AS_TEXT)
    fig.colorbar(image, ax=list(axes), label="share of the subset's routing slots")
    if path is not None:
        fig.savefig(path, dpi=120)
    return fig


def _without_common_folder(labels: list[str]) -> list[str]:
    """Path labels shown relative to the folder they all share ("." for that folder itself), so that long
    absolute paths do not crowd the plot; other labels unchanged."""
    if len(labels) < 2 or not all(label.startswith("/") for label in labels):
        return labels
    common = os.path.commonpath(labels)
    return [os.path.relpath(label, common) for label in labels]


def plot_selectivity(selectivity: Selectivity, path: str | Path | None = None, max_classes: int = 12):
    """One heat map per mixture layer, [expert x token class]: log2 of the lift p(class | expert) / p(class),
    red where an expert takes more of a class than the corpus has, blue where less; each title gives the
    layer's mutual information I(expert; class) and its share of H(class). With many classes (classes="token")
    the ``max_classes`` most frequent are shown."""
    if selectivity.counts is None:
        raise ValueError("this Selectivity holds no counts (over 4096 classes): use fewer classes to plot it")
    counts = selectivity.counts.double()
    n_layers, n_experts, n_classes = counts.shape
    shown = counts.sum((0, 1)).argsort(descending=True)[:max_classes].sort().values
    fig = _figure((min(2.0 + n_layers * (1.0 + 0.45 * len(shown)), 30), min(1.8 + 0.32 * n_experts, 30)))
    axes = fig.subplots(1, n_layers, sharey=True, squeeze=False)[0]
    for i, (ax, layer) in enumerate(zip(axes, selectivity.layers)):
        c = counts[i]
        p_class = c.sum(0) / c.sum().clamp(min=1)
        p_class_given_expert = c / c.sum(1, keepdim=True).clamp(min=1)
        lift = torch.log2((p_class_given_expert / p_class.clamp(min=1e-12)).clamp(min=2**-4, max=2**4))[:, shown].numpy()
        image = ax.imshow(lift, aspect="auto", cmap="RdBu_r", vmin=-4, vmax=4, interpolation="nearest")
        mi, share = float(selectivity.mutual_information[i]), float(selectivity.normalized[i])
        ax.set_title(f"layer {layer}: I = {mi:.3f} nats ({share:.1%} of H)", fontsize=9)
        ax.set_xticks(range(len(shown)), [selectivity.classes[j] for j in shown.tolist()], rotation=60, ha="right", fontsize=8, **AS_TEXT)
    axes[0].set_yticks(range(n_experts), [f"E{e}" for e in range(n_experts)])
    axes[0].set_ylabel("expert")
    fig.colorbar(image, ax=list(axes), label="log2 p(class | expert) / p(class)")
    if path is not None:
        fig.savefig(path, dpi=120)
    return fig


def _heatmap(fig, ax, data, layers: list[int], title: str, label: str, fmt: str) -> None:
    """A [layer x expert] heatmap with its cells' values written in (NaN cells, experts no token reached, blank)."""
    image = ax.imshow(data, aspect="auto", cmap="viridis", interpolation="nearest")
    fig.colorbar(image, ax=ax, label=label)
    n_layers, n_experts = data.shape
    ax.set_xlabel("expert")
    ax.set_ylabel("layer")
    ax.set_yticks(range(n_layers), [str(layer) for layer in layers])
    if n_experts <= 64:
        ax.set_xticks(range(n_experts))
    ax.set_title(title)
    if data.size <= MAX_ANNOTATED_CELLS:
        for i in range(n_layers):
            for e in range(n_experts):
                if data[i, e] == data[i, e]:  # not NaN
                    color = _text_color(image.cmap(image.norm(data[i, e])))
                    ax.text(e, i, format(data[i, e], fmt), ha="center", va="center", fontsize=7, color=color)


def plot_specialization(spec: Specialization, path: str | Path | None = None):
    """Heatmaps [layer x expert] of expert_specialization / trace_specialization: the JSD of each expert's
    classes against its layer's, and REAP's saliency beside it where it was computed."""
    data = spec.jsd.float().numpy()
    n_layers, n_experts = data.shape
    panels = 1 if spec.saliency is None else 2
    fig = _figure((min(2.5 + 0.45 * n_experts, 24) * panels, min(1.5 + 0.45 * n_layers, 24)))
    axes = fig.subplots(1, panels, squeeze=False)[0]
    _heatmap(fig, axes[0], data, spec.layers, f"specialization over {len(spec.classes)} classes", "JSD (bits)", ".2f")
    if spec.saliency is not None:
        _heatmap(fig, axes[1], spec.saliency.float().numpy(), spec.layers, "REAP saliency", "mean weight x ||output||", ".2f")
    if path is not None:
        fig.savefig(path, dpi=120)
    return fig


def plot_expert_lens(lens: ExpertLens, path: str | Path | None = None, row: int = 0, labels: list[str] | None = None):
    """Per token of one row of expert_logit_lens: the cosine of the top-1 expert's output with the mixture's,
    each bar labelled with the top-1 expert (x-axis: ``labels``, the row's token strings, where given)."""
    valid = lens.valid[row].cpu()
    cos = lens.cosine[row].cpu()[valid].float().numpy()
    experts = lens.experts[row, :, 0].cpu()[valid].tolist()
    fig = _figure((min(2.0 + 0.35 * len(cos), 24), 3.0))
    ax = fig.add_subplot()
    ax.bar(range(len(cos)), cos, color="tab:blue")
    for x, (c, e) in enumerate(zip(cos, experts)):
        ax.text(x, c, f"E{e}", ha="center", va="bottom", fontsize=6)
    if labels is not None:
        shown = [labels[i] for i in range(len(labels)) if bool(valid[i])]
        ax.set_xticks(range(len(cos)), [repr(t)[1:-1] for t in shown], rotation=90, fontsize=7, **AS_TEXT)
    ax.set_ylim(min(0.0, float(cos.min()) - 0.05), 1.08)
    ax.set_ylabel("cosine")
    ax.set_title(f"layer {lens.layer}: top-1 expert output vs the {lens.mixture} output")
    if path is not None:
        fig.savefig(path, dpi=120)
    return fig


def plot_routing_paths(paths: RoutingPaths, path: str | Path | None = None):
    """The most frequent routing paths of routing_paths / trace_routing_paths, as horizontal bars of their
    share of the tokens."""
    names = [" > ".join(f"E{e}" for e in p) for p, _ in paths.paths]
    shares = [n / paths.n_tokens for _, n in paths.paths]
    fig = _figure((6.0, 1.0 + 0.3 * len(names)))
    ax = fig.add_subplot()
    ax.barh(range(len(names)), shares, color="tab:green")
    ax.set_yticks(range(len(names)), names, fontsize=8)
    ax.invert_yaxis()
    ax.set_xlabel("share of tokens")
    ax.set_title(f"routing paths, layers {paths.layers}: H = {paths.entropy:.2f} bits")
    if path is not None:
        fig.savefig(path, dpi=120)
    return fig


def plot_expert_loss_effects(
    effects: dict[str, torch.Tensor] | torch.Tensor, layers: list[int], path: str | Path | None = None
):
    """Heat maps [layer x expert] of expert_loss_effects' mean loss changes (nats), one per removal mode
    (``effects``: one tensor, or {"zero": ..., "reroute": ...}); red where removing the expert raises the loss,
    blue where it lowers it, one color scale for all."""
    effects = effects if isinstance(effects, dict) else {"loss change": effects}
    data = {name: t.float().cpu().numpy() for name, t in effects.items()}
    n_layers, n_experts = next(iter(data.values())).shape
    if n_layers != len(layers):
        raise ValueError(f"the effects have {n_layers} rows, got {len(layers)} layers to label them")
    vmax = max(float(abs(d).max()) for d in data.values()) or 1.0
    fig = _figure((min(1.5 + len(data) * (1.0 + 0.45 * n_experts), 30), min(1.6 + 0.45 * n_layers, 24)))
    axes = fig.subplots(1, len(data), sharey=True, squeeze=False)[0]
    for ax, (name, values) in zip(axes, data.items()):
        image = ax.imshow(values, aspect="auto", cmap="RdBu_r", vmin=-vmax, vmax=vmax, interpolation="nearest")
        ax.set_title(f"{name}: loss change (nats)", **AS_TEXT)
        ax.set_xlabel("expert removed")
        if n_experts <= 64:
            ax.set_xticks(range(n_experts))
        if values.size <= MAX_ANNOTATED_CELLS:
            for i in range(n_layers):
                for e in range(n_experts):
                    color = _text_color(image.cmap(image.norm(values[i, e])))
                    ax.text(e, i, f"{values[i, e]:+.3f}", ha="center", va="center", fontsize=6, color=color)
    axes[0].set_ylabel("layer")
    axes[0].set_yticks(range(n_layers), [str(layer) for layer in layers])
    fig.colorbar(image, ax=list(axes), label="mean loss change (nats)")
    if path is not None:
        fig.savefig(path, dpi=120)
    return fig
