"""Expert specialization over a trace, out of core: the Jensen-Shannon divergence between the classes of the
tokens routed to each expert and its layer's (as moelens.analysis.expert_specialization, routing only)."""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import Literal

import numpy as np
import torch

from moelens.analysis.specialization import Specialization, class_index, specialization_from_counts
from moelens.traces.analysis import TraceLike, _in, _labelled, as_trace


def trace_specialization(
    trace: TraceLike,
    classes: str | Mapping[int, str] = "token",
    by: Literal["file", "folder"] | Mapping[int, str] | Sequence[str] | None = None,
    layers: int | Sequence[int] | None = None,
    default: str | None = None,
) -> Specialization:
    """Per expert, JSD (bits) between the distribution of the classes of its routed tokens and the layer's,
    over routing slots, as moelens.analysis.expert_specialization computes it (no saliency: a trace holds no
    expert outputs). The classes are token classes (``classes``: "token", each token id its own class, or a
    mapping token id -> class name, ids it lacks taking ``default``), or, with ``by``, corpus labels of the
    documents (by data file, by folder, or a mapping doc -> label / a sequence of labels indexed by doc, as
    trace_subset_load takes them). Aggregated by DuckDB: the trace is never loaded."""
    trace = as_trace(trace)
    layers = trace.resolve_layers(layers)
    if by is not None and not (isinstance(classes, str) and classes == "token"):
        raise ValueError("trace_specialization takes token classes (classes=) or document labels (by=), not both")
    index, names = class_index(classes, default)
    con = trace.connect()
    try:
        if by is not None:
            names = _labelled(con, trace, by)
            column = {label: i for i, label in enumerate(names)}
            rows = [(layer, e, column[label], n) for layer, e, label, n in con.execute(
                f"SELECT layer, e, label, count(*) FROM (SELECT t.layer, unnest(t.experts) AS e, l.label FROM trace t "
                f"JOIN labels l USING (doc) WHERE t.layer IN {_in(layers)}) GROUP BY ALL"
            ).fetchall()]
        else:
            rows = con.execute(
                f"SELECT layer, e, token, count(*) FROM (SELECT layer, unnest(experts) AS e, token FROM trace "
                f"WHERE layer IN {_in(layers)}) GROUP BY ALL"
            ).fetchall()
    finally:
        con.close()
    arr = np.array(rows, dtype=np.int64).reshape(-1, 4)
    if by is None:
        tokens = np.unique(arr[:, 2])
        if index is None:  # one class per traced token, in token id order
            names = [str(int(t)) for t in tokens]
            column = {int(t): i for i, t in enumerate(tokens)}
        else:
            missing = [int(t) for t in tokens if int(t) not in index]
            if missing and default is None:
                raise ValueError(f"classes has no class for {len(missing)} traced tokens (the first: token {missing[0]}): map them or pass default=")
            fallback = names.index(str(default)) if default is not None else -1
            column = {int(t): index.get(int(t), fallback) for t in tokens}
        arr[:, 2] = [column[int(t)] for t in arr[:, 2]]
    yi = {layer: i for i, layer in enumerate(layers)}
    counts = np.zeros((len(layers), trace.n_experts, len(names)), dtype=np.int64)
    for layer, e, c, n in arr:
        counts[yi[int(layer)], e, c] += n
    return specialization_from_counts(layers, names, torch.from_numpy(counts), None)
