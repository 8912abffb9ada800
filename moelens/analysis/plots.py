"""Plots of routing (matplotlib, the optional ``plot`` extra, imported only when a plot is drawn).

Figures are built with matplotlib.figure.Figure, not pyplot, so no global state or GUI backend is touched;
in a notebook the returned figure displays itself.
"""

from __future__ import annotations

from pathlib import Path

import torch

from moelens.analysis.routing import RoutingTable
from moelens.analysis.usage import ExpertUsage

MAX_ANNOTATED_CELLS = 600  # beyond this the numbers would overlap; the colors still tell the story


def _figure(size: tuple[float, float]):
    try:
        from matplotlib.figure import Figure
    except ImportError as err:
        raise ImportError("moelens plots need matplotlib: pip install 'moelens[plot]'") from err
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
    ax.set_yticks(range(n_tok), [f"{pos} {tok!r}" for pos, tok in enumerate(table.str_tokens)], fontsize=8)
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
