"""A report of a routing trace that a person can open: expert load, load by corpus subset, consecutive-token
routing, selectivity by token class, and each expert's top tokens in context (``moelens trace-report``).

Written as one HTML file with its plots (PNG) in a folder beside it, or as PNGs and a text summary in a
folder. Every number comes from the trace analyses in moelens.traces.analysis; nothing here computes its own.
"""

from __future__ import annotations

import html
from dataclasses import dataclass
from pathlib import Path
from typing import Literal

from moelens.analysis.plots import plot_selectivity, plot_subset_load
from moelens.traces.analysis import (
    TraceLike,
    as_trace,
    trace_consecutive,
    trace_expert_load,
    trace_selectivity,
    trace_subset_load,
    trace_top_tokens,
)


@dataclass(frozen=True)
class Section:
    title: str
    text: str  # preformatted
    image: str | None = None  # file name of a plot, relative to the report's folder of files


def report_sections(trace: TraceLike, files: Path, decode=None, by: Literal["file", "folder"] = "folder", top: int = 5) -> list[Section]:
    """Compute every analysis, save its plot into ``files``, and return the sections in reading order."""
    trace = as_trace(trace)
    files.mkdir(parents=True, exist_ok=True)
    sections = [Section("Expert load per layer", str(trace_expert_load(trace)))]

    subsets = trace_subset_load(trace, by=by)
    plot_subset_load(subsets, files / "subset_load.png")
    lines = [f"{len(subsets.labels)} subsets (by {by}); share of each subset's routing slots per expert:"]
    for li, layer in enumerate(subsets.layers):
        lines.append(f"layer {layer}")
        for si, label in enumerate(subsets.labels):
            shares = " ".join(f"{float(x):.2f}" for x in subsets.load[si, li])
            lines.append(f"  {label:<32} {shares}")
    sections.append(Section(f"Expert load by {by}", "\n".join(lines), "subset_load.png"))

    consecutive = trace_consecutive(trace)
    lines = ["layer  pairs      same 1st choice (chance)   share an expert (uniform chance)"]
    for li, layer in enumerate(consecutive.layers):
        lines.append(
            f"{layer:>5}  {int(consecutive.n_pairs[0, li]):>9}  {float(consecutive.same_top1[0, li]):>6.1%} ({float(consecutive.chance_top1[0, li]):.1%})"
            f"           {float(consecutive.same_any[0, li]):>6.1%} ({float(consecutive.uniform_any[li]):.1%})"
        )
    sections.append(Section("Consecutive tokens routed to the same expert (Mixtral, section 5)", "\n".join(lines)))

    if decode is None:
        sections.append(Section("Selectivity by token class", "left out: no tokenizer to tell the token classes apart (pass --model)"))
    else:
        selectivity = trace_selectivity(trace, "builtin", decode=decode, top=3)
        plot_selectivity(selectivity, files / "selectivity.png")
        lines = ["layer  I(expert; class) nats  share of H(class)"]
        for li, layer in enumerate(selectivity.layers):
            lines.append(f"{layer:>5}  {float(selectivity.mutual_information[li]):>21.4f}  {float(selectivity.normalized[li]):>17.1%}")
        for li, layer in enumerate(selectivity.layers):
            lines.append(f"layer {layer}: each expert's most frequent classes (share of its slots, lift)")
            for e, shares in enumerate(selectivity.top_classes[li]):
                lines.append(f"  E{e}: " + ", ".join(f"{c.name} {c.share:.0%} (x{c.lift:.2f})" for c in shares))
        sections.append(Section("Selectivity by token class", "\n".join(lines), "selectivity.png"))

    lines = []
    for layer in trace.layers:
        for expert in range(trace.n_experts):
            lines.append(str(trace_top_tokens(trace, layer, expert, k=top, decode=decode)))
    sections.append(Section("Top tokens of each expert, in context", "\n".join(lines)))
    return sections


def trace_report(trace: TraceLike, out: str | Path, decode=None, by: Literal["file", "folder"] = "folder", top: int = 5) -> Path:
    """Write the report. out ending in .html: one HTML page, its plots in ``<out stem>_files/``; any other
    path: a folder with the plots and ``report.txt``. decode (a model, tokenizer or function ids -> text) is
    needed for the selectivity section and readable top tokens. Returns the file or folder written."""
    trace = as_trace(trace)
    out = Path(out)
    if out.suffix == ".html":
        files = out.with_name(f"{out.stem}_files")
        sections = report_sections(trace, files, decode, by, top)
        out.write_text(_html(trace, sections, files.name), encoding="utf-8")
        return out
    if out.exists() and not out.is_dir():
        raise ValueError(f"{out}: the report goes into a folder, or a file ending in .html; this is a file")
    sections = report_sections(trace, out, decode, by, top)
    (out / "report.txt").write_text(_text(trace, sections), encoding="utf-8")
    return out


def _heading(trace) -> str:
    return f"routing trace {trace.path}: model {trace.manifest['model'].get('name', '?')}, {trace.n_tokens} tokens, mixture layers {trace.layers}, {trace.n_experts} experts"


def _text(trace, sections: list[Section]) -> str:
    parts = [_heading(trace)]
    for s in sections:
        parts.append(f"\n## {s.title}\n{s.text}" + (f"\n(plot: {s.image})" if s.image else ""))
    return "\n".join(parts) + "\n"


def _html(trace, sections: list[Section], files: str) -> str:
    body = [f"<h1>{html.escape(_heading(trace))}</h1>"]
    for s in sections:
        body.append(f"<h2>{html.escape(s.title)}</h2>")
        if s.image:
            body.append(f'<img src="{html.escape(files)}/{html.escape(s.image)}" alt="{html.escape(s.title)}">')
        body.append(f"<pre>{html.escape(s.text)}</pre>")
    style = "body{font-family:sans-serif;max-width:1200px;margin:auto} pre{font-size:12px;overflow-x:auto} img{max-width:100%}"
    return f"<!doctype html><html><head><meta charset='utf-8'><title>moelens trace report</title><style>{style}</style></head><body>\n" + "\n".join(body) + "\n</body></html>\n"
