"""Routing traces of a whole corpus, in one package: ``trace`` writes one (corpus -> Parquet parts and a
manifest), ``Trace`` and the ``trace_*`` analyses read it out of core, ``trace_report`` makes a page of it.

    from moelens.traces import trace, Trace, trace_expert_load
    trace(model, [Path("corpus/")], "traces/corpus", seq_len=1024)
    print(trace_expert_load(Trace("traces/corpus")))

Modules: run (the trace itself), sources (files, folders, iterables -> documents -> windows), jsonl (JSONL
lines of any length), hashed (data files hashed as they are read), tokenize (long documents in exact
pieces), parts (Parquet parts, and the checks that a part is the manifest's), manifest (what a trace was
made from, and the folder's lock), replicas (data parallelism: parts dealt to model replicas), analysis
(DuckDB analyses), specialization and paths (expert specialization, routing paths and overlap, DuckDB),
report (``moelens trace-report``).

The writer needs pyarrow (the ``trace`` extra) at import: ``trace``, ``TraceSummary`` and ``pad_windows``
are loaded from moelens.traces.run on first use, so that importing this package (the CLI does) needs no
pyarrow until a trace is written.
"""

from moelens.analysis.plots import plot_selectivity, plot_subset_load
from moelens.traces.analysis import (
    ClassShare,
    ConsecutiveRouting,
    ExpertDelta,
    Selectivity,
    SubsetLoad,
    Trace,
    TraceExpertLoad,
    TraceLike,
    TraceTopToken,
    TraceTopTokens,
    as_trace,
    builtin_class,
    delta_experts,
    delta_steer_hooks,
    trace_activation_difference,
    trace_coactivation,
    trace_coactivations,
    trace_consecutive,
    trace_expert_load,
    trace_selectivity,
    trace_subset_load,
    trace_top_tokens,
)
from moelens.traces.manifest import TraceMismatch
from moelens.traces.paths import trace_routing_overlap, trace_routing_paths
from moelens.traces.report import trace_report
from moelens.traces.specialization import trace_specialization

_WRITER = ("trace", "TraceSummary", "pad_windows")


def __getattr__(name: str):
    if name in _WRITER:
        from moelens.traces import run  # pyarrow, the trace extra: imported when a trace is written

        return getattr(run, name)
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")


__all__ = [
    "ClassShare",
    "ConsecutiveRouting",
    "ExpertDelta",
    "Selectivity",
    "SubsetLoad",
    "Trace",
    "TraceExpertLoad",
    "TraceLike",
    "TraceMismatch",
    "TraceSummary",
    "TraceTopToken",
    "TraceTopTokens",
    "as_trace",
    "builtin_class",
    "delta_experts",
    "delta_steer_hooks",
    "pad_windows",
    "plot_selectivity",
    "plot_subset_load",
    "trace",
    "trace_activation_difference",
    "trace_coactivation",
    "trace_coactivations",
    "trace_consecutive",
    "trace_expert_load",
    "trace_report",
    "trace_routing_overlap",
    "trace_routing_paths",
    "trace_selectivity",
    "trace_specialization",
    "trace_subset_load",
    "trace_top_tokens",
]
