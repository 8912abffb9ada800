"""Corpus-scale routing traces: every real token's experts and weights at every mixture layer, in Parquet.

    from moelens.traces import trace
    trace("tiny-qwen2-moe", [Path("corpus/")], "traces/corpus", seq_len=1024)

DIR then holds part-NNNNNN.parquet files (one row per real token per mixture layer; see
moelens.traces.parts.schema) and manifest.json (model, config, data hashes, settings, completed parts).
Query it with DuckDB (``read_parquet('DIR/*.parquet')``) or moelens.traces.analysis.

Parts are deterministic: part k holds windows [k * windows_per_part, (k + 1) * windows_per_part) of the
data. A run killed at any moment and started again with the same arguments continues after the last
recorded part and ends with exactly the rows of an uninterrupted run; another model, data or settings is
refused, naming what changed. A re-run checks every recorded part's size and sha256 and traces a damaged
or missing one again. A run holds DIR's lock while it writes: a second one stops at once. Under
torch.distributed every rank runs the forward; rank 0 alone writes (and holds the lock).
"""

from __future__ import annotations

import contextlib
import datetime
import itertools
import os
import sys
from collections.abc import Iterable, Iterator, Sequence
from dataclasses import dataclass, field
from pathlib import Path

import numpy as np
import torch
from jaxtyping import Int
from tqdm.auto import tqdm

from moelens.models import HookedTransformer
from moelens.traces.hashed import DataChanged
from moelens.traces.manifest import (
    FORMAT,
    LOCK,
    MANIFEST,
    PART,
    TEMP_SUFFIX,
    TraceMismatch,
    check_manifest,
    check_same_run,
    file_sha256,
    folder_lock,
    is_first_manifest_leftover,
    is_own_journal,
    is_own_part,
    is_own_temporary,
    jsonable,
    model_identity,
    read_manifest,
    write_json_atomic,
)
try:
    import pyarrow.parquet as pq

    from moelens.traces.parts import (
        PartWriter,
        batch_rows,
        part_footer_problem,
        part_identity,
        part_rows_problem,
        schema,
        windows_sha256,
    )
except ImportError as err:  # pyarrow
    raise ImportError(f"moelens trace writes Parquet with pyarrow: pip install '.[trace]' from moelens's checkout ({err})") from err
from moelens.traces.replicas import Replicas, journals, read_journal, write_journal
from moelens.traces.sources import (
    FileDocuments,
    Files,
    LeftOut,
    Window,
    describe_files,
    is_paths,
    iterable_documents,
    resolve_files,
    windows,
)
from moelens.traces.tokenize import DocumentTokenizer

PART_TOKENS = 1 << 17  # default part size: windows_per_part = ceil(PART_TOKENS / seq_len)

__all__ = ["TraceMismatch", "TraceSummary", "trace"]


@dataclass(frozen=True)
class TraceSummary:
    out: Path
    already_complete: bool  # the folder held a complete trace of these inputs: nothing was run
    parts_written: int  # by this run
    parts_reused: int  # recorded by an earlier run and kept
    n_tokens: int  # real tokens in the whole trace
    n_rows: int  # rows in the whole trace (tokens x mixture layers)
    left_out: list[LeftOut] = field(default_factory=list)  # what the given folders hold that is not traced (see sources)
    redone: list[str] = field(default_factory=list)  # recorded parts found damaged or missing, traced again


def trace(
    model,
    data,
    out: str | os.PathLike,
    seq_len: int = 1024,
    batch_size: int = 8,
    max_tokens: int | None = None,
    router_logits: bool = False,
    *,
    windows_per_part: int | None = None,
    dtype: torch.dtype | str | None = None,
    device: torch.device | str | None = None,
    model_name: str | None = None,
    command: Sequence[str] | dict | None = None,
    progress: bool = True,
    data_parallel: bool = False,
    ranks_per_replica: int = 1,
) -> TraceSummary:
    """Trace the routing of ``data`` through ``model`` into the folder ``out`` (created; resumed if it holds
    a partial trace of the same inputs).

    model: a HookedTransformer, or a name/path for HookedTransformer.from_pretrained (with dtype, device).
    data: a path (str or Path) or a list of Paths (files, folders; see moelens.traces.sources), or any
    iterable of documents: texts, token-id sequences, or mappings with "text" (a Hugging Face dataset,
    streaming included) or "input_ids". Each document is tokenized (as whole: see moelens.traces.tokenize)
    and cut into windows of seq_len tokens (the last may be shorter); each window is its own forward,
    batch_size windows at a time, right padded. max_tokens: stop after exactly this many tokens.
    router_logits: also store each token's router logits [n_experts]. windows_per_part: windows per part
    file (default ceil(2**17 / seq_len)). command: recorded in the manifest (the CLI passes its argv).
    model_name: recorded as the model's name when model is an object (default: its class and family).

    Under torch.distributed (torchrun), without data_parallel every rank runs every forward (one model over
    all ranks, expert parallel) and rank 0 alone writes. With data_parallel, each group of ranks_per_replica
    consecutive ranks is one replica of the model (placed by the caller: a device, a device map, or an expert
    parallel group of that many ranks), part k is traced and written by replica k % n_replicas, and rank 0
    writes the manifest of them all (see moelens.traces.replicas): the rows are those of one process.
    """
    for name, value in (("seq_len", seq_len), ("batch_size", batch_size), ("max_tokens", max_tokens), ("windows_per_part", windows_per_part)):
        if value is not None and (isinstance(value, bool) or not isinstance(value, int) or not 1 <= value <= sys.maxsize):
            raise ValueError(f"{name} must be a positive integer up to 2**63 - 1, got {value!r}")
    out = Path(out)
    model, model_name, dtype = _model(model, dtype, device, model_name)
    layers = list(model.cfg.moe_layer_indices)
    if not layers:
        raise ValueError(f"{model_name} has no mixture layers: there is no routing to trace")
    windows_per_part = windows_per_part or -(-PART_TOKENS // seq_len)
    replicas = Replicas.create(data_parallel, ranks_per_replica)
    rank = replicas.rank
    files, file_list, data_identity = _data(data, rank, out)
    settings = {"seq_len": seq_len, "router_logits": bool(router_logits), "windows_per_part": windows_per_part,
                "max_tokens": max_tokens, "layers": layers}

    with contextlib.ExitStack() as held:  # rank 0 holds the folder's lock until the end
        state: dict | Exception
        redone: list[str] = []
        if rank == 0:
            identity = {"model": model_identity(model, model_name, dtype), "settings": settings, "data": data_identity}
            arguments = command if command is not None else {
                "model": model_name, "data": _describe(data), "out": str(out), "seq_len": seq_len, "batch_size": batch_size,
                "max_tokens": max_tokens, "router_logits": bool(router_logits), "windows_per_part": windows_per_part,
            }
            try:
                if out.exists() and not out.is_dir():
                    raise NotADirectoryError(f"out: {out} is a file, expected a folder for the trace")
                out.mkdir(parents=True, exist_ok=True)
                lock_was_there = (out / LOCK).exists()
                held.enter_context(folder_lock(out))
                try:
                    state = _prepare(out, identity, model, arguments, router_logits, redone)
                except Exception:
                    if not lock_was_there:  # a refused run leaves the folder as it found it
                        (out / LOCK).unlink(missing_ok=True)
                    raise
            except Exception as err:  # raised on every rank by _agree, so that none waits for the others forever
                state = err
        else:
            state = {}
        manifest = _agree(state, replicas)
        left_out = files.left_out if files else []
        if rank == 0:
            for name in redone:
                print(f"{out}: {name}; tracing it again", file=sys.stderr)

        if manifest.get("complete"):
            totals = manifest["totals"]
            if progress and rank == 0:
                print(f"{out}: trace already complete ({totals['tokens']} tokens, {totals['rows']} rows)")
            return TraceSummary(out, True, 0, totals["parts"], totals["tokens"], totals["rows"], left_out, redone)

        # the hashes the files had when the trace began (rank 0's, recorded): each must be what is read
        expected = [f["sha256"] for f in manifest["data"]["files"]] if file_list is not None else None
        reader = FileDocuments(file_list, expected) if file_list is not None else None
        documents = _Counting(reader if reader is not None else iterable_documents(data))
        tokenizer = DocumentTokenizer(model.tokenizer) if model.tokenizer is not None else None
        position = (lambda: reader.bytes_read) if reader is not None else None
        stream = windows(documents, tokenizer, seq_len, model.cfg.d_vocab, max_tokens, position)
        done: dict[str, dict] = manifest.get("parts", {})
        journal: dict[str, dict] = {}  # the parts this rank wrote, where rank 0 records them later (data parallel)
        table_schema = schema(router_logits)
        pad = model.tokenizer.pad_token_id if model.tokenizer is not None and model.tokenizer.pad_token_id is not None else 0

        def record(key: str, part: dict) -> None:
            done[key] = part
            if rank == 0:
                manifest["parts"] = done
                write_json_atomic(out / MANIFEST, manifest)
            elif replicas.writes:
                journal[key] = part
                write_journal(out, rank, journal)

        bar = _Progress(data, files, max_tokens, enabled=progress and rank == 0, name=out.name)
        written = reused = 0
        error: Exception | None = None
        try:
            for part in itertools.count():
                chunk = list(itertools.islice(stream, windows_per_part))
                if not chunk:
                    break
                digest = windows_sha256((w.doc, w.start, w.tokens) for w in chunk)
                n_tokens = sum(len(w.tokens) for w in chunk)
                recorded = done.get(str(part))
                if recorded is not None:
                    if recorded["data_sha256"] != digest:
                        raise TraceMismatch(
                            f"{out}: part {part} was traced from other token windows than this data gives (the data "
                            "changed since, or its order): trace into a new folder to start over"
                        )
                    reused += 1
                    bar.update(chunk)
                    continue
                if not replicas.owns(part):  # another replica's
                    bar.update(chunk)
                    continue
                entry = {
                    "file": PART.format(part), "first_window": part * windows_per_part, "windows": len(chunk),
                    "tokens": n_tokens, "rows": n_tokens * len(layers), "docs": [chunk[0].doc, chunk[-1].doc], "data_sha256": digest,
                }
                writer = PartWriter(out / PART.format(part), table_schema, identity=part_identity(manifest, part, entry)) if replicas.writes else None
                for batch in _batches(chunk, batch_size):
                    rows = _trace_batch(model, batch, layers, pad, table_schema)
                    if writer is not None:
                        writer.add(rows)
                    bar.update(batch)
                if writer is None:
                    done[str(part)] = entry
                else:
                    committed = writer.commit()
                    if committed.rows != n_tokens * len(layers):  # a forward that skipped a hook would leave a gap
                        raise RuntimeError(f"part {part}: wrote {committed.rows} rows, expected {n_tokens} tokens x {len(layers)} layers")
                    record(str(part), {**entry, "size": committed.size, "sha256": committed.sha256})
                written += 1
            if reader is not None:
                reader.finish()  # a file that max_tokens left half read: the rest is hashed, and checked
        except DataChanged as err:
            if replicas.writes:  # drop what may hold the file's new contents from this rank's record
                _forget_parts_of(out, manifest, done, err.path)
                if rank == 0:
                    manifest["parts"] = done
                    write_json_atomic(out / MANIFEST, manifest)
                else:
                    journal = {k: p for k, p in journal.items() if k in done}
                    write_journal(out, rank, journal)
            error = err
        except Exception as err:  # under data parallelism, said to the other ranks before it is raised
            error = err
        finally:
            bar.close()

        if replicas.data_parallel and replicas.world > 1:
            return _gather_replicas(out, manifest, done, replicas, journal, written, reused, error, documents.count,
                                    left_out, redone, n_parts=part if error is None else None)
        if error is not None:
            raise error
        missing = sorted(set(done) - {str(k) for k in range(part)}, key=int)
        if missing:  # recorded parts past the data's end: the data must have shrunk since
            raise TraceMismatch(f"{out}: parts {missing[:3]} are recorded but the data now ends before them: trace into a new folder to start over")
        n_tokens = sum(p["tokens"] for p in done.values())
        n_rows = sum(p["rows"] for p in done.values())
        if rank == 0:
            _complete(out, manifest, done, documents.count)
        return TraceSummary(out, False, written, reused, n_tokens, n_rows, left_out, redone)


def _complete(out: Path, manifest: dict, done: dict[str, dict], n_docs: int) -> None:
    manifest["parts"] = done
    manifest["complete"] = True
    manifest["totals"] = {"parts": len(done), "docs": n_docs, "windows": sum(p["windows"] for p in done.values()),
                          "tokens": sum(p["tokens"] for p in done.values()), "rows": sum(p["rows"] for p in done.values())}
    manifest["completed_at"] = _now()
    write_json_atomic(out / MANIFEST, manifest)


def _gather_replicas(out, manifest, done, replicas: Replicas, journal, written, reused, error, n_docs, left_out, redone, n_parts) -> TraceSummary:
    """Data parallelism's end: every rank's parts and outcome to rank 0, which records them all in the
    manifest (and completes it when no rank failed and every part is there); then the outcome on every rank."""
    failure = None if error is None else f"{type(error).__name__}: {error}"
    outcomes = replicas.gather({"parts": journal, "written": written if replicas.writes else 0, "failure": failure, "n_parts": n_parts})
    verdict = None
    if replicas.rank == 0:
        for outcome in outcomes[1:]:
            done.update(outcome["parts"])
        failed = [(r, o["failure"]) for r, o in enumerate(outcomes) if o["failure"] is not None]
        manifest["parts"] = done
        write_json_atomic(out / MANIFEST, manifest)  # every journal's parts are in it now
        for path in journals(out):
            path.unlink()
        if not failed:
            missing = sorted(set(range(n_parts)) - {int(k) for k in done}) + sorted(int(k) for k in done if int(k) >= n_parts)
            if missing:
                failed = [(0, f"TraceMismatch: {out}: parts {missing[:3]} are recorded but not the data's, or not written by any replica")]
            else:
                _complete(out, manifest, done, n_docs)
        verdict = {"failed": failed, "written": sum(o["written"] for o in outcomes),
                   "tokens": sum(p["tokens"] for p in done.values()), "rows": sum(p["rows"] for p in done.values())}
    verdict = replicas.broadcast(verdict)
    if error is not None:
        raise error
    if verdict["failed"]:
        rank, failure = verdict["failed"][0]
        raise RuntimeError(f"data parallel trace: rank {rank} failed ({failure}); the parts every replica finished are recorded: "
                           "run the same command again to trace the rest")
    return TraceSummary(out, False, verdict["written"], reused, verdict["tokens"], verdict["rows"], left_out, redone)


class _Progress:
    """The progress bar. Its total, where it is known without reading the data: max_tokens (tokens), the
    token count of a list of token-id sequences, or the bytes of the data files (the bar then counts bytes
    read, with the tokens beside). Otherwise it counts tokens without a total (no ETA)."""

    def __init__(self, data, files: Files | None, max_tokens: int | None, enabled: bool, name: str) -> None:
        self.by_bytes = False
        total = max_tokens
        if total is None and files is not None:
            total, self.by_bytes = files.total_bytes, True
        elif total is None and isinstance(data, (list, tuple)) and all(_is_ids(d) for d in data):
            total = sum(len(d) for d in data)
        self.tokens = 0
        self.bar = tqdm(total=total, unit="B" if self.by_bytes else "tok", unit_scale=True, disable=not enabled, desc=f"trace {name}")

    def update(self, windows: Sequence[Window]) -> None:
        tokens = sum(len(w.tokens) for w in windows)
        self.tokens += tokens
        if self.by_bytes:
            self.bar.update(windows[-1].read - self.bar.n)
            self.bar.set_postfix_str(f"{self.tokens:,} tokens", refresh=False)
        else:
            self.bar.update(tokens)

    def close(self) -> None:
        self.bar.close()


def _is_ids(document) -> bool:
    return not isinstance(document, (str, bytes, dict)) and hasattr(document, "__len__") and (
        isinstance(document, (list, tuple)) and all(isinstance(i, int) for i in document[:1]) or getattr(document, "ndim", None) == 1
    )


# ---- one batch -----------------------------------------------------------------------------------


def pad_windows(windows: Sequence[Window], pad: int) -> tuple[Int[torch.Tensor, "batch pos"], Int[torch.Tensor, "batch pos"]]:
    """(tokens, attention_mask), right padded to the longest window; mask 1 = real token."""
    width = max(len(w.tokens) for w in windows)
    tokens = np.full((len(windows), width), pad, dtype=np.int64)
    mask = np.zeros((len(windows), width), dtype=np.int64)
    for i, w in enumerate(windows):
        tokens[i, : len(w.tokens)] = w.tokens
        mask[i, : len(w.tokens)] = 1
    return torch.from_numpy(tokens), torch.from_numpy(mask)


def _trace_batch(model, batch: Sequence[Window], layers: list[int], pad: int, table_schema):
    tokens, mask = pad_windows(batch, pad)
    tokens, mask = tokens.to(model.device), mask.to(model.device)
    valid = mask.bool()
    captured: dict[tuple[int, str], torch.Tensor] = {}

    def capture(layer: int, site: str):
        def read(tensor: torch.Tensor, hook) -> None:
            # Only the real tokens, in row-major order: right padding keeps each row's tokens first.
            captured[layer, site] = tensor[valid.to(tensor.device)]

        read.reads_only = True  # lets the hook point skip its copy-on-edit
        return read

    sites = ["expert_indices", "expert_weights"] + (["router_logits"] if "router_logits" in table_schema.names else [])
    hooks = [(f"blocks.{layer}.mlp.hook_{site}", capture(layer, site)) for layer in layers for site in sites]
    with torch.inference_mode():
        model.run_with_hooks(tokens, attention_mask=mask, return_type=None, fwd_hooks=hooks)
    missing = [f"blocks.{layer}.mlp.hook_{site}" for layer in layers for site in sites if (layer, site) not in captured]
    if missing:
        raise RuntimeError(f"the forward never reached hook points {missing[:3]}{'...' if len(missing) > 3 else ''}")

    lengths = [len(w.tokens) for w in batch]
    docs = np.repeat(np.array([w.doc for w in batch], dtype=np.int64), lengths)
    starts = np.repeat(np.array([w.start for w in batch], dtype=np.int64), lengths)
    positions = np.concatenate([np.arange(n, dtype=np.int32) for n in lengths])
    token_ids = np.concatenate([w.tokens for w in batch]).astype(np.int32)

    def host(t: torch.Tensor | None) -> np.ndarray | None:
        return None if t is None else t.float().cpu().numpy() if t.is_floating_point() else t.cpu().numpy()

    routing = [
        (layer, host(captured[layer, "expert_indices"]), host(captured[layer, "expert_weights"]),
         host(captured.get((layer, "router_logits"))))
        for layer in layers
    ]
    return batch_rows(table_schema, docs, starts, positions, token_ids, routing)


# ---- setting up and resuming ---------------------------------------------------------------------


def _data(data, rank: int, out: Path) -> tuple[Files | None, list[Path] | None, dict | None]:
    """(described files or None, the files to read or None for an iterable, the data's identity).

    Rank 0 hashes the files for the manifest; the other ranks only need the list, in the same order. The
    output folder is never read as data (it is listed as left out where it lies inside a given folder)."""
    if not is_paths(data):
        identity = {"kind": "iterable", "type": f"{type(data).__module__}.{type(data).__qualname__}"}
        fingerprint = getattr(data, "_fingerprint", None)  # a Hugging Face Dataset's content hash
        if isinstance(fingerprint, str):
            identity["fingerprint"] = fingerprint
        return None, None, identity
    if rank != 0:
        return None, resolve_files(data, exclude=out)[0], None
    files = describe_files(data, exclude=out)
    identity = {"kind": "files", "files": [f.to_json() for f in files.files], "left_out": [x.to_json() for x in files.left_out]}
    return files, [Path(f.path) for f in files.files], identity


def _prepare(out: Path, identity: dict, model, arguments, router_logits: bool, redone: list[str]) -> dict:
    """The manifest to continue from: a new one for an empty folder, the recorded one (checked to be of the
    same inputs) otherwise. Leftovers of a killed run go: temporary files and parts the manifest lacks.
    Recorded parts are checked against their recorded size and sha256: one that is damaged or missing is
    deleted and dropped from the manifest, so that this run traces it again (its name goes into redone)."""
    for p in out.iterdir():  # a trace's own names are its regular files: anything else under them is the user's
        if (is_own_temporary(p.name) or is_own_part(p.name) or is_own_journal(p.name)) and (p.is_symlink() or not p.is_file()):
            kind = "temporary file" if is_own_temporary(p.name) else "part" if is_own_part(p.name) else "journal"
            raise IsADirectoryError(f"out: {p} is a {'symlink' if p.is_symlink() else 'folder'}, not a {kind} of a trace: move it out of {out}")
    manifest = read_manifest(out)
    if manifest is None:
        # No manifest: nothing here is provably this trace's, except what a run killed inside its very first
        # manifest write leaves (the lock, the manifest's temporary file). Anything else is the user's: refused.
        foreign = sorted(p.name for p in out.iterdir() if p.name != LOCK and not is_first_manifest_leftover(p))
        if foreign:
            raise FileExistsError(
                f"out: {out} holds files but no {MANIFEST} ({', '.join(foreign[:3])}{', ...' if len(foreign) > 3 else ''}): "
                "give an empty or new folder"
            )
        (out / (MANIFEST + TEMP_SUFFIX)).unlink(missing_ok=True)
        cfg = model.cfg
        manifest = {
            "format": FORMAT,
            **identity,
            "config": jsonable(cfg),  # every field; the identity hashes those that define the model
            "layers": identity["settings"]["layers"],
            "n_experts": cfg.n_experts,
            "top_k": {str(layer): cfg.top_k_per_layer[layer] for layer in identity["settings"]["layers"]},
            "columns": {f.name: str(f.type) for f in schema(router_logits)},
            "command": arguments,
            "created_at": _now(),
            "parts": {},
            "complete": False,
        }
        write_json_atomic(out / MANIFEST, manifest)
        return manifest
    check_same_run(out, manifest, identity)
    found = journals(out)
    if found:  # a data-parallel run's replicas' parts, not gathered into the manifest yet (a kill)
        for path in found:
            for key, part in read_journal(path).items():
                manifest["parts"].setdefault(key, part)
        check_manifest(out / MANIFEST, manifest)  # the journals' parts as strictly as the manifest's own
        write_json_atomic(out / MANIFEST, manifest)
        for path in found:
            path.unlink()
    recorded = {p["file"] for p in manifest["parts"].values()}
    unhashed = any("sha256" not in part for part in manifest["parts"].values())
    for p in out.iterdir():  # only the trace's own names: a file of the user's in DIR is left alone
        if is_own_temporary(p.name) or (is_own_part(p.name) and p.name not in recorded):
            p.unlink()  # from a run killed mid-part: its windows are traced again
    for key in sorted(manifest["parts"], key=int):
        problem = _part_problem(out, manifest, int(key))
        if problem is not None:
            redone.append(problem)
            (out / manifest["parts"][key]["file"]).unlink(missing_ok=True)
            del manifest["parts"][key]
    if redone:
        manifest["complete"] = False
        manifest.pop("totals", None)
        write_json_atomic(out / MANIFEST, manifest)
    elif unhashed:
        write_json_atomic(out / MANIFEST, manifest)  # recorded before parts had hashes: now they have
    return manifest


def _forget_parts_of(out: Path, manifest: dict, done: dict[str, dict], path: str) -> None:
    """A data file changed while it was traced: drop from done (and delete) every part from the file's first
    document on, which may hold windows of its new contents, so that what is recorded is what the manifest
    describes."""
    first_doc = next((f["first_doc"] for f in manifest["data"]["files"] if f["path"] == path), 0)
    for key in [k for k, p in done.items() if p.get("docs", [0, first_doc])[1] >= first_doc]:
        (out / done.pop(key)["file"]).unlink(missing_ok=True)


def _part_problem(out: Path, manifest: dict, index: int) -> str | None:
    """What is wrong with recorded part ``index``'s file, or None: its size and sha256 against the manifest,
    then its footer and its rows (its columns, layers and token windows: a part copied in from another trace
    with the manifest's size and sha256 edited to match is caught there). A part recorded without size and
    sha256 (by an earlier moelens) gets them recorded once its rows pass."""
    part = manifest["parts"][str(index)]
    path = out / part["file"]
    if not path.is_file():
        return f"{part['file']} is recorded in {MANIFEST} but missing"
    size = path.stat().st_size
    if "sha256" in part:
        if size != part["size"]:
            return f"{part['file']} is damaged: {size} bytes, {MANIFEST} records {part['size']}"
        if file_sha256(path) != part["sha256"]:
            return f"{part['file']} is damaged: its sha256 is not the one {MANIFEST} records (replaced or edited)"
    problem = part_footer_problem(path, manifest, index) or part_rows_problem(path, manifest, index)
    if problem is None and "sha256" not in part:
        part.update(size=size, sha256=file_sha256(path))
    return problem


def _agree(state, replicas: Replicas) -> dict:
    """Rank 0's manifest (or its error) on every rank, so that all ranks skip the same parts or stop together."""
    state = replicas.broadcast(state)
    if isinstance(state, Exception):
        raise state
    return state


# ---- helpers -------------------------------------------------------------------------------------


def _model(model, dtype, device, name):
    if isinstance(model, (str, os.PathLike)):
        path = str(model)
        check_device(device)
        model = HookedTransformer.from_pretrained(path, dtype=dtype or torch.float32, device=device or "cpu")
        name = name or path
    elif dtype is not None or device is not None:
        raise ValueError("dtype and device apply when the model is given by name or path; move a model object yourself")
    name = name or f"{type(model).__name__}({model.cfg.family})"
    return model.eval(), name, model.embed.weight.dtype


def check_device(device) -> None:
    """A device this torch and machine have, checked before any weights are read."""
    if device is None:
        return
    try:
        parsed = torch.device(device)
    except (RuntimeError, TypeError) as err:
        raise ValueError(f"device: {device!r} is not a torch device ({err})") from None
    if parsed.type == "cuda":
        if not torch.cuda.is_available():
            raise ValueError(f"device: {device} asked for, but this torch sees no CUDA device (torch.cuda.is_available() is False)")
        count = torch.cuda.device_count()
        if parsed.index is not None and parsed.index >= count:
            raise ValueError(f"device: {device} asked for, but this machine has {count} CUDA device(s): cuda:0 to cuda:{count - 1}")


def _batches(items: list, size: int) -> Iterator[list]:
    for i in range(0, len(items), size):
        yield items[i : i + size]


class _Counting:
    """Counts the documents read (the trace's document count once complete)."""

    def __init__(self, documents: Iterable) -> None:
        self.documents, self.count = documents, 0

    def __iter__(self):
        for document in self.documents:
            self.count += 1
            yield document


def _describe(data) -> str | list[str]:
    if isinstance(data, (str, os.PathLike)):
        return str(data)
    if isinstance(data, (list, tuple)) and all(isinstance(d, os.PathLike) for d in data):
        return [str(d) for d in data]
    return f"{type(data).__module__}.{type(data).__qualname__}"


def _now() -> str:
    return datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds")
