"""Corpus-scale routing traces: every real token's experts and weights at every mixture layer, in Parquet.

    from moelens.traces import trace
    trace("tiny-qwen2-moe", [Path("corpus/")], "traces/corpus", seq_len=1024)

DIR then holds part-NNNNNN.parquet files (one row per real token per mixture layer; see
moelens.traces.parts.schema) and manifest.json (model, config, data hashes, settings, completed parts).
Query it with DuckDB (``read_parquet('DIR/*.parquet')``) or moelens.traces.analysis.

Parts are deterministic: part k holds windows [k * windows_per_part, (k + 1) * windows_per_part) of the
data. A run killed at any moment and started again with the same arguments continues after the last
recorded part and ends with exactly the rows of an uninterrupted run; another model, data or settings is
refused, naming what changed. Under torch.distributed every rank runs the forward; rank 0 alone writes.
"""

from __future__ import annotations

import datetime
import hashlib
import itertools
import os
from collections.abc import Iterable, Iterator, Sequence
from dataclasses import dataclass, field
from pathlib import Path

import numpy as np
import torch
from jaxtyping import Int

from moelens.models import HookedTransformer
from moelens.traces.manifest import (
    FORMAT,
    MANIFEST,
    PART,
    TEMP_SUFFIX,
    TraceMismatch,
    check_same_run,
    jsonable,
    model_identity,
    read_manifest,
    write_json_atomic,
)
try:
    from moelens.traces.parts import PartWriter, batch_rows, schema
except ImportError as err:  # pyarrow
    raise ImportError(f"moelens trace writes Parquet with pyarrow: pip install 'moelens[trace]' ({err})") from err
from moelens.traces.sources import (
    Files,
    Window,
    describe_files,
    file_documents,
    is_paths,
    iterable_documents,
    resolve_files,
    windows,
)

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
    skipped_files: list[str] = field(default_factory=list)  # files of the given folders left out (see sources)


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
) -> TraceSummary:
    """Trace the routing of ``data`` through ``model`` into the folder ``out`` (created; resumed if it holds
    a partial trace of the same inputs).

    model: a HookedTransformer, or a name/path for HookedTransformer.from_pretrained (with dtype, device).
    data: a path (str or Path) or a list of Paths (files, folders; see moelens.traces.sources), or any
    iterable of documents: texts, token-id sequences, or mappings with "text" (a Hugging Face dataset,
    streaming included) or "input_ids". Each document is tokenized whole and cut into windows of seq_len
    tokens (the last may be shorter); each window is its own forward, batch_size windows at a time, right
    padded. max_tokens: stop after exactly this many tokens. router_logits: also store each token's router
    logits [n_experts]. windows_per_part: windows per part file (default ceil(2**17 / seq_len)).
    command: recorded in the manifest (the CLI passes its argv). model_name: recorded as the model's name
    when model is an object (default: its class and family).
    """
    for name, value in (("seq_len", seq_len), ("batch_size", batch_size), ("max_tokens", max_tokens), ("windows_per_part", windows_per_part)):
        if value is not None and (isinstance(value, bool) or not isinstance(value, int) or value < 1):
            raise ValueError(f"{name} must be a positive integer, got {value!r}")
    model, model_name, dtype = _model(model, dtype, device, model_name)
    layers = list(model.cfg.moe_layer_indices)
    if not layers:
        raise ValueError(f"{model_name} has no mixture layers: there is no routing to trace")
    windows_per_part = windows_per_part or -(-PART_TOKENS // seq_len)
    rank, world = _rank()
    out = Path(out)

    files, file_list, data_identity = _data(data, rank)
    settings = {"seq_len": seq_len, "router_logits": bool(router_logits), "windows_per_part": windows_per_part,
                "max_tokens": max_tokens, "layers": layers}

    state: dict | Exception
    if rank == 0:
        identity = {"model": model_identity(model, model_name, dtype), "settings": settings, "data": data_identity}
        arguments = command if command is not None else {
            "model": model_name, "data": _describe(data), "out": str(out), "seq_len": seq_len, "batch_size": batch_size,
            "max_tokens": max_tokens, "router_logits": bool(router_logits), "windows_per_part": windows_per_part,
        }
        try:
            state = _prepare(out, identity, model, arguments, router_logits)
        except Exception as err:  # raised on every rank by _agree, so that none waits for the others forever
            state = err
    else:
        state = {}
    manifest = _agree(state, rank, world)

    if manifest.get("complete"):
        totals = manifest["totals"]
        if progress and rank == 0:
            print(f"{out}: trace already complete ({totals['tokens']} tokens, {totals['rows']} rows)")
        return TraceSummary(out, True, 0, totals["parts"], totals["tokens"], totals["rows"], files.skipped if files else [])

    documents = _Counting(file_documents(file_list) if file_list is not None else iterable_documents(data))
    encode = _encoder(model)
    stream = windows(documents, encode, seq_len, model.cfg.d_vocab, max_tokens)
    done: dict[str, dict] = manifest.get("parts", {})
    table_schema = schema(router_logits)
    pad = model.tokenizer.pad_token_id if model.tokenizer is not None and model.tokenizer.pad_token_id is not None else 0

    from tqdm.auto import tqdm

    bar = tqdm(total=max_tokens, unit="tok", unit_scale=True, disable=not progress or rank != 0, desc=f"trace {out.name}")
    written = reused = 0
    try:
        for part in itertools.count():
            chunk = list(itertools.islice(stream, windows_per_part))
            if not chunk:
                break
            digest = _windows_sha256(chunk)
            n_tokens = sum(len(w.tokens) for w in chunk)
            recorded = done.get(str(part))
            if recorded is not None:
                if recorded["data_sha256"] != digest:
                    raise TraceMismatch(
                        f"{out}: part {part} was traced from other token windows than this data gives (the data "
                        "changed since, or its order): trace into a new folder to start over"
                    )
                reused += 1
                bar.update(n_tokens)
                continue
            writer = PartWriter(out / PART.format(part), table_schema) if rank == 0 else None
            for batch in _batches(chunk, batch_size):
                rows = _trace_batch(model, batch, layers, pad, table_schema)
                if writer is not None:
                    writer.add(rows)
                bar.update(sum(len(w.tokens) for w in batch))
            done[str(part)] = {
                "file": PART.format(part), "first_window": part * windows_per_part, "windows": len(chunk),
                "tokens": n_tokens, "rows": n_tokens * len(layers), "docs": [chunk[0].doc, chunk[-1].doc], "data_sha256": digest,
            }
            if writer is not None:
                n_rows = writer.commit()
                if n_rows != n_tokens * len(layers):  # a forward that skipped a hook would leave a gap
                    raise RuntimeError(f"part {part}: wrote {n_rows} rows, expected {n_tokens} tokens x {len(layers)} layers")
                manifest["parts"] = done
                write_json_atomic(out / MANIFEST, manifest)
            written += 1
    finally:
        bar.close()

    n_tokens = sum(p["tokens"] for p in done.values())
    n_rows = sum(p["rows"] for p in done.values())
    if rank == 0:
        manifest["complete"] = True
        manifest["totals"] = {"parts": len(done), "docs": documents.count, "windows": sum(p["windows"] for p in done.values()),
                              "tokens": n_tokens, "rows": n_rows}
        manifest["completed_at"] = _now()
        write_json_atomic(out / MANIFEST, manifest)
    return TraceSummary(out, False, written, reused, n_tokens, n_rows, files.skipped if files else [])


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


def _data(data, rank: int) -> tuple[Files | None, list[Path] | None, dict | None]:
    """(described files or None, the files to read or None for an iterable, the data's identity).

    Rank 0 hashes the files for the manifest; the other ranks only need the list, in the same order."""
    if not is_paths(data):
        identity = {"kind": "iterable", "type": f"{type(data).__module__}.{type(data).__qualname__}"}
        fingerprint = getattr(data, "_fingerprint", None)  # a Hugging Face Dataset's content hash
        if isinstance(fingerprint, str):
            identity["fingerprint"] = fingerprint
        return None, None, identity
    if rank != 0:
        return None, resolve_files(data)[0], None
    files = describe_files(data)
    identity = {"kind": "files", "files": [f.to_json() for f in files.files], "skipped": files.skipped}
    return files, [Path(f.path) for f in files.files], identity


def _prepare(out: Path, identity: dict, model, arguments, router_logits: bool) -> dict:
    """The manifest to continue from: a new one for an empty folder, the recorded one (checked to be of the
    same inputs) otherwise. Leftovers of a killed run go: temporary files and parts the manifest lacks."""
    if out.exists() and not out.is_dir():
        raise NotADirectoryError(f"out: {out} is a file, expected a folder for the trace")
    out.mkdir(parents=True, exist_ok=True)
    manifest = read_manifest(out)
    if manifest is None:
        foreign = sorted(p.name for p in out.iterdir() if not _is_leftover(p.name))
        if foreign:
            raise FileExistsError(
                f"out: {out} holds files but no {MANIFEST} ({', '.join(foreign[:3])}{', ...' if len(foreign) > 3 else ''}): "
                "give an empty or new folder"
            )
        for p in out.iterdir():
            p.unlink()
        cfg = model.cfg
        manifest = {
            "format": FORMAT,
            **identity,
            "config": jsonable(cfg),  # every field; the identity hashes those that define the model
            "layers": identity["settings"]["layers"],
            "n_experts": cfg.n_experts,
            "top_k": {str(layer): cfg.top_k[layer] for layer in identity["settings"]["layers"]},
            "columns": {f.name: str(f.type) for f in schema(router_logits)},
            "command": arguments,
            "created_at": _now(),
            "parts": {},
            "complete": False,
        }
        write_json_atomic(out / MANIFEST, manifest)
        return manifest
    check_same_run(out, manifest, identity)
    recorded = {p["file"] for p in manifest["parts"].values()}
    for p in out.iterdir():
        if p.name.endswith(TEMP_SUFFIX) or (_is_part(p.name) and p.name not in recorded):
            p.unlink()  # from a run killed mid-part: its windows are traced again
    lost = sorted(name for name in recorded if not (out / name).is_file())
    if lost:
        raise FileNotFoundError(f"{out}: parts recorded in {MANIFEST} are missing ({', '.join(lost[:3])}): the trace is damaged; start over in a new folder")
    return manifest


def _is_part(name: str) -> bool:
    return name.startswith("part-") and name.endswith(".parquet")


def _is_leftover(name: str) -> bool:
    """What a run killed before its first manifest write can leave (parts come only after it)."""
    return name.endswith(TEMP_SUFFIX)


def _agree(state, rank: int, world: int) -> dict:
    """Rank 0's manifest (or its error) on every rank, so that all ranks skip the same parts or stop together."""
    if world > 1:
        import torch.distributed as dist

        box = [state]
        dist.broadcast_object_list(box, src=0)
        state = box[0]
    if isinstance(state, Exception):
        raise state
    return state


def _rank() -> tuple[int, int]:
    import torch.distributed as dist

    if dist.is_available() and dist.is_initialized():
        return dist.get_rank(), dist.get_world_size()
    return 0, 1


# ---- helpers -------------------------------------------------------------------------------------


def _model(model, dtype, device, name):
    if isinstance(model, (str, os.PathLike)):
        path = str(model)
        model = HookedTransformer.from_pretrained(path, dtype=dtype or torch.float32, device=device or "cpu")
        name = name or path
    elif dtype is not None or device is not None:
        raise ValueError("dtype and device apply when the model is given by name or path; move a model object yourself")
    name = name or f"{type(model).__name__}({model.cfg.family})"
    return model.eval(), name, model.embed.weight.dtype


def _encoder(model):
    def encode(text: str) -> list[int]:
        if model.tokenizer is None:
            raise ValueError("the model has no tokenizer (no tokenizer.json): give documents as token-id sequences, not text")
        return model.tokenizer.encode(text)

    return encode


def _batches(items: list, size: int) -> Iterator[list]:
    for i in range(0, len(items), size):
        yield items[i : i + size]


def _windows_sha256(chunk: Iterable[Window]) -> str:
    """The identity of a part's windows, checked when a resumed run passes over a recorded part."""
    digest = hashlib.sha256()
    for w in chunk:
        digest.update(np.array([w.doc, w.start, len(w.tokens)], dtype=np.int64).tobytes())
        digest.update(w.tokens.astype(np.int64, copy=False).tobytes())
    return digest.hexdigest()


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
