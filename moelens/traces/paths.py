"""Routing across layers over traces, out of core: routing paths and their entropy (trace_routing_paths), and
the overlap of two traces of the same tokens (trace_routing_overlap), as moelens.analysis.paths computes them."""

from __future__ import annotations

import math
from collections.abc import Sequence

import torch

from moelens.analysis.paths import RoutingOverlap, RoutingPaths, overlap_from_sums
from moelens.traces.analysis import Trace, TraceLike, _in, as_trace



def _top1(row: str = "") -> str:
    """SQL of a row's top-1 expert: the slot with the largest weight (list_position: the first of equal
    maxima, as torch.argmax); ``row`` qualifies the columns ("x." for a table aliased x)."""
    return f"{row}experts[list_position({row}weights, list_max({row}weights))]"


def trace_routing_paths(trace: TraceLike, layers: Sequence[int] | None = None, top: int = 10) -> RoutingPaths:
    """The most frequent routing paths (top-1 expert per layer, through consecutive traced mixture layers:
    all of them without ``layers``) and the path entropy in bits, as moelens.analysis.routing_paths. DuckDB
    groups the tokens by path; the entropy is summed in SQL (H = log2 N - sum n log2 n / N), so only the
    ``top`` paths come back."""
    trace = as_trace(trace)
    layers = trace.resolve_layers(layers)
    where = [trace.layers.index(layer) for layer in layers]
    if len(layers) < 2 or where != list(range(where[0], where[0] + len(layers))):
        raise ValueError(f"layers must be two or more consecutive traced mixture layers, in order (traced: {trace.layers}); got {layers}")
    con = trace.connect()
    try:
        con.execute(
            f"CREATE TEMP TABLE counted AS SELECT path, count(*) AS n FROM (SELECT list({_top1()} ORDER BY layer) AS path "
            f"FROM trace WHERE layer IN {_in(layers)} GROUP BY doc, start, pos) GROUP BY path"
        )
        n, distinct, nlogn = con.execute("SELECT sum(n), count(*), sum(n * log2(n)) FROM counted").fetchone()
        best = con.execute(f"SELECT path, n FROM counted ORDER BY n DESC, path LIMIT {int(top)}").fetchall()
    finally:
        con.close()
    if not n:
        raise ValueError(f"{trace.path}: the trace holds no tokens")
    n = int(n)
    entropy = max(math.log2(n) - float(nlogn) / n, 0.0)  # 0 for one path, where rounding could leave -1e-16
    max_entropy = min(len(layers) * math.log2(trace.n_experts), math.log2(n))
    return RoutingPaths(layers, n, int(distinct), entropy, max_entropy, [(tuple(int(e) for e in p), int(c)) for p, c in best])


def _views(a: Trace, b: Trace):
    """One DuckDB connection with views ``a`` and ``b`` over the two traces' parts."""
    con = a.connect()
    con.execute("ALTER VIEW trace RENAME TO a")
    files = ", ".join("'" + str(p).replace("'", "''") + "'" for p in b.parts)
    con.execute(f"CREATE VIEW b AS SELECT * FROM read_parquet([{files}])")
    return con


def trace_routing_overlap(trace_a: TraceLike, trace_b: TraceLike, layers: int | Sequence[int] | None = None) -> RoutingOverlap:
    """How alike two traces of the same tokens are routed (two checkpoints of one family on one corpus: routing
    stability after fine-tuning), per layer: the mean over tokens of the weighted Jaccard similarity of the
    routing weights, the same of the expert loads, and the share of tokens keeping their top-1 expert, as
    moelens.analysis.routing_overlap. The two traces must hold the same tokens in the same windows (every
    (doc, start, pos) in both with the same token id: checked, the first difference named) and the same
    number of experts."""
    a, b = as_trace(trace_a), as_trace(trace_b)
    if a.n_experts != b.n_experts:
        raise ValueError(f"{a.path} has {a.n_experts} experts per layer, {b.path} {b.n_experts}: routing is comparable only expert for expert")
    layers = a.resolve_layers(layers)
    b.resolve_layers(layers)
    keys = "doc, start, pos, layer"
    con = _views(a, b)
    try:
        first = layers[0]
        bad = con.execute(
            f"SELECT count(*), min(coalesce(x.doc, y.doc)) FROM (SELECT doc, start, pos, token FROM a WHERE layer = {first}) x "
            f"FULL JOIN (SELECT doc, start, pos, token FROM b WHERE layer = {first}) y USING (doc, start, pos) "
            "WHERE x.token IS NULL OR y.token IS NULL OR x.token <> y.token"
        ).fetchone()
        if bad[0]:
            raise ValueError(
                f"{a.path} and {b.path} do not hold the same tokens: {bad[0]} positions differ or are in one trace only "
                f"(the first in doc {bad[1]}); trace the same data with the same --seq-len and --max-tokens"
            )
        if con.execute("SELECT min(list_min(weights)) FROM (SELECT weights FROM a UNION ALL SELECT weights FROM b)").fetchone()[0] < 0:
            raise ValueError("weighted Jaccard takes non-negative weights; a trace holds a negative routing weight")
        # per token: sum over common experts of min(w_a, w_b); sum max = sum a + sum b - sum min
        rows = con.execute(
            f"WITH sa AS (SELECT {keys}, e, sum(w::DOUBLE) AS w FROM (SELECT {keys}, unnest(experts) AS e, unnest(weights) AS w "
            f"FROM a WHERE layer IN {_in(layers)}) GROUP BY ALL), "
            f"sb AS (SELECT {keys}, e, sum(w::DOUBLE) AS w FROM (SELECT {keys}, unnest(experts) AS e, unnest(weights) AS w "
            f"FROM b WHERE layer IN {_in(layers)}) GROUP BY ALL), "
            f"common AS (SELECT {keys}, sum(least(sa.w, sb.w)) AS mn FROM sa JOIN sb USING ({keys}, e) GROUP BY ALL), "
            f"tok AS (SELECT {keys}, list_sum(CAST(x.weights AS DOUBLE[])) AS wa, "
            "list_sum(CAST(y.weights AS DOUBLE[])) AS wb, "
            f"{_top1('x.')} = {_top1('y.')} AS same FROM a x JOIN b y USING ({keys}) WHERE layer IN {_in(layers)}) "
            f"SELECT layer, sum(coalesce(mn, 0) / (wa + wb - coalesce(mn, 0))), count(*) FILTER (WHERE same), count(*) "
            f"FROM tok LEFT JOIN common USING ({keys}) GROUP BY layer"
        ).fetchall()
        loads = {name: con.execute(f"SELECT layer, e, count(*) FROM (SELECT layer, unnest(experts) AS e FROM {name} "
                                   f"WHERE layer IN {_in(layers)}) GROUP BY ALL").fetchall() for name in ("a", "b")}
    finally:
        con.close()
    yi = {layer: i for i, layer in enumerate(layers)}
    jac = torch.zeros(len(layers), dtype=torch.float64)
    same = torch.zeros(len(layers), dtype=torch.float64)
    n = 0
    for layer, j, s, count in rows:
        jac[yi[layer]], same[yi[layer]] = j, s
        n = int(count)
    load = {name: torch.zeros(len(layers), a.n_experts, dtype=torch.float64) for name in loads}
    for name, found in loads.items():
        for layer, e, count in found:
            load[name][yi[layer], e] += count
    if n == 0:
        raise ValueError(f"{a.path}: the traces hold no tokens")
    return overlap_from_sums(layers, n, jac, same, load["a"], load["b"])
