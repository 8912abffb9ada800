"""Analyses of routing traces (moelens.traces.run), computed out of core with DuckDB over the Parquet parts.

Every function takes a trace as a folder path or a Trace, reads only the parts its manifest records, and
never loads the trace in memory: DuckDB aggregates (spilling to disk where it must), and per-token numbers
(routing entropy) stream record batches. Results are plain dataclasses of tensors; row i of a per-layer
tensor is layer ``layers[i]``; entropies and mutual information are in nats.

Names follow the in-memory analyses (expert_usage, coactivations, top_tokens) with a ``trace_`` prefix.
"""

from __future__ import annotations

import math
import os
import unicodedata
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Literal

import numpy as np
import torch
from jaxtyping import Float, Int

from moelens.analysis.difference import ExpertDelta, ranked_deltas
from moelens.analysis.interventions import steer_router_hooks
from moelens.traces.manifest import MANIFEST, read_manifest

BUILTIN_CLASSES = ("whitespace", "punctuation", "digits", "word", "other")


class Trace:
    """A trace folder: its manifest and the Parquet parts the manifest records (each checked to have the size
    the manifest records, and, from its footer, its columns, rows, layers, token windows and model: a part
    truncated, replaced or copied in from another trace is refused; a re-run of the trace checks sha256 and
    the rows themselves too; a part without that footer, by an earlier moelens, has its rows checked here).

    layers: the traced mixture layers; n_experts; top_k: {layer: k}; has_router_logits; complete (a run
    killed before the end leaves an incomplete trace: re-run the same command to finish it)."""

    def __init__(self, path: str | os.PathLike, allow_incomplete: bool = False) -> None:
        self.path = Path(path)
        manifest = read_manifest(self.path) if self.path.is_dir() else None
        if manifest is None:
            raise FileNotFoundError(f"{self.path}: no {MANIFEST}: not a trace folder (moelens trace writes one)")
        self.manifest = manifest
        self.complete = bool(manifest.get("complete"))
        if not self.complete and not allow_incomplete:
            raise ValueError(
                f"{self.path}: the trace is incomplete ({len(manifest['parts'])} parts recorded): re-run the same "
                "command to finish it, or open it with Trace(path, allow_incomplete=True)"
            )
        self.layers: list[int] = list(manifest["layers"])
        self.n_experts: int = int(manifest["n_experts"])
        self.top_k: dict[int, int] = {int(layer): int(k) for layer, k in manifest["top_k"].items()}
        self.has_router_logits: bool = bool(manifest["settings"]["router_logits"])
        self.parts: list[Path] = [self.path / manifest["parts"][k]["file"] for k in sorted(manifest["parts"], key=int)]
        for part in manifest["parts"].values():  # the cheap check: a part truncated or replaced has another size
            path = self.path / part["file"]
            if not path.is_file():
                raise FileNotFoundError(f"{path}: recorded in {MANIFEST} but missing: re-run the trace command to trace it again")
            if "size" in part and path.stat().st_size != part["size"]:
                raise ValueError(
                    f"{path}: {path.stat().st_size} bytes, {MANIFEST} records {part['size']}: the part is damaged (truncated "
                    "or replaced); re-run the trace command to trace it again"
                )
        from moelens.traces.parts import part_footer_problem  # pyarrow: the trace extra, needed once a trace is read

        for key in sorted(manifest["parts"], key=int):  # from the footers: its columns, rows, layers, windows
            problem = part_footer_problem(self.path / manifest["parts"][key]["file"], manifest, int(key))
            if problem is not None:
                raise ValueError(f"{self.path}: {problem}; re-run the trace command to trace it again")

    @property
    def n_tokens(self) -> int:
        """Real tokens in the recorded parts (the manifest's count; no Parquet is read)."""
        return sum(p["tokens"] for p in self.manifest["parts"].values())

    def __repr__(self) -> str:
        state = "complete" if self.complete else "incomplete"
        return f"Trace({str(self.path)!r}: {state}, {len(self.parts)} parts, {self.n_tokens} tokens, layers {self.layers}, {self.n_experts} experts)"

    def connect(self):
        """A DuckDB connection with the view ``trace`` over the recorded parts."""
        try:
            import duckdb
        except ImportError as err:
            raise ImportError(f"trace analyses query Parquet with DuckDB: pip install '.[trace]' from moelens's checkout ({err})") from err

        con = duckdb.connect()
        if not self.parts:
            raise ValueError(f"{self.path}: the trace has no parts yet")
        files = ", ".join("'" + str(p).replace("'", "''") + "'" for p in self.parts)
        con.execute(f"CREATE VIEW trace AS SELECT * FROM read_parquet([{files}])")
        return con

    def query(self, sql: str, params: Sequence | None = None) -> list[tuple]:
        """Rows of a DuckDB query over the view ``trace``."""
        con = self.connect()
        try:
            return con.execute(sql, params or []).fetchall()
        finally:
            con.close()

    def dataset(self):
        """A pyarrow dataset of the recorded parts, to stream record batches."""
        import pyarrow.dataset as ds

        return ds.dataset([str(p) for p in self.parts], format="parquet")

    def doc_labels(self, by: Literal["file", "folder"] | Mapping[int, str] | Sequence[str]):
        """A pyarrow table (doc int64, label string): by data file, by its folder, or a user mapping doc -> label
        (a mapping or a sequence indexed by doc)."""
        import pyarrow as pa

        if isinstance(by, str):
            if by not in ("file", "folder"):
                raise ValueError(f"by must be 'file', 'folder', a mapping doc -> label or a sequence of labels, got {by!r}")
            data = self.manifest["data"]
            if data["kind"] != "files":
                raise ValueError(f"{self.path} was traced from a Python iterable, not files: label its documents with a mapping doc -> label")
            docs, labels = [], []
            for f in data["files"]:
                label = f["path"] if by == "file" else str(Path(f["path"]).parent)
                docs += range(f["first_doc"], f["first_doc"] + f["n_docs"])
                labels += [label] * f["n_docs"]
        elif isinstance(by, Mapping):
            docs, labels = [int(d) for d in by], [str(v) for v in by.values()]
        elif isinstance(by, Sequence):
            docs, labels = list(range(len(by))), [str(v) for v in by]
        else:
            raise TypeError(f"by must be 'file', 'folder', a mapping doc -> label or a sequence of labels, got {type(by).__name__}")
        return pa.table({"doc": pa.array(docs, pa.int64()), "label": pa.array(labels, pa.string())})

    def resolve_layers(self, layers: int | Sequence[int] | None) -> list[int]:
        if layers is None:
            return list(self.layers)
        chosen = [layers] if isinstance(layers, int) else list(layers)
        bad = [layer for layer in chosen if layer not in self.layers]
        if bad:
            raise ValueError(f"layers {bad} are not in the trace {self.path} (traced mixture layers: {self.layers})")
        return chosen


TraceLike = Trace | str | os.PathLike


def as_trace(trace: TraceLike) -> Trace:
    """A `Trace`, opened from a folder (str or path) where one is not given."""
    if isinstance(trace, Trace):
        return trace
    if isinstance(trace, (str, os.PathLike)):
        return Trace(trace)
    raise TypeError(f"expected a trace folder path or a Trace, got {type(trace).__name__}")


def _in(layers: Sequence[int]) -> str:
    return "(" + ", ".join(str(int(layer)) for layer in layers) + ")"


def _labelled(con, trace: Trace, by) -> list[str]:
    """Register table ``labels`` (doc, label) on con, checked to cover every traced document; the labels in
    first-seen order."""
    table = trace.doc_labels(by)
    con.register("labels", table)
    unmapped = con.execute("SELECT min(doc), count(DISTINCT doc) FROM trace ANTI JOIN labels USING (doc)").fetchone()
    if unmapped[1]:
        raise ValueError(f"{unmapped[1]} traced documents have no label (the first: doc {unmapped[0]}): label every document")
    return list(dict.fromkeys(table.column("label").to_pylist()))


# ---- load, entropy, imbalance ------------------------------------------------------------------------


@dataclass(frozen=True)
class TraceExpertLoad:
    layers: list[int]
    n_tokens: int  # real tokens (each mixture layer routes every one of them)
    counts: Int[torch.Tensor, "n_layers n_experts"]  # tokens routed to each expert (a token counts once per expert)
    load: Float[torch.Tensor, "n_layers n_experts"]  # counts / all routing slots of the layer (rows sum to 1)
    load_entropy: Float[torch.Tensor, "n_layers"]  # H(load); ln(n_experts) is perfectly balanced
    cv: Float[torch.Tensor, "n_layers"]  # coefficient of variation of counts (population std / mean); 0 is balanced
    max_over_mean: Float[torch.Tensor, "n_layers"]  # busiest expert's count / mean count; 1 is balanced
    routing_entropy: Float[torch.Tensor, "n_layers"] | None  # mean per-token H(router probabilities); needs router_logits

    @property
    def rates(self) -> Float[torch.Tensor, "n_layers n_experts"]:
        """Share of tokens routed to each expert (sums to top_k per layer)."""
        return self.counts.double().div(self.n_tokens).float()

    def __str__(self) -> str:
        lines = [f"expert load over {self.n_tokens} tokens, {self.counts.shape[1]} experts (ln E = {math.log(self.counts.shape[1]):.3f})"]
        lines.append(f"{'layer':>5}  {'H(load)':>8}  {'CV':>6}  {'max/mean':>8}" + ("  H(route)" if self.routing_entropy is not None else ""))
        for i, layer in enumerate(self.layers):
            row = f"{layer:>5}  {float(self.load_entropy[i]):>8.3f}  {float(self.cv[i]):>6.3f}  {float(self.max_over_mean[i]):>8.3f}"
            if self.routing_entropy is not None:
                row += f"  {float(self.routing_entropy[i]):>8.3f}"
            lines.append(row)
        return "\n".join(lines)


def _clip(text: str, width: int) -> str:
    """text in at most `width` characters (its end kept: a path's file name says more than its start)."""
    return text if len(text) <= width else "..." + text[-(width - 3):]


def _entropy(p: torch.Tensor) -> torch.Tensor:
    return -torch.special.xlogy(p, p).sum(-1)


def _counts(con, layers: list[int], label: bool = False) -> list[tuple]:
    """counts[label, layer, expert] of routing slots (labels from table ``labels`` when label is set)."""
    key = "l.label" if label else "'all'"
    join = "JOIN labels l USING (doc)" if label else ""
    rows = con.execute(
        f"SELECT {key} AS label, layer, e, count(*) FROM (SELECT t.doc, t.layer, unnest(t.experts) AS e FROM trace t "
        f"WHERE t.layer IN {_in(layers)}) {join} GROUP BY ALL"
    ).fetchall()
    return rows


def _grid(rows, labels: list[str], layers: list[int], n_experts: int) -> np.ndarray:
    out = np.zeros((len(labels), len(layers), n_experts), dtype=np.int64)
    li = {label: i for i, label in enumerate(labels)}
    yi = {layer: i for i, layer in enumerate(layers)}
    for label, layer, e, n in rows:
        out[li[label], yi[layer], e] += n
    return out


def trace_expert_load(trace: TraceLike, layers: int | Sequence[int] | None = None) -> TraceExpertLoad:
    """Expert load per layer: counts, load, H(load), CV and max/mean of counts, and, when the trace holds
    router logits, the mean per-token routing entropy (router probabilities, recomputed from the stored logits as
    hook_router_probs defines them: softmax of the logits, or for sigmoid routers the sigmoid scores normalised
    to sum to one, as expert_usage reads them)."""
    trace = as_trace(trace)
    layers = trace.resolve_layers(layers)
    con = trace.connect()
    try:
        counts = torch.from_numpy(_grid(_counts(con, layers), ["all"], layers, trace.n_experts)[0])
        n_tokens = con.execute(f"SELECT count(*) FROM trace WHERE layer = {layers[0]}").fetchone()[0]
    finally:
        con.close()
    if n_tokens == 0:
        raise ValueError(f"{trace.path}: the trace holds no tokens")
    c = counts.double()
    mean = c.mean(-1)
    load = c / c.sum(-1, keepdim=True).clamp(min=1)
    routing_entropy = _routing_entropy(trace, layers) if trace.has_router_logits else None
    return TraceExpertLoad(
        layers=layers, n_tokens=int(n_tokens), counts=counts, load=load.float(), load_entropy=_entropy(load).float(),
        cv=(c.std(-1, correction=0) / mean).float(), max_over_mean=(c.max(-1).values / mean).float(),
        routing_entropy=routing_entropy,
    )


def _routing_entropy(trace: Trace, layers: list[int]) -> torch.Tensor:
    """Mean over tokens of H(router probabilities), streaming record batches of (layer, router_logits)."""
    import pyarrow.compute as pc
    import pyarrow.dataset as ds

    sigmoid = trace.manifest["config"].get("router_scoring") == "sigmoid"
    sums = dict.fromkeys(layers, 0.0)
    n = dict.fromkeys(layers, 0)
    scanner = trace.dataset().scanner(columns=["layer", "router_logits"], filter=ds.field("layer").isin(layers))
    for batch in scanner.to_batches():
        if batch.num_rows == 0:
            continue
        logits = torch.from_numpy(pc.list_flatten(batch.column("router_logits")).to_numpy(zero_copy_only=False).astype(np.float64))
        logits = logits.reshape(batch.num_rows, trace.n_experts)
        if sigmoid:
            scores = torch.sigmoid(logits)
            probs = scores / scores.sum(-1, keepdim=True)
        else:
            probs = torch.softmax(logits, -1)
        h = _entropy(probs)
        layer_of = torch.from_numpy(batch.column("layer").to_numpy().astype(np.int64))
        for layer in layers:
            chosen = layer_of == layer
            sums[layer] += float(h[chosen].sum())
            n[layer] += int(chosen.sum())
    return torch.tensor([sums[layer] / max(n[layer], 1) for layer in layers], dtype=torch.float32)


# ---- Mixtral section 5: expert distribution per subset, repeated assignments -------------------------


@dataclass(frozen=True)
class SubsetLoad:
    labels: list[str]  # one per subset, in data order
    layers: list[int]
    n_tokens: Int[torch.Tensor, "n_labels"]
    counts: Int[torch.Tensor, "n_labels n_layers n_experts"]  # tokens of the subset routed to each expert
    load: Float[torch.Tensor, "n_labels n_layers n_experts"]  # counts / the subset's routing slots (sums to 1)

    def __str__(self) -> str:
        """Per subset and layer, its tokens and its three busiest experts with their load (1/E is balanced)."""
        E = self.counts.shape[-1]
        lines = [f"subset load: {len(self.labels)} subsets, layers {self.layers}, {E} experts (load: share of the "
                 f"subset's routing slots; balanced 1/E = {1 / E:.3f})",
                 f"{'subset':<24} {'tokens':>8} {'layer':>5}  busiest experts (load)"]
        for i, label in enumerate(self.labels):
            for j, layer in enumerate(self.layers):
                load = self.load[i, j]
                top = torch.argsort(-load, stable=True)[:3].tolist()
                busiest = ", ".join(f"E{e} {float(load[e]):.3f}" for e in top)
                lines.append(f"{_clip(label, 24):<24} {int(self.n_tokens[i]):>8} {layer:>5}  {busiest}")
        return "\n".join(lines)

    __repr__ = __str__


def trace_subset_load(
    trace: TraceLike,
    by: Literal["file", "folder"] | Mapping[int, str] | Sequence[str] = "file",
    layers: int | Sequence[int] | None = None,
) -> SubsetLoad:
    """Expert distribution per corpus subset (Mixtral, section 5): by data file, by folder, or by a user
    labelling of the documents (mapping doc -> label, or a sequence of labels indexed by doc)."""
    trace = as_trace(trace)
    layers = trace.resolve_layers(layers)
    con = trace.connect()
    try:
        labels = _labelled(con, trace, by)
        counts = _grid(_counts(con, layers, label=True), labels, layers, trace.n_experts)
        tokens = dict(con.execute(f"SELECT l.label, count(*) FROM trace t JOIN labels l USING (doc) WHERE t.layer = {layers[0]} GROUP BY ALL").fetchall())
    finally:
        con.close()
    c = torch.from_numpy(counts)
    load = c.double() / c.sum(-1, keepdim=True).clamp(min=1)
    return SubsetLoad(labels, layers, torch.tensor([tokens.get(label, 0) for label in labels]), c, load.float())


@dataclass(frozen=True)
class ConsecutiveRouting:
    """How often consecutive tokens (positions p and p+1 of one window) share an expert, per subset and layer.

    same_top1: the router's first choice (slot 0) is the same; same_any: the two tokens' top-k sets share an
    expert (Mixtral's "first or second choice" for top-2). The chance rates: chance_top1 = sum over experts
    of the squared share of first choices (two independent tokens); uniform rates for a balanced router:
    1/E for the first choice and 1 - C(E-k, k) / C(E, k) for the sets."""

    labels: list[str]  # ["all"] without subsets
    layers: list[int]
    n_pairs: Int[torch.Tensor, "n_labels n_layers"]
    same_top1: Float[torch.Tensor, "n_labels n_layers"]
    same_any: Float[torch.Tensor, "n_labels n_layers"]
    chance_top1: Float[torch.Tensor, "n_labels n_layers"]
    uniform_top1: Float[torch.Tensor, "n_layers"]
    uniform_any: Float[torch.Tensor, "n_layers"]

    def __str__(self) -> str:
        """Per subset and layer: the pairs, the rates of a shared first choice and of a shared expert, beside
        their chance and balanced-router rates."""
        lines = ["consecutive tokens routed alike (same_top1: same first choice; same_any: top-k sets share an expert)",
                 f"{'subset':<24} {'layer':>5} {'pairs':>8} {'same_top1':>9} {'chance':>7} {'uniform':>7} "
                 f"{'same_any':>8} {'uniform':>7}"]
        for i, label in enumerate(self.labels):
            for j, layer in enumerate(self.layers):
                lines.append(
                    f"{_clip(label, 24):<24} {layer:>5} {int(self.n_pairs[i, j]):>8} {float(self.same_top1[i, j]):>9.3f} "
                    f"{float(self.chance_top1[i, j]):>7.3f} {float(self.uniform_top1[j]):>7.3f} "
                    f"{float(self.same_any[i, j]):>8.3f} {float(self.uniform_any[j]):>7.3f}"
                )
        return "\n".join(lines)

    __repr__ = __str__


def trace_consecutive(
    trace: TraceLike,
    layers: int | Sequence[int] | None = None,
    by: Literal["file", "folder"] | Mapping[int, str] | Sequence[str] | None = None,
) -> ConsecutiveRouting:
    """Rate at which consecutive tokens get the same expert (Mixtral, section 5), against chance."""
    trace = as_trace(trace)
    layers = trace.resolve_layers(layers)
    con = trace.connect()
    try:
        labels = _labelled(con, trace, by) if by is not None else ["all"]
        key, join = ("l.label", "JOIN labels l ON a.doc = l.doc") if by is not None else ("'all'", "")
        pairs = con.execute(
            f"SELECT {key}, a.layer, count(*), count(*) FILTER (WHERE a.experts[1] = b.experts[1]), "
            "count(*) FILTER (WHERE list_has_any(a.experts, b.experts)) "
            "FROM trace a JOIN trace b ON a.doc = b.doc AND a.start = b.start AND a.layer = b.layer AND b.pos = a.pos + 1 "
            f"{join} WHERE a.layer IN {_in(layers)} GROUP BY ALL"
        ).fetchall()
        key, join = ("l.label", "JOIN labels l ON a.doc = l.doc") if by is not None else ("'all'", "")
        firsts = con.execute(
            f"SELECT {key}, a.layer, a.experts[1], count(*) FROM trace a {join} WHERE a.layer IN {_in(layers)} GROUP BY ALL"
        ).fetchall()
    finally:
        con.close()
    shape = (len(labels), len(layers))
    li = {label: i for i, label in enumerate(labels)}
    yi = {layer: i for i, layer in enumerate(layers)}
    n = np.zeros(shape, dtype=np.int64)
    same1 = np.zeros(shape, dtype=np.int64)
    same_any = np.zeros(shape, dtype=np.int64)
    for label, layer, count, s1, sa in pairs:
        n[li[label], yi[layer]], same1[li[label], yi[layer]], same_any[li[label], yi[layer]] = count, s1, sa
    first = _grid(firsts, labels, layers, trace.n_experts).astype(np.float64)
    share = first / np.maximum(first.sum(-1, keepdims=True), 1)
    E = trace.n_experts
    ks = [trace.top_k[layer] for layer in layers]
    return ConsecutiveRouting(
        labels=labels, layers=layers, n_pairs=torch.from_numpy(n),
        same_top1=torch.from_numpy(same1 / np.maximum(n, 1)).float(),
        same_any=torch.from_numpy(same_any / np.maximum(n, 1)).float(),
        chance_top1=torch.from_numpy((share**2).sum(-1)).float(),
        uniform_top1=torch.full((len(layers),), 1 / E),
        uniform_any=torch.tensor([1 - math.comb(E - k, k) / math.comb(E, k) for k in ks], dtype=torch.float32),
    )


# ---- selectivity by token class -------------------------------------------------------------------


def builtin_class(text: str) -> str:
    """whitespace, punctuation (and symbols), digits, word (letters/digits/underscore, at least one letter:
    identifiers too), or other (empty, mixed, or an incomplete UTF-8 piece). Surrounding whitespace is
    ignored except for whitespace-only tokens."""
    if text and text.isspace():
        return "whitespace"
    core = text.strip()
    if not core or "\ufffd" in core:
        return "other"
    if core.isdigit():
        return "digits"
    if core.replace("_", "").isalnum() and any(ch.isalpha() for ch in core):
        return "word"
    if all(unicodedata.category(ch)[0] in "PS" for ch in core):
        return "punctuation"
    return "other"


Decode = Callable[[list[int]], str]


def _decoder(decode) -> Decode:
    """A function ids -> text from a function, a tokenizer (anything with .decode) or a model (its tokenizer)."""
    if decode is None:
        raise ValueError("decoding tokens needs decode=: a model with a tokenizer, a tokenizer, or a function ids -> text")
    tokenizer = getattr(decode, "tokenizer", None)
    if tokenizer is not None and hasattr(tokenizer, "decode"):
        return lambda ids: tokenizer.decode(list(ids))
    if hasattr(decode, "decode"):
        return lambda ids: decode.decode(list(ids))
    if callable(decode):
        return decode
    raise TypeError(f"decode must be a model, a tokenizer or a function ids -> text, got {type(decode).__name__}")


@dataclass(frozen=True)
class ClassShare:
    name: str
    share: float  # p(class | expert): share of the expert's routed tokens in this class
    lift: float  # p(class | expert) / p(class): above 1, the expert prefers the class


@dataclass(frozen=True)
class Selectivity:
    """Mutual information between expert choice and token class, over routing slots (a token routed to k
    experts counts k times): I(E; C) = sum p(e, c) ln p(e, c) / (p(e) p(c)), nats, per layer."""

    layers: list[int]
    classes: list[str]  # class names; for classes="token", the token ids as strings
    mutual_information: Float[torch.Tensor, "n_layers"]
    class_entropy: Float[torch.Tensor, "n_layers"]  # H(C) over slots: the bound of the mutual information
    expert_kl: Float[torch.Tensor, "n_layers n_experts"]  # KL(p(c | e) || p(c)); I = sum_e p(e) KL_e
    top_classes: list[list[list[ClassShare]]]  # [layer][expert]: its `top` most frequent classes, with lift
    counts: Int[torch.Tensor, "n_layers n_experts n_classes"] | None  # slot counts; None past 4096 classes

    @property
    def normalized(self) -> Float[torch.Tensor, "n_layers"]:
        """I(E; C) / H(C): 0 when experts ignore the class, 1 when the expert choice determines it."""
        return self.mutual_information / self.class_entropy.clamp(min=1e-12)

    def __str__(self) -> str:
        """Per layer, I(E; C), H(C) and their ratio, then the most selective expert (largest KL) and its top
        classes with their lift."""
        shown = ", ".join(self.classes[:8]) + (f", ... ({len(self.classes)} in all)" if len(self.classes) > 8 else "")
        lines = [f"selectivity of expert choice for token class ({shown}); nats, over routing slots",
                 f"{'layer':>5} {'I(E;C)':>8} {'H(C)':>7} {'I/H':>6}  most selective expert: KL, top classes (share, lift)"]
        for i, layer in enumerate(self.layers):
            e = int(torch.argmax(self.expert_kl[i]))
            top = "; ".join(f"{_clip(c.name, 16)} {c.share:.2f} x{c.lift:.2f}" for c in self.top_classes[i][e][:3])
            lines.append(
                f"{layer:>5} {float(self.mutual_information[i]):>8.4f} {float(self.class_entropy[i]):>7.4f} "
                f"{float(self.normalized[i]):>6.3f}  E{e} {float(self.expert_kl[i, e]):.4f}: {top}"
            )
        return "\n".join(lines)

    __repr__ = __str__


def trace_selectivity(
    trace: TraceLike,
    classes: Literal["builtin", "token"] | Mapping[int, str] = "builtin",
    decode=None,
    layers: int | Sequence[int] | None = None,
    top: int = 5,
    default: str | None = None,
) -> Selectivity:
    """Selectivity of each expert for token classes: "token" (each token id its own class), "builtin"
    (builtin_class of the decoded token: needs decode=, a model, tokenizer or function ids -> text), or a
    mapping token id -> class name (tokens it lacks take ``default``; without one they are an error)."""
    import pyarrow as pa

    trace = as_trace(trace)
    layers = trace.resolve_layers(layers)
    con = trace.connect()
    try:
        tokens = [t for (t,) in con.execute("SELECT DISTINCT token FROM trace ORDER BY token").fetchall()]
        if isinstance(classes, str) and classes == "token":
            names = [str(t) for t in tokens]
        elif isinstance(classes, str) and classes == "builtin":
            text = _decoder(decode)
            names = [builtin_class(text([t])) for t in tokens]
        elif isinstance(classes, Mapping):
            missing = [t for t in tokens if t not in classes]
            if missing and default is None:
                raise ValueError(f"classes has no class for {len(missing)} traced tokens (the first: token {missing[0]}): map them or pass default=")
            names = [str(classes.get(t, default)) for t in tokens]
        else:
            raise ValueError(f"classes must be 'builtin', 'token' or a mapping token id -> class, got {classes!r}")
        if classes == "token":
            class_names = names  # one per traced token, in token id order
        elif classes == "builtin":
            class_names = [c for c in BUILTIN_CLASSES if c in set(names)]
        else:
            class_names = sorted(set(names))
        index = {n: i for i, n in enumerate(class_names)}
        con.register("classes", pa.table({"token": pa.array(tokens, pa.int32()), "cls": pa.array([index[n] for n in names], pa.int32())}))
        joint = con.execute(
            f"SELECT layer, e, cls, count(*) FROM (SELECT t.layer, unnest(t.experts) AS e, c.cls FROM trace t "
            f"JOIN classes c USING (token) WHERE t.layer IN {_in(layers)}) GROUP BY ALL"
        ).fetchall()
    finally:
        con.close()
    E, C = trace.n_experts, len(class_names)
    yi = {layer: i for i, layer in enumerate(layers)}
    arr = np.array(joint, dtype=np.int64).reshape(-1, 4)
    mi = np.zeros(len(layers))
    hc = np.zeros(len(layers))
    kl = np.zeros((len(layers), E))
    top_classes: list[list[list[ClassShare]]] = []
    for layer in layers:
        rows = arr[arr[:, 0] == layer]
        e, c, n = rows[:, 1], rows[:, 2], rows[:, 3].astype(np.float64)
        total = n.sum()
        n_e = np.bincount(e, weights=n, minlength=E)
        n_c = np.bincount(c, weights=n, minlength=C)
        p_c = n_c / total
        hc[yi[layer]] = -(p_c[p_c > 0] * np.log(p_c[p_c > 0])).sum()
        # per (e, c): p(c|e) ln p(c|e)/p(c); KL_e sums them, and I = sum_e p(e) KL_e
        p_c_given_e = n / n_e[e]
        term = p_c_given_e * np.log(p_c_given_e / p_c[c])
        kl[yi[layer]] = np.bincount(e, weights=term, minlength=E)
        mi[yi[layer]] = (n_e / total * kl[yi[layer]]).sum()
        per_expert = []
        for expert in range(E):
            mine = rows[:, 1] == expert
            order = np.lexsort((c[mine], -n[mine]))[:top]
            per_expert.append([
                ClassShare(class_names[c[mine][j]], float(p_c_given_e[mine][j]), float(p_c_given_e[mine][j] / p_c[c[mine][j]]))
                for j in order
            ])
        top_classes.append(per_expert)
    counts = None
    if C <= 4096:
        dense = np.zeros((len(layers), E, C), dtype=np.int64)
        for layer, e, c, n in arr:
            dense[yi[int(layer)], e, c] = n
        counts = torch.from_numpy(dense)
    return Selectivity(layers, class_names, torch.from_numpy(mi).float(), torch.from_numpy(hc).float(),
                       torch.from_numpy(kl).float(), top_classes, counts)


# ---- co-activation across layers ----------------------------------------------------------------------


def trace_coactivations(trace: TraceLike, pairs: Sequence[tuple[int, int]]) -> dict[tuple[int, int], Int[torch.Tensor, "n_experts n_experts"]]:
    """For each layer pair (a, b): counts[e, f] = tokens routed to e at layer a and to f at layer b (as
    moelens.analysis.coactivations; with a == b, within the layer: the diagonal is each expert's count)."""
    trace = as_trace(trace)
    if not pairs:
        raise ValueError("trace_coactivations needs at least one (layer_a, layer_b) pair")
    for pair in pairs:
        trace.resolve_layers(list(pair))
    E = trace.n_experts
    out = {}
    con = trace.connect()
    try:
        for a, b in pairs:
            rows = con.execute(
                # two unnests in one select list would zip the lists: nest them for the product of slots
                "SELECT ea, f, count(*) FROM (SELECT ea, unnest(eb) AS f FROM (SELECT unnest(x.experts) AS ea, "
                "y.experts AS eb FROM trace x JOIN trace y ON x.doc = y.doc AND x.start = y.start AND x.pos = y.pos "
                f"WHERE x.layer = {int(a)} AND y.layer = {int(b)})) GROUP BY ALL"
            ).fetchall()
            counts = torch.zeros(E, E, dtype=torch.long)
            for e, f, n in rows:
                counts[e, f] += n
            out[(a, b)] = counts
    finally:
        con.close()
    return out


def trace_coactivation(trace: TraceLike, layer_a: int, layer_b: int | None = None) -> Int[torch.Tensor, "n_experts n_experts"]:
    """counts[e, f]: tokens routed to e at layer_a and to f at layer_b (layer_a itself when not given): one
    pair of `trace_coactivations`."""
    pair = (layer_a, layer_a if layer_b is None else layer_b)
    return trace_coactivations(trace, [pair])[pair]


# ---- top tokens of an expert ------------------------------------------------------------------------


@dataclass(frozen=True)
class TraceTopToken:
    value: float  # the expert's slot weight, or its router logit
    doc: int
    start: int
    pos: int
    token: int
    before: list[int]  # up to `context` tokens of the window before it, oldest first
    after: list[int]  # up to `context` tokens of the window after it
    token_str: str
    before_str: str
    after_str: str


@dataclass(frozen=True)
class TraceTopTokens:
    layer: int
    expert: int
    by: str
    entries: list[TraceTopToken] = field(default_factory=list)  # strongest first; ties in data order

    def __iter__(self):
        return iter(self.entries)

    def __len__(self) -> int:
        return len(self.entries)

    def __getitem__(self, i: int) -> TraceTopToken:
        return self.entries[i]

    def __str__(self) -> str:
        lines = [f"tokens routed most strongly to expert {self.expert} of layer {self.layer} (by {self.by})"]
        for t in self.entries:
            text = f"{t.before_str}[[{t.token_str}]]{t.after_str}".replace("\n", "\\n").replace("\t", "\\t")  # one line each
            lines.append(f"  {t.value:.4f}  [doc {t.doc} @{t.start + t.pos}]  {text}")
        return "\n".join(lines)


def trace_top_tokens(
    trace: TraceLike,
    layer: int,
    expert: int,
    k: int = 10,
    by: Literal["weight", "logit"] = "weight",
    context: int = 5,
    decode=None,
) -> TraceTopTokens:
    """The k tokens with the highest slot weight on ``expert`` (tokens not routed to it do not count), or the
    highest router logit for it (every token counts; needs a trace with router logits), each with up to
    ``context`` tokens of its window either side. decode: a model, tokenizer or function ids -> text
    (without it, the strings show token ids)."""
    import pyarrow as pa

    trace = as_trace(trace)
    (layer,) = trace.resolve_layers(layer)
    if not 0 <= expert < trace.n_experts:
        raise IndexError(f"expert {expert} is out of range: the trace has {trace.n_experts} experts")
    if by == "weight":
        value, where = f"weights[list_position(experts, CAST({int(expert)} AS SMALLINT))]", f"list_contains(experts, CAST({int(expert)} AS SMALLINT))"
    elif by == "logit":
        if not trace.has_router_logits:
            raise ValueError(f"{trace.path} holds no router logits: trace with router_logits=True, or use by='weight'")
        value, where = f"router_logits[{int(expert) + 1}]", "true"
    else:
        raise ValueError(f"by must be 'weight' or 'logit', got {by!r}")
    text = _decoder(decode) if decode is not None else (lambda ids: "".join(f"{i} " for i in ids))
    con = trace.connect()
    try:
        best = con.execute(
            f"SELECT {value} AS v, doc, start, pos, token FROM trace WHERE layer = {layer} AND {where} "
            f"ORDER BY v DESC, doc, start, pos LIMIT {int(k)}"
        ).fetchall()
        con.register("targets", pa.table({"doc": [b[1] for b in best], "start": [b[2] for b in best], "pos": [b[3] for b in best]},
                                         schema=pa.schema([("doc", pa.int64()), ("start", pa.int64()), ("pos", pa.int32())])))
        near = con.execute(
            "SELECT g.doc, g.start, g.pos, t.pos, t.token FROM trace t JOIN targets g ON t.doc = g.doc AND t.start = g.start "
            f"WHERE t.layer = {layer} AND t.pos BETWEEN g.pos - {int(context)} AND g.pos + {int(context)} ORDER BY t.pos"
        ).fetchall()
    finally:
        con.close()
    around: dict[tuple[int, int, int], list[tuple[int, int]]] = {}
    for doc, start, pos, p, token in near:
        around.setdefault((doc, start, pos), []).append((p, token))
    entries = []
    for v, doc, start, pos, token in best:
        window = around.get((doc, start, pos), [])
        before = [t for p, t in window if p < pos]
        after = [t for p, t in window if p > pos]
        entries.append(TraceTopToken(float(v), doc, start, pos, token, before, after, text([token]), text(before), text(after)))
    return TraceTopTokens(layer, expert, by, entries)


# ---- paired corpora: SteerMoE's activation-rate difference -------------------------------------------


def trace_activation_difference(
    trace_a: TraceLike, trace_b: TraceLike, layers: int | Sequence[int] | None = None
) -> list[ExpertDelta]:
    """SteerMoE's Δ per (layer, expert): activation rate on corpus A minus on corpus B, ranked by |Δ|
    (ties: layer, then expert). Both traces must come from the same model. See delta_experts and
    delta_steer_hooks to turn the ranking into arguments of ablate_experts / steer_router_hooks."""
    a, b = as_trace(trace_a), as_trace(trace_b)
    for key in ("config_sha256", "weights_fingerprint", "dtype"):
        if a.manifest["model"][key] != b.manifest["model"][key]:
            raise ValueError(f"{a.path} and {b.path} trace different models (model {key} differs): rates are comparable only under one model")
    layers = a.resolve_layers(layers)
    b.resolve_layers(layers)
    load_a, load_b = trace_expert_load(a, layers), trace_expert_load(b, layers)
    return ranked_deltas(layers, load_a.rates, load_b.rates)


def delta_experts(
    deltas: Sequence[ExpertDelta], top: int | None = None, sign: Literal["positive", "negative"] = "positive", threshold: float = 0.0
) -> dict[int, list[int]]:
    """{layer: [experts]} of the ``top`` experts (all past ``threshold`` without it) most active on A
    (sign="positive": Δ > threshold) or on B ("negative": Δ < -threshold), ranked by |Δ|: the ``experts``
    argument of ablate_experts / ablate_experts_hooks, and per layer the ``expert`` of steer_router."""
    if sign not in ("positive", "negative"):
        raise ValueError(f"sign must be 'positive' or 'negative', got {sign!r}")
    chosen = [d for d in sorted(deltas, key=lambda d: -abs(d.delta)) if (d.delta > threshold if sign == "positive" else d.delta < -threshold)]
    out: dict[int, list[int]] = {}
    for d in chosen[:top]:
        out.setdefault(d.layer, []).append(d.expert)
    return out


def delta_steer_hooks(
    model, deltas: Sequence[ExpertDelta], value: float, top: int | None = None,
    sign: Literal["positive", "negative"] = "positive", threshold: float = 0.0, positions=None,
) -> list[tuple[str, object]]:
    """Hooks adding ``value`` to the router logits of the delta_experts(...) experts, each at its own layer
    (steer_router_hooks per layer): SteerMoE's steering, ready for run_with_hooks / model.hooks()."""
    hooks: list[tuple[str, object]] = []
    for layer, experts in delta_experts(deltas, top, sign, threshold).items():
        hooks += steer_router_hooks(model, layer, experts, value, positions)
    return hooks
